"""The shared-prompt layout (``megaopd.models.shared_prompt``) on megatron-core: one flat sequence per micro-batch, the
local spec's core attention run per segment, rotary embeddings at each token's own position.

    spec = segment_attention_spec(spec)                 # the bridge's local layer spec
    with shared_forward(model, groups):                 # one micro-batch's forward
        output = model(ids, positions, None)            # ids, positions: groups' flat sequence, [1, T]

megatron's GPT model takes rotary positions from the sequence index, not from ``position_ids``: a forward hook on its
rotary embedding hands each token the embedding of its own position instead. The Transformer Engine spec's fused
attention is not routed (``megaopd.run.resolve.shared_prompt_problem`` turns the switch off there).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megaopd.models.shared_prompt import PromptGroups


class SegmentAttention(DotProductAttention):
    """megatron's local core attention; while ``groups`` is set (a shared-prompt forward), over each prompt causally
    and each response over its prompt's keys and values and causally over its own, in two calls of its own."""

    groups: PromptGroups | None = None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        groups = self.groups
        if groups is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        # [T, 1, heads, d] -> prompts [Pp, G, heads, d], responses [Rp, b, heads, d] (megatron's [s, b, ...])
        (qp, qr), (kp, kr), (vp, vr) = (tuple(part.transpose(0, 1).contiguous() for part in groups.split(x, 0))
                                        for x in (query, key, value))
        prompts = super().forward(qp, kp, vp, None)  # the causal mask megatron builds for self-attention
        responses = super().forward(qr, groups.response_keys(kp, kr, 1, 0), groups.response_keys(vp, vr, 1, 0),
                                    ~groups.response_visible())  # megatron's mask: True where masked
        out = groups.join(prompts.transpose(0, 1), responses.transpose(0, 1))  # [G*Pp + b*Rp, hidden]
        return torch.nn.functional.pad(out, (0, 0, 0, query.shape[0] - out.shape[0]))[:, None]


def segment_attention_spec(block_spec):
    """A decoder block spec with ``SegmentAttention`` as the core attention of every layer that has megatron's
    local one (new spec objects: megatron's are left as they are)."""
    layers = []
    for layer in block_spec.layer_specs:
        attention = layer.submodules.self_attention
        if attention.submodules.core_attention is DotProductAttention:
            attention = replace(attention, submodules=replace(attention.submodules, core_attention=SegmentAttention))
            layer = replace(layer, submodules=replace(layer.submodules, self_attention=attention))
        layers.append(layer)
    return replace(block_spec, layer_specs=layers)


@contextlib.contextmanager
def shared_forward(model: torch.nn.Module, groups: PromptGroups, positions: torch.Tensor):
    """While open, ``model``'s attention runs ``groups``' segments and its rotary embedding follows ``positions``
    ([T], the flat sequence's, padded to the model's input length)."""
    layers = [m for m in model.modules() if isinstance(m, SegmentAttention)]
    if not layers:
        raise ValueError("train.shared_prompt needs megatron's local attention spec (model.megatron."
                         "transformer_engine=false)")
    rotary = [m for name, m in model.named_modules() if name.endswith("rotary_pos_emb")]
    handles = [r.register_forward_hook(lambda module, args, emb: emb[positions]) for r in rotary]
    for layer in layers:
        layer.groups = groups
    try:
        yield
    finally:
        for layer in layers:
            layer.groups = None
        for handle in handles:
            handle.remove()
