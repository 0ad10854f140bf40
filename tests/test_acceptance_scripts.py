"""The scripts around the suite: the GPU acceptance command without a GPU and in its CPU dry mode, and CI's rule
that the SGLang suite must run (`.ci/sglang_env.sh`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this checks the no-GPU path")
def test_gpu_acceptance_stops_with_a_clear_message_without_a_gpu(tmp_path):
    out = tmp_path / "acceptance.json"
    proc = subprocess.run(["bash", "bench/gpu_acceptance.sh", str(out)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable}, timeout=120)
    assert proc.returncode == 2
    assert "no CUDA GPU visible" in proc.stderr and "nothing ran" in proc.stderr
    assert not out.exists()


# Every check the GPU run applies, each listed (with its threshold) by the dry mode too.
GPU_CHECKS = {"megatron_bf16_mfu", "megatron_fp8_runs", "sglang_logprobs_match_trainer", "sync_disk", "sync_tensor",
              "sync_distributed", "sft_loss_falls", "grpo_reward_rises", "grpo_peak_memory_vs_plan", "opd_kl_falls"}


def dry_run(tmp_path, *args) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "acceptance.json"
    proc = subprocess.run(["bash", "bench/gpu_acceptance.sh", "--dry-run", *args, str(out)], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=500)
    return proc, json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpu_acceptance_dry_run_lists_every_check_and_passes_on_cpu(tmp_path):
    proc, result = dry_run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = {c["name"]: c for c in result["checks"]}
    assert set(checks) == GPU_CHECKS and result["passed"]
    for c in checks.values():
        assert c["threshold"] and (c.get("skipped") == "cuda-only" or c["passed"] is True), c
    assert checks["sft_loss_falls"]["value"]["t"] > 2.0  # the CPU-runnable learning check ran and held
    assert all(part["ok"] for part in result["parts"].values()), result["parts"]


def test_trend_check_fails_a_flat_or_wrong_way_curve():
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_acceptance import trend_check

    falling = [5.0 - 0.1 * i + 0.01 * (-1) ** i for i in range(20)]
    assert trend_check("loss", falling, -1)["passed"]
    assert not trend_check("reward", falling, +1)["passed"]  # the wrong way
    assert not trend_check("loss", [1.0 + 0.01 * (-1) ** i for i in range(20)], -1)["passed"]  # flat: noise only
    assert not trend_check("loss", [1.0, 0.5], -1)["passed"]  # too few steps to fit a slope with its error


def sglang_env(tmp_path, **env) -> subprocess.CompletedProcess:
    """The setup script on a disk that cannot hold the environment (it asks for more than any disk has)."""
    base = {k: v for k, v in os.environ.items() if k not in ("CI", "MEGAOPD_ALLOW_SGLANG_SKIP")}
    return subprocess.run(["bash", ".ci/sglang_env.sh", str(tmp_path / "venv")], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**base, "MEGAOPD_SGLANG_NEED_GB": "100000000", **env})


def test_ci_fails_when_the_sglang_suite_cannot_run(tmp_path):
    local = sglang_env(tmp_path)
    assert local.returncode == 0 and "the SGLang tests will skip" in local.stderr  # locally: skip, say why
    reason = (tmp_path / "venv.unavailable").read_text()
    assert "needs 100000000 GB" in reason
    ci = sglang_env(tmp_path, CI="true")
    assert ci.returncode == 1 and "MEGAOPD_ALLOW_SGLANG_SKIP=1" in ci.stderr
    opted_out = sglang_env(tmp_path, CI="true", MEGAOPD_ALLOW_SGLANG_SKIP="1")
    assert opted_out.returncode == 0 and (tmp_path / "venv.unavailable").exists()
