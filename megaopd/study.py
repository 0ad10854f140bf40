"""A study: a list of stages, each a normal run directory, run after the stages it names; a finished stage is
reused and an interrupted one resumes from its last checkpoint.

    megaopd study configs/studies/self_teacher.yaml [seeds=[0,1,2]]

Stage overrides may name ``{out}`` (the study directory) and any ``{var}`` of ``vars``; a stage's run directory
is ``{out}/<name>`` and its trained model ``{out}/<name>/final``, which later stages use as their initial model or
teacher. With ``workers: 2`` stages whose inputs are ready run side by side, one process each with ``threads``
threads: a stage's numbers do not depend on where it ran (each seeds its own generators), only the wall time does.
"""

from __future__ import annotations

import logging
import multiprocessing
import re
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from megaopd.config import ConfigError, RunConfig, load_config, save_config
from megaopd.embedded import make_embedded
from megaopd.metrics import read_metrics
from megaopd.trainer import FINAL_DIR, Trainer

log = logging.getLogger(__name__)


@dataclass
class AssetsConfig:
    """The embedded default's models and data, built into {out}/models and {out}/data before any stage."""

    presets: list[str] = field(default_factory=list)
    domains: list[str] = field(default_factory=list)
    difficulty: dict[str, int] = field(default_factory=dict)
    train_rows: int = 4000
    heldout_rows: int = 500
    heldout_percent: int = 10  # share of distinct problems kept for held-out (2-digit addition has 8100 in all)
    verbosity: dict[str, int] = field(default_factory=dict)  # worded solutions (the length sweep): domain -> 0..2
    seed: int = 0


# What a stage is, for the report: its curves, targets and comparisons are chosen by these labels.
METHODS = ("base", "teacher_sft", "grpo", "expert", "joint_grpo", "opd_external", "opd_external_grpo", "opd_self",
           "multi_teacher_opd", "other")


@dataclass
class StageConfig:
    name: str = ""
    config: str = ""  # the stage's run config (YAML); overrides below apply on top
    overrides: list[str] = field(default_factory=list)
    method: str = "other"  # one of METHODS
    # For opd_self / opd_external*: the GRPO stage it is compared with; for expert: the domain it owns.
    compare_with: str = ""
    domain: str = ""


@dataclass
class StudyConfig:
    out: str = "runs/study"
    seed: int = 0  # every stage's train.seed; run the study again with another seed and out to measure the spread
    # Several seeds in one command: each runs the whole study in {out}/seed_<s> (assets identical), one report.
    seeds: list[int] = field(default_factory=list)
    # torch intra-op threads of the study process: results depend on the thread count (reduction order), so it is
    # a setting of the study, not of the environment (OMP_NUM_THREADS).
    threads: int = 1
    workers: int = 1  # stages run side by side (processes of `threads` threads each) once their inputs exist
    # Named values substituted as {name} in stage overrides and asset presets (e.g. {student}: a sweep over student
    # size is `megaopd study STUDY.yaml vars.student=qwen3-small out=runs/student_small`).
    vars: dict[str, str] = field(default_factory=dict)
    assets: AssetsConfig = field(default_factory=AssetsConfig)
    stages: list[StageConfig] = field(default_factory=list)

    def substitute(self, text: str) -> str:
        """Replace {out} and every {var}; a var's value may itself name {out} or other vars."""
        values = {**self.vars, "out": self.out}
        for _ in range(len(values) + 1):
            if not any("{" + key + "}" in text for key in values):
                return text
            for key, value in values.items():
                text = text.replace("{" + key + "}", str(value))
        raise ValueError(f"study vars refer to each other in a cycle: {text!r}")


def seed_studies(study: StudyConfig) -> list[StudyConfig]:
    """The study itself, or one copy per seed of `seeds`, each with its own out directory."""
    if not study.seeds:
        return [study]
    if len(set(study.seeds)) != len(study.seeds):
        raise ValueError(f"study seeds must be distinct, got {study.seeds}")
    return [replace(study, seed=s, seeds=[], out=f"{study.out}/seed_{s}") for s in study.seeds]


def stage_overrides(study: StudyConfig, stage: StageConfig) -> list[str]:
    """The overrides a stage's config runs with, here and on Slurm: the study's seed, then the stage's own."""
    return [f"train.seed={study.seed}"] + [study.substitute(o) for o in stage.overrides]


def stage_config(study: StudyConfig, stage: StageConfig) -> RunConfig:
    if stage.method not in METHODS:
        raise ValueError(f"stage {stage.name!r}: method must be one of {METHODS}, got {stage.method!r}")
    return load_config(stage.config, stage_overrides(study, stage) + [f"run_dir={study.out}/{stage.name}"])


def build_assets(study: StudyConfig) -> None:
    """Save the resolved study in {out} and build its embedded models and data there (when it has any)."""
    out = Path(study.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(study, out / "study.yaml")
    a = study.assets
    if a.presets or a.domains:
        make_embedded(out, [study.substitute(p) for p in a.presets], [study.substitute(d) for d in a.domains] or None,
                      a.seed, a.train_rows, a.heldout_rows, a.difficulty, a.heldout_percent, a.verbosity)


def stage_is_done(run_dir: Path) -> bool:
    """A finished stage: its exported model and summary exist (both written only at the end of a run)."""
    return (run_dir / FINAL_DIR / "config.json").exists() and (run_dir / "summary.json").exists()


def dependencies(study: StudyConfig) -> dict[str, list[str]]:
    """Stage -> the stages whose run directories its overrides mention (``{out}/<stage>`` or ``{out}/<stage>/``)."""
    names = {s.name for s in study.stages}
    deps = {}
    for stage in study.stages:
        found = re.findall(r"\{out\}/([^/\s,\]\"']+)", " ".join(stage.overrides))
        deps[stage.name] = sorted({n for n in found if n in names and n != stage.name},
                                  key=[s.name for s in study.stages].index)
    return deps


def submission_order(study: StudyConfig) -> list[str]:
    """The stages ordered so that every stage comes after the stages it depends on (else the study order)."""
    deps, order, state = dependencies(study), [], {}

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise ConfigError(f"stage dependencies form a cycle: {' -> '.join(path + [name])}")
        state[name] = "visiting"
        for dep in deps[name]:
            visit(dep, path + [name])
        state[name] = "done"
        order.append(name)

    for stage in study.stages:
        visit(stage.name, [])
    return order


def run_study(study: StudyConfig) -> list[Path]:
    """Every stage of every seed; returns the run directories in the study's order."""
    if study.threads < 1 or study.workers < 1:
        raise ValueError(f"study threads and workers must be >= 1, got {study.threads} and {study.workers}")
    torch.set_num_threads(study.threads)
    run_dirs = []
    for one in seed_studies(study):
        run_dirs += _run_one_seed(one)
    return run_dirs


def _run_one_seed(study: StudyConfig) -> list[Path]:
    build_assets(study)
    configs = {stage.name: stage_config(study, stage) for stage in study.stages}
    todo = []
    for name in submission_order(study):
        if stage_is_done(Path(configs[name].run_dir)):
            log.info("stage %s is done; reusing %s", name, configs[name].run_dir)
        else:
            todo.append(name)
    if study.workers == 1:
        for name in todo:
            Trainer(configs[name]).fit()
    else:
        _run_side_by_side(study, configs, todo)
    return [Path(configs[stage.name].run_dir) for stage in study.stages]


def _run_side_by_side(study: StudyConfig, configs: dict[str, RunConfig], todo: list[str]) -> None:
    """Start each stage once the stages it names are done, at most `workers` at a time (in `todo`'s order)."""
    needs = dependencies(study)
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch state shared with this one
    running = {}
    with ProcessPoolExecutor(study.workers, mp_context=context, initializer=torch.set_num_threads,
                             initargs=(study.threads,)) as pool:
        while todo or running:
            for name in [n for n in todo if not any(d in todo or d in running.values() for d in needs[n])]:
                if len(running) < study.workers:
                    running[pool.submit(_fit, configs[name])] = name
                    todo.remove(name)
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                name = running.pop(future)
                future.result()  # a failed stage stops the study here (the running ones finish first)
                log.info("stage %s finished", name)


def _fit(cfg: RunConfig) -> None:
    Trainer(cfg).fit()


def accuracy_flops_table(run_dirs: list[Path]) -> str:
    """Held-out accuracy (greedy, mean over domains) vs cumulative FLOPs, every eval of every stage."""
    lines = [f"{'stage':<14}{'step':>6}{'stage FLOPs':>14}{'+teachers':>12}{'+cold start':>13}{'accuracy':>10}"]
    for run_dir in run_dirs:
        name = f"{run_dir.parent.name}/{run_dir.name}" if run_dir.parent.name.startswith("seed_") else run_dir.name
        for m in read_metrics(run_dir):
            if "eval/mean/accuracy_greedy" in m:
                lines.append(f"{name:<14}{m['step']:>6}{m['flops/total_stage']:>14.3e}"
                             f"{m['flops/total_with_teachers']:>12.3e}{m['flops/total_with_cold_start']:>13.3e}"
                             f"{m['eval/mean/accuracy_greedy']:>10.3f}")
        final = [m for m in read_metrics(run_dir) if "final/mean/accuracy_greedy" in m]
        if final:
            m = final[-1]
            lines.append(f"{name + ' (final)':<20}{m['flops/total_stage']:>14.3e}"
                         f"{m['flops/total_with_teachers']:>12.3e}{m['flops/total_with_cold_start']:>13.3e}"
                         f"{m['final/mean/accuracy_greedy']:>10.3f}")
    return "\n".join(lines)
