"""A fused one-token decode step for the dense decoder families megaopd trains (Llama, Qwen2, Qwen3).

At small sizes a decode forward is ~60 tiny eager ops per layer, and their per-op overhead, not the matmuls, is what
the rollout costs. ``FusedDecoder.step`` computes what the HF model's forward computes for one new token per row over
a KV cache, in about a quarter of the ops: q/k/v and gate/up each as one packed matmul, the q and k norms and RoPE
of all heads at once, the softmax scale folded into the query, attention as two matmuls over the KV heads (GQA
without repeating the cache), keys and values written into a cache allocated once for the whole generation.

The packed weights are copied from the model's current parameters when the decoder is built, i.e. once per rollout
chunk, so there is no copy to keep in sync with training (``pack`` copies them again where an in-flight weight update
lands mid-generation). Prefill stays the model's own forward; its cache seeds
this one. ``tests/test_policy_fast_paths.py`` checks the result against HF's own decoding.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from megaopd.accounting.flops import sliding_window


def cache_argument(model, cache) -> dict:
    """``{name: cache}`` for the model's forward: transformers 5.2x renamed ``past_key_values`` to ``cache``, and an
    older forward takes the new name into ``**kwargs`` and ignores it (building a cache of its own)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache}


def _rope_follows_length(rope_type: str) -> bool:
    """Whether RoPE's frequencies change with the sequence's length (transformers' ``dynamic_rope_update``: dynamic
    NTK scaling, LongRoPE's switch of factors): the decoder's one table for the whole generation would rotate each
    token by the frequencies of the generation's end, the model's forward by those of its own step."""
    return "dynamic" in rope_type or rope_type == "longrope"


class FusedDecoder:
    FAMILIES = ("llama", "qwen2", "qwen3")

    @classmethod
    def supports(cls, model) -> bool:
        """A dense decoder of a known family, SiLU MLP, full causal attention in every layer (no sliding window), RoPE
        frequencies fixed for the whole generation."""
        cfg = model.config
        layer_types = getattr(cfg, "layer_types", None) or ["full_attention"]
        return (cfg.model_type in cls.FAMILIES and cfg.hidden_act == "silu" and sliding_window(cfg) is None
                and all(t == "full_attention" for t in layer_types) and getattr(cfg, "pretraining_tp", 1) == 1
                and not _rope_follows_length(model.model.rotary_emb.rope_type))

    @torch.no_grad()
    def __init__(self, model, cache, capacity: int):
        """``cache``: the HF cache after prefill (and the group's repeat), its length the prompt width; ``capacity``:
        prompt width + new tokens, the cache positions this decoder allocates."""
        cfg, body = model.config, model.model
        first = body.layers[0].self_attn
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = first.head_dim
        self.eps = cfg.rms_norm_eps
        self.embed = body.embed_tokens.weight
        self.final_norm = body.norm.weight
        self.lm_head = model.get_output_embeddings().weight
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qk_width = q_width + kv_width
        # RoPE tables for every position this generation can reach (the model's own rotary module, so its scaling
        # variant applies); rotate_half(x) * sin is computed as roll(x) * sin with the sign folded into sin.
        positions = torch.arange(capacity, device=self.embed.device)[None]
        cos, sin = body.rotary_emb(self.embed.detach()[:1][None], positions)  # x gives only dtype and device
        half = self.head_dim // 2
        self.cos = cos[0]
        self.sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1)

        self.scale = first.scaling
        self.layers = []
        for index in range(len(body.layers)):
            keys, values = cache.layers[index].keys, cache.layers[index].values
            k_cache = keys.new_zeros((*keys.shape[:2], capacity, self.head_dim))
            v_cache = values.new_zeros(k_cache.shape)
            k_cache[:, :, :keys.shape[2]] = keys
            v_cache[:, :, :values.shape[2]] = values
            self.layers.append(dict(k_cache=k_cache, v_cache=v_cache))
        self.pack(model)
        self.ffn = body.layers[0].mlp.gate_proj.out_features

    @torch.no_grad()
    def pack(self, model) -> None:
        """Copy the model's current weights into the packed ones, keeping the KV cache: again after an in-flight
        weight update (rollout.inflight_updates), whose later tokens the new weights decode."""
        scale = self.scale
        for packed, layer in zip(self.layers, model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            has_qk_norm = hasattr(attn, "q_norm")
            q_scale = 1.0 if has_qk_norm else scale  # with q/k norms the scale goes into the q norm
            w_qkv = torch.cat([attn.q_proj.weight * q_scale, attn.k_proj.weight, attn.v_proj.weight])
            b_qkv = (torch.cat([attn.q_proj.bias * q_scale, attn.k_proj.bias, attn.v_proj.bias])
                     if attn.q_proj.bias is not None else None)
            qk_norm = (torch.cat([(attn.q_norm.weight * scale).expand(self.heads, -1),
                                  attn.k_norm.weight.expand(self.kv_heads, -1)])
                       if has_qk_norm else None)
            gate_up_bias = (torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])
                            if mlp.gate_proj.bias is not None else None)
            packed.update(
                input_norm=layer.input_layernorm.weight, w_qkv=w_qkv, b_qkv=b_qkv, qk_norm=qk_norm,
                w_o=attn.o_proj.weight, b_o=attn.o_proj.bias, post_norm=layer.post_attention_layernorm.weight,
                w_gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), b_gate_up=gate_up_bias,
                w_down=mlp.down_proj.weight, b_down=mlp.down_proj.bias)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # HF's RMSNorm: normalise in float32, cast back, then scale (written out: F.rms_norm is slower on CPU).
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(self.eps))).to(x.dtype) * weight

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int, mask: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] after feeding ``tokens`` [B] at RoPE ``positions`` [B] into cache column ``slot``;
        ``mask``: additive [B, 1, 1, >= slot + 1] (0 for a real key, -inf for padding)."""
        batch, heads, kv_heads, dim = tokens.shape[0], self.heads, self.kv_heads, self.head_dim
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [B, 1, dh]: all heads alike
        mask = mask[..., : slot + 1]
        x = F.embedding(tokens, self.embed)
        for layer in self.layers:
            qkv = F.linear(self._norm(x, layer["input_norm"]), layer["w_qkv"], layer["b_qkv"])
            qk = qkv[:, : self.qk_width].view(batch, heads + kv_heads, dim)
            if layer["qk_norm"] is not None:
                qk = self._norm(qk, layer["qk_norm"])
            qk = torch.addcmul(qk * cos, qk.roll(dim // 2, -1), sin)
            layer["k_cache"][:, :, slot] = qk[:, heads:]
            layer["v_cache"][:, :, slot] = qkv[:, self.qk_width:].view(batch, kv_heads, dim)
            # The query heads that share a KV head are the rows of one matmul: [B, kv heads, heads per kv head, keys].
            scores = torch.matmul(qk[:, :heads].view(batch, kv_heads, heads // kv_heads, dim),
                                  layer["k_cache"][:, :, : slot + 1].transpose(-1, -2))
            out = torch.matmul((scores + mask).softmax(-1), layer["v_cache"][:, :, : slot + 1])
            x = x + F.linear(out.reshape(batch, heads * dim), layer["w_o"], layer["b_o"])
            gate_up = F.linear(self._norm(x, layer["post_norm"]), layer["w_gate_up"], layer["b_gate_up"])
            x = x + F.linear(F.silu(gate_up[:, : self.ffn]) * gate_up[:, self.ffn:], layer["w_down"], layer["b_down"])
        return F.linear(self._norm(x, self.final_norm), self.lm_head)
