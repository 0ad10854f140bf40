"""The fault suite (issue 55): each fault a long run meets on a shared cluster, injected for real (no mocks), with
the line megaopd prints and what a rerun of the same command does. docs/faults.md lists them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_config
from megaopd.models.checkpoint import Checkpointer, UnsafeCheckpoint, load_state
from megaopd.config import save_config
from megaopd.accounting.metrics import read_metrics


class _OpensAFile:
    """A pickle that creates a file when it is loaded: what a planted checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def _plant_pickle(path: Path, marker: Path) -> None:
    torch.save({"step": 4, "policy": _OpensAFile(marker)}, path)
    assert not marker.exists()


def test_a_planted_pickle_is_refused_and_runs_nothing(tmp_path):
    state = tmp_path / "checkpoints" / "step_0000004" / "state.pt"
    state.parent.mkdir(parents=True)
    marker = tmp_path / "created_on_load"
    _plant_pickle(state, marker)
    with pytest.raises(UnsafeCheckpoint, match=r"holds code \(io.open would run on load\)"):
        load_state(state)
    assert Checkpointer(tmp_path, every=2, keep=2).latest() is None  # moved aside: the run starts over
    assert (tmp_path / "checkpoints" / "damaged" / "step_0000004" / "state.pt").exists()
    assert not marker.exists()


def test_a_checkpoint_holds_data_only(assets, tmp_path):
    """A real checkpoint (model, optimizer, RNG states, rollouts ahead) loads under the allow-list."""
    from megaopd.run.trainer import train

    train(run_config(assets, tmp_path / "run", "grpo", **{"train.steps": 4, "rollout.max_staleness": 1}))
    state = load_state(tmp_path / "run" / "checkpoints" / "step_0000002" / "state.pt")
    assert state["step"] == 2 and len(state["rollouts"]) == 1


# ---------------------------------------------------------------------------------------------- damaged checkpoints

STEPS = {"train.steps": 4, "checkpoint.every": 2, "checkpoint.keep": 2}


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    """A finished 4-step GRPO run (checkpoints at steps 2 and 4), and the same run carried to 6 steps unbroken: a
    damaged run resumed to 6 steps must end with this one's metrics and ledger."""
    from megaopd.run.trainer import train

    root = tmp_path_factory.mktemp("fault_runs")
    train(run_config(assets, root / "base" / "run", "grpo", **STEPS))
    train(run_config(assets, root / "reference" / "run", "grpo", **(STEPS | {"train.steps": 6})))
    return root


def _copy_base(runs, tmp_path) -> Path:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(runs / "base" / "run", run)
    return run


def _deterministic(metrics):
    return [{k: v for k, v in m.items() if not k.startswith("perf/")} for m in metrics]


def _resumes_to_the_reference(assets, runs, run) -> dict:
    """Train the damaged run on to 6 steps: its metrics (one row per step, none twice) and ledger are the unbroken
    run's."""
    import json

    from megaopd.run.trainer import train

    summary = train(run_config(assets, run, "grpo", **(STEPS | {"train.steps": 6})))
    expected = json.loads((runs / "reference" / "run" / "summary.json").read_text())
    assert summary["ledger"]["own"] == expected["ledger"]["own"]
    metrics = read_metrics(run)
    assert _deterministic(metrics) == _deterministic(read_metrics(runs / "reference" / "run"))
    return summary


def _damage_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "checkpoint" in r.getMessage()]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["truncated", "zeroed", "manifest_garbled", "byte_flipped"])
def test_a_damaged_latest_checkpoint_is_moved_aside_and_the_previous_one_resumes(fault, assets, runs, tmp_path,
                                                                                    caplog):
    run = _copy_base(runs, tmp_path)
    latest = run / "checkpoints" / "step_0000004"
    state = latest / "state.pt"
    data = state.read_bytes()
    if fault == "truncated":
        state.write_bytes(data[: len(data) // 2])
    elif fault == "zeroed":
        state.write_bytes(bytes(len(data)))
    elif fault == "manifest_garbled":
        (latest / "manifest.json").write_text('{"format": 1, "fil')
    else:  # one byte changed deep in a tensor: still a valid zip, caught only by the checksum
        state.write_bytes(data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1:])
    caplog.set_level("WARNING")
    _resumes_to_the_reference(assets, runs, run)
    [line] = _damage_warnings(caplog)
    assert "step_0000004 is damaged" in line and "resuming from step 2" in line, line
    moved = run / "checkpoints" / "damaged" / "step_0000004"
    assert moved.is_dir() and f"moved to {moved}" in line  # kept for a post-mortem, never deleted


@pytest.mark.timeout(300)
def test_a_run_with_no_intact_checkpoint_starts_over_and_logs_each_step_once(assets, runs, tmp_path):
    """What a kill before the first checkpoint leaves too: the run's metrics.jsonl and TensorBoard events, nothing
    to resume from. The run starts over and its metrics and events hold each step once (its step-0 eval once)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = _copy_base(runs, tmp_path)
    for state in (run / "checkpoints").glob("step_*/state.pt"):
        state.write_bytes(b"")
    _resumes_to_the_reference(assets, runs, run)
    metrics = read_metrics(run)
    events = EventAccumulator(str(run / "tensorboard")).Reload()
    for tag in events.Tags()["scalars"]:
        assert [e.step for e in events.Scalars(tag)] == [m["step"] for m in metrics if tag in m], tag


@pytest.mark.timeout(300)
def test_a_checkpoint_without_a_manifest_loads_when_it_reads_as_data(assets, runs, tmp_path, caplog):
    """A checkpoint written before manifests (issue 55): loaded unverified when it reads completely as data, moved
    aside like a damaged one when it does not."""
    run = _copy_base(runs, tmp_path)
    (run / "checkpoints" / "step_0000004" / "manifest.json").unlink()
    caplog.set_level("WARNING")
    _resumes_to_the_reference(assets, runs, run)
    [line] = _damage_warnings(caplog)
    assert "step_0000004 has no manifest" in line and "loaded unverified" in line, line

    old = _copy_base(runs, tmp_path / "truncated")
    state = old / "checkpoints" / "step_0000004" / "state.pt"
    (state.parent / "manifest.json").unlink()
    state.write_bytes(state.read_bytes()[:1000])
    assert Checkpointer(old, every=2, keep=2).latest()["step"] == 2
    assert (old / "checkpoints" / "damaged" / "step_0000004" / "state.pt").exists()


@pytest.mark.timeout(300)
def test_a_metrics_line_cut_short_is_left_out_and_the_run_resumes(assets, runs, tmp_path, caplog):
    """A kill or a full disk mid-write leaves metrics.jsonl's last line without its end: the run resumes as the
    unbroken one. A line damaged before the last is an error naming the file and line, not a traceback."""
    run = _copy_base(runs, tmp_path)
    metrics = run / "metrics.jsonl"
    text = metrics.read_text()
    metrics.write_text(text[:-len(text.splitlines()[-1]) // 2])
    caplog.set_level("WARNING")
    _resumes_to_the_reference(assets, runs, run)
    assert any("the last line was cut short" in r.getMessage() for r in caplog.records)

    from megaopd.errors import RunDirError

    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(lines[:2] + [lines[2][:40] + "\n"] + lines[3:]))
    with pytest.raises(RunDirError, match=rf"{metrics}:3: not a JSON line"):
        read_metrics(run)


@pytest.mark.timeout(300)
def test_a_summary_cut_short_ends_the_run_again_from_its_last_checkpoint(assets, runs, tmp_path, caplog):
    """A kill while summary.json was written (before it was renamed into place) left half of one: the same command
    ends the run again from its last checkpoint, with the same ledger and metrics, and writes it whole."""
    import json

    from megaopd.run.trainer import train

    run = _copy_base(runs, tmp_path)
    summary = run / "summary.json"
    expected = json.loads(summary.read_text())
    summary.write_text(summary.read_text()[:100])
    caplog.set_level("WARNING")
    train(run_config(assets, run, "grpo", **STEPS))
    assert any("summary.json is not JSON" in r.getMessage() for r in caplog.records)
    assert json.loads(summary.read_text())["ledger"]["own"] == expected["ledger"]["own"]
    assert _deterministic(read_metrics(run)) == _deterministic(read_metrics(runs / "base" / "run"))
    assert not list(run.glob(".tmp_*"))


@pytest.mark.timeout(300)
def test_a_planted_pickle_in_the_latest_checkpoint_is_moved_aside(assets, runs, tmp_path, caplog):
    """Its manifest rewritten to match it too (someone who can write the file can write the manifest): loading
    still refuses it, creates nothing, and the run resumes from the one before."""
    from megaopd.models.checkpoint import write_manifest

    run = _copy_base(runs, tmp_path)
    latest = run / "checkpoints" / "step_0000004"
    marker = tmp_path / "created_on_load"
    _plant_pickle(latest / "state.pt", marker)
    write_manifest(latest)
    caplog.set_level("WARNING")
    _resumes_to_the_reference(assets, runs, run)
    [line] = _damage_warnings(caplog)
    assert "holds code (io.open would run on load)" in line and "resuming from step 2" in line, line
    assert not marker.exists()


def test_every_checkpoint_damaged_starts_over(tmp_path, caplog):
    for step in (2, 4):
        directory = tmp_path / "checkpoints" / f"step_{step:07d}"
        directory.mkdir(parents=True)
        (directory / "state.pt").write_bytes(b"\0" * 100)
    caplog.set_level("WARNING")
    assert Checkpointer(tmp_path, every=2, keep=2).latest() is None
    lines = _damage_warnings(caplog)
    assert len(lines) == 2 and all("resuming from the start" in line for line in lines)
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "damaged").iterdir()) == ["step_0000002",
                                                                                        "step_0000004"]


def test_a_saved_checkpoint_is_flushed_and_verified(tmp_path):
    from megaopd.models.checkpoint import verify

    checkpointer = Checkpointer(tmp_path, every=1, keep=2)
    for step in (1, 2, 3):
        checkpointer.save(step, {"step": step, "w": torch.arange(10.0) * step})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_0000002", "step_0000003"]
    assert verify(tmp_path / "checkpoints" / "step_0000003") is None
    assert checkpointer.latest()["step"] == 3


def test_a_distributed_checkpoint_verifies_with_every_shard(tmp_path):
    """Megatron's: the trainer's state file points at a directory of every rank's shards; the manifest covers them,
    so a shard missing or cut short makes the step fall back to the previous one."""
    def shards(step):
        directory = tmp_path / "megatron_checkpoints" / f"step_{step:07d}"
        directory.mkdir(parents=True)
        for rank in range(4):
            (directory / f"__{rank}_0.distcp").write_bytes(os.urandom(256))
        return directory

    checkpointer = Checkpointer(tmp_path, every=1, keep=2)
    for step in (1, 2):
        checkpointer.save(step, {"step": step, "policy": {"dist_checkpoint": str(shards(step)), "steps": step}})
    (tmp_path / "megatron_checkpoints" / "step_0000002" / "__3_0.distcp").unlink()  # one rank's shard lost
    state = checkpointer.latest()
    assert state["step"] == 1
    assert (tmp_path / "checkpoints" / "damaged" / "step_0000002").is_dir()


# ---------------------------------------------------------------------------------------------- damaged models

@pytest.mark.parametrize("fault", ["cut_short", "header_changed", "no_weights", "no_config"])
@pytest.mark.parametrize("role", ["student", "teacher"])
def test_a_model_directory_whose_weights_cannot_be_read_is_refused_before_the_run(assets, tmp_path, fault, role):
    """A copy cut short, a changed header, no weights, no config.json: one model error naming the setting and the
    file, before the run directory is made or any model loads (transformers' error came mid-load, a traceback)."""
    import shutil

    from megaopd.errors import ModelError
    from megaopd.run.resolve import resolve_run

    model = tmp_path / "model"
    shutil.copytree(assets / "models" / "qwen3-tiny", model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    if fault == "cut_short":
        weights.write_bytes(data[: len(data) // 2])
    elif fault == "header_changed":
        weights.write_bytes(data[:4] + bytes([data[4] ^ 0xFF]) + data[5:])
    else:
        (weights if fault == "no_weights" else model / "config.json").unlink()
    setting = {"student": "model.path", "teacher": "opd.teachers.*"}[role]
    cfg = run_config(assets, tmp_path / "run", "opd", **{"rollout.samples_per_prompt": 1,
                                                          "opd.teachers.*": assets / "models" / "qwen3-tiny-seed1",
                                                          setting: model})
    problem = {"cut_short": "model.safetensors is not a readable safetensors file (Error while deserializing "
                            "header: incomplete metadata, file not fully covered)",
               "header_changed": "model.safetensors is not a readable safetensors file (Error while deserializing "
                                 "header: header too large)",
               "no_weights": "no weights there (no *.safetensors)", "no_config": "no config.json there"}[fault]
    with pytest.raises(ModelError) as err:
        resolve_run(cfg)
    assert str(err.value) == (f"{setting}={model}: {problem}; point it at a complete HF model directory (copy or "
                              "export it again)")
    assert not (tmp_path / "run").exists()


def _sharded_copy(model: Path, out: Path, kind: str) -> Path:
    """`model` (one model.safetensors) as a sharded checkpoint of two shards and their index, as transformers writes
    one: safetensors shards, or pytorch .bin shards."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out, ignore=shutil.ignore_patterns("model.safetensors"))
    weights = load_file(model / "model.safetensors")
    names = sorted(weights)
    shards = {f"model-0000{i + 1}-of-00002.safetensors" if kind == "safetensors" else
              f"pytorch_model-0000{i + 1}-of-00002.bin": names[i::2] for i in range(2)}
    for shard, keys in shards.items():
        part = {k: weights[k] for k in keys}
        if kind == "safetensors":
            save_file(part, out / shard, metadata={"format": "pt"})
        else:
            torch.save(part, out / shard)
    index = "model.safetensors.index.json" if kind == "safetensors" else "pytorch_model.bin.index.json"
    (out / index).write_text(json.dumps({"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    return out


@pytest.mark.parametrize("fault", ["shard_missing", "index_not_json", "no_weight_map"])
@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_a_sharded_model_whose_index_cannot_be_followed_is_refused_before_the_run(assets, tmp_path, kind, fault):
    """A shard the index names is gone, the index is cut short, it has no weight_map: one model error naming the
    directory and the file (transformers' FileNotFoundError, JSONDecodeError, KeyError came mid-load)."""
    from transformers import AutoModelForCausalLM

    from megaopd.errors import ModelError
    from megaopd.run.resolve import resolve_run, weights_problem

    model = _sharded_copy(assets / "models" / "qwen3-tiny", tmp_path / "model", kind)
    assert weights_problem(model) is None and AutoModelForCausalLM.from_pretrained(model)  # intact: it loads
    index = model / ("model.safetensors.index.json" if kind == "safetensors" else "pytorch_model.bin.index.json")
    shard = "model-00002-of-00002.safetensors" if kind == "safetensors" else "pytorch_model-00002-of-00002.bin"
    if fault == "shard_missing":
        (model / shard).unlink()
    elif fault == "index_not_json":
        index.write_text('{"weight_map": {')  # cut short
    else:
        index.write_text('{"metadata": {}}')
    problem = {"shard_missing": f"{index.name} names a shard that is not there: {shard}",
               "index_not_json": f"{index.name} is not a readable JSON index (Expecting property name enclosed in "
                                 "double quotes: line 1 column 17 (char 16))",
               "no_weight_map": f"{index.name} has no weight_map (tensor name -> shard file)"}[fault]
    cfg = run_config(assets, tmp_path / "run", "grpo", **{"model.path": model})
    with pytest.raises(ModelError) as err:
        resolve_run(cfg)
    assert str(err.value) == (f"model.path={model}: {problem}; point it at a complete HF model directory (copy or "
                              "export it again)")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------- non-finite steps

def _megaopd_train(config: Path, *overrides) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "megaopd.cli", "train", str(config), *overrides], env=env,
                          capture_output=True, text=True, timeout=280)


def _poison(model: Path) -> None:
    """Make an HF model directory's final norm weights NaN: every logprob it gives is then NaN."""
    from safetensors.torch import load_file, save_file

    weights = load_file(model / "model.safetensors")
    weights["model.norm.weight"][:] = float("nan")
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_teachers_nan_logprobs_stop_the_run_before_the_update(assets, tmp_path):
    """A teacher's weights go bad mid-run (NaN logprobs): the step stops before the optimizer applies it, in one
    line naming the step and the quantity, with the last finite checkpoint kept; once the teacher is mended the
    same command resumes from it and ends as an unbroken run does."""
    import json
    import shutil

    from megaopd.run.trainer import train

    teacher = tmp_path / "teacher"
    shutil.copytree(assets / "models" / "qwen3-tiny-seed1", teacher)
    opd = {"opd.teachers.*": teacher, "rollout.samples_per_prompt": 1, "opd.form": "sampled"}
    save_config(run_config(assets, tmp_path / "run", "opd", **(STEPS | opd | {"train.steps": 2})), tmp_path / "a.yaml")
    assert _megaopd_train(tmp_path / "a.yaml").returncode == 0
    _poison(teacher)
    save_config(run_config(assets, tmp_path / "run", "opd", **(STEPS | opd)), tmp_path / "run.yaml")
    proc = _megaopd_train(tmp_path / "run.yaml")
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("megaopd:")]
    assert line.startswith("megaopd: non-finite step: step 3: the teacher's logprobs (teacher_logprobs) are "
                           "non-finite at "), line
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")) == ["step_0000002"]

    shutil.copytree(assets / "models" / "qwen3-tiny-seed1", teacher, dirs_exist_ok=True)  # mended
    assert _megaopd_train(tmp_path / "run.yaml").returncode == 0
    shutil.copytree(assets / "models" / "qwen3-tiny-seed1", tmp_path / "ref_teacher")
    reference = train(run_config(assets, tmp_path / "reference" / "run", "opd",
                                 **(STEPS | opd | {"opd.teachers.*": tmp_path / "ref_teacher"})))
    resumed = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert resumed["ledger"]["own"] == reference["ledger"]["own"]
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [m["step"] for m in read_metrics(
        tmp_path / "reference" / "run")]  # no row twice


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_nan_loss_stops_the_run_or_is_skipped_and_counted(assets, tmp_path):
    """grpo.kl_coef=.inf times the first step's zero KL makes the loss NaN: stop (the default) ends the run in one
    line before any update; skip leaves every such update out, counted, and the weights stay the initial ones."""
    from safetensors.torch import load_file

    overrides = STEPS | {"train.steps": 2, "grpo.kl_coef": ".inf"}
    save_config(run_config(assets, tmp_path / "run", "grpo", **overrides), tmp_path / "run.yaml")
    proc = _megaopd_train(tmp_path / "run.yaml")
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("megaopd:")]
    assert line.startswith("megaopd: non-finite step: step 1: the loss is nan; the update was not applied"), line

    save_config(run_config(assets, tmp_path / "skip", "grpo", **(overrides | {"train.nonfinite": "skip"})),
                tmp_path / "skip.yaml")
    proc = _megaopd_train(tmp_path / "skip.yaml")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sum("update left out (train.nonfinite=skip)" in x for x in proc.stderr.splitlines()) == 2
    steps = [m for m in read_metrics(tmp_path / "skip") if "train/nonfinite_skipped" in m]
    assert [m["train/nonfinite_skipped"] for m in steps] == [1, 1]
    initial = load_file(assets / "models" / "qwen3-tiny" / "model.safetensors")
    final = load_file(tmp_path / "skip" / "final" / "model.safetensors")
    assert all(torch.equal(final[k], initial[k]) for k in initial)  # nothing non-finite reached the weights


# ---------------------------------------------------------------------------------------------- a full disk

@pytest.fixture
def mount_small(request):
    """Mounts a small tmpfs of its own at a directory (root only, as in CI's containers): a filesystem the test can
    really fill. Unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")

    def mount(directory: Path, size: str = "64m", options: str = "") -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}{options}", "tmpfs", str(directory)],
                          capture_output=True).returncode:
            pytest.skip("this machine does not let the test mount a tmpfs")
        request.addfinalizer(lambda: subprocess.run(["umount", "-l", str(directory)], check=False))
        return directory
    return mount


@pytest.fixture
def small_disk(tmp_path, mount_small):
    return mount_small(tmp_path / "disk")


def _fill(disk: Path, leave: int) -> Path:
    """A ballast file that leaves about `leave` bytes free on `disk`."""
    import shutil

    ballast = disk / "ballast"
    with open(ballast, "wb") as f:
        chunk = bytes(1 << 20)
        while shutil.disk_usage(disk).free > leave + len(chunk):
            f.write(chunk)
        rest = shutil.disk_usage(disk).free - leave
        if rest > 0:
            f.write(bytes(rest))
    return ballast


def _no_space_line(proc) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("megaopd:")]
    assert line.endswith("free); free space, lower checkpoint.keep or move run_dir"), line
    return line


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_full_disk_at_a_checkpoint_ends_in_one_line_and_the_rerun_resumes(assets, runs, small_disk, tmp_path):
    import json
    import re
    import shutil

    run = small_disk / "run"
    shutil.copytree(runs / "base" / "run", run)
    save_config(run_config(assets, run, "grpo", **(STEPS | {"train.steps": 6})), tmp_path / "run.yaml")
    ballast = _fill(small_disk, 300_000)  # room for the evals and metrics of two steps, not for a checkpoint
    line = _no_space_line(_megaopd_train(tmp_path / "run.yaml"))
    assert re.fullmatch(rf"megaopd: {run}/checkpoints/step_0000006: no space left \(1\.\d MiB needed, \d+\.\d KiB "
                        r"free\); free space, lower checkpoint.keep or move run_dir", line), line
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_0000002", "step_0000004"]  # no .tmp_step_*
    assert Checkpointer(run, every=2, keep=2).latest()["step"] == 4  # the earlier ones intact

    ballast.unlink()  # space freed: the same command resumes
    assert _megaopd_train(tmp_path / "run.yaml").returncode == 0
    resumed = json.loads((run / "summary.json").read_text())
    expected = json.loads((runs / "reference" / "run" / "summary.json").read_text())
    assert resumed["ledger"]["own"] == expected["ledger"]["own"]
    assert _deterministic(read_metrics(run)) == _deterministic(read_metrics(runs / "reference" / "run"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_full_disk_at_the_export_or_an_eval_file_ends_in_one_line(assets, small_disk, mount_small, tmp_path):
    overrides = {"train.steps": 1, "checkpoint.every": 1000}
    save_config(run_config(assets, small_disk / "export", "grpo", **overrides), tmp_path / "export.yaml")
    (small_disk / "export").mkdir()
    _fill(small_disk, 200_000)  # the model (about 0.5 MiB) does not fit
    line = _no_space_line(_megaopd_train(tmp_path / "export.yaml"))
    assert line.startswith(f"megaopd: {small_disk}/export/.tmp_final: no space left ("), line
    assert not (small_disk / "export" / ".tmp_final").exists()

    # the eval files' directory on a filesystem of its own, full: the run's first eval record cannot be written
    evals = mount_small(tmp_path / "eval" / "run" / "evals", "1m")
    _fill(evals, 0)
    save_config(run_config(assets, tmp_path / "eval" / "run", "grpo", **overrides), tmp_path / "eval.yaml")
    line = _no_space_line(_megaopd_train(tmp_path / "eval.yaml"))
    assert line.startswith(f"megaopd: {evals}/step_000000.json: no space left ("), line
    assert not (evals / "step_000000.json").exists()


@pytest.mark.timeout(300)
def test_a_full_disk_while_the_report_is_written_ends_in_one_line(small_disk, tmp_path):
    from test_report import make_study

    study = make_study(tmp_path / "study")
    _fill(small_disk, 0)
    proc = subprocess.run([sys.executable, "-m", "megaopd.cli", "report", str(study), "--out", str(small_disk)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=280)
    line = _no_space_line(proc)
    assert line.startswith(f"megaopd: {small_disk}: no space left (more needed, "), line


@pytest.mark.timeout(300)
def test_a_run_dir_on_a_read_only_filesystem_ends_in_one_line(assets, mount_small, tmp_path, capsys):
    from megaopd.cli import main

    read_only = mount_small(tmp_path / "read_only", "1m", ",ro")
    save_config(run_config(assets, read_only / "run", "grpo"), tmp_path / "run.yaml")
    assert main(["train", str(tmp_path / "run.yaml")]) == 2
    [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("megaopd:")]
    assert line == (f"megaopd: {read_only / 'run'}: read-only file system; make it writable, or write elsewhere "
                    "(run_dir, the study's out, --out)")


# ---------------------------------------------------------------------------------------------- kill -9 mid-save

_SAVER = """
import sys, torch
from megaopd.models.checkpoint import Checkpointer
checkpointer = Checkpointer(sys.argv[1], every=1, keep=2)
for step in range(1, 1000):
    checkpointer.save(step, {"step": step, "w": torch.full((24 << 20,), float(step))})  # 96 MiB: a long write
"""


@pytest.mark.timeout(300)
def test_kill_9_during_a_save_leaves_the_previous_checkpoint_and_no_partial_one(tmp_path):
    """kill -9 while a checkpoint is being written, flushed or renamed (its .tmp_step_* directory exists): the
    checkpoints that were complete stay so, the partial one is never taken for one, and the next resume removes it."""
    import time

    from megaopd.models.checkpoint import verify

    proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(tmp_path)], env={**os.environ, "OMP_NUM_THREADS": "1"})
    checkpoints, deadline = tmp_path / "checkpoints", time.time() + 240
    while time.time() < deadline and not (checkpoints / "step_0000002").exists():
        time.sleep(0.01)
    while time.time() < deadline and not list(checkpoints.glob(".tmp_step_*")):  # the next save under way
        time.sleep(0.001)
    proc.kill()
    proc.wait()
    [partial] = list(checkpoints.glob(".tmp_step_*"))
    complete = sorted(p.name for p in checkpoints.glob("step_*"))
    assert all(verify(checkpoints / name) is None for name in complete)
    state = Checkpointer(tmp_path, every=1, keep=2).latest()
    assert f"step_{state['step']:07d}" == complete[-1] and bool((state["w"] == state["step"]).all())
    assert not partial.exists() and not (checkpoints / "damaged").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_9_mid_run_at_its_checkpoint_then_the_same_command_resumes(assets, runs, tmp_path):
    """The real trainer, killed as soon as its step-4 checkpoint's temporary directory appears (mid-write, flush
    or rename): the same command finishes the run as the unbroken one (metrics once per step, same ledger)."""
    import json
    import time

    save_config(run_config(assets, tmp_path / "run", "grpo", **(STEPS | {"train.steps": 6})), tmp_path / "run.yaml")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "megaopd.cli", "train", str(tmp_path / "run.yaml")], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoints, deadline = tmp_path / "run" / "checkpoints", time.time() + 240
    while time.time() < deadline and proc.poll() is None and not (checkpoints / ".tmp_step_0000004").exists():
        time.sleep(0.0005)
    proc.kill()
    proc.wait()
    assert not (tmp_path / "run" / "summary.json").exists()
    assert _megaopd_train(tmp_path / "run.yaml").returncode == 0
    assert not list(checkpoints.glob(".tmp_step_*"))
    resumed = json.loads((tmp_path / "run" / "summary.json").read_text())
    expected = json.loads((runs / "reference" / "run" / "summary.json").read_text())
    assert resumed["ledger"]["own"] == expected["ledger"]["own"]
    assert _deterministic(read_metrics(tmp_path / "run")) == _deterministic(read_metrics(runs / "reference" / "run"))
