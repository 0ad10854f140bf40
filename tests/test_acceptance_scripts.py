"""The scripts around the suite: the GPU acceptance command without a GPU, and CI's rule that the SGLang suite
must run (`.ci/sglang_env.sh`)."""

from __future__ import annotations

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
