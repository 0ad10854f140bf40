"""Analytic FLOP calculator for megaopd (the x-axis of every result: held-out accuracy vs training FLOPs).

Implements the conventions of ``docs/flops.md`` (``megaopd.run.flop_audit`` checks a real trainer step against them;
``megaopd.objectives.methods`` says which passes each method runs). In short (state them in every report):

* **1 multiply-accumulate = 2 FLOPs.** Backward = 2x forward, so a training pass = 3x forward.
* **Model FLOPs, not hardware FLOPs.** Only matmuls count: no activation-recompute forward (nor a teacher's
  recomputation: ``recompute_flops`` gives that hardware work, logged as ``perf/``), no optimizer, no
  elementwise ops (norms, RoPE, softmax, residuals), and the embedding lookup costs 0. The LM head (2*d*V FLOPs per
  position) is counted even when it is tied to the embedding, **at the positions whose logits are used**: in a
  teacher-forced pass over prompt + response (old-logprob, reference, teacher, training) the R positions that predict
  response tokens; in prefill the last prompt position. (A textbook count bills it at every position; megaopd's
  engines and HF policy project only where logits are used, as TRL and SGLang do, and the ledger bills what they
  run.)
* **A response of R tokens costs a prefill and R-1 decode forwards**: the prefill's logits give the first token, and
  the last sampled token is never fed back (a textbook count bills R decode steps; no engine runs the R-th).
* **Causal attention with the 1/2 discount** (current Megatron-LM convention) for teacher-forced forwards and for
  prefill: the score and value matmuls cost 2*L*nq*dh*S^2 instead of the full 4*L*nq*dh*S^2. verl does not halve;
  pass ``causal=False`` to get the un-discounted (dense-matmul) count, which is also what
  ``torch.utils.flop_counter.FlopCounterMode`` measures for eager attention. Decode steps have one query per step,
  so their attention cost is exact and has no discount. A sliding-window model (``ModelShape.window``) is counted so
  while no sequence exceeds its window; past it the formulas refuse (they would bill the keys the window skips).
* **Prefix-cached prefill by default**: with ``prefix_cached=True`` a prompt is prefilled once and its KV cache is
  shared by all samples of the group; with ``prefix_cached=False`` every sample prefills its own prompt.
* **Real token counts** (after truncation), never padded lengths: callers pass per-sample lengths.
* Dense decoder with GQA and (by default) a gated SwiGLU MLP. A mixture-of-experts config is refused
  (``ModelShape.from_hf_config``): its router and active experts are no dense MLP of ``intermediate_size``.

Formulas (L layers, d model width, nq/nkv query/key-value heads, dh head dim, dff MLP width, V vocab)::

    N_mm        = N_body + d*V,  N_body = L*(d*nq*dh + 2*d*nkv*dh + nq*dh*d + 3*d*dff)   (2*d*dff non-gated)
    F_fwd(S, h) = 2*N_body*S + 2*d*V*h + 2*L*nq*dh*S^2     (LM head at h positions; causal; 4*L*nq*dh*S^2 non-causal)
    F_score(P, R) = F_fwd(P + R, R)                         (teacher-forced pass reading the response's logits)
    F_train     = 3*F_fwd
    prefill     = F_fwd(P, 1)
    decode      = 2*N_mm*(R-1) + 4*L*nq*dh*((R-1)*P + (R-1)*R/2)   (fed-back token t = 1..R-1 attends to P+t keys)

Per step (``step_flops`` returns the components separately; ``megaopd.objectives.methods`` says which passes a method runs)::

    GRPO: gen + (1[old-logprob recompute] + 1[reference KL] + 3*epochs) * sum_i F_score_student(P_i, R_i)
    OPD:  gen_student + sum_i [F_score_teacher(P_i, R_i) + (1[recompute] + 3*epochs) * F_score_student(P_i, R_i)]

All functions are pure and return Python ints (exact integer arithmetic). No torch import.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Union

from megaopd.errors import ModelError

__all__ = [
    "COMPONENTS",
    "ModelShape",
    "HF_CONFIG",
    "read_hf_config",
    "attention_heads",
    "sliding_window",
    "forward_flops",
    "train_flops",
    "prefill_flops",
    "decode_flops",
    "generation_flops",
    "rollout_flops",
    "scoring_flops",
    "step_flops",
    "teacher_passes",
    "recompute_flops",
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
    window: int | None = None  # the sliding attention window of some layer (``sliding_window``); None: none has one

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ModelShape.{name} must be a positive int, got {v!r}")
        if self.window is not None and (not isinstance(self.window, int) or self.window <= 0):
            raise ValueError(f"ModelShape.window must be a positive int or None, got {self.window!r}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    @cached_property
    def body_params(self) -> int:
        """N_body: parameters that multiply per token in the decoder layers (attention projections and MLP)."""
        d, dh = self.d_model, self.head_dim
        attn = d * self.n_heads * dh + 2 * d * self.n_kv_heads * dh + self.n_heads * dh * d
        mlp = (3 if self.gated_mlp else 2) * d * self.d_ff
        return self.n_layers * (attn + mlp)

    @cached_property
    def head_params(self) -> int:
        """d*V: the LM head's parameters (counted even when tied to the embedding)."""
        return self.d_model * self.vocab_size

    @cached_property
    def matmul_params(self) -> int:
        """N_mm = N_body + d*V: parameters that multiply per token when the LM head runs at every position."""
        return self.body_params + self.head_params

    @cached_property
    def attn_width(self) -> int:
        """L*nq*dh, the coefficient of the sequence-length-squared attention terms."""
        return self.n_layers * self.n_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: Union[Mapping[str, Any], Any], gated_mlp: bool = True) -> "ModelShape":
        """Build from a transformers ``PretrainedConfig`` (Qwen3 / Qwen2 / Llama / Mistral kind) or a plain dict of
        the same keys (the contents of ``config.json``): the one reader of a model's shape (the memory plan's
        ``Arch`` and the launchers' head checks read it through here).

        Reads num_hidden_layers, hidden_size, num_attention_heads, num_key_value_heads (``attention_heads``),
        head_dim (default: hidden_size // num_attention_heads; Qwen3 sets it explicitly, e.g. 128 with hidden 2048
        and 16 heads), intermediate_size and vocab_size. The SwiGLU families listed are gated; pass
        ``gated_mlp=False`` for a plain 2-matrix MLP. A mixture-of-experts config is refused (``_refuse_experts``).
        """
        get = _config_getter(cfg)
        _refuse_experts(get)

        def req(key: str) -> int:
            v = get(key)
            if v is None:
                raise ValueError(f"config lacks required key {key!r}")
            return int(v)

        hidden = req("hidden_size")
        heads, kv_heads = attention_heads(cfg)
        if not heads:
            raise ValueError("config lacks required key 'num_attention_heads'")
        head_dim = get("head_dim")
        return cls(
            n_layers=req("num_hidden_layers"),
            d_model=hidden,
            n_heads=heads,
            n_kv_heads=kv_heads,
            head_dim=int(head_dim) if head_dim else hidden // heads,
            d_ff=req("intermediate_size"),
            vocab_size=req("vocab_size"),
            gated_mlp=gated_mlp,
            window=sliding_window(cfg),
        )


HF_CONFIG = "config.json"  # an HF model directory's architecture, what ``ModelShape.from_hf_config`` reads


def read_hf_config(model_dir: Union[str, Path]) -> dict:
    """The ``config.json`` of the HF model directory ``model_dir``, parsed: the one place a model's config is read
    (OSError where the file cannot be read, ValueError where it is not JSON)."""
    return json.loads((Path(model_dir) / HF_CONFIG).read_text())


def _config_getter(cfg: Union[Mapping[str, Any], Any]):
    """key -> value (None when absent) of an HF config object or dict; a multimodal config's language model is
    its ``text_config``."""
    if isinstance(cfg, Mapping):
        cfg = cfg.get("text_config") or cfg
        return lambda key: cfg.get(key)
    cfg = getattr(cfg, "text_config", None) or cfg
    return lambda key: getattr(cfg, key, None)


# The keys that give an HF config's expert count: Qwen2/3-MoE, Mixtral / OLMoE / PhiMoE, DeepSeek.
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _refuse_experts(get) -> None:
    """The formulas count one dense MLP of ``intermediate_size`` per layer: a mixture-of-experts model (a router and
    its active experts' MLPs, some layers dense) would be mis-billed, under or over, with no error, so it is refused."""
    experts = {key: get(key) for key in EXPERT_KEYS if get(key)}
    if experts:
        named = ", ".join(f"{key}={value}" for key, value in experts.items())
        raise ModelError(f"the model is a mixture of experts ({named}), which megaopd's FLOP ledger and memory plan do "
                         "not count (they assume one dense MLP per layer); use a dense model")


def sliding_window(cfg: Union[Mapping[str, Any], Any]) -> int | None:
    """The sliding attention window of an HF config (the most keys a query attends), None where every layer attends
    to all earlier tokens: windowed are the layers ``layer_types`` names so (Gemma 2 / 3), or without it every layer
    where ``sliding_window`` is set and ``use_sliding_window`` is not false (Mistral, Phi-3; Qwen2 / 3 name a window
    they do not use)."""
    get = _config_getter(cfg)
    window, layer_types = get("sliding_window"), get("layer_types")
    if not window:
        return None
    if layer_types:
        return int(window) if "sliding_attention" in layer_types else None
    return int(window) if get("use_sliding_window") is not False else None


def _within_window(shape: ModelShape, keys: int) -> None:
    """The formulas count full causal attention: a sliding-window model's exactly while no query attends more keys
    than its window; past it they would bill the keys it skips, so that is refused."""
    if shape.window is not None and keys > shape.window:
        raise ModelError(f"a sequence of {keys} tokens exceeds the model's sliding attention window of {shape.window} "
                         "tokens, and megaopd's FLOP ledger counts full causal attention (it would bill the keys the "
                         "window skips); keep prompt + rollout.max_new_tokens (plan.prompt_tokens: the prompt the plan "
                         f"assumes) within {shape.window} tokens, or use a model without a sliding window")


def attention_heads(cfg: Union[Mapping[str, Any], Any]) -> tuple[int, int]:
    """(query heads, KV heads) of an HF config (0 query heads where it names none): KV heads absent or null mean
    multi-head attention, as many as the query heads."""
    get = _config_getter(cfg)
    heads = int(get("num_attention_heads") or 0)
    return heads, int(get("num_key_value_heads") or heads)


def _nonneg(name: str, v: int) -> int:
    if isinstance(v, bool) or int(v) != v or v < 0:
        raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    return int(v)


def forward_flops(shape: ModelShape, seq_len: int, causal: bool = True, head_positions: int | None = None) -> int:
    """Teacher-forced forward of one sequence of ``seq_len`` real tokens, the LM head at ``head_positions`` of them
    (default: all): 2*N_body*S + 2*d*V*h + 2*L*nq*dh*S^2 (causal, halved) or + 4*L*nq*dh*S^2 (``causal=False``)."""
    s = _nonneg("seq_len", seq_len)
    h = s if head_positions is None else _nonneg("head_positions", head_positions)
    if h > s:
        raise ValueError(f"head_positions={h} exceeds seq_len={s}")
    _within_window(shape, s)
    attn = (2 if causal else 4) * shape.attn_width * s * s
    return 2 * shape.body_params * s + 2 * shape.head_params * h + attn


def train_flops(shape: ModelShape, seq_len: int, causal: bool = True, head_positions: int | None = None) -> int:
    """Forward + backward of one sequence: 3 * forward_flops."""
    return 3 * forward_flops(shape, seq_len, causal, head_positions)


def prefill_flops(shape: ModelShape, prompt_len: int, causal: bool = True) -> int:
    """Prefill of one prompt: a forward of the prompt with the LM head at its last position (the first token's
    logits)."""
    return forward_flops(shape, prompt_len, causal, head_positions=min(1, _nonneg("prompt_len", prompt_len)))


def decode_flops(shape: ModelShape, prompt_len: int, response_len: int) -> int:
    """KV-cache decode of a ``response_len``-token response after a prompt of ``prompt_len``: R-1 single-token
    forwards, 2*N_mm*(R-1) + 4*L*nq*dh*((R-1)*P + (R-1)*R/2). Fed-back token t (1..R-1) attends to P+t keys; the
    prefill gave token 1 and the last token is never fed back."""
    p = _nonneg("prompt_len", prompt_len)
    steps = max(_nonneg("response_len", response_len) - 1, 0)
    _within_window(shape, p + steps)  # the last token fed back attends to P + R - 1 keys
    return 2 * shape.matmul_params * steps + 4 * shape.attn_width * (steps * p + steps * (steps + 1) // 2)


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


def scoring_flops(
    shape: ModelShape,
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    group_size: int,
    causal: bool = True,
    shared_prompt: bool = False,
) -> int:
    """Teacher-forced passes over every sample that read its response logits (old-logprob, reference, teacher
    scoring, and one third of training): sum_i F_fwd(P_i + R_i, head at R_i positions). Samples are grouped
    consecutively, ``group_size`` per prompt.

    ``shared_prompt``: each group's prompt forwarded once (``train.shared_prompt``, docs/shared_prompt.md): per group
    the prompt's forward without the LM head, and per sample its R tokens through the body and the LM head, attending
    to the P prompt keys and causally to its own: F_fwd(P, 0) + sum_i [F_fwd(R_i, R_i) + 4*L*nq*dh*P*R_i]. Causal,
    that is the unshared passes less (samples - 1) * F_fwd(P, 0) per group; dense (``causal=False``, what eager
    attention executes) it also drops the P x R block of scores the unshared pass computes and masks."""
    _check_groups(prompt_lens, response_lens, group_size)
    total = 0
    for k, p in enumerate(prompt_lens):
        p = _nonneg("prompt_len", p)
        total += forward_flops(shape, p, causal, head_positions=0) if shared_prompt else 0
        for r in response_lens[k * group_size:(k + 1) * group_size]:
            r = _nonneg("response_len", r)
            _within_window(shape, p + r)
            total += forward_flops(shape, r, causal) + 4 * shape.attn_width * p * r if shared_prompt \
                else forward_flops(shape, p + r, causal, head_positions=r)
    return total


def teacher_passes(form: str, epochs: int, recompute: bool = False) -> int:
    """Teacher forwards per sample that one OPD step runs: 1 in every form. The full-vocabulary form keeps that
    forward's response rows (the output layer's input, [N x H], H << V) for the step and projects them again chunk by
    chunk in the update. Only where the memory plan cannot keep them (``plan.Plan.teacher_recompute``) does it run the
    teacher again per micro-batch and epoch: 1 + epochs. The ledger bills one pass in every case (model FLOPs); the
    rest is hardware work (``recompute_flops``), like activation recomputation. Each pass reads the response rows
    only: on SGLang with ``logprob_start_len = prompt length - 1``, so the server's LM head runs over the R response
    rows, as billed."""
    return 1 + (_nonneg("epochs", epochs) if recompute and form == "full_vocab" else 0)


def recompute_flops(shape: ModelShape, head_rows: int, seq_lens: Sequence[int], causal: bool = True) -> int:
    """Hardware FLOPs a teacher spends beyond its one billed pass: its LM head over ``head_rows`` rows projected again
    (per epoch in the update, and once more where a checkpointed chunk is recomputed in the backward) and, under
    forced recomputation, the body of one more forward over each sequence of ``seq_lens`` real tokens."""
    return 2 * shape.head_params * _nonneg("head_rows", head_rows) + sum(
        forward_flops(shape, s, causal, head_positions=0) for s in seq_lens)


Lengths = tuple[Sequence[int], Sequence[int]]  # (one real prompt length per prompt, one response length per sample)


def step_flops(
    student: ModelShape,
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    group_size: int,
    generate: bool = True,
    recompute_old: bool = True,
    use_reference: bool = False,
    epochs: int = 1,
    teachers: Union[ModelShape, Sequence[ModelShape], None] = None,
    teacher_lens: Lengths | None = None,
    prefix_cached: bool = True,
    causal: bool = True,
    shared_prompt: bool = False,
) -> dict[str, int]:
    """FLOPs of one training step by component, each from its one formula: ``rollout`` (``generate``: the samples
    generated, else 0), ``old_logprob`` (one student scoring pass when ``recompute_old``), ``reference`` (one when
    ``use_reference``), ``teacher`` (one pass of each sample's teacher in every OPD form: ``teacher_passes``) and
    ``train`` (3 x ``epochs`` scoring passes). The step total is ``sum(result.values())``. ``shared_prompt``: the
    student's passes with each group's prompt forwarded once (``scoring_flops``'s: the work executed, where
    the ledger bills the unshared passes, docs/flops.md).

    prompt_lens: one real prompt length per prompt; response_lens: one real response length per sample, grouped
    consecutively (``group_size`` samples per prompt). ``teachers``: None (no teacher term), one shape, or one
    (routed) shape per prompt. ``teacher_lens``: the same lengths in the teachers' own tokens (a teacher with
    another tokenizer scores its own tokenisation of the prompt and response); default the student's.
    """
    fwd = scoring_flops(student, prompt_lens, response_lens, group_size, causal, shared_prompt)
    if teachers is None:
        teach = 0
    else:
        t_prompts, t_responses = teacher_lens or (prompt_lens, response_lens)
        routed = [teachers] * len(t_prompts) if isinstance(teachers, ModelShape) else list(teachers)
        if len(routed) != len(t_prompts):
            raise ValueError(f"{len(routed)} teacher shapes for {len(t_prompts)} prompts")
        g = group_size
        teach = sum(scoring_flops(t, [p], t_responses[k * g:(k + 1) * g], g, causal)
                    for k, (t, p) in enumerate(zip(routed, t_prompts)))
    return {
        "rollout": rollout_flops(student, prompt_lens, response_lens, group_size, prefix_cached, causal)
        if generate else 0,
        "old_logprob": fwd if recompute_old else 0,
        "reference": fwd if use_reference else 0,
        "teacher": teach,
        "train": 3 * _nonneg("epochs", epochs) * fwd,
    }
