"""The jobs around a study's stages on a cluster, run by the scripts that ``megaopd submit`` writes.

    python -m megaopd.launch.jobs assets STUDY.yaml                       # the embedded models and data, in {out}
    python -m megaopd.launch.jobs report STUDY.yaml --launch LAUNCH.yaml  # {out}/report.txt and {out}/report/

``megaopd study`` does both in one process around its stages; on Slurm each stage is its own job, so these run
before the first stage and after the last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megaopd.config import load_config
from megaopd.launch.slurm import LaunchConfig, for_stage, load_launch
from megaopd.run.study import StudyConfig, accuracy_flops_table, build_assets, seed_studies, stage_finished


def report_job(study: StudyConfig, launch: LaunchConfig) -> str:
    """The accuracy-vs-FLOPs table of every stage (of every seed), and the study report over all seeds; each stage
    must have ended under the step cap its job trained to (its config with ``launch``'s overrides)."""
    seeds = seed_studies(study)
    outs = [Path(one.out) for one in seeds]
    run_dirs = [out / s.name for out in outs for s in study.stages]
    missing = [str((Path(one.out) / s.name).relative_to(study.out)) for one in seeds for s in one.stages
               if not stage_finished(one, s, for_stage(launch, s.name).overrides)]
    if missing:  # afterok should make this impossible; say so rather than print a partial table
        raise SystemExit(f"megaopd: stages not finished: {', '.join(missing)}")
    from megaopd.analysis import report

    table = accuracy_flops_table(run_dirs)
    (Path(study.out) / "report.txt").write_text(table + "\n")
    report.write_report(outs, Path(study.out) / "report")  # report.md, plots and report.json
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megaopd.launch.jobs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["assets", "report"])
    parser.add_argument("study")
    parser.add_argument("--launch", help="report: the launch config the stages' jobs ran with")
    args = parser.parse_args(argv)
    study = load_config(args.study, cls=StudyConfig)
    if args.action == "assets":
        build_assets(study)
    else:
        print(report_job(study, load_launch(args.launch)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
