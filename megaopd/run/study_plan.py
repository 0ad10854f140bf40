"""`megaopd plan`: plan a run config, or every stage of a study file, before it runs (the per-run planner and its
formulas are ``megaopd.run.plan``; this module reads studies, so the trainer's plan check does not import the study).

    megaopd plan configs/cluster/grpo.yaml model.path=/models/Qwen3-1.7B --memory-gib 141
    megaopd plan configs/studies/cluster/two_domain_qwen3.yaml [--stage expert_math]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from megaopd.run import plan as run_plan
from megaopd.config import ConfigError, load_config
from megaopd.errors import UserError, require_file
from megaopd.run.plan import Plan, build_plan, device_budget
from megaopd.run.resolve import resolve_run, resolve_stage


def plan_study(path: str, overrides: list[str], run_overrides: list[str], stage: str = "") -> list[Plan]:
    """One plan per stage of a study file (or the named stage), of the run it resolves to (what `megaopd train` would
    refuse is refused here, naming the stage). A stage's ``{out}/<name>/final`` model has the shape of that stage's
    own model."""
    from megaopd.run.study import StudyConfig, stage_config  # here: the study imports the trainer

    study = load_config(path, overrides, cls=StudyConfig)
    names = [s.name for s in study.stages]
    if stage and stage not in names:
        raise ConfigError(f"no stage {stage!r} in {path}; stages: {', '.join(names)}")
    configs = {}
    for s in study.stages:
        s.overrides = s.overrides + run_overrides
        configs[s.name] = stage_config(study, s)
    aliases = {f"{study.out}/{name}/final": c.model.path for name, c in configs.items()}
    for _ in range(len(configs)):  # a final whose stage itself started from another final
        aliases = {k: aliases.get(v, v) for k, v in aliases.items()}
    plans = []
    for name, c in configs.items():
        if not stage or name == stage:
            c = resolve_stage(c, name).cfg
            plans.append(build_plan(c, aliases, device_budget(c), title=f"stage {name}"))
    return plans


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megaopd plan", description=__doc__ + "\n" + run_plan.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="a run config, or a study file (every stage is planned)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value (for a study: study keys, e.g. vars.student=)")
    parser.add_argument("--stage", default="", help="plan only this stage of a study")
    parser.add_argument("--memory-gib", type=float, help="memory per GPU (plan.memory_gib)")
    parser.add_argument("--gpus-per-node", type=int, help="plan.gpus_per_node")
    parser.add_argument("--nodes", type=int, help="trainer nodes (plan.nodes)")
    parser.add_argument("--mfu", type=float, help="assumed MFU for the step time (plan.mfu)")
    args = parser.parse_intermixed_args(argv)
    flags = {"memory_gib": args.memory_gib, "gpus_per_node": args.gpus_per_node, "nodes": args.nodes,
             "mfu": args.mfu}
    run_overrides = [f"plan.{k}={v}" for k, v in flags.items() if v is not None]
    try:
        require_file(args.config, "config file", ConfigError)
        data = yaml.safe_load(Path(args.config).read_text()) or {}
        if isinstance(data, dict) and "stages" in data:
            plans = plan_study(args.config, args.overrides, run_overrides, args.stage)
        else:
            cfg = resolve_run(load_config(args.config, args.overrides + run_overrides), inputs_exist=False).cfg
            plans = [build_plan(cfg, budget=device_budget(cfg), title=args.config)]
    except UserError as e:
        print(e.line(), file=sys.stderr)
        return 2
    print("\n\n".join(plan.table() for plan in plans))
    return 1 if any(plan.problem() for plan in plans) else 0
