"""Smoke runs of the benchmarks in bench/ (seconds each), so that they cannot rot. Nothing here asserts a timing:
each script runs its --smoke mode (one tiny iteration) and must exit 0 and print its table. The TRL comparisons are
skipped, with the reason, when trl is not importable (CI installs it, so there they run)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each a script's run in a subprocess (the TRL ones beside TRL's trainers)
BENCH = Path(__file__).resolve().parents[1] / "bench"
HAVE_TRL = importlib.util.find_spec("trl") is not None
needs_trl = pytest.mark.skipif(not HAVE_TRL, reason="trl is not installed: the megaopd-vs-TRL benchmarks need it "
                                                    "(pip install 'trl>=1.16')")


@pytest.fixture(scope="module")
def bench_assets(tmp_path_factory):
    return tmp_path_factory.mktemp("bench_assets")


def run_bench(script: str, assets: Path | None, timeout: int = 120, extra: list[str] = ()) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, str(BENCH / script), "--smoke", *extra] + (["--assets", str(assets)] if assets else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, f"{script} --smoke failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_flops_vs_counter_smoke():
    out = run_bench("flops_vs_counter.py", None)
    assert "| model | measurement | FlopCounterMode |" in out
    assert "forward+backward" in out and "largest deviation" in out


def test_rollout_throughput_smoke(bench_assets):
    out = run_bench("rollout_throughput.py", bench_assets)
    assert "| prompts x samples |" in out and "LocalEngine tok/s" in out


@needs_trl
@pytest.mark.parametrize("script", ["grpo_vs_trl.py", "opd_vs_trl.py"])
def test_step_vs_trl_smoke(bench_assets, script):
    out = run_bench(script, bench_assets)
    assert "step throughput ratio" in out and "generated tokens per step" in out
    assert "ratio with megaopd's rollout free" in out  # the bound on what generation speed alone can buy
    # the share of the measured matmul peak, for the step and for each phase (OPD's teacher scoring among them)
    assert "share of the fp32 matmul peak" in out and "| rollout |" in out and "| update |" in out
    assert ("| teacher |" in out) == ("opd" in script)


@needs_trl
def test_step_vs_trl_profiles_both_sides_both_ways(bench_assets):
    out = run_bench("opd_vs_trl.py", bench_assets, extra=["--profile"])
    for side in ("megaopd", "trl"):
        assert f"#### cProfile, top by cumulative time, {side}" in out
        assert f"#### torch.profiler, operators by their own CPU time, {side}" in out
        assert f"#### torch.profiler with record_shapes, operators and input shapes (slowed: see the step time), {side}" in out
    assert "aten::mm" in out and "Self CPU" in out and "Input Shapes" in out


@needs_trl
def test_memory_smoke(bench_assets):
    out = run_bench("memory.py", bench_assets)
    assert "| step | side | peak RSS (MiB) |" in out


def test_stale_gradient_smoke(bench_assets):
    out = run_bench("stale_gradient.py", bench_assets)
    assert "| step | sampled by | mean abs log w |" in out and "\n| 2 | 0 | " in out  # step 2 trains version 0's batch


def test_math_grader_agreement_smoke():
    out = run_bench("math_grader_agreement.py", None)
    assert "graded the same here: 2 (100.0%)" in out and "expected-to-fail cases paid: 0" in out


def test_shared_prompt_pass_smoke(tmp_path):
    out = run_bench("shared_prompt_pass.py", None, extra=["--out", str(tmp_path / "pass.json")])
    assert "| pass (s) |" in out and "| executed / billed FLOPs |" in out and "speed-up" in out
    result = json.loads((tmp_path / "pass.json").read_text())
    assert result["executed_share"] < 1  # the shared side skipped the repeated prompts
    assert result["max_logprob_gap"] < 1e-5  # and scored the same tokens the same (fp32)
