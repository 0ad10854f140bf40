"""The embedded default: tiny HF models of two families and synthetic data, built locally from a seed.

    megaopd make-embedded --out runs/embedded

writes ``models/<preset>/`` (config.json, model.safetensors, tokenizer with a chat template) and
``data/<domain>/{train,validation,test}.jsonl``. Nothing is downloaded: the tokenizer is a byte-level BPE with no merges
(every byte one token) plus chat special tokens, and the models are transformers' own Qwen3 / Llama classes,
random-initialised, so the same loading code serves Qwen3-1.7B or Llama-3-8B on a cluster.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from megaopd.data.rows import write_rows
from megaopd.data.synthetic import DOMAINS, make_splits
from megaopd.accounting.flops import HF_CONFIG
from megaopd.accounting.shapes import REAL_SHAPES, real_model_config, real_shape

log = logging.getLogger(__name__)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# name -> (family, hidden, layers, heads, kv heads, MLP width, tied embeddings)
PRESETS: dict[str, tuple[str, int, int, int, int, int, bool]] = {
    "qwen3-tiny": ("qwen3", 64, 2, 4, 2, 192, True),
    "qwen3-small": ("qwen3", 96, 3, 4, 2, 288, True),
    "qwen3-base": ("qwen3", 128, 4, 4, 2, 384, True),
    "llama-tiny": ("llama", 64, 2, 4, 2, 192, False),
    "llama-small": ("llama", 96, 3, 4, 2, 288, False),
}


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


def build_model_config(preset: str, vocab_size: int, eos_id: int, pad_id: int):
    from transformers import LlamaConfig, Qwen3Config

    shape = real_shape(preset)
    if shape is not None:
        return real_model_config(shape, vocab_size, eos_id, pad_id)
    if preset not in PRESETS:
        raise KeyError(f"unknown model preset {preset!r}; known: {sorted(PRESETS) + sorted(REAL_SHAPES)}")
    family, hidden, layers, heads, kv_heads, mlp, tied = PRESETS[preset]
    common = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, intermediate_size=mlp, max_position_embeddings=512,
                  tie_word_embeddings=tied, eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None,
                  rms_norm_eps=1e-6)
    if family == "qwen3":
        return Qwen3Config(head_dim=hidden // heads, **common)
    return LlamaConfig(**common)


def build_model(preset: str, out_dir: str | Path, seed: int = 0) -> Path:
    """A random-initialised HF model directory with the embedded tokenizer saved beside it."""
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer()
    config = build_model_config(preset, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    log.info("built %s (%d parameters) in %s", preset, sum(p.numel() for p in model.parameters()), out_dir)
    return out_dir


def build_data(out_dir: str | Path, domains: list[str] | None = None, train_rows: int = 4000,
               heldout_rows: int = 500, difficulty: dict[str, int] | None = None, seed: int = 0,
               heldout_percent: int = 10, verbosity: dict[str, int] | None = None,
               validation_rows: int = 200) -> dict[str, Path]:
    """Write train / validation / test JSONL per domain (`heldout_rows`: the test rows); returns domain -> its data
    directory."""
    out_dir = Path(out_dir)
    paths = {}
    counts = {"train": train_rows, "validation": validation_rows, "test": heldout_rows}
    for domain in domains or list(DOMAINS):
        level = (difficulty or {}).get(domain)
        splits = make_splits(domain, counts, level, seed, heldout_percent, (verbosity or {}).get(domain, 0))
        for split, rows in splits.items():
            write_rows(out_dir / domain / f"{split}.jsonl", rows)
        paths[domain] = out_dir / domain
    return paths


def make_embedded(out: str | Path, presets: list[str], domains: list[str] | None = None, seed: int = 0,
                  train_rows: int = 4000, heldout_rows: int = 500, difficulty: dict[str, int] | None = None,
                  heldout_percent: int = 10, verbosity: dict[str, int] | None = None,
                  validation_rows: int = 200) -> None:
    out = Path(out)
    for preset in presets:
        if not (out / "models" / preset / HF_CONFIG).exists():
            build_model(preset, out / "models" / preset, seed)
    build_data(out / "data", domains, train_rows, heldout_rows, difficulty, seed, heldout_percent, verbosity,
               validation_rows)
