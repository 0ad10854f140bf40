"""Every user error is one line: a table of mistakes (config, paths, data, models, studies) run through the real
``megaopd`` command, each answered by ``megaopd: <what>: <why>; <what to do>`` on stderr and exit status 2, with no
traceback (``--debug`` brings it back)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GRPO = str(ROOT / "configs/embedded/grpo.yaml")
LINE = re.compile(r"megaopd: [a-z]+ error: .+; .+")


def cases(tmp: Path) -> list[tuple[list[str], str]]:
    (tmp / "bad.yaml").write_text("train: [1, 2\n")
    (tmp / "list.yaml").write_text("- train\n")
    (tmp / "empty_model").mkdir()
    (tmp / "seeds.yaml").write_text(f"out: {tmp / 'study'}\nseeds: [0, 0]\nstages: []\n")
    (tmp / "not_a_study").mkdir()
    run = [f"run_dir={tmp / 'run'}", "data.eval=[]"]
    return [
        (["train", str(tmp / "missing.yaml")], "config error: config file"),
        (["train", str(tmp / "bad.yaml")], "is not valid YAML"),
        (["train", str(tmp / "list.yaml")], "must be a YAML mapping"),
        (["train", GRPO, "train.stepz=3"], "unknown config key 'train.stepz'; did you mean 'train.steps'"),
        (["train", GRPO, "train.algorithm=ppo"], "train.algorithm: 'ppo' is not one of"),
        (["train", GRPO, "train.steps=many"], "train.steps: expected int, got 'many'"),
        (["train", GRPO, "optim.lr=-1"], "optim.lr must be >= 0, got -1; set one in that range"),
        (["train", GRPO, "trainsteps"], "is not of the form key.sub=value"),
        (["train", GRPO, "train.steps.every=3"], "cannot set 'train.steps.every'"),
        (["train", GRPO, *run, f"data.train=[{tmp / 'missing.jsonl'}]"], "data error: data file"),
        (["eval", "--model", str(tmp / "empty_model"), "--data", str(tmp / "missing.jsonl")], "model error"),
        (["convert", "--source", "gsm8k", "--input", str(tmp / "missing.jsonl"), "--out", str(tmp / "o.jsonl")],
         "data error: data file"),
        (["study", str(tmp / "seeds.yaml")], "study error: study seeds must be distinct"),
        (["report", str(tmp / "not_a_study")], "study error: study file"),
        (["plan", GRPO, "model.path=/models/Unknown-9B"], "plan error: cannot plan model"),
        (["plan", str(tmp / "missing.yaml")], "config error: config file"),
        (["plan", GRPO, "plan.mfu=high"], "plan.mfu: expected float, got 'high'"),
    ]


def megaopd(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "megaopd.cli", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=240)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_user_errors_are_one_line_with_exit_status_2(tmp_path):
    table = cases(tmp_path)
    assert len(table) >= 15
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda case: megaopd(case[0], tmp_path), table))
    for (args, expected), result in zip(table, results):
        lines = [line for line in result.stderr.splitlines() if line.startswith("megaopd: ")]
        assert "Traceback" not in result.stderr and result.returncode == 2, (args, result.stderr[-2000:])
        assert len(lines) == 1 and LINE.fullmatch(lines[0]) and expected in lines[0], (args, lines)


def test_a_number_out_of_its_range_is_one_line_before_the_run_directory(tmp_path, capsys):
    """optim.lr=-1 ended in torch's "Invalid learning rate" traceback once the model had loaded."""
    from megaopd.cli import main

    assert main(["train", GRPO, f"run_dir={tmp_path / 'run'}", "optim.lr=-1"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("megaopd: ")]
    assert "Traceback" not in err and len(lines) == 1 and LINE.fullmatch(lines[0]), err
    assert lines[0].startswith("megaopd: config error: optim.lr must be >= 0, got -1; ")
    assert not (tmp_path / "run").exists()


def test_a_study_number_out_of_its_range_is_one_line_before_the_assets(tmp_path, capsys):
    """threads=0 ended in a ValueError traceback; seed=-1 was refused as train.seed once the assets were built."""
    from megaopd.cli import main

    for override in ("threads=0", "seed=-1", "assets.train_rows=-1"):
        study = str(ROOT / "configs/studies/self_teacher.yaml")
        assert main(["study", study, f"out={tmp_path / 'study'}", override]) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("megaopd: ")]
        assert "Traceback" not in err and len(lines) == 1 and LINE.fullmatch(lines[0]), err
        assert lines[0].startswith(f"megaopd: config error: {override.split('=')[0]} must be ")
    assert not (tmp_path / "study").exists()


# A command's number flag outside the range its code reads it in: argparse's usage error names the flag, exit status
# 2. Before, eval --max-new-tokens -3 or 0 ended in a RuntimeError / IndexError traceback once the model had loaded,
# report --window 0 in a ZeroDivisionError and make-embedded --seed past 2**64 in torch's overflow; a negative row
# count cut the held-out rows short, report --length-window 0 gave NaN lengths and --target-fraction 0, 1.5 or nan
# targets met at once or never, without a word; rehearse --timeout 0 brought its cluster up only to time out, --steps 0
# was refused as eval.every, and --prompts-per-domain was refused as the config key it sets.
FLAGS_OUT_OF_RANGE = [
    *(("make-embedded --out {tmp} --presets --domains letter_count", flag, value) for flag, value in
      (("--train-rows", "-1"), ("--validation-rows", "-1"), ("--heldout-rows", "-5"), ("--seed", "-1"),
       ("--seed", "99999999999999999999999"))),
    *(("eval --model {tmp} --data {tmp}/rows.jsonl", flag, value) for flag, value in
      (("--max-new-tokens", "-3"), ("--max-new-tokens", "0"), ("--prompts-per-domain", "-1"))),
    *(("convert --source gsm8k --input {tmp}/raw.jsonl --out {tmp}/rows.jsonl", flag, value) for flag, value in
      (("--validation", "-1"), ("--seed", "-1"))),
    *(("report {tmp}", flag, value) for flag, value in
      (("--window", "0"), ("--length-window", "0"), ("--replicates", "-1"), ("--target-fraction", "0"),
       ("--target-fraction", "1.5"), ("--target-fraction", "nan"))),
    *(("rehearse {tmp}/study.yaml", flag, value) for flag, value in
      (("--steps", "0"), ("--gpus-per-node", "0"), ("--timeout", "0"), ("--timeout", "nan"))),
]


@pytest.mark.parametrize("command, flag, value", FLAGS_OUT_OF_RANGE, ids=lambda part: part.split()[0])
def test_a_flag_out_of_its_range_is_one_usage_error_naming_it(tmp_path, capsys, command, flag, value):
    from megaopd.cli import main

    args = command.format(tmp=tmp_path).split()
    with pytest.raises(SystemExit) as exited:
        main([*args, flag, value])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err, err
    assert re.fullmatch(rf"megaopd {args[0]}: error: argument {flag}: must be .+, got {re.escape(value)}; give one "
                        "in that range", err.splitlines()[-1]), err


def test_a_flag_at_the_edge_of_its_range_is_taken():
    from megaopd.config import flag_in_range

    assert flag_in_range(0, means="0: all")("0") == 0 and flag_in_range(0, 1, kind=float, low_open=True)("1") == 1
    assert flag_in_range(0, kind=float, low_open=True)("inf") == float("inf")


def test_debug_gives_the_traceback(tmp_path):
    result = megaopd(["--debug", "train", str(tmp_path / "missing.yaml")], tmp_path)
    assert "Traceback" in result.stderr and "ConfigError" in result.stderr and result.returncode == 1


@pytest.mark.timeout(300)
def test_settings_checked_once_the_model_is_loaded_are_one_line_too(assets, tmp_path):
    """The objective's and the backends' own checks (here the top-k form without its K) are user errors as well."""
    model = assets / "models" / "qwen3-tiny"
    data = assets / "data" / "arith_add"
    result = megaopd(["train", str(ROOT / "configs/embedded/opd.yaml"), f"run_dir={tmp_path / 'run'}",
                      f"model.path={model}", f"opd.teachers.*={model}", f"data.train=[{data / 'train.jsonl'}]",
                      f"data.eval=[{data / 'test.jsonl'}]", "opd.form=topk", "opd.topk=0"], tmp_path)
    lines = [line for line in result.stderr.splitlines() if line.startswith("megaopd: ")]
    assert "Traceback" not in result.stderr and result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and LINE.fullmatch(lines[0]) and "opd.form=topk needs opd.topk" in lines[0], lines
