"""End to end on tiny models: cold start -> GRPO -> OPD with the ledger carried, TensorBoard, kill -9 / resume."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import file_mtimes, run_config, tiny_overrides, validation
from megaopd.models.checkpoint import load_state
from megaopd.config import save_config
from megaopd.accounting.metrics import read_metrics
from megaopd.run.trainer import PREEMPTED_EXIT, train


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


def test_ledger_components_are_billed_where_they_run(pipeline):
    _, base, grpo, opd = pipeline
    own = grpo["ledger"]["own"]
    assert own["rollout"] > 0 and own["train"] > 0 and own["teacher"] == 0 and own["reference"] == 0
    assert opd["ledger"]["own"]["teacher"] > 0
    assert set(base["ledger"]["own"]) == set(own) and base["ledger"]["own"]["rollout"] == 0


def hand_count(model):
    """Matmul FLOPs of an HF decoder, counted off its own modules (not megaopd.accounting.flops): per token each Linear weight
    is one multiply-add (2 FLOPs); causal attention scores and mixes s*s/2 query-key pairs per layer, 2 matmuls of
    nq*dh multiply-adds each. Returns (score(p, r): a teacher-forced pass over p + r tokens whose logits are read at
    the r response positions, generate(p, rs): a prefill, then each response's r - 1 fed-back tokens)."""
    import torch

    layers = model.model.layers
    body = sum(m.weight.numel() for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Linear))
    head = model.lm_head.weight.numel()
    width = sum(layer.self_attn.q_proj.out_features for layer in layers)  # L * nq * dh

    def score(p: int, r: int) -> int:
        return 2 * body * (p + r) + 2 * head * r + 2 * width * (p + r) ** 2

    def generate(p: int, rs: list[int]) -> int:
        total = 2 * body * p + 2 * head + 2 * width * p * p  # one prefill per prompt: the group shares its KV cache
        for r in rs:
            for t in range(1, r):  # token t of the response goes back in and attends to p + t keys
                total += 2 * (body + head) + 4 * width * (p + t)
        return total
    return score, generate


def one_rl_step(assets, run_dir, algorithm, **overrides):
    """Trainer.rl_step(1), recording the rollouts it sampled and each update's (metrics, response tokens)."""
    from megaopd.run.trainer import Trainer

    trainer = Trainer(run_config(assets, run_dir, algorithm, **overrides))
    samples, updates = [], []
    generate, train_minibatch = trainer.engine.generate, trainer.policy.train_minibatch

    def recording_generate(*args, **kwargs):
        samples.extend(generate(*args, **kwargs))
        return samples

    def recording_update(batch, *args, **kwargs):
        updates.append((train_minibatch(batch, *args, **kwargs), float(batch.response_mask.sum())))
        return updates[-1][0]
    trainer.engine.generate, trainer.policy.train_minibatch = recording_generate, recording_update
    metrics = trainer.rl_step(1)
    trainer.close()
    return trainer, metrics, samples, updates


def test_grpo_ledger_equals_a_hand_count_of_the_step(assets, tmp_path):
    """Two epochs, two minibatches, a reference model: every component against a count from the model's modules and
    the real prompt / response lengths (forward + backward = 3 forwards, per epoch)."""
    trainer, _, samples, updates = one_rl_step(assets, tmp_path / "run", "grpo", **{
        "train.epochs": 2, "train.minibatches": 2, "grpo.kl_coef": 0.01})
    score, generate = hand_count(trainer.policy.model)
    scored = sum(score(len(s.prompt_ids), len(s.response_ids)) for s in samples)
    groups = [samples[i:i + 4] for i in range(0, len(samples), 4)]
    assert len(updates) == 4 and len({len(s.response_ids) for s in samples}) > 1  # lengths vary: no padding billed
    assert trainer.ledger.own == {
        "rollout": sum(generate(len(g[0].prompt_ids), [len(s.response_ids) for s in g]) for g in groups),
        "old_logprob": scored, "reference": scored, "teacher": 0, "train": 3 * 2 * scored}


def test_full_vocab_teacher_runs_once_per_sample_and_is_billed_once(assets, tmp_path):
    """The full-vocabulary teacher runs once per sample per step, also over 2 epochs (the update projects the rows
    its scoring forward kept): its rows are counted as they go through the teacher model, then billed by hand."""
    from megaopd.run.trainer import Trainer

    init = Trainer.__init__
    rows = []

    def counting_init(self, cfg):
        init(self, cfg)
        teacher = self.teachers.teachers["*"].model
        teacher.register_forward_pre_hook(lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]),
                                          with_kwargs=True)
    Trainer.__init__ = counting_init
    try:
        trainer, _, samples, _ = one_rl_step(assets, tmp_path / "run", "opd", **{
            "opd.teachers.*": assets / "models" / "qwen3-tiny-seed1", "opd.form": "full_vocab",
            "rollout.samples_per_prompt": 1, "train.epochs": 2})
    finally:
        Trainer.__init__ = init
    passes = sum(rows) / len(samples)
    assert passes == 1  # the scoring pass only: no forward in the update's 2 epochs
    score, _ = hand_count(trainer.teachers.teachers["*"].model)
    assert trainer.ledger.own["teacher"] == passes * sum(score(len(s.prompt_ids), len(s.response_ids))
                                                         for s in samples)


def test_step_metrics_are_over_all_updates_not_the_last(assets, tmp_path):
    """Two epochs of two minibatches: the logged loss is the token-mean over the four updates, the grad norm their
    mean and max. (Sampled-token OPD: its advantages are never all zero, unlike GRPO's on an untrained model.)"""
    _, metrics, _, updates = one_rl_step(assets, tmp_path / "run", "opd", **{
        "opd.teachers.*": assets / "models" / "qwen3-tiny-seed1", "opd.form": "sampled",
        "rollout.samples_per_prompt": 2, "train.epochs": 2, "train.minibatches": 2})
    tokens = sum(n for _, n in updates)
    assert len({n for _, n in updates}) > 1  # minibatches of different token counts: a plain mean would differ
    for key in ("loss", "clip_fraction", "reverse_kl_k1"):
        assert metrics[f"train/{key}"] == pytest.approx(sum(u[key] * n for u, n in updates) / tokens, rel=1e-12)
    norms = [u["grad_norm"] for u, _ in updates]
    assert metrics["train/grad_norm"] == pytest.approx(sum(norms) / 4, rel=1e-12)
    assert metrics["train/grad_norm_max"] == max(norms) and len(set(norms)) == 4
    assert metrics["train/loss"] != pytest.approx(updates[-1][0]["loss"], rel=1e-6)
    assert metrics["train/loss"] != pytest.approx(sum(u["loss"] for u, _ in updates) / 4, rel=1e-6)


def test_merge_updates_by_hand():
    from megaopd.run.trainer import merge_updates

    merged = merge_updates([({"loss": 1.0, "kl": 0.5, "grad_norm": 2.0, "lr": 0.1}, 10.0),
                            ({"loss": 4.0, "kl": 0.1, "grad_norm": 1.0, "lr": 0.2}, 30.0)])
    assert merged == pytest.approx({"loss": 3.25, "kl": 0.2, "grad_norm": 1.5, "grad_norm_max": 2.0, "lr": 0.2})


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
    assert step["perf/teacher_wait_seconds"] == step["perf/teacher_seconds"] > 0  # local teachers score in the step


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


def test_measuring_the_validation_split_moves_no_training_number(assets, tmp_path):
    """The same run with and without data.validation: every metric of the one without equal at every step, the
    final weights byte-identical; the other has the valid/ and final_valid/ numbers besides."""
    runs = {}
    for name, extra in (("test_only", {}), ("both", validation(assets))):
        train(run_config(assets, tmp_path / name, "grpo", **extra, **{"eval.every": 1, "train.steps": 2}))
        runs[name] = _deterministic(read_metrics(tmp_path / name))
    plain = [{k: v for k, v in m.items() if "valid/" not in k} for m in runs["both"]]
    assert plain == runs["test_only"] and plain != runs["both"]
    weights = [(tmp_path / name / "final" / "model.safetensors").read_bytes() for name in runs]
    assert weights[0] == weights[1]


def _kill_9_after_checkpoint(config_path, checkpoint, env):
    proc = subprocess.Popen(_cli(config_path), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not checkpoint.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert checkpoint.exists(), f"the run never reached its checkpoint {checkpoint}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_9_then_same_command_resumes_with_the_rollouts_generated_ahead(assets, tmp_path):
    """kill -9 mid-stage, then the same command: metrics and ledger equal an uninterrupted run's.

    With rollout.max_staleness=1 (K=0 resumes the same state less the batch ahead): the first checkpoint (step 2 of
    4) holds batch 3, generated during step 2 and billed there; the resumed run trains it at step 3, as the
    uninterrupted run does, and generates the rest as that run did: no sample trained twice, none lost."""
    import torch

    overrides = {"train.steps": 4, "checkpoint.every": 2, "rollout.max_staleness": 1}
    save_config(run_config(assets, tmp_path / "run", "grpo", **overrides), tmp_path / "run.yaml")
    train(run_config(assets, tmp_path / "reference", "grpo", **overrides))

    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    checkpoint = tmp_path / "run" / "checkpoints" / "step_0000002" / "state.pt"
    _kill_9_after_checkpoint(tmp_path / "run.yaml", checkpoint, env)
    assert not (tmp_path / "run" / "summary.json").exists()
    [ahead] = load_state(checkpoint)["rollouts"]  # the work in flight at the kill
    assert {s["weight_version"] for s in ahead["samples"]} == {1}

    subprocess.run(_cli(tmp_path / "run.yaml"), env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    resumed = json.loads((tmp_path / "run" / "summary.json").read_text())
    expected = json.loads((tmp_path / "reference" / "summary.json").read_text())
    assert resumed["ledger"]["own"] == expected["ledger"]["own"]
    metrics = read_metrics(tmp_path / "run")
    assert _deterministic(metrics) == _deterministic(read_metrics(tmp_path / "reference"))
    steps = [m for m in metrics if "rollout/draw_index" in m]
    # Each step trains the next prompts_per_step draws: none trained twice, none skipped; never more than K stale.
    assert [m["rollout/draw_index"] for m in steps] == [4 * i for i in range(4)]
    assert [m["rollout/staleness_max"] for m in steps] == [0, 1, 1, 1]
    # train.tis=auto at K=1: token-level truncated IS, in the saved config and in every step's metrics
    assert "  tis: token\n" in (tmp_path / "run" / "config.yaml").read_text()
    assert all(0.5 < m["rollout/tis_weight_mean"] < 2 for m in steps)


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
    """Two epochs of two minibatches: four optimizer steps per batch (the ledger: the hand count above)."""
    import torch

    train(run_config(assets, tmp_path / "run", "grpo", **{"train.epochs": 2, "train.minibatches": 2, "train.steps": 2}))
    state = load_state(tmp_path / "run" / "checkpoints" / "step_0000002" / "state.pt")
    assert all(int(p["step"]) == 8 for p in state["policy"]["optimizer"]["state"].values())


def test_running_a_finished_run_again_changes_nothing(assets, tmp_path):
    """What a job requeued by a preemption signal that came after the last step runs (the final eval or export
    was under way): the same command on a finished run. With no checkpoint at the end (checkpoint.every past
    it), resuming would train the whole stage again; it must write nothing."""
    config = run_config(assets, tmp_path / "run", "grpo", **{"train.steps": 2, "checkpoint.every": 1000})
    first = train(config)
    written = file_mtimes(tmp_path / "run")
    again = train(config)
    assert again["ledger"]["own"] == first["ledger"]["own"] and again["final"] == first["final"]
    assert file_mtimes(tmp_path / "run") == written
    assert sum(any(k.startswith("final/") for k in m) for m in read_metrics(tmp_path / "run")) == 1
    longer = train(run_config(assets, tmp_path / "run", "grpo", **{"train.steps": 3, "checkpoint.every": 1000}))
    assert longer["steps"] == 3  # a larger cap trains on (here from the start: no checkpoint)


# The code before the bounded-staleness rollout pipeline (rollout.max_staleness, issue 29): at K=0 this code must
# reproduce its runs exactly. When a later change alters these numbers on purpose, move the pin to the commit that
# changed them (PINNED_COMMIT, its megaopd tree id and the archive: see pinned_code), and say so (and why the numbers
# changed) in the commit message.
PINNED_COMMIT = "69e760be98d171f340c5570d5a50a7d7235d6d51"
PINNED_TREE = "d9850639f5e4de86f19b5cac9b9fb112bf6cffac"  # `git rev-parse PINNED_COMMIT:megaopd`
# `git archive PINNED_COMMIT megaopd | gzip -n -9`: stored, since a shallow clone (CI's) does not hold the commit.
PINNED_ARCHIVE = Path(__file__).resolve().parent / "data" / "pinned_megaopd.tar.gz"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pinned_code(tmp_path_factory):
    """The megaopd package of PINNED_COMMIT, extracted from PINNED_ARCHIVE, which must hash to the commit's tree
    (a git tree id covers every file's bytes, name and mode): the code that ran then, with or without the history."""
    out = tmp_path_factory.mktemp("pinned_code")
    subprocess.run(["tar", "-xzf", str(PINNED_ARCHIVE), "-C", str(out)], check=True)
    git = ["git", "-C", str(out)]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "megaopd"], check=True)
    tree = subprocess.run(git + ["write-tree", "--prefix=megaopd/"], capture_output=True, text=True, check=True)
    assert tree.stdout.strip() == PINNED_TREE, f"{PINNED_ARCHIVE} is not the megaopd tree of {PINNED_COMMIT}"
    shutil.rmtree(out / ".git")  # the old code runs from here, as from an export
    return out


def _train_with(code, config, overrides):
    """`megaopd train` in a subprocess with `code` first on the path, after checking that it is the megaopd imported."""
    script = ("import sys, megaopd; print(megaopd.__file__, flush=True); from megaopd.cli import main; "
              "sys.exit(main())")
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script, "train", str(config), *overrides], env=env, cwd=code,
                          capture_output=True, text=True)  # cwd: `python -c` puts it before PYTHONPATH
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.splitlines()[0] == str(code / "megaopd" / "__init__.py")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm", ["grpo", "opd"])
def test_zero_staleness_reproduces_the_pinned_commit(algorithm, assets, tmp_path, pinned_code):
    """The embedded GRPO and OPD (full vocabulary, a local teacher) configs, 2 steps with a checkpoint after the
    first, by the code of PINNED_COMMIT (before the pipeline) and by this code at rollout.max_staleness=0: every
    metric both log (but perf/*) equal at every step, the ledger equal but for its run id, the final weights
    byte-identical."""
    config = ROOT / "configs" / "embedded" / f"{algorithm}.yaml"
    extra = {"train.steps": 2, "checkpoint.every": 1, "eval.every": 1}
    if algorithm == "opd":
        extra |= {"opd.teachers.*": assets / "models" / "qwen3-tiny-seed1", "rollout.samples_per_prompt": 1}
    old, new = tmp_path / "old" / "run", tmp_path / "new" / "run"  # one name: the ledger names its run
    _train_with(pinned_code, config, tiny_overrides(assets, old, algorithm, **extra))
    _train_with(ROOT, config, tiny_overrides(assets, new, algorithm, **extra) + ["rollout.max_staleness=0"])

    old_metrics, new_metrics = _deterministic(read_metrics(old)), _deterministic(read_metrics(new))
    print("keys new since", PINNED_COMMIT, sorted(set().union(*new_metrics) - set().union(*old_metrics)))
    print("keys gone since", PINNED_COMMIT, sorted(set().union(*old_metrics) - set().union(*new_metrics)))
    assert [m["step"] for m in new_metrics] == [m["step"] for m in old_metrics]
    compared = set()
    for before, now in zip(old_metrics, new_metrics):
        both = before.keys() & now.keys()
        assert {k: now[k] for k in both} == {k: before[k] for k in both}, f"step {now['step']}"
        compared |= both
    assert {"train/loss", "rollout/reward", "flops/total_stage", "eval/mean/accuracy_greedy"} <= compared
    ledgers = [json.loads((run / "final" / "megaopd_ledger.json").read_text()) for run in (old, new)]
    assert ledgers[1] | {"run_id": None} == ledgers[0] | {"run_id": None}  # a fresh uuid per run
    assert (new / "final" / "model.safetensors").read_bytes() == (old / "final" / "model.safetensors").read_bytes()
