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


# Every check the GPU run applies, each listed (with its threshold) by the dry mode too, which adds the tiny model's
# SFT cold start.
GPU_CHECKS = {"megatron_bf16_mfu", "megatron_fp8_runs", "sglang_logprobs_match_trainer", "sync_disk", "sync_tensor",
              "sync_distributed", "grpo_reward_rises", "grpo_peak_memory_vs_plan", "opd_teacher_kl_falls",
              "opd_grpo_kl_falls", "teacher_flops_ratio", "teacher_stronger_than_student"}
RUN_ON_CPU = {"sft_loss_falls", "sglang_logprobs_match_trainer", "sync_disk"}  # enforced by the dry mode


def dry_run(tmp_path, *args) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "acceptance.json"
    proc = subprocess.run(["bash", "bench/gpu_acceptance.sh", "--dry-run", *args, str(out)], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=1700)
    return proc, json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.timeout(1800)
def test_gpu_acceptance_dry_run_lists_every_check_and_passes_on_cpu(tmp_path):
    from test_sglang import sglang_python

    sglang_python()  # its serving checks run on a CPU server (skips, or fails in CI, without the environment)
    proc, result = dry_run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = {c["name"]: c for c in result["checks"]}
    assert set(checks) == GPU_CHECKS | {"sft_loss_falls"} and result["passed"]
    for c in checks.values():
        assert c["threshold"] and (c.get("skipped") == "cuda-only" or c["passed"] is True), c
        assert ("skipped" in c) == (c["name"] not in RUN_ON_CPU), c
    assert checks["sft_loss_falls"]["value"]["t"] > 2.0  # the CPU-runnable learning check ran and held
    assert checks["sync_disk"]["value"]["stale_refused"] and checks["sync_disk"]["value"]["served_versions"] == ["1"]
    assert set(result["study"]) == {"student", "teacher", "grpo", "opd_teacher", "opd_grpo"}
    assert all(part["ok"] for part in result["parts"].values()), result["parts"]


# ------------------------------------------------------- the serving checks' negative controls, on a CPU server

@pytest.fixture(scope="module")
def acceptance(tmp_path_factory):
    """The dry mode's Acceptance, attached to one CPU SGLang server of its tiny student (launched once)."""
    from test_sglang import server_config, sglang_python

    sglang_python()
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_acceptance import Acceptance

    from megaopd.rollout.serving.server import SGLangServer

    work = tmp_path_factory.mktemp("acceptance")
    acc = Acceptance(work, True, None, None, [])
    server = SGLangServer.launch(str(acc.student), server_config(), "float32", work / "server.log")
    acc.urls = [server.url]
    try:
        yield acc, server
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.timeout(900)
def test_a_server_that_never_loaded_the_new_weights_fails_the_sync_check(acceptance, monkeypatch):
    """The sync check reads the version from the server and needs a stale server to fail the probe first. With
    the transport and the engine's own verification both doing nothing, the engine's counter still says 1 (what the
    check once compared, true by construction); the server says 0, and the check fails. An update that changes
    nothing passes a stale server's probe, and fails the check too."""
    from gpu_acceptance import sync_check

    from megaopd.rollout.serving import weight_sync
    from megaopd.rollout.serving.engine import SGLangEngine

    acc, server = acceptance
    good = acc.sync("disk")
    assert sync_check("disk", good, timed=False)["passed"], good
    assert good["stale_refused"] and good["served_versions"] == ["1"]
    server.load_weights(acc.student, "0", 120)

    unchanged = acc.sync("disk", update=lambda model: None)
    assert not unchanged["stale_refused"] and not sync_check("disk", unchanged, timed=False)["passed"]
    server.load_weights(acc.student, "0", 120)

    with monkeypatch.context() as patch:
        patch.setattr(weight_sync, "for_method", lambda method: lambda engine, policy, version: None)
        patch.setattr(SGLangEngine, "verify", lambda self, policy, version: None)
        never_loaded = acc.sync("disk")
    assert never_loaded["engine_version"] == 1 and never_loaded["served_versions"] == ["0"]
    assert not sync_check("disk", never_loaded, timed=False)["passed"]


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.timeout(900)
def test_the_logprob_gap_check_needs_real_tokens(acceptance):
    """Sampled responses of 16 tokens give a gap over real tokens that passes; responses cut to 0 tokens give a gap
    of 0 over nothing, and the check fails them."""
    from gpu_acceptance import LOGPROB_TOLERANCE, gap_check

    acc, _ = acceptance
    real = acc.sglang_gap()
    assert real["tokens"] > 0 and gap_check(real, LOGPROB_TOLERANCE["dry"])["passed"], real
    empty = acc.sglang_gap(max_new_tokens=0)
    assert empty["tokens"] == 0 and empty["mean"] == 0.0
    assert not gap_check(empty, LOGPROB_TOLERANCE["dry"])["passed"]


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
