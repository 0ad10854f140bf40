"""A study directory's runs as the analysis reads them: one ``Stage`` per run directory, and its bootstrap resample.

A study directory holds ``study.yaml`` and one run directory per stage (``megaopd/run/study.py``): ``metrics.jsonl``
(curves, FLOPs, response lengths), ``summary.json``, ``config.yaml`` and ``evals/*.json`` (per-prompt results,
``megaopd/run/evaluate.py``). Several study directories of the same layout are the seeds of one study.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import numpy as np
import yaml

from megaopd.config import renamed_value
from megaopd.errors import StudyError, require_file
from megaopd.accounting.flops import HF_CONFIG, ModelShape, read_hf_config
from megaopd.accounting.ledger import SUMMARY
from megaopd.accounting.metrics import read_metrics
from megaopd.teachers.check import CHECK_FILE
from megaopd.analysis.stats import mean_and_se, resample


@dataclass
class Stage:
    """One stage's run directory as the report needs it (only stages with metrics lines are loaded)."""

    name: str
    role: str  # its study.yaml's label (megaopd.run.study.STAGE_LABELS)
    compare_with: str = ""
    domain: str = ""
    algorithm: str = ""
    lines: list[dict] = field(default_factory=list)
    records: dict = field(default_factory=dict)  # eval step or "final" -> per-prompt results (megaopd/run/evaluate.py)
    teacher_cost: dict[str, float] = field(default_factory=dict)  # OPD: domain -> teacher/student FLOPs per token
    form: str = ""  # the objective as objectives.form_label names it, e.g. opd:topk(K=16,reverse)
    stop: dict = field(default_factory=dict)  # why the run ended (megaopd/run/stopping.py); {} for older runs
    max_staleness: int | None = None  # rollout.max_staleness of its config.yaml (0: synchronous); None if not recorded
    # model.path and data.train of its config.yaml: a teacher-free control controls the OPD stages with both equal
    starts_from: str = ""
    trains_on: tuple[str, ...] = ()
    # optim and opd.form of its config.yaml: whether a control's comparison is fair (analysis/controls.py)
    optim: dict = field(default_factory=dict)
    opd_form: str = ""
    teacher_check: dict = field(default_factory=dict)  # an external teacher's check (megaopd/teachers/check.py)

    @property
    def final(self) -> dict:
        return self.lines[self.final_index] if self.final_index is not None else {}

    @cached_property
    def final_index(self) -> int | None:
        """The line of the final eval (its keys are final/...), if the run has one."""
        return next((i for i in reversed(range(len(self.lines)))
                     if any(k.startswith("final/") for k in self.lines[i])), None)

    def final_acc(self, domain: str, metric: str) -> float | None:
        return self.final.get(f"final/{domain}/accuracy_{metric}")

    def valid_acc(self, domain: str) -> float | None:
        """Validation accuracy (greedy: the split is evaluated greedy only), what a sweep chooses by: the final
        eval's (all validation prompts), else the last periodic one's; None without a validation split."""
        final = self.final.get(f"final_valid/{domain}/accuracy_greedy")
        periodic = [m[key] for m in self.lines if (key := f"valid/{domain}/accuracy_greedy") in m]
        return final if final is not None else (periodic[-1] if periodic else None)

    def total(self, kind: str = "stage") -> float | None:
        return self.lines[-1].get(f"flops/total_{kind}")

    def curve(self, domain: str, metric: str, x: str = "stage") -> tuple[list[float], list[float]]:
        """The periodic evals (a fixed held-out subset): the final eval, on all prompts, is not on the curve."""
        key = f"eval/{domain}/accuracy_{metric}"
        pts = [(m[f"flops/total_{x}"], m[key]) for m in self.lines if key in m]
        return [p[0] for p in pts], [p[1] for p in pts]

    def curve_se(self, domain: str, metric: str) -> list[float | None]:
        """Standard error of each curve point over its prompts (the mean: of the domains' mean); None without
        per-prompt results."""
        key = f"eval/{domain}/accuracy_{metric}"
        return [_record_se(self.records.get(m["step"]), domain, metric) for m in self.lines if key in m]

    def domains(self, metric: str) -> list[str]:
        keys = {k for m in self.lines for k in m if k.startswith(("eval/", "final/")) and k.endswith(metric)}
        return sorted({k.split("/")[1] for k in keys} - {"mean"})

    def wall_clock(self) -> dict:
        """WALL_RULE: the timed training steps' mean and total seconds and the share of them the trainer waited for
        rollouts; None where the metrics lack the perf keys (older runs, SFT steps)."""
        timed = [m["perf/step_seconds"] for m in self.lines if "perf/step_seconds" in m]
        waits = [(m["perf/rollout_wait_seconds"], m["perf/step_seconds"]) for m in self.lines
                 if "perf/rollout_wait_seconds" in m and "perf/step_seconds" in m]
        waited = sum(s for _, s in waits)
        return {"steps_timed": len(timed), "step_seconds": sum(timed) / len(timed) if timed else None,
                "train_seconds": sum(timed) if timed else None,
                "rollout_wait_share": sum(w for w, _ in waits) / waited if waited > 0 else None}

    def lengths(self) -> tuple[list[int], list[float], list[float]]:
        pts = [(m["step"], m["flops/total_stage"], m["rollout/response_length"]) for m in self.lines
               if "rollout/response_length" in m]
        return [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]

    def length_first_last(self, window: int) -> tuple[float | None, float | None]:
        """LENGTH_RULE: mean response length of the first and of the last `window` training steps."""
        lengths = self.lengths()[2]
        if not lengths:
            return None, None
        return float(np.mean(lengths[:window])), float(np.mean(lengths[-window:]))

    def first_step_length(self) -> float | None:
        """Mean response length of the first training step's rollouts: the start model's, before any update."""
        return next((m["rollout/response_length"] for m in self.lines if "rollout/response_length" in m), None)

    def truncated_last(self, window: int) -> float | None:
        """Share of the last `window` training steps' rollouts cut at the token cap; None where not logged."""
        shares = [m["rollout/truncated_share"] for m in self.lines if "rollout/truncated_share" in m]
        return float(np.mean(shares[-window:])) if shares else None

    def teacher_accuracy(self, domain: str) -> float | None:
        """The teacher check's greedy validation accuracy of the teacher serving `domain` (the mean: over the
        domains its teachers serve); None without a check."""
        served = {d: t["greedy"]["accuracy"][d] for t in self.teacher_check.get("teachers", {}).values()
                  for d in t["domains"]}
        if domain == "mean":
            return sum(served.values()) / len(served) if served else None
        return served.get(domain)

    @property
    def stopped(self) -> str:
        """Why the stage ended, in words (its `stop` record, megaopd/run/stopping.py)."""
        return stop_text(self.stop)


def stop_text(stop: dict) -> str:
    """A stop record in words: the rule that ended the stage at which step, and each budget it had to cover."""
    if not stop:
        return "stopped (no stop record)"
    reason = {"plateau": f"plateau ({stop.get('metric')})", "max_steps": "cap"}.get(stop["reason"], stop["reason"])
    covers = []
    for c in stop.get("cover") or []:
        partner = Path(c["run"]).name
        how = {"target": "reached its target", "budget": "spent its budget"}.get(c.get("met"))
        covers.append(f"covering {partner}: {how} at {c['met_at_step']}" if how else f"covering {partner}: not met")
    return f"{reason} at {stop['step']}" + "".join(f"; {c}" for c in covers)


def _record_se(record: dict | None, domain: str, metric: str) -> float | None:
    if record is None or metric not in record["reward"]:
        return None
    rewards = record["reward"][metric]
    if domain != "mean":
        return mean_and_se(rewards[domain])[1] if domain in rewards else None
    return math.sqrt(sum(mean_and_se(v)[1] ** 2 for v in rewards.values())) / len(rewards)


def study_dirs(paths: list[str | Path]) -> list[Path]:
    """Study directories; one run with `seeds` (seed_<s>/ below it, no study.yaml of its own) counts as its seeds."""
    out = []
    for p in map(Path, paths):
        seeds = sorted(p.glob("seed_*/study.yaml"), key=lambda y: int(y.parent.name.split("_")[1]))
        out += [y.parent for y in seeds] if not (p / "study.yaml").exists() and seeds else [p]
    return out


def _records(run_dir: Path) -> dict:
    out = {}
    for path in sorted((run_dir / "evals").glob("*.json")):
        rec = json.loads(path.read_text())
        rec["reward"] = {mode: {d: np.asarray(v, dtype=float) for d, v in by.items()}
                         for mode, by in rec["reward"].items()}
        out["final" if rec["final"] else rec["step"]] = rec
    return out


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _config(run_dir: Path) -> dict:
    """The run's resolved config.yaml ({} when there is none)."""
    path = run_dir / "config.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}


def _teacher_cost(run_dir: Path, cfg: dict) -> dict[str, float]:
    """Teacher FLOPs per token over the student's (2 x matmul parameters each, megaopd/accounting/flops.py) for an OPD stage."""
    teachers = (cfg.get("opd") or {}).get("teachers") or {}
    started_in = _started_in(run_dir, cfg.get("run_dir"))
    student = _matmul_params(started_in, (cfg.get("model") or {}).get("path"))
    if not teachers or student is None:
        return {}
    costs = {d: _matmul_params(started_in, t) for d, t in teachers.items()}
    return {d: c / student for d, c in sorted(costs.items()) if c is not None}


def _started_in(run_dir: Path, recorded: str | None) -> Path:
    """The directory the run was started from, which its config's relative paths are relative to: where the run
    directory is now, less the relative run_dir the config recorded (else this process's directory)."""
    here, parts = run_dir.absolute().parts, Path(recorded or "").parts
    if recorded and not Path(recorded).is_absolute() and here[len(here) - len(parts):] == parts:
        return Path(*here[:len(here) - len(parts)])
    return Path.cwd()


def _matmul_params(started_in: Path, model_dir: str | None) -> int | None:
    if not model_dir or not (started_in / model_dir / HF_CONFIG).exists():
        return None
    return ModelShape.from_hf_config(read_hf_config(started_in / model_dir)).matmul_params


def _algorithm(name: str) -> str:
    """An algorithm (or the form label of one without a teacher, its name) as it is spelled now: a run recorded before
    a rename (train.algorithm=opsa, now fixed_advantage) reads under the new name."""
    return renamed_value("TrainConfig", "algorithm", name)


def _role(stage: dict) -> str:
    """A stage's label in its study.yaml as it is spelled now (a study recorded before the renames: the key method,
    now role; teacher_free, now control); a stage without one counts as ``other``."""
    return renamed_value("StageConfig", "role", stage.get("role") or stage.get("method") or "other")


def load_study(study_dir: str | Path) -> tuple[dict, list[Stage]]:
    """study.yaml and every stage that has a run directory; a stage without `role` counts as `other`."""
    study_dir = Path(study_dir)
    require_file(study_dir / "study.yaml", "study file", StudyError)
    study = yaml.safe_load((study_dir / "study.yaml").read_text()) or {}
    stages = []
    for s in study.get("stages") or []:
        run_dir = study_dir / s["name"]
        summary = _json(run_dir / SUMMARY)
        cfg = _config(run_dir)
        stages.append(Stage(s["name"], _role(s), s.get("compare_with") or "", s.get("domain") or "",
                            _algorithm(summary.get("algorithm", "")), read_metrics(run_dir), _records(run_dir),
                            _teacher_cost(run_dir, cfg), _algorithm(summary.get("form", "")), summary.get("stop") or {},
                            (cfg.get("rollout") or {}).get("max_staleness"), (cfg.get("model") or {}).get("path", ""),
                            tuple((cfg.get("data") or {}).get("train") or ()), optim=cfg.get("optim") or {},
                            opd_form=(cfg.get("opd") or {}).get("form", ""), teacher_check=_json(run_dir / CHECK_FILE)))
    return study, [s for s in stages if s.lines]


def resample_stage(stage: Stage, metric: str, draw, rng: np.random.Generator, length_window: int) -> Stage:
    """One bootstrap replicate of a stage: every accuracy recomputed on resampled prompts, and the response lengths
    of the first and last `length_window` training steps resampled among those steps.

    `draw(domain, prompts)` gives the replicate's indices for a set of prompts (the same for every eval and stage
    on those prompts, so that comparisons are paired); evals without per-prompt results keep their value."""
    lines = []
    for i, m in enumerate(stage.lines):
        final = i == stage.final_index
        record = stage.records.get("final" if final else m["step"])
        if record is not None and metric in record["reward"]:
            prefix = "final" if final else "eval"
            acc = {d: float(v[draw(d, record["prompts"][d])].mean()) for d, v in record["reward"][metric].items()}
            m = {**m, **{f"{prefix}/{d}/accuracy_{metric}": a for d, a in acc.items()},
                 f"{prefix}/mean/accuracy_{metric}": sum(acc.values()) / len(acc)}
        lines.append(m)
    steps = [i for i, m in enumerate(lines) if "rollout/response_length" in m]
    for group in (steps[:length_window], steps[-length_window:]):
        values = [lines[i]["rollout/response_length"] for i in group]
        for i, j in zip(group, resample(rng, len(group))):
            lines[i] = {**lines[i], "rollout/response_length": values[j]}
    return replace(stage, lines=lines)
