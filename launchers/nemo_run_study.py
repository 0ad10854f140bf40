"""A megaopd study as a nemo-run Experiment: an assets task, then one task per stage, with the same dependency
graph as `megaopd submit` (a stage waits for the stages whose run directories its overrides name).

    python launchers/nemo_run_study.py configs/studies/self_teacher.yaml --executor local
    python launchers/nemo_run_study.py STUDY.yaml --executor slurm --launch launch.yaml   # submits and detaches
    python launchers/nemo_run_study.py STUDY.yaml --stages base                          # a subset (+ assets)

Needs ``nemo-run==0.11.1`` with ``leptonai==0.27.3`` (later leptonai releases break ``import nemo_run``).
Logs go to ``$NEMORUN_HOME/experiments/<title>/...`` (default ~/.nemo_run). The Slurm executor reuses the
launch config of `megaopd submit` (partition, account, time, nodes, GPUs, container); preemption with
requeue-and-resume is what `megaopd submit`'s scripts add on top, so prefer those for long runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nemo_run as run

from megaopd.config import load_config, save_config
from megaopd.launch.slurm import LaunchConfig, absolute_study, dependencies, for_stage, load_launch, submission_order
from megaopd.study import StudyConfig, stage_is_done

ROOT = Path(__file__).resolve().parents[1]


def local_executor(launch: LaunchConfig, torchrun: bool = False) -> run.LocalExecutor:
    # The tasks run `python -m megaopd...` from the experiment's directory: put this checkout on the path.
    return run.LocalExecutor(env_vars={"PYTHONPATH": str(ROOT)}, launcher="torchrun" if torchrun else None,
                             ntasks_per_node=max(launch.gpus_per_node, 1) if torchrun else 1)


def slurm_executor(launch: LaunchConfig, torchrun: bool = False) -> run.SlurmExecutor:
    gpus = launch.gpus_per_node
    return run.SlurmExecutor(
        account=launch.account, partition=launch.partition or None, time=launch.time,
        nodes=launch.nodes, ntasks_per_node=1, gpus_per_node=gpus or None,
        cpus_per_task=launch.cpus_per_task or None, mem=launch.mem or None,
        container_image=launch.container_image or None, container_mounts=launch.container_mounts,
        launcher="torchrun" if torchrun or launch.nodes * max(gpus, 1) > 1 else None,
        env_vars={"PYTHONPATH": str(ROOT)},
        # An empty job_dir (nemo-run's home) is the one that submits correctly through a local tunnel, and the
        # plain packager ships nothing (the default one runs `git archive` and needs a git checkout).
        tunnel=run.LocalTunnel(job_dir=""), packager=run.Packager())


def add_study(exp: run.Experiment, study: StudyConfig, launch: LaunchConfig, make_executor,
              stages: list[str] | None = None, python: str = "python") -> None:
    """Add the study's tasks to ``exp`` (inside its ``with`` block); ``study`` must be absolute. ``python``
    runs the tasks: this interpreter for the local executor, the job's (venv or container) on Slurm."""
    out = Path(study.out)
    study_file = out / "nemo_run" / "study.yaml"
    study_file.parent.mkdir(parents=True, exist_ok=True)
    save_config(study, study_file)
    by_name = {s.name: s for s in study.stages}
    deps = dependencies(study)
    todo = [n for n in submission_order(study) if (stages is None or n in stages) and not stage_is_done(out / n)]
    task_ids: dict[str, str] = {}
    if study.assets.presets or study.assets.domains:
        task_ids["assets"] = exp.add(
            run.Script(path="megaopd.launch.jobs", args=["assets", str(study_file)], entrypoint=python, m=True),
            executor=make_executor(launch), name="assets")
    for name in todo:
        stage, stage_launch = by_name[name], for_stage(launch, name)
        args = [study.substitute(o) for o in stage.overrides] + stage_launch.overrides
        train_args = [stage.config, *args, f"run_dir={out / name}"]
        # The megatron backend runs the trainer on every torchrun rank (megaopd.megatron.launch), even on one GPU.
        megatron = load_config(stage.config, train_args[1:]).model.backend == "megatron"
        script = (run.Script(path="megaopd.megatron.launch", entrypoint=python, m=True, args=train_args) if megatron
                  else run.Script(path="megaopd.cli", entrypoint=python, m=True, args=["train", *train_args]))
        after = [task_ids[d] for d in ["assets", *deps[name]] if d in task_ids]
        task_ids[name] = exp.add(script, executor=make_executor(stage_launch, torchrun=megatron), name=name,
                                 dependencies=after)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="the study YAML")
    parser.add_argument("overrides", nargs="*", help="study overrides, key.sub=value")
    parser.add_argument("--executor", choices=["local", "slurm"], default="local")
    parser.add_argument("--launch", help="launch YAML, as for `megaopd submit` (Slurm executor)")
    parser.add_argument("--stages", nargs="*", help="only these stages (default: all)")
    args = parser.parse_args(argv)
    study = absolute_study(load_config(args.config, args.overrides, cls=StudyConfig))
    launch = load_launch(args.launch)
    local = args.executor == "local"
    with run.Experiment(f"megaopd-{Path(study.out).name}") as exp:
        add_study(exp, study, launch, local_executor if local else slurm_executor, args.stages,
                  sys.executable if local else "python")
        # Slurm: queue every task with afterok dependencies and return; local: run level by level, waiting.
        exp.run(detach=not local)
    return 0


if __name__ == "__main__":
    sys.exit(main())
