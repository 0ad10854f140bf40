"""A GRPO group's prompt forwarded once (``train.shared_prompt``): the layout both backends run, the HF attention
over it, and when the switch cannot apply. docs/shared_prompt.md is the design.

The rows of a micro-batch (prompt + response, right-padded: ``batch.collate``'s layout) become one flat sequence of
T tokens: each group's prompt once, padded to the longest prompt (Pp), then each sample's response, padded to the
longest response (Rp)::

    [ prompt_0 | ... | prompt_{G-1} | response_0 | ... | response_{b-1} ]      T = G*Pp + b*Rp
      G x Pp                          b x Rp

A group is a run of consecutive rows with equal prompt tokens (the samples of one prompt). Response token t of a
sample whose prompt has P tokens sits at position P + t, as in its own row. The model's body (projections, MLP,
norms) runs on the T tokens; attention runs per segment through the backend's own kernel: each prompt causally over
itself, each response over its prompt's keys and values (the same tensors for every sample of the group, so autograd
sums their gradients) and causally over its own. The hidden state that predicts a response's first token is the
prompt's last one, shared by the group.

    groups = PromptGroups.of(batch.input_ids, batch.attention_mask, batch.response_mask, pad_id)  # None: no sharing
    hidden_flat[groups.source]   # [b, S, H]: each row position's hidden state, as the row's own forward gives it
"""

from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from megaopd.accounting.flops import HF_CONFIG

log = logging.getLogger(__name__)

KWARG = "megaopd_prompt_groups"  # the model forward's keyword that carries the layout down to the attention


@dataclass
class PromptGroups:
    input_ids: torch.Tensor  # [T] long: the flat sequence
    positions: torch.Tensor  # [T] long: each token's position in its own row
    group_of: torch.Tensor  # [b] long: each sample's group
    prompt_lens: torch.Tensor  # [G] long
    response_lens: torch.Tensor  # [b] long
    prompt_width: int  # Pp
    response_width: int  # Rp
    # [b, S] long: where each position of the rows sits in the flat sequence (a group's prompt for prompt positions;
    # 0 for padding, which nothing reads)
    source: torch.Tensor
    group_size: int  # samples in every group where all groups have as many (a GRPO batch), else 0

    @classmethod
    def of(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
           pad_id: int, always: bool = False) -> "PromptGroups | None":
        """The layout of right-padded rows, or None where the rows are not right-padded, or where no two
        consecutive rows share a prompt (nothing to save) unless ``always`` (a backend whose micro-batches must all
        take one form). A row without response tokens is its own group, all prompt."""
        found = group_rows(input_ids, attention_mask, response_mask)
        if found is None:
            return None
        group_of, prompt_lens, response_lens = found
        ids, (rows, width) = input_ids, input_ids.shape
        if int(group_of[-1]) + 1 == rows and not always:  # every row its own group
            return None
        column = torch.arange(width, device=ids.device)
        first = torch.cat([group_of.new_ones(1, dtype=torch.bool), group_of[1:] != group_of[:-1]]).nonzero()[:, 0]
        group_prompts = prompt_lens[first]
        groups, pp, rp = len(first), max(int(group_prompts.max()), 1), max(int(response_lens.max()), 1)

        prompt_cols = torch.arange(pp, device=ids.device)
        prompt_tokens = torch.where(prompt_cols < group_prompts[:, None], ids[first][:, :pp], pad_id)
        response_cols = torch.arange(rp, device=ids.device)
        at = (prompt_lens[:, None] + response_cols).clamp(max=width - 1)
        response_tokens = torch.where(response_cols < response_lens[:, None], ids.gather(1, at), pad_id)
        flat = torch.cat([prompt_tokens.flatten(), response_tokens.flatten()])
        positions = torch.cat([prompt_cols.expand(groups, pp).flatten(),
                               (prompt_lens[:, None] + response_cols).flatten()])

        in_prompt = column < prompt_lens[:, None]
        in_response = (column >= prompt_lens[:, None]) & (column < (prompt_lens + response_lens)[:, None])
        sample = torch.arange(rows, device=ids.device)[:, None]
        source = torch.where(in_prompt, group_of[:, None] * pp + column, 0)
        source = torch.where(in_response, groups * pp + sample * rp + column - prompt_lens[:, None], source)
        sizes = torch.bincount(group_of)
        group_size = int(sizes[0]) if bool((sizes == sizes[0]).all()) else 0
        return cls(flat, positions, group_of, group_prompts, response_lens, pp, rp, source, group_size)

    @property
    def groups(self) -> int:
        return len(self.prompt_lens)

    @property
    def samples(self) -> int:
        return len(self.group_of)

    @property
    def length(self) -> int:
        return len(self.input_ids)

    def sizes(self) -> list[tuple[int, list[int]]]:
        """(prompt length, its samples' response lengths) of each group: what ``saved_flops`` counts."""
        sizes = [(p, []) for p in self.prompt_lens.tolist()]
        for group, r in zip(self.group_of.tolist(), self.response_lens.tolist()):
            sizes[group][1].append(r)
        return sizes

    def to(self, device: torch.device | str) -> "PromptGroups":
        return PromptGroups(**{name: value.to(device) if isinstance(value, torch.Tensor) else value
                               for name, value in self.__dict__.items()})

    def response_visible(self) -> torch.Tensor:
        """[b, 1, Rp, Pp + Rp] bool, True where a response's query attends: its prompt's real tokens, then its own
        tokens causally (padding queries see the prompt too: no row is empty)."""
        prompt = torch.arange(self.prompt_width, device=self.group_of.device) < self.prompt_lens[self.group_of, None]
        own = torch.ones(self.response_width, self.response_width, dtype=torch.bool, device=prompt.device).tril()
        return torch.cat([prompt[:, None, :].expand(-1, self.response_width, -1),
                          own.expand(self.samples, -1, -1)], -1)[:, None]

    def split(self, x: torch.Tensor, seq_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A flat tensor (T along ``seq_dim``, a batch of one beside it) as (prompts [G, Pp, ...], responses
        [b, Rp, ...]); the other dimensions follow in their order, the batch of one dropped."""
        x = x.movedim(seq_dim, 0)[:, 0]
        cut = self.groups * self.prompt_width
        return (x[:cut].unflatten(0, (self.groups, self.prompt_width)),
                x[cut:cut + self.samples * self.response_width].unflatten(0, (self.samples, self.response_width)))

    def spans(self) -> list[tuple[int, int, int, int]]:
        """(group, its first sample, the sample after its last, its prompt length) of each group."""
        ends = torch.bincount(self.group_of, minlength=self.groups).cumsum(0).tolist()
        return [(g, start, end, length) for g, (start, end, length)
                in enumerate(zip([0, *ends[:-1]], ends, self.prompt_lens.tolist()))]

    def response_keys(self, prompt: torch.Tensor, own: torch.Tensor, batch_dim: int, seq_dim: int,
                      span: tuple[int, int, int, int] | None = None) -> torch.Tensor:
        """Each response's keys (or values): its group's prompt's, then its own, along ``seq_dim``. With a ``span``
        (``spans``): that group's samples only (``own`` is theirs), its prompt cut to its real tokens."""
        if span is None:
            return torch.cat([self._per_sample(prompt, batch_dim), own], seq_dim)
        group, _, _, length = span
        part = prompt.narrow(batch_dim, group, 1).narrow(seq_dim, 0, length)
        sizes = list(part.shape)
        sizes[batch_dim] = own.shape[batch_dim]
        return torch.cat([part.expand(sizes), own], seq_dim)

    def _per_sample(self, prompt: torch.Tensor, batch_dim: int) -> torch.Tensor:
        """A per-group tensor repeated for each sample of its group: by index, or where every group has as many
        samples (a GRPO batch) by ``_RepeatPerGroup``, whose backward gives the same sums without the gather's."""
        if not self.group_size:
            return prompt.index_select(batch_dim, self.group_of)
        return _RepeatPerGroup.apply(prompt, batch_dim, self.group_size)

    def join(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """(prompts [G, Pp, ...], responses [b, Rp, ...]) back to the flat [T, ...]."""
        return torch.cat([prompts.flatten(0, 1), responses.flatten(0, 1)])


class _RepeatPerGroup(torch.autograd.Function):
    """Each slice of ``dim`` repeated ``size`` times in a row, as ``index_select`` by ``arange(G).repeat_interleave``.
    The gather's backward scatter-adds the gradient one row at a time (the GRPO bench's update: ~1.3 ms in each of 2
    layers on CPU); this one adds each group's sample slices in sample order onto zeros, the order and rounding of the
    gather's backward, in ``size`` vector adds (a sum over the group, which orders its additions its own way, would
    move the shared-prompt run off the gather's numbers)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
        ctx.dim, ctx.size = dim, size
        sizes = list(x.shape)
        sizes.insert(dim + 1, size)
        return x.unsqueeze(dim + 1).expand(sizes).flatten(dim, dim + 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        per_sample = grad.unflatten(ctx.dim, (-1, ctx.size))
        total = torch.zeros_like(per_sample.select(ctx.dim + 1, 0))
        for i in range(ctx.size):
            total += per_sample.select(ctx.dim + 1, i)
        return total, None, None


def group_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor):
    """(each row's group [b], its prompt length [b], its response length [b]) of right-padded rows (None if they are
    not): a group is a run of consecutive rows with the same prompt tokens and a response each."""
    ids, mask = input_ids, attention_mask.bool()
    if not len(ids) or not bool((mask[:, 1:] <= mask[:, :-1]).all()):
        return None
    response = response_mask.bool()
    has_response = response.any(1)
    # The prompt ends where the response starts: target position P-1 scores the response's first token.
    prompt_lens = torch.where(has_response, response.int().argmax(1) + 1, mask.sum(1))
    column = torch.arange(ids.shape[1], device=ids.device)
    same_tokens = ((ids[1:] == ids[:-1]) | (column >= prompt_lens[1:, None])).all(1)
    same = same_tokens & (prompt_lens[1:] == prompt_lens[:-1]) & has_response[1:] & has_response[:-1]
    group_of = torch.cat([same.new_ones(1), ~same]).long().cumsum(0) - 1
    return group_of, prompt_lens, response.sum(1)


def saved_flops(shape, ran: list[tuple[int, list[int], int]], causal: bool = True) -> int:
    """The FLOPs shared-prompt passes did not run: for each group (prompt length, response lengths, passes: 1 for a
    forward, 3 with its backward) as it ran, its unshared passes less its shared ones (``flops.scoring_flops``)."""
    from megaopd.accounting.flops import scoring_flops

    return sum(passes * (scoring_flops(shape, [p], r, len(r), causal)
                         - scoring_flops(shape, [p], r, len(r), causal, shared_prompt=True)) for p, r, passes in ran)


# ---- the HF backend: attention through transformers' AttentionInterface ----
NAME = "megaopd_shared_prompt"


# Where SDPA takes the responses one maskless call per group: a GPU's (FlashAttention, ``_sdpa_responses``). The CPU's
# kernels take a mask either way, so there one masked call over every response does the same in fewer calls (the
# GRPO bench's update 0.117-0.124 -> 0.100-0.114 s: docs/benchmarks.md).
PER_GROUP_DEVICES = ("cuda",)


@dataclass
class _Routed:
    groups: PromptGroups
    base: object  # the model's own attention function (sdpa, eager, ...), called per segment
    prompt_mask: torch.Tensor | None  # additive [1, 1, Pp, Pp] causal; None: the function is causal without one
    # How the responses attend. SDPA (``sdpa``: called directly, ``_sdpa_responses``): where it runs per group
    # (PER_GROUP_DEVICES) ``spans`` (``PromptGroups.spans``) and no mask, elsewhere one call with ``response_mask``,
    # additive [b, 1, Rp, Pp + Rp] (``response_visible``), one tensor for every layer. Other functions: the same
    # batch through the function with that mask.
    sdpa: bool
    spans: list[tuple[int, int, int, int]] | None
    response_mask: torch.Tensor | None


def _segment_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention call over the flat sequence ([1, heads, T, d] each): the prompts and the responses as
    two batches through the model's own attention function (SDPA: ``_sdpa_responses``)."""
    routed: _Routed = kwargs.pop(KWARG)
    groups, base = routed.groups, routed.base
    if kwargs.get("sliding_window") is not None:
        raise ValueError("train.shared_prompt cannot express sliding-window attention")
    (qp, qr), (kp, kr), (vp, vr) = (tuple(part.movedim(1, 2) for part in groups.split(x, 2))
                                    for x in (query, key, value))  # [G, h, Pp, d], [b, h, Rp, d]
    prompt_out, _ = base(module, qp, kp, vp, routed.prompt_mask, **kwargs)
    if routed.sdpa:
        response_out = _sdpa_responses(groups, routed, qr, (kp, kr), (vp, vr), kwargs.get("dropout", 0.0),
                                       kwargs.get("scaling"))
    else:
        response_out, _ = base(module, qr, groups.response_keys(kp, kr, 0, 2), groups.response_keys(vp, vr, 0, 2),
                               routed.response_mask, **kwargs)
    return groups.join(prompt_out, response_out)[None], None  # [1, T, h, d]: what the attention functions return


def _sdpa_responses(groups: PromptGroups, routed: _Routed, query, keys, values, dropout: float,
                    scale: float | None):
    """The responses' attention through SDPA, KV heads not repeated (``enable_gqa``): each response's queries
    [h, Rp, d] over its prompt's keys then its own. Per group (``routed.spans``): its samples' queries over their
    prompt's real keys, causal aligned to the end (``causal_lower_right``: query t sees the prompt and its own first
    t + 1 keys), no mask, so SDPA may run FlashAttention on a GPU (torch's lower-right causal dispatch), as for the
    unshared rows' causal call; a mask (the prompt's padding) would send it to a kernel over the whole rectangle.
    Else one call with the boolean mask. Returns [b, Rp, h, d], the layout the attention functions return."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if routed.spans is None:
        k, v = groups.response_keys(*keys, 0, 2), groups.response_keys(*values, 0, 2)
        return sdpa(query, k, v, attn_mask=routed.response_mask, dropout_p=dropout, scale=scale,
                    enable_gqa=True).transpose(1, 2)
    outs = []
    for span in routed.spans:
        _, first, end, _ = span
        k = groups.response_keys(keys[0], keys[1][first:end], 0, 2, span)
        v = groups.response_keys(values[0], values[1][first:end], 0, 2, span)
        outs.append(sdpa(query[first:end], k, v, attn_mask=_causal_to_the_end(query.shape[2], k.shape[2],
                                                                             query.device),
                         dropout_p=dropout, scale=scale, enable_gqa=True))
    return torch.cat(outs).transpose(1, 2)


def _causal_to_the_end(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """Query t sees keys [0, keys - queries + t]: torch's ``causal_lower_right``, which lets SDPA pick its maskless
    kernels. Under a TorchDispatchMode (a FLOP counter, a memory probe) that tensor subclass cannot be made, and the
    boolean mask it stands for goes instead (what SDPA builds from it on CPU anyway)."""
    from torch.nn.attention.bias import causal_lower_right

    try:
        return causal_lower_right(queries, keys)
    except RuntimeError:  # "Creating a new Tensor subclass CausalBias but the raw Tensor ... is already associated"
        return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as the additive form every HF attention function takes (eager adds it, SDPA too)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible,
                                                                                       torch.finfo(dtype).min)


def _family_eager(model):
    """The eager attention of the model's own modeling file (each HF family defines ``eager_attention_forward``)."""
    return getattr(sys.modules[type(model).__module__], "eager_attention_forward")


@contextlib.contextmanager
def hf_attention(model, groups: PromptGroups):
    """While open, the model's attention runs per segment of ``groups``' flat sequence; yields the forward's extra
    keyword arguments. Hold it across the backward where layers recompute their forward (activation
    checkpointing): the recomputation goes through the same attention."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if NAME not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(NAME, _segment_attention)
    previous = model.config._attn_implementation
    base = _family_eager(model) if previous == "eager" else ALL_ATTENTION_FUNCTIONS[previous]
    # One layout for every layer. SDPA's prompts need no mask (causal where none is given: its fast path), nor its
    # responses where they go by group; elsewhere the responses' mask is additive, made once here (SDPA would convert
    # a boolean one in each layer's call), and the other functions' prompts take an additive causal mask too.
    if previous == "sdpa" and groups.source.device.type in PER_GROUP_DEVICES:
        routed = _Routed(groups, base, None, True, groups.spans(), None)
    else:
        response_mask = _additive(groups.response_visible(), model.dtype)
        if previous == "sdpa":
            routed = _Routed(groups, base, None, True, None, response_mask)
        else:
            causal = torch.ones(groups.prompt_width, groups.prompt_width, dtype=torch.bool,
                                device=groups.source.device)
            routed = _Routed(groups, base, _additive(causal.tril()[None, None], model.dtype), False, None,
                             response_mask)
    model.config._attn_implementation = NAME  # not a mask implementation: the model builds no [T x T] mask
    try:
        yield {KWARG: routed, "position_ids": groups.positions[None]}
    finally:
        model.config._attn_implementation = previous


def hf_attention_problem(config) -> str | None:
    """Why an HF model's attention cannot run the shared layout (None: it can)."""
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or getattr(config, "use_sliding_window", False):
        return f"its layers are not all full causal attention ({', '.join(sorted(kinds))})"
    if getattr(config, "attn_logit_softcapping", None):
        return "its attention soft-caps the logits (SDPA cannot)"
    return None


# ---- when it applies ----
def resolve(cfg):
    """``train.shared_prompt`` as the run will do it: off, with the reason logged once, where it cannot apply (one
    sample per prompt; a model whose attention the layout cannot express). Before the config is saved: config.yaml
    holds what the run does."""
    if not cfg.train.shared_prompt:
        return cfg
    reason = problem(cfg)
    if reason is None:
        return cfg
    log.info("train.shared_prompt: off: %s", reason)
    return replace(cfg, train=replace(cfg.train, shared_prompt=False))


def problem(cfg) -> str | None:
    """Why ``train.shared_prompt`` cannot apply to the run ``cfg`` describes (None: it can)."""
    from megaopd.objectives.methods import method

    if not method(cfg.train.algorithm).shares_prompts(cfg.rollout):
        return "one sample per prompt, so no prompt is shared"
    if cfg.model.backend == "megatron":
        from megaopd.models.megatron.fp8 import use_te_spec

        if use_te_spec(cfg.model.megatron):
            return ("the Transformer Engine layer spec: its fused attention is not routed per segment (use "
                    "model.megatron.transformer_engine=false)")
    config = Path(cfg.model.path) / HF_CONFIG
    if config.exists():
        from transformers import AutoConfig

        return hf_attention_problem(AutoConfig.from_pretrained(config.parent))
    return None
