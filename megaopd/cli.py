"""The ``megaopd`` command.

    megaopd make-embedded --out runs/embedded           # tiny models + synthetic data, built locally
    megaopd train CONFIG [key.sub=value ...]            # one run: sft | grpo | opd, chosen by the config
    megaopd eval --model DIR --data FILE [FILE ...]     # held-out accuracy of an HF model directory
    megaopd study CONFIG [key.sub=value ...]            # a list of stages, then the accuracy-vs-FLOPs table
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from megaopd.config import ConfigError, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megaopd", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-embedded", help="build the tiny default models and synthetic data")
    p.add_argument("--out", required=True)
    p.add_argument("--presets", nargs="*", default=["qwen3-tiny", "llama-tiny"])
    p.add_argument("--domains", nargs="*", default=None)
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("train", help="run one stage (sft, grpo or opd) from a config")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key.sub=value")

    p = sub.add_parser("eval", help="held-out accuracy of an HF model directory")
    p.add_argument("--model", required=True)
    p.add_argument("--data", nargs="+", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts-per-domain", type=int, default=0, help="0 = all")

    p = sub.add_parser("study", help="run a study's stages in order and print accuracy vs FLOPs")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key.sub=value")

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        return _run(args)
    except ConfigError as e:
        print(f"megaopd: config error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    if args.command == "make-embedded":
        from megaopd.embedded import make_embedded

        make_embedded(args.out, args.presets, args.domains, args.seed)
    elif args.command == "train":
        from megaopd.trainer import train

        summary = train(load_config(args.config, args.overrides))
        print(json.dumps(summary["final"], indent=1))
    elif args.command == "eval":
        from megaopd.config import EvalConfig, ModelConfig
        from megaopd.evaluate import Evaluator
        from megaopd.policy import HFPolicy
        from megaopd.rollout import LocalEngine
        from megaopd.trainer import load_split

        policy = HFPolicy(ModelConfig(path=args.model))
        evaluator = Evaluator(load_split(args.data, False), EvalConfig(prompts_per_domain=args.prompts_per_domain),
                              args.max_new_tokens, seed=0)
        print(json.dumps(evaluator.run(LocalEngine(policy), policy.tokenizer, step=0), indent=1))
    elif args.command == "study":
        from megaopd.study import StudyConfig, accuracy_flops_table, run_study

        run_dirs = run_study(load_config(args.config, args.overrides, cls=StudyConfig))
        print(accuracy_flops_table(run_dirs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
