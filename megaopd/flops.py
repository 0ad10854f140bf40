"""Analytic FLOP calculator for megaopd (the x-axis of every result: held-out accuracy vs training FLOPs).

Implements ``shared/reference/flops.md`` exactly. Conventions (state them in every report):

* **1 multiply-accumulate = 2 FLOPs.** Backward = 2x forward, so a training pass = 3x forward.
* **Model FLOPs, not hardware FLOPs.** Only matmuls count: no activation-recompute forward, no optimizer, no
  elementwise ops (norms, RoPE, softmax, residuals), and the embedding lookup costs 0. The LM head (2*d*V FLOPs per
  token) *is* counted, for every token of every forward, even when it is tied to the embedding.
* **Causal attention with the 1/2 discount** (current Megatron-LM convention) for teacher-forced forwards and for
  prefill: the score and value matmuls cost 2*L*nq*dh*S^2 instead of the full 4*L*nq*dh*S^2. verl does not halve;
  pass ``causal=False`` to get the un-discounted (dense-matmul) count, which is also what
  ``torch.utils.flop_counter.FlopCounterMode`` measures for eager attention. Decode steps have one query per step,
  so their attention cost is exact and has no discount.
* **Prefix-cached prefill by default**: with ``prefix_cached=True`` a prompt is prefilled once and its KV cache is
  shared by all samples of the group; with ``prefix_cached=False`` every sample prefills its own prompt.
* **Real token counts** (after truncation), never padded lengths: callers pass per-sample lengths.
* Dense decoder with GQA and (by default) a gated SwiGLU MLP. For MoE, build a ``ModelShape`` from the active
  experts' width.

Formulas (L layers, d model width, nq/nkv query/key-value heads, dh head dim, dff MLP width, V vocab)::

    N_mm      = L*(d*nq*dh + 2*d*nkv*dh + nq*dh*d + 3*d*dff) + d*V      (2*d*dff for a non-gated MLP)
    F_fwd(S)  = 2*N_mm*S + 2*L*nq*dh*S^2                               (causal; 4*L*nq*dh*S^2 non-causal)
    F_train   = 3*F_fwd
    prefill   = F_fwd(P)
    decode    = 2*N_mm*R + 4*L*nq*dh*(R*P + R*(R+1)/2)                   (step t attends to P+t keys, t=1..R)

Per step (``grpo_step_flops`` / ``opd_step_flops`` return the components separately)::

    GRPO: gen + (1[old-logprob recompute] + 1[reference KL] + 3*epochs) * sum_i F_fwd_student(S_i)
    OPD:  gen_student + sum_i [F_fwd_teacher(S_i) + (1[recompute] + 3*epochs) * F_fwd_student(S_i)]

All functions are pure and return Python ints (exact integer arithmetic). No torch import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

__all__ = [
    "COMPONENTS",
    "ModelShape",
    "forward_flops",
    "train_flops",
    "prefill_flops",
    "decode_flops",
    "generation_flops",
    "rollout_flops",
    "sequence_lengths",
    "sum_forward_flops",
    "teacher_forward_flops",
    "grpo_step_flops",
    "opd_step_flops",
]

#: Keys of the per-step component dicts, in ledger order. ``sum(d.values())`` is the step total.
COMPONENTS = ("rollout", "old_logprob", "reference", "teacher", "train")


@dataclass(frozen=True)
class ModelShape:
    """Shape of a dense decoder-only transformer, as far as matmul FLOPs are concerned."""

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    gated_mlp: bool = True

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ModelShape.{name} must be a positive int, got {v!r}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    @property
    def matmul_params(self) -> int:
        """N_mm: parameters that multiply per token, including the LM head d*V (counted even when tied)."""
        d, dh = self.d_model, self.head_dim
        attn = d * self.n_heads * dh + 2 * d * self.n_kv_heads * dh + self.n_heads * dh * d
        mlp = (3 if self.gated_mlp else 2) * d * self.d_ff
        return self.n_layers * (attn + mlp) + d * self.vocab_size

    @property
    def attn_width(self) -> int:
        """L*nq*dh, the coefficient of the sequence-length-squared attention terms."""
        return self.n_layers * self.n_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: Union[Mapping[str, Any], Any], gated_mlp: bool = True) -> "ModelShape":
        """Build from a transformers ``PretrainedConfig`` (Qwen3 / Qwen2 / Llama / Mistral kind) or a plain dict of
        the same keys (the contents of ``config.json``).

        Reads num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads (default: attention heads),
        head_dim (default: hidden_size // num_attention_heads; Qwen3 sets it explicitly, e.g. 128 with hidden 2048
        and 16 heads), intermediate_size and vocab_size. The SwiGLU families listed are gated; pass
        ``gated_mlp=False`` for a plain 2-matrix MLP.
        """
        if isinstance(cfg, Mapping):
            get = cfg.get
        else:
            def get(key: str, default: Any = None) -> Any:
                return getattr(cfg, key, default)

        def req(key: str) -> int:
            v = get(key, None)
            if v is None:
                raise ValueError(f"config lacks required key {key!r}")
            return int(v)

        hidden = req("hidden_size")
        heads = req("num_attention_heads")
        kv = get("num_key_value_heads", None)
        head_dim = get("head_dim", None)
        return cls(
            n_layers=req("num_hidden_layers"),
            d_model=hidden,
            n_heads=heads,
            n_kv_heads=int(kv) if kv is not None else heads,
            head_dim=int(head_dim) if head_dim is not None else hidden // heads,
            d_ff=req("intermediate_size"),
            vocab_size=req("vocab_size"),
            gated_mlp=gated_mlp,
        )


def _nonneg(name: str, v: int) -> int:
    if isinstance(v, bool) or int(v) != v or v < 0:
        raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    return int(v)


def forward_flops(shape: ModelShape, seq_len: int, causal: bool = True) -> int:
    """Teacher-forced forward of one sequence of ``seq_len`` real tokens:
    2*N_mm*S + 2*L*nq*dh*S^2 (causal, halved) or 2*N_mm*S + 4*L*nq*dh*S^2 (``causal=False``)."""
    s = _nonneg("seq_len", seq_len)
    attn = (2 if causal else 4) * shape.attn_width * s * s
    return 2 * shape.matmul_params * s + attn


def train_flops(shape: ModelShape, seq_len: int, causal: bool = True) -> int:
    """Forward + backward of one sequence: 3 * forward_flops."""
    return 3 * forward_flops(shape, seq_len, causal)


def prefill_flops(shape: ModelShape, prompt_len: int, causal: bool = True) -> int:
    """Prefill of one prompt (a teacher-forced forward of the prompt, LM head on every prompt position)."""
    return forward_flops(shape, prompt_len, causal)


def decode_flops(shape: ModelShape, prompt_len: int, response_len: int) -> int:
    """KV-cache decode of ``response_len`` tokens after a prompt of ``prompt_len``:
    2*N_mm*R + 4*L*nq*dh*(R*P + R*(R+1)/2). Step t (1..R) processes one token attending to P+t keys."""
    p = _nonneg("prompt_len", prompt_len)
    r = _nonneg("response_len", response_len)
    return 2 * shape.matmul_params * r + 4 * shape.attn_width * (r * p + r * (r + 1) // 2)


def generation_flops(
    shape: ModelShape,
    prompt_len: int,
    response_len: Union[int, Sequence[int]],
    samples: int = 1,
    prefix_cached: bool = True,
    causal: bool = True,
) -> int:
    """Generation for one prompt: prefill + decode of every sample.

    ``response_len`` is either one int (used for all ``samples``) or a sequence with one real length per sample (then
    ``samples`` must be 1 or equal to its length). Prefill is billed once when ``prefix_cached`` (shared KV cache),
    else once per sample. ``causal`` applies to the prefill only (decode is exact).
    """
    if isinstance(response_len, Sequence):
        lens = [_nonneg("response_len", r) for r in response_len]
        if samples not in (1, len(lens)):
            raise ValueError(f"samples={samples} but {len(lens)} response lengths given")
    else:
        lens = [_nonneg("response_len", response_len)] * _nonneg("samples", samples)
    pre = prefill_flops(shape, prompt_len, causal)
    n_prefill = (1 if lens else 0) if prefix_cached else len(lens)
    return n_prefill * pre + sum(decode_flops(shape, prompt_len, r) for r in lens)


def _check_groups(prompt_lens: Sequence[int], response_lens: Sequence[int], group_size: int) -> None:
    g = _nonneg("group_size", group_size)
    if g == 0:
        raise ValueError("group_size must be >= 1")
    if len(response_lens) != len(prompt_lens) * g:
        raise ValueError(
            f"expected len(response_lens) == len(prompt_lens) * group_size = {len(prompt_lens)}*{g}, "
            f"got {len(response_lens)}"
        )


def sequence_lengths(prompt_lens: Sequence[int], response_lens: Sequence[int], group_size: int) -> list[int]:
    """Per-sample S_i = P_prompt(i) + R_i, with samples grouped consecutively, ``group_size`` per prompt."""
    _check_groups(prompt_lens, response_lens, group_size)
    return [
        _nonneg("prompt_len", prompt_lens[i // group_size]) + _nonneg("response_len", r)
        for i, r in enumerate(response_lens)
    ]


def rollout_flops(
    shape: ModelShape,
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    group_size: int,
    prefix_cached: bool = True,
    causal: bool = True,
) -> int:
    """Generation FLOPs of a batch: one ``generation_flops`` per prompt over its group of samples."""
    _check_groups(prompt_lens, response_lens, group_size)
    return sum(
        generation_flops(shape, p, list(response_lens[k * group_size:(k + 1) * group_size]),
                         prefix_cached=prefix_cached, causal=causal)
        for k, p in enumerate(prompt_lens)
    )


def sum_forward_flops(shape: ModelShape, seq_lens: Sequence[int], causal: bool = True) -> int:
    """sum_i F_fwd(S_i) over full sequences (prompt + response) of real lengths ``seq_lens``."""
    return sum(forward_flops(shape, s, causal) for s in seq_lens)


def teacher_forward_flops(
    teacher: ModelShape,
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    group_size: int,
    causal: bool = True,
) -> int:
    """Teacher forward (scoring) FLOPs of these sequences: sum_i F_fwd_teacher(P_i + R_i).

    For multi-teacher routing, call it once per routed group (or per routed sub-batch) with that teacher's shape
    and sum, or use ``sum_forward_flops`` on explicit sequence lengths.
    """
    return sum_forward_flops(teacher, sequence_lengths(prompt_lens, response_lens, group_size), causal)


def grpo_step_flops(
    shape: ModelShape,
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    group_size: int,
    recompute_old: bool = True,
    use_reference: bool = True,
    epochs: int = 1,
    prefix_cached: bool = True,
    causal: bool = True,
) -> dict[str, int]:
    """FLOPs of one GRPO step, by component.

    prompt_lens: one real prompt length per prompt; response_lens: one real response length per sample, grouped
    consecutively (``group_size`` samples per prompt). Returns {"rollout", "old_logprob", "reference", "teacher"
    (always 0), "train"}; the step total is ``sum(result.values())``.
    """
    seqs = sequence_lengths(prompt_lens, response_lens, group_size)
    fwd = sum_forward_flops(shape, seqs, causal)
    return {
        "rollout": rollout_flops(shape, prompt_lens, response_lens, group_size, prefix_cached, causal),
        "old_logprob": fwd if recompute_old else 0,
        "reference": fwd if use_reference else 0,
        "teacher": 0,
        "train": 3 * _nonneg("epochs", epochs) * fwd,
    }


def opd_step_flops(
    student: ModelShape,
    teacher: Union[ModelShape, Sequence[ModelShape], None],
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    samples_per_prompt: int,
    recompute_old: bool = True,
    epochs: int = 1,
    prefix_cached: bool = True,
    causal: bool = True,
) -> dict[str, int]:
    """FLOPs of one on-policy-distillation step, by component.

    ``teacher`` is one ``ModelShape``, or a sequence with one (routed) teacher shape per prompt, or None when the
    caller bills the teacher itself (e.g. with ``teacher_forward_flops`` per routed group); then "teacher" is 0.
    Lengths as in ``grpo_step_flops``. Returns {"rollout", "old_logprob", "reference" (always 0), "teacher",
    "train"}; the step total is ``sum(result.values())``.
    """
    g = samples_per_prompt
    seqs = sequence_lengths(prompt_lens, response_lens, g)
    fwd = sum_forward_flops(student, seqs, causal)
    if teacher is None:
        teach = 0
    elif isinstance(teacher, ModelShape):
        teach = sum_forward_flops(teacher, seqs, causal)
    else:
        if len(teacher) != len(prompt_lens):
            raise ValueError(f"{len(teacher)} teacher shapes for {len(prompt_lens)} prompts")
        teach = sum(sum_forward_flops(t, seqs[k * g:(k + 1) * g], causal) for k, t in enumerate(teacher))
    return {
        "rollout": rollout_flops(student, prompt_lens, response_lens, g, prefix_cached, causal),
        "old_logprob": fwd if recompute_old else 0,
        "reference": 0,
        "teacher": teach,
        "train": 3 * _nonneg("epochs", epochs) * fwd,
    }
