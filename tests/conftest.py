"""Shared fixtures: tiny models and synthetic data built once per test session (seconds, no download)."""

from __future__ import annotations

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
