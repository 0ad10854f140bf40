"""The shared-prompt layout (``megaopd.models.shared_prompt``) on the HF backend: transformers' attention routed per
segment of the flat sequence through its AttentionInterface, and which HF models it can express. docs/shared_prompt.md
is the design.

    with hf_attention(model, groups) as extra:          # one shared-prompt forward (and its backward)
        model(input_ids=groups.input_ids[None], use_cache=False, **extra)  # extra: the layout, the positions
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch

from megaopd.accounting.flops import sliding_window
from megaopd.models.shared_prompt import PromptGroups

KWARG = "megaopd_prompt_groups"  # the model forward's keyword that carries the layout down to the attention


NAME = "megaopd_shared_prompt"


# Where SDPA takes the responses one maskless call per group: a GPU's (FlashAttention, ``_sdpa_responses``). The CPU's
# kernels take a mask either way, so there one masked call over every response does the same in fewer calls (the
# GRPO bench's update 0.117-0.124 -> 0.100-0.114 s: docs/benchmarks.md).
PER_GROUP_DEVICES = ("cuda",)


def responses_per_group(device: str) -> bool:
    """Whether SDPA takes the responses one maskless call per group on ``device`` (``cuda:0``, ``cpu``, ...): the
    dispatch ``hf_attention`` runs and the memory plan sizes the activations by (``megaopd.run.plan``)."""
    return device.split(":")[0] in PER_GROUP_DEVICES


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
    if previous == "sdpa" and responses_per_group(groups.source.device.type):
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
    if kinds != {"full_attention"}:
        return f"its layers are not all full causal attention ({', '.join(sorted(kinds))})"
    if window := sliding_window(config):
        return f"its attention has a sliding window ({window} tokens)"
    if getattr(config, "attn_logit_softcapping", None):
        return "its attention soft-caps the logits (SDPA cannot)"
    return None
