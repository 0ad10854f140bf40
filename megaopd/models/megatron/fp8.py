"""Precision: bf16/fp32 as model.dtype says, FP8 through Transformer Engine when model.megatron.fp8 asks for it.

FP8 needs both TE and a GPU; without either the run stops before building anything, saying what is missing.
"""

from __future__ import annotations

import importlib.util

import torch

TE_INSTALL = ("install Transformer Engine (`pip install --no-build-isolation 'transformer_engine[pytorch]'`, "
              "or use an NGC PyTorch container, which ships it)")


def have_te() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available()


def use_te_spec(mcfg) -> bool:
    """The TE layer spec when asked for and available; megatron's local spec otherwise (CPU, no TE)."""
    return bool(mcfg.transformer_engine) and have_te()


def fp8_overrides(mcfg) -> dict:
    """TransformerConfig fields for the configured FP8 recipe; raises before any model is built if it cannot run."""
    if mcfg.fp8 == "none":
        return {}
    missing = []
    if not torch.cuda.is_available():
        missing.append("a CUDA GPU (FP8 matmuls need Hopper or newer, e.g. H100/H200)")
    if importlib.util.find_spec("transformer_engine") is None:
        missing.append(f"Transformer Engine: {TE_INSTALL}")
    if not mcfg.transformer_engine:
        missing.append("the TE layer spec: set model.megatron.transformer_engine=true")
    if missing:
        raise RuntimeError(f"model.megatron.fp8={mcfg.fp8} needs " + "; and ".join(missing)
                           + ". Or train in bf16 with model.megatron.fp8=none.")
    # Delayed scaling (per-tensor amax history) works on every FP8-capable GPU generation.
    return dict(fp8=mcfg.fp8, fp8_recipe="delayed", fp8_margin=0, fp8_amax_history_len=1024,
                fp8_amax_compute_algo="max")
