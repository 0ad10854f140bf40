"""A megaopd study as a nemo-run Experiment: an assets task, then one task per stage, with the same dependency
graph as `megaopd submit` (a stage waits for the stages whose run directories its overrides name).

    python launchers/nemo_run_study.py configs/studies/self_teacher.yaml --executor local
    python launchers/nemo_run_study.py STUDY.yaml --executor slurm --launch launch.yaml   # submits and detaches
    python launchers/nemo_run_study.py STUDY.yaml --stages base                          # a subset (+ assets)

Needs ``nemo-run==0.11.1`` with ``leptonai==0.27.3`` (later leptonai releases break ``import nemo_run``).
Logs go to ``$NEMORUN_HOME/experiments/<title>/...`` (default ~/.nemo_run).

On Slurm the tasks are exactly `megaopd submit`'s jobs (``megaopd.launch.slurm.plan``): nemo-run queues and tracks
each one, and the job's batch shell hands over (``exec``) to megaopd's rendered script, saved in
``{out}/slurm/nemo/<job>.sbatch``. So every launch setting (trainer, rollout and teacher nodes, venv or container,
setup lines, signal, requeue limit, site settings) reaches the job the way it does with `megaopd submit`, from one
source: the rendered script's ``#SBATCH`` lines become the executor's options, and its body runs unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

import nemo_run as run

from megaopd.config import ConfigError, load_config, save_config
from megaopd.launch.slurm import (Job, LaunchConfig, add_study_arguments, dependencies, for_stage, plan,
                                  study_and_launch, submission_order, write_job_inputs)
from megaopd.run.study import StudyConfig, stage_finished, stage_overrides

ROOT = Path(__file__).resolve().parents[1]
# nemo-run names the job and its log itself (it reads the log back from its own job directory).
_NEMO_OWNS = ("job-name", "output")
_EXECUTOR_FIELDS = {f.name for f in dataclasses.fields(run.SlurmExecutor) if f.init}


# ---- local: each stage as a Python task on this machine ----
def local_executor(launch: LaunchConfig, torchrun: bool = False) -> run.LocalExecutor:
    # The tasks run `python -m megaopd...` from the experiment's directory: put this checkout on the path.
    return run.LocalExecutor(env_vars={"PYTHONPATH": str(ROOT)}, launcher="torchrun" if torchrun else None,
                             ntasks_per_node=max(launch.gpus_per_node, 1) if torchrun else 1)


def add_local(exp: run.Experiment, study: StudyConfig, launch: LaunchConfig, stages: list[str] | None = None,
              python: str = sys.executable) -> None:
    """Add the study's tasks to ``exp`` (inside its ``with`` block); ``study`` must be absolute."""
    if study.seeds:
        raise ConfigError(f"the local executor runs one seed, the study has seeds={study.seeds}: run "
                          "`megaopd study` for several seeds here, --executor slurm, or seeds=[] for one")
    out = Path(study.out)
    study_path = out / "nemo_run" / "study.yaml"
    study_path.parent.mkdir(parents=True, exist_ok=True)
    save_config(study, study_path)
    by_name = {s.name: s for s in study.stages}
    deps = dependencies(study)
    todo = [n for n in submission_order(study) if (stages is None or n in stages)
            and not stage_finished(study, by_name[n], for_stage(launch, n).overrides)]
    task_ids: dict[str, str] = {}
    if study.assets.presets or study.assets.domains:
        task_ids["assets"] = exp.add(
            run.Script(path="megaopd.launch.jobs", args=["assets", str(study_path)], entrypoint=python, m=True),
            executor=local_executor(launch), name="assets")
    for name in todo:
        stage, stage_launch = by_name[name], for_stage(launch, name)
        args = stage_overrides(study, stage) + stage_launch.overrides  # the study's seed first, as everywhere
        train_args = [stage.config, *args, f"run_dir={out / name}"]
        # The megatron backend runs the trainer on every torchrun rank (the launch setting trainer_module,
        # megaopd.models.megatron.launch by default), even on one GPU.
        megatron = load_config(stage.config, train_args[1:]).model.backend == "megatron"
        script = (run.Script(path=stage_launch.trainer_module, entrypoint=python, m=True, args=train_args) if megatron
                  else run.Script(path="megaopd.cli", entrypoint=python, m=True, args=["train", *train_args]))
        after = [task_ids[d] for d in ["assets", *deps[name]] if d in task_ids]
        task_ids[name] = exp.add(script, executor=local_executor(stage_launch, torchrun=megatron), name=name,
                                 dependencies=after)


# ---- Slurm: `megaopd submit`'s jobs, queued and tracked by nemo-run ----
def sbatch_options(script: str) -> dict[str, str | bool]:
    """The ``#SBATCH --key[=value]`` lines of a rendered script, in order (a bare flag maps to True)."""
    options = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH --"):
            key, _, value = line[len("#SBATCH --"):].partition("=")
            options[key] = value if value else True
    return options


def slurm_task(job: Job, script: Path, prefix: str) -> tuple[run.Script, run.SlurmExecutor]:
    """The task and executor that run ``job``: nemo-run's batch script carries the rendered ``#SBATCH`` options,
    then execs ``script`` (the rendered job) in its place, so the trap for the preemption signal, the node split
    and the requeue are megaopd's. ``prefix`` + the job's name gives the same job name as `megaopd submit`."""
    script.write_text(job.script)
    fields, extra = {}, {}
    for key, value in sbatch_options(job.script).items():
        if key in _NEMO_OWNS:
            continue
        name = key.replace("-", "_")  # nemo-run writes name back as --name-with-dashes
        value = int(value) if isinstance(value, str) and value.isdigit() else value
        (fields if name in _EXECUTOR_FIELDS else extra)[name] = value
    fields.setdefault("account", None)  # nemo-run requires the argument; None writes no --account line
    executor = run.SlurmExecutor(
        **fields, additional_parameters=extra, job_name_prefix=prefix,
        setup_lines=f"exec bash {shlex.quote(str(script))}",
        # An empty job_dir (nemo-run's home) is the one that submits correctly through a local tunnel, and the
        # plain packager ships nothing (the default one runs `git archive` and needs a git checkout).
        tunnel=run.LocalTunnel(job_dir=""), packager=run.Packager())
    # Only reached if the exec above failed (the script is missing on the node: {out} is not shared).
    fallback = run.Script(inline=f"echo 'megaopd: could not run {script}' >&2; exit 1")
    return fallback, executor


def add_slurm(exp: run.Experiment, study: StudyConfig, launch: LaunchConfig,
              stages: list[str] | None = None) -> None:
    """Add `megaopd submit`'s jobs for ``study`` (absolute) to ``exp``: assets, the stages not yet done (or only
    ``stages``), and the report when every stage is included."""
    # Not under a directory named nemo_run: nemo-run rewrites "/nemo_run" in its scripts (its container mount).
    script_dir = Path(study.out) / "slurm" / "nemo"
    script_dir.mkdir(parents=True, exist_ok=True)
    write_job_inputs(study, launch)  # what the assets and report jobs read
    prefix = f"megaopd-{Path(study.out).name}-"
    jobs = [j for j in plan(study, launch)
            if stages is None or j.name == "assets" or j.name in stages]
    task_ids: dict[str, str] = {}
    for job in jobs:
        task, executor = slurm_task(job, script_dir / f"{job.name}.sbatch", prefix)
        task_ids[job.name] = exp.add(task, executor=executor, name=job.name,
                                     dependencies=[task_ids[a] for a in job.after if a in task_ids])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_study_arguments(parser)  # as for `megaopd submit`
    parser.add_argument("--executor", choices=["local", "slurm"], default="local")
    parser.add_argument("--stages", nargs="*", help="only these stages (default: all)")
    args = parser.parse_args(argv)
    local = args.executor == "local"
    try:
        study, launch = study_and_launch(args)
        with run.Experiment(f"megaopd-{Path(study.out).name}") as exp:
            (add_local if local else add_slurm)(exp, study, launch, args.stages)
            # Slurm: queue every task with afterok dependencies and return; local: run level by level, waiting.
            exp.run(detach=not local)
    except ConfigError as e:
        print(f"megaopd: config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
