"""The public architectures at full width and vocabulary (``REAL_SHAPES``): what ``megaopd plan`` plans a model by
when its directory is not on this machine, what the rehearsal checks a model's split against, and what
``megaopd make-embedded`` random-initialises at real shape (``megaopd.models.embedded``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class RealShape:
    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int  # the real vocabulary: token ids of the byte-level tokenizer are its first 259 rows
    tied: bool
    rope_theta: float
    rms_eps: float
    max_positions: int
    rope_scaling: tuple[tuple[str, object], ...] = ()  # Llama-3's "llama3" frequency scaling


_LLAMA3_ROPE = (("rope_type", "llama3"), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
                ("original_max_position_embeddings", 8192))
# From each model's published config.json. `qwen3-0.6b:layers=2` keeps the width and vocabulary with 2 layers.
REAL_SHAPES: dict[str, RealShape] = {
    "qwen3-0.6b": RealShape("qwen3", 1024, 28, 16, 8, 128, 3072, 151936, True, 1e6, 1e-6, 40960),
    "qwen3-1.7b": RealShape("qwen3", 2048, 28, 16, 8, 128, 6144, 151936, True, 1e6, 1e-6, 40960),
    "qwen3-8b": RealShape("qwen3", 4096, 36, 32, 8, 128, 12288, 151936, False, 1e6, 1e-6, 40960),
    "llama-3.2-1b": RealShape("llama", 2048, 16, 32, 8, 64, 8192, 128256, True, 5e5, 1e-5, 131072,
                              _LLAMA3_ROPE + (("factor", 32.0),)),
    "llama-3.1-8b": RealShape("llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 5e5, 1e-5, 131072,
                              _LLAMA3_ROPE + (("factor", 8.0),)),
}


def real_shape(spec: str) -> RealShape | None:
    """``name`` or ``name:layers=N`` of a REAL_SHAPES entry; None for any other preset."""
    name, _, option = spec.partition(":")
    if name not in REAL_SHAPES:
        return None
    shape = REAL_SHAPES[name]
    if option:
        key, _, value = option.partition("=")
        if key != "layers" or not value.isdigit() or int(value) < 1:
            raise KeyError(f"model preset {spec!r}: the only option is ':layers=N' (N >= 1)")
        shape = replace(shape, layers=int(value))
    return shape


def real_model_config(shape: RealShape, tokenizer_size: int, eos_id: int, pad_id: int):
    """The HF config of a real shape, for a tokenizer of ``tokenizer_size`` ids (its first rows)."""
    from transformers import LlamaConfig, Qwen3Config

    if tokenizer_size > shape.vocab:
        raise ValueError(f"the tokenizer has {tokenizer_size} tokens, more than the model's vocabulary {shape.vocab}")
    common = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                  num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                  intermediate_size=shape.mlp, max_position_embeddings=shape.max_positions,
                  tie_word_embeddings=shape.tied, rms_norm_eps=shape.rms_eps, rope_theta=shape.rope_theta,
                  eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    if shape.family == "qwen3":
        return Qwen3Config(**common)
    scaling = {**dict(shape.rope_scaling), "rope_theta": shape.rope_theta}
    return LlamaConfig(**common, rope_scaling=scaling)
