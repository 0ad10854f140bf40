"""A study: a list of stages, each a normal run directory, run after the stages it names; a finished stage is
reused, an interrupted one resumes from its last checkpoint, and one whose train.steps was raised trains on from it
(``megaopd.run.finished``: the rule of ``trainer.train``, which runs every stage).

    megaopd study configs/studies/self_teacher.yaml [seeds=[0,1,2]]

Stage overrides may name ``{out}`` (the study directory) and any ``{var}`` of ``vars``; a stage's run directory
is ``{out}/<name>`` and its trained model ``{out}/<name>/final``, which later stages use as their initial model or
teacher. With ``workers: 2`` stages whose inputs are ready run side by side, one process each with ``threads``
threads: a stage's numbers do not depend on where it ran (each seeds its own generators), only the wall time does.
With ``seeds`` every seed's stages share that pool, and a ``shared`` stage runs once for all of them.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import re
import signal
import sys
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from megaopd.run import allocator
from megaopd.config import (SEED_MAX, ConfigError, RunConfig, check_at_least, check_range, check_value, load_config,
                            save_config, unknown_choice)
from megaopd.data.synthetic import DOMAINS
from megaopd.models.embedded import make_embedded
from megaopd.errors import StudyError
from megaopd.accounting.flops import HF_CONFIG
from megaopd.run.finished import finished_summary
from megaopd.objectives.methods import method
from megaopd.accounting.metrics import read_metrics
from megaopd.run.resolve import resolve_stage
from megaopd.run.trainer import train

log = logging.getLogger(__name__)


@dataclass
class AssetsConfig:
    """The embedded default's models and data, built into {out}/models and {out}/data before any stage."""

    presets: list[str] = field(default_factory=list)
    domains: list[str] = field(default_factory=list)
    difficulty: dict[str, int] = field(default_factory=dict)
    train_rows: int = 4000
    heldout_rows: int = 500  # test rows per domain (test.jsonl: what the report judges)
    validation_rows: int = 200  # validation rows per domain (validation.jsonl: what stops and tunes a run)
    # Share of distinct problems kept out of train (2-digit addition has 8100 in all); validation and test are cut
    # from them, disjoint (megaopd.data.synthetic).
    heldout_percent: int = 10
    verbosity: dict[str, int] = field(default_factory=dict)  # worded solutions (the length sweep): domain -> 0..2
    seed: int = 0
    # Published checkpoints, imported into {out}/models/<name> (`megaopd import-model <name>`; names may use {var})
    imported: list[str] = field(default_factory=list)
    # Natural-language word problems with \boxed{} answers in {out}/data/arith_word (megaopd.data.word_problems):
    # digits per operand, 0 for none
    word_problem_digits: int = 0

    def __post_init__(self):
        # below 0 a count cut the held-out rows short without a word (validation_rows=-1: 299 test rows)
        check_at_least("assets", self, 0, "train_rows", "heldout_rows", "validation_rows")
        check_range("assets", self, "heldout_percent", 0, 100)  # outside it reads as 0 or 100
        check_range("assets", self, "seed", 0, SEED_MAX)  # as train.seed (past 2**64 torch.manual_seed overflowed)
        check_range("assets", self, "word_problem_digits", 0, means="0: none")
        for setting in ("difficulty", "verbosity"):  # a misspelt domain was ignored: the sweep ran its default
            for domain in getattr(self, setting):
                if domain not in DOMAINS:
                    raise unknown_choice(domain, tuple(DOMAINS), f"assets.{setting}")
        for domain, level in self.difficulty.items():  # 0 read as the default; below it the makers fail
            check_value(f"assets.difficulty.{domain}", level, DOMAINS[domain].default_difficulty, 1)
        for domain, level in self.verbosity.items():
            check_value(f"assets.verbosity.{domain}", level, 0, 0, DOMAINS[domain].max_verbosity,
                        means="0: the shortest wording; only arith_add has longer ones")


# What a stage is, for the report: its curves, targets and comparisons are chosen by these labels.
# control: the control of the OPD stages that start from its model and train on its data (OPD's settings without the
# teacher: train.algorithm=fixed_advantage, in either form), named for its role, as the other labels are; until this
# release teacher_free, still read for one release with a deprecation line (config.RENAMED_VALUES).
STAGE_LABELS = ("base", "teacher_sft", "grpo", "expert", "joint_grpo", "opd_external", "opd_external_grpo",
                "opd_self", "multi_teacher_opd", "control", "other")


EXTERNAL_TEACHER = ("opd_external", "opd_external_grpo")  # the stages whose teacher is checked before they train


@dataclass
class StageConfig:
    name: str = ""
    config: str = ""  # the stage's run config (YAML); overrides below apply on top
    overrides: list[str] = field(default_factory=list)
    # What the stage is in the study, one of STAGE_LABELS: the report picks its curves, targets and comparisons by
    # it (the algorithm is the config's train.algorithm). The key was `method` until this release, still read for
    # one release with a deprecation line (config.RENAMED_KEYS).
    role: str = "other"
    # For opd_self / opd_external*: the GRPO stage it is compared with (E1-E3); for any other role, a stage it is
    # compared with as another setting of one method (the report's "Stage vs stage"; e.g. K=1 vs K=0).
    compare_with: str = ""
    # For expert: the domain it owns; for control: the domain it is compared with its OPD stages on (else the
    # mean of the domains).
    domain: str = ""
    # With seeds: one run for all of them, in the first seed's directory, which the other seeds' {out}/<name> links
    # to. For the study's inputs (the external teacher "trained elsewhere"), not for what the seeds measure.
    shared: bool = False
    # For opd_external*: the stage refuses a teacher not above its student on validation (megaopd/teachers/check.py)
    # unless this runs it on purpose; the report then marks its findings "teacher below student".
    allow_weaker_teacher: bool = False


@dataclass
class StudyConfig:
    out: str = "runs/study"
    seed: int = 0  # every stage's train.seed; run the study again with another seed and out to measure the spread
    # Several seeds in one command: each runs the study in {out}/seed_<s> (assets identical; a `shared` stage
    # once), their stages side by side in one pool of `workers`, and one report over them.
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

    def __post_init__(self):
        # each stage's train.seed: refused here, not once the assets are built
        check_range("", self, "seed", 0, SEED_MAX)
        check_range("", self, "seeds", 0, SEED_MAX)
        check_range("", self, "threads", 1, 2**31 - 1)  # above it torch.set_num_threads overflows
        check_at_least("", self, 1, "workers")

    def substitute(self, text: str) -> str:
        """Replace {out} and every {var}; a var's value may itself name {out} or other vars."""
        values = {**self.vars, "out": self.out}
        for _ in range(len(values) + 1):
            if not any("{" + key + "}" in text for key in values):
                return text
            for key, value in values.items():
                text = text.replace("{" + key + "}", str(value))
        raise StudyError(f"study vars refer to each other in a cycle: {text!r}; make one of them a plain value")


def seed_studies(study: StudyConfig) -> list[StudyConfig]:
    """The study itself, or one copy per seed of `seeds`, each with its own out directory."""
    if not study.seeds:
        return [study]
    if len(set(study.seeds)) != len(study.seeds):
        raise StudyError(f"study seeds must be distinct, got {study.seeds}; list each seed once")
    return [replace(study, seed=s, seeds=[], out=f"{study.out}/seed_{s}") for s in study.seeds]


def stage_overrides(study: StudyConfig, stage: StageConfig) -> list[str]:
    """The overrides a stage's config runs with, here and on Slurm: the study's seed, an external teacher's check
    (``megaopd.teachers.check``), then the stage's own."""
    check = ["opd.check_teacher=true", f"opd.allow_weaker_teacher={str(stage.allow_weaker_teacher).lower()}"]
    return ([f"train.seed={study.seed}"] + (check if stage.role in EXTERNAL_TEACHER else [])
            + [study.substitute(o) for o in stage.overrides])


def stage_config(study: StudyConfig, stage: StageConfig, launch_overrides: list[str] = ()) -> RunConfig:
    """The stage's run config as its job loads it: its config file, the study's overrides, then (on a cluster) the
    launch file's ``overrides`` for that stage."""
    if stage.role not in STAGE_LABELS:
        raise StudyError(f"stage {stage.name!r}: role must be one of {', '.join(STAGE_LABELS)}, got "
                         f"{stage.role!r}; set one of them")
    cfg = load_config(stage.config, stage_overrides(study, stage) + list(launch_overrides)
                      + [f"run_dir={study.out}/{stage.name}"])
    method(cfg.train.algorithm)  # a name the algorithm table lacks is refused here, before any stage runs
    return cfg


def stage_finished(study: StudyConfig, stage: StageConfig, launch_overrides: list[str] = ()) -> bool:
    """Whether the stage's run ended under the step cap its config (as its job loads it) sets: the rule of
    ``megaopd.run.finished``, for the launchers that decide before any job runs."""
    cap = stage_config(study, stage, launch_overrides).train.steps
    return finished_summary(Path(study.out) / stage.name, cap) is not None


def build_assets(study: StudyConfig) -> None:
    """Save the resolved study in {out} and build its embedded models and data there (when it has any)."""
    out = Path(study.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(study, out / "study.yaml")
    a = study.assets
    if a.presets or a.domains:
        make_embedded(out, [study.substitute(p) for p in a.presets], [study.substitute(d) for d in a.domains] or None,
                      a.seed, a.train_rows, a.heldout_rows, a.difficulty, a.heldout_percent, a.verbosity,
                      a.validation_rows)
    for name in map(study.substitute, a.imported):
        if not (out / "models" / name / HF_CONFIG).exists():
            from megaopd.models.model_import import import_model

            import_model(name, None, str(out / "models" / name))
    if a.word_problem_digits:
        from megaopd.data.word_problems import build_word_problems

        build_word_problems(out / "data", a.train_rows, a.heldout_rows, a.word_problem_digits, a.seed,
                            a.heldout_percent, a.validation_rows)


def dependencies(study: StudyConfig) -> dict[str, list[str]]:
    """Stage -> the stages whose run directories its overrides mention (``{out}/<stage>`` or ``{out}/<stage>/``),
    themselves or through ``vars`` (a teacher's model, a partner in ``train.stop.cover``)."""
    names = {s.name for s in study.stages}
    deps = {}
    for stage in study.stages:
        text = " ".join(map(study.substitute, stage.overrides))
        found = re.findall(re.escape(study.out) + r"/([^/\s,\]}\"']+)", text)
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


def link_shared_stages(study: StudyConfig) -> None:
    """With seeds, every later seed's {out}/<name> of a shared stage links to the first seed's run directory."""
    shared = [stage.name for stage in study.stages if stage.shared]
    if not study.seeds or not shared:
        return
    for name, deps in dependencies(study).items():
        if name in shared and set(deps) - set(shared):
            raise ConfigError(f"stage {name!r} is shared by all seeds, so it cannot start from the per-seed stage(s) "
                              f"{sorted(set(deps) - set(shared))}: share them too, or do not share {name!r}")
    first, *later = seed_studies(study)
    for one in later:
        for name in shared:
            link = Path(one.out) / name
            if not link.exists() and not link.is_symlink():  # a run of its own from an earlier study stays
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(Path("..") / Path(first.out).name / name, target_is_directory=True)


def run_study(study: StudyConfig) -> list[Path]:
    """Every stage of every seed (a shared stage once); returns the run directories, seed by seed in study order."""
    torch.set_num_threads(study.threads)
    seeds = seed_studies(study)
    for one in seeds:
        build_assets(one)
    link_shared_stages(study)
    # One task per run directory (a shared stage's links resolve to one), waiting for the run directories it names;
    # the shared stages first (each gates a stage of every seed, and they need no per-seed stage), then stage by
    # stage across the seeds, so that the last stages of the seeds end side by side.
    configs: dict[Path, RunConfig] = {}
    needs: dict[Path, set[Path]] = {}
    deps, stages = dependencies(study), {stage.name: stage for stage in study.stages}
    for name in sorted(submission_order(study), key=lambda name: not stages[name].shared):
        for one in seeds:
            run_dir = (Path(one.out) / name).resolve()
            if run_dir not in configs:
                configs[run_dir] = stage_config(one, stages[name])
                needs[run_dir] = {(Path(one.out) / d).resolve() for d in deps[name]}
    todo = []
    for run_dir, cfg in configs.items():
        if finished_summary(run_dir, cfg.train.steps) is not None:
            log.info("stage %s is done; reusing it", run_dir)
        else:
            todo.append(run_dir)
    for run_dir in todo:  # refused now, not once the stages before it have trained
        resolve_stage(configs[run_dir], run_dir.name)
    devices = [configs[run_dir].model.device for run_dir in todo]
    if study.workers == 1:
        allocator.keep_heap_for(devices)  # the stages train in this process: its allocator (allocator.py)
        for run_dir in todo:
            train(configs[run_dir])
    else:
        _run_side_by_side(configs, needs, todo, study.workers, study.threads, devices)
    return [Path(one.out) / stage.name for one in seeds for stage in one.stages]


def _start_worker(threads: int, devices: list[str], study_pid: int) -> None:
    """A stage worker's process start: it ends with the study, its threads, and its allocator where a stage trains
    on the CPU."""
    _end_with(study_pid)
    torch.set_num_threads(threads)
    allocator.keep_heap_for(devices)


def _end_with(study_pid: int) -> None:
    """On Linux, SIGKILL this worker when the study process dies. A `kill -9` of the study alone (or the OOM killer
    choosing it) would otherwise leave its workers training on, into the run directories the resumed study trains
    in. (Ctrl-C and a Slurm job's end reach the whole process group anyway.)"""
    if sys.platform != "linux":
        return
    pr_set_pdeathsig = 1  # <linux/prctl.h>
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != study_pid:  # the study died before the line above
        os._exit(1)


def _run_side_by_side(configs: dict[Path, RunConfig], needs: dict[Path, set[Path]], todo: list[Path],
                      workers: int, threads: int, devices: list[str]) -> None:
    """Start each stage once the stages it names are done, at most `workers` at a time (in `todo`'s order)."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch state shared with this one
    running = {}
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                             initargs=(threads, devices, os.getpid())) as pool:
        while todo or running:
            for run_dir in [d for d in todo if not needs[d] & (set(todo) | set(running.values()))]:
                if len(running) < workers:
                    running[pool.submit(train, configs[run_dir])] = run_dir
                    todo.remove(run_dir)
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                run_dir = running.pop(future)
                future.result()  # a failed stage stops the study here (the running ones finish first)
                log.info("stage %s finished", run_dir)


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
