"""The megaopd command: building the embedded default, evaluating a model directory, config errors, conversion."""

import json
import subprocess
import sys

import pytest


def megaopd(*args, check=True):
    return subprocess.run([sys.executable, "-m", "megaopd.cli", *map(str, args)], capture_output=True, text=True,
                          check=check)


def answering_model(model_dir, reply: str) -> None:
    """Rewrite an untied Llama so that greedy decoding after the prompt's last token spells `reply` then EOS.

    Zeroed attention and MLP outputs leave each position's hidden state its own token's embedding; each LM-head
    row is the normalised embedding of the token that should precede it, so the argmax is "the next character".
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chain = tokenizer.encode("\n" + reply, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert len(set(chain)) == len(chain), "each token may have one successor"
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        unit = embed / embed.norm(dim=-1, keepdim=True)
        model.lm_head.weight.zero_()
        for before, after in zip(chain, chain[1:]):
            model.lm_head.weight[after] = 100 * unit[before]
    model.save_pretrained(model_dir)


@pytest.mark.slow
def test_make_embedded_then_eval(tmp_path):
    megaopd("make-embedded", "--out", tmp_path, "--presets", "llama-tiny", "--domains", "letter_count")
    model = tmp_path / "models" / "llama-tiny"
    assert (model / "model.safetensors").exists() and (model / "tokenizer.json").exists()
    answering_model(model, "answer:7")  # 8 tokens + EOS
    heldout = tmp_path / "data" / "letter_count" / "test.jsonl"
    rows = [json.loads(line) for line in heldout.read_text().splitlines()]
    for i, row in enumerate(rows):  # the first five: truths 7, 8, 7, 8, 8; the rest must not be read
        row["reward_model"]["ground_truth"] = "7" if i in (0, 2) or i >= 5 else "8"
    heldout.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = megaopd("eval", "--model", model, "--data", heldout, "--max-new-tokens", "12",
                  "--prompts-per-domain", "5").stdout
    metrics = json.loads(out)
    assert metrics["eval/letter_count/response_length"] == 9  # stopped at EOS, which counts
    assert metrics["eval/letter_count/accuracy_greedy"] == 2 / 5
    assert metrics["eval/mean/accuracy_greedy"] == 2 / 5


def test_make_embedded_builds_every_domain_by_default(tmp_path):
    """The README's first command, with no --domains: each domain's rows fit its distinct problems (its default
    counts asked 2-digit subtraction for 700 held-out rows of its ~410, a ValueError traceback); a count too large
    for a domain is one data-error line naming what to lower."""
    megaopd("make-embedded", "--out", tmp_path, "--presets")
    lines = {p.relative_to(tmp_path / "data").as_posix(): len(p.read_text().splitlines())
             for p in (tmp_path / "data").glob("*/*.jsonl")}
    assert {name.split("/")[0] for name in lines} == {"arith_add", "arith_sub", "prog_trace", "letter_count"}
    assert lines["arith_sub/test.jsonl"] == 300 and lines["arith_sub/validation.jsonl"] == 100

    result = megaopd("make-embedded", "--out", tmp_path / "more", "--presets", "--domains", "arith_sub",
                     "--heldout-rows", "400", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("megaopd: data error: arith_sub at difficulty 2 has "
                                                             "too few distinct heldout problems for 500 rows")


def embedded_letter_count(tmp_path):
    """A tiny Llama and five held-out letter_count rows: (model directory, rows file)."""
    megaopd("make-embedded", "--out", tmp_path, "--presets", "llama-tiny", "--domains", "letter_count",
            "--train-rows", "10", "--validation-rows", "0", "--heldout-rows", "5")
    return tmp_path / "models" / "llama-tiny", tmp_path / "data" / "letter_count" / "test.jsonl"


def test_eval_refuses_rows_without_a_verifier(tmp_path):
    """Rows of a data source no verifier reads are one data-error line, as at a run's start (a KeyError traceback)."""
    model, rows = embedded_letter_count(tmp_path)
    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text(rows.read_text().replace('"letter_count"', '"no_such_task"'))
    result = megaopd("eval", "--model", model, "--data", unknown, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "megaopd: data error: no verifier for data_source='no_such_task'" in result.stderr


def test_eval_refuses_weights_it_cannot_read_before_loading(tmp_path):
    """``megaopd eval`` checks its model directory before the model loads, as a run does: weights cut short are one
    model-error line (a safetensors traceback mid-load)."""
    model, rows = embedded_letter_count(tmp_path)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    result = megaopd("eval", "--model", model, "--data", rows, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"megaopd: model error: --model={model}: "
                                                             "model.safetensors is not a readable safetensors file")


def test_config_error_is_one_clear_line(tmp_path):
    result = megaopd("train", "configs/embedded/grpo.yaml", "optim.lrr=1", check=False)
    assert result.returncode == 2
    assert "unknown config key 'optim.lrr'; did you mean 'optim.lr'?" in result.stderr
    assert "Traceback" not in result.stderr


def test_convert_names_bad_records(tmp_path):
    raw = tmp_path / "gsm8k.jsonl"
    raw.write_text('{"question": "1+1?", "answer": "so #### 2"}\n{"question": "no answer"}\n')
    result = megaopd("convert", "--source", "gsm8k", "--input", raw, "--out", tmp_path / "rows.jsonl")
    assert "1 rows loaded, 1 skipped" in result.stdout and f"{raw}:2" in result.stdout
    row = json.loads((tmp_path / "rows.jsonl").read_text())
    assert row["reward_model"]["ground_truth"] == "2" and row["data_source"]


def test_convert_carves_a_validation_split_off_the_held_out_file(tmp_path):
    """--validation N: N distinct problems, drawn by --seed, into validation.jsonl beside --out; --out keeps the
    rest; a repeated problem stays on one side; the same seed draws the same split."""
    raw = tmp_path / "gsm8k.jsonl"
    questions = [f"{i}+1?" for i in range(10)] + ["3+1?"]  # the last repeats a problem
    raw.write_text("".join(json.dumps({"question": q, "answer": f"#### {q.split('+')[0]}1"}) + "\n" for q in questions))

    def split(out, seed="0"):
        result = megaopd("convert", "--source", "gsm8k", "--input", raw, "--out", out / "test.jsonl",
                         "--validation", "4", "--seed", seed)
        assert f"to {out / 'validation.jsonl'}" in result.stdout
        return [[json.loads(line)["prompt"][0]["content"] for line in (out / f).read_text().splitlines()]
                for f in ("validation.jsonl", "test.jsonl")]

    validation, test = split(tmp_path / "a")
    assert len(set(validation)) == 4 and len(validation) + len(test) == 11 and not set(validation) & set(test)
    assert [validation, test] == split(tmp_path / "b") and [validation, test] != split(tmp_path / "c", "1")
    too_many = megaopd("convert", "--source", "gsm8k", "--input", raw, "--out", tmp_path / "d" / "test.jsonl",
                       "--validation", "10", check=False)
    assert too_many.returncode == 2 and "the file has 10 distinct prompts; carve off fewer" in too_many.stderr
