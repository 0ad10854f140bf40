"""The megaopd command: building the embedded default, evaluating a model directory, config errors, conversion."""

import json
import subprocess
import sys


def megaopd(*args, check=True):
    return subprocess.run([sys.executable, "-m", "megaopd.cli", *map(str, args)], capture_output=True, text=True,
                          check=check)


def test_make_embedded_then_eval(tmp_path):
    megaopd("make-embedded", "--out", tmp_path, "--presets", "llama-tiny", "--domains", "letter_count")
    model = tmp_path / "models" / "llama-tiny"
    assert (model / "model.safetensors").exists() and (model / "tokenizer.json").exists()
    out = megaopd("eval", "--model", model, "--data", tmp_path / "data" / "letter_count" / "heldout.jsonl",
                  "--max-new-tokens", "8", "--prompts-per-domain", "5").stdout
    metrics = json.loads(out)
    # The same five prompts decoded greedily by transformers' own generate and scored by the verifier directly.
    lengths, scores = greedy_reference(model, tmp_path / "data" / "letter_count" / "heldout.jsonl", 5, 8)
    assert metrics["eval/letter_count/response_length"] == sum(lengths) / 5
    assert metrics["eval/letter_count/accuracy_greedy"] == sum(scores) / 5
    assert metrics["eval/mean/accuracy_greedy"] == metrics["eval/letter_count/accuracy_greedy"]


def greedy_reference(model_dir, heldout, prompts: int, max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Response lengths (up to and including the first EOS) and verifier scores of greedy decoding with HF generate."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megaopd.data.rows import load_rows
    from megaopd.verifiers import score

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lengths, scores = [], []
    for row in load_rows(heldout)[0][:prompts]:
        text = tokenizer.apply_chat_template(row.prompt, add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
        length = out.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in out else len(out)
        lengths.append(length)
        scores.append(score(row, tokenizer.decode(out[:length], skip_special_tokens=True)))
    return lengths, scores


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
