"""``megaopd submit STUDY [key=value ...] [--launch launch.yaml] [--dry-run]``: a study as Slurm jobs.

Renders one batch script per stage (see ``megaopd.launch.slurm``), writes them to ``{out}/slurm/`` and submits
them with ``sbatch --parsable`` in dependency order, each with ``--dependency=afterok:<ids of its upstream
stages>``; prints ``<job> <job id>`` per line. ``--dry-run`` prints the sbatch commands and scripts instead.
Submitting again after a failure re-queues only the stages that have not finished (under the step cap each job
would train to: ``megaopd.run.finished``; a raised ``train.steps`` queues its stage again, to train on).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from megaopd.errors import UserError
from megaopd.launch.slurm import Job, LaunchConfig, add_study_arguments, plan, study_and_launch, write_job_inputs
from megaopd.run.study import StudyConfig, link_shared_stages


def sbatch_command(job: Job, script: Path, ids: dict[str, str]) -> list[str]:
    """``ids`` maps job names to Slurm job ids (or to placeholders, for a dry run)."""
    cmd = ["sbatch", "--parsable"]
    if job.after:
        cmd.append("--dependency=afterok:" + ":".join(ids[name] for name in job.after))
    return cmd + [str(script)]


def submit(study: StudyConfig, launch: LaunchConfig, jobs: list[Job]) -> dict[str, str]:
    """Write the scripts under {out}/slurm/ and submit them in order; returns job name -> Slurm job id."""
    slurm_dir = Path(study.out) / "slurm"
    write_job_inputs(study, launch)
    link_shared_stages(study)
    ids: dict[str, str] = {}
    for job in jobs:
        script = slurm_dir / f"{job.name}.sbatch"
        script.write_text(job.script)
        result = subprocess.run(sbatch_command(job, script, ids), capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch {script} failed ({result.returncode}): {result.stderr.strip()}; "
                               f"already submitted: {ids or 'none'}")
        ids[job.name] = result.stdout.strip().split(";")[0]  # --parsable prints "id" or "id;cluster"
    return ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megaopd submit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_study_arguments(parser)
    parser.add_argument("--dry-run", action="store_true", help="print the sbatch commands and scripts only")
    args = parser.parse_args(argv)
    try:
        study, launch = study_and_launch(args)
        jobs = plan(study, launch)
    except UserError as e:
        print(e.line(), file=sys.stderr)
        return 2
    if args.dry_run:
        slurm_dir = Path(study.out) / "slurm"
        placeholders = {job.name: f"<{job.name}>" for job in jobs}
        for job in jobs:
            print(f"# ===== {job.name} =====")
            print("# " + shlex.join(sbatch_command(job, slurm_dir / f"{job.name}.sbatch", placeholders)))
            print(job.script)
        return 0
    for name, job_id in submit(study, launch, jobs).items():
        print(name, job_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
