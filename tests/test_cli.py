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
    assert 0.0 <= metrics["eval/letter_count/accuracy_greedy"] <= 1.0 and "eval/letter_count/response_length" in metrics


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
