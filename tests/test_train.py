"""End to end on tiny models: cold start -> GRPO -> OPD with the ledger carried, TensorBoard, kill -9 / resume."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import run_config
from megaopd.config import save_config
from megaopd.metrics import read_metrics
from megaopd.trainer import PREEMPTED_EXIT, train


@pytest.fixture(scope="module")
def pipeline(assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    base = train(run_config(assets, root / "base", "sft", counts_as="cold_start", **{"sft.noise": 0.3}))
    grpo = train(run_config(assets, root / "grpo", "grpo", **{"model.path": root / "base" / "final"}))
    opd = train(run_config(assets, root / "opd", "opd", **{
        "model.path": root / "base" / "final", "opd.teachers.*": root / "grpo" / "final",
        "rollout.samples_per_prompt": 1}))
    return root, base, grpo, opd


def test_each_run_writes_its_directory(pipeline):
    root, *_ = pipeline
    for name in ("base", "grpo", "opd"):
        run = root / name
        for path in ("config.yaml", "metrics.jsonl", "summary.json", "final/config.json", "final/model.safetensors",
                     "final/tokenizer.json", "final/megaopd_ledger.json"):
            assert (run / path).exists(), f"{name}/{path}"
        metrics = read_metrics(run)
        assert metrics[0]["step"] == 0 and "eval/mean/accuracy_greedy" in metrics[0]
        assert "final/mean/accuracy_greedy" in metrics[-1]
        assert [m["step"] for m in metrics if "eval/mean/accuracy_greedy" in m] == [0, 2, 4]


def test_ledger_components_follow_the_step_formulas(pipeline):
    _, base, grpo, opd = pipeline
    own = grpo["ledger"]["own"]
    assert own["rollout"] > 0 and own["teacher"] == 0 and own["reference"] == 0
    assert own["train"] == pytest.approx(3 * own["old_logprob"])  # one epoch: update = 3x the recompute forward
    own = opd["ledger"]["own"]
    # The teacher has the student's shape here; the full-vocabulary form runs it twice a step (the scoring pass, and
    # its rows recomputed in the update instead of a stored [B, S-1, V] grid: flops.teacher_passes).
    assert own["teacher"] == pytest.approx(2 * own["old_logprob"])
    assert set(base["ledger"]["own"]) == set(own) and base["ledger"]["own"]["rollout"] == 0


def test_totals_carry_teacher_training_and_cold_start(pipeline):
    _, base, grpo, opd = pipeline
    stage = lambda s: sum(s["ledger"]["own"].values())  # noqa: E731
    totals = opd["ledger"]["totals"]
    assert totals["stage"] == pytest.approx(stage(opd))
    assert totals["with_teachers"] == pytest.approx(stage(opd) + stage(grpo))
    assert totals["with_cold_start"] == pytest.approx(stage(opd) + stage(grpo) + stage(base))


def test_opd_logs_per_teacher_kl_and_token_share(pipeline):
    root, *_ = pipeline
    step = read_metrics(root / "opd")[1]
    assert step["train/teacher/*/token_share"] == pytest.approx(1.0)
    assert "train/teacher/*/reverse_kl_k1" in step and "train/reverse_kl" in step


def test_tensorboard_events_match_metrics(pipeline):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, *_ = pipeline
    acc = EventAccumulator(str(root / "grpo" / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for prefix in ("train/", "rollout/", "eval/", "flops/", "perf/"):
        assert any(t.startswith(prefix) for t in tags), prefix
    logged = {m["step"]: m["flops/total_stage"] for m in read_metrics(root / "grpo") if "flops/total_stage" in m}
    events = {e.step: e.value for e in acc.Scalars("flops/total_stage")}
    assert events.keys() == logged.keys()
    assert all(events[s] == pytest.approx(logged[s], rel=1e-6) for s in logged)


def _cli(config_path, *extra):
    return [sys.executable, "-m", "megaopd.cli", "train", str(config_path), *extra]


def _deterministic(metrics):
    return [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in metrics]


def test_kill_9_then_same_command_resumes_to_identical_metrics(assets, tmp_path):
    config = run_config(assets, tmp_path / "run", "grpo", **{"train.steps": 6, "checkpoint.every": 2})
    save_config(config, tmp_path / "run.yaml")
    reference = run_config(assets, tmp_path / "reference", "grpo", **{"train.steps": 6, "checkpoint.every": 2})
    train(reference)

    env = {**os.environ, "OMP_NUM_THREADS": str(__import__("torch").get_num_threads())}
    proc = subprocess.Popen(_cli(tmp_path / "run.yaml"), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_0000004" / "state.pt"
    deadline = time.time() + 300
    while not checkpoint.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert checkpoint.exists(), "the run never reached its step-4 checkpoint"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "run" / "summary.json").exists()

    subprocess.run(_cli(tmp_path / "run.yaml"), env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    resumed = json.loads((tmp_path / "run" / "summary.json").read_text())
    expected = json.loads((tmp_path / "reference" / "summary.json").read_text())
    assert resumed["ledger"]["own"] == expected["ledger"]["own"]
    assert _deterministic(read_metrics(tmp_path / "run")) == _deterministic(read_metrics(tmp_path / "reference"))


def test_preemption_signal_checkpoints_and_exits_for_requeue(assets, tmp_path):
    config = run_config(assets, tmp_path / "run", "grpo", **{"train.steps": 400, "checkpoint.every": 1000})
    save_config(config, tmp_path / "run.yaml")
    proc = subprocess.Popen(_cli(tmp_path / "run.yaml"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 300
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 3) and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=120) == PREEMPTED_EXIT
    checkpoints = list((tmp_path / "run" / "checkpoints").glob("step_*"))
    assert len(checkpoints) == 1  # written on the signal, not by the every-1000 schedule
    step = int(checkpoints[0].name.split("_")[1])
    assert max(m["step"] for m in read_metrics(tmp_path / "run")) == step


def test_several_updates_per_batch(assets, tmp_path):
    """Two epochs of two minibatches: four optimizer steps per batch, and the ledger bills two training passes."""
    import torch

    summary = train(run_config(assets, tmp_path / "run", "grpo",
                               **{"train.epochs": 2, "train.minibatches": 2, "train.steps": 2}))
    own = summary["ledger"]["own"]
    assert own["train"] == pytest.approx(6 * own["old_logprob"])
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_0000002" / "state.pt", weights_only=False)
    assert all(int(p["step"]) == 8 for p in state["policy"]["optimizer"]["state"].values())


def test_running_a_finished_run_again_changes_nothing(assets, tmp_path):
    config = run_config(assets, tmp_path / "run", "grpo", **{"train.steps": 2})
    first = train(config)
    again = train(config)
    assert again["ledger"]["own"] == first["ledger"]["own"] and again["final"] == first["final"]
    assert sum(any(k.startswith("final/") for k in m) for m in read_metrics(tmp_path / "run")) == 1
