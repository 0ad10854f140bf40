"""Rollout engines: sample responses with per-token logprobs. ``local`` runs in-process; ``sglang`` on servers
(``megaopd.serving.engine``).

The interface every engine implements:

    engine.generate(rows, samples_per_prompt, temperature, top_p, max_new_tokens, generator) -> list[Sample]
    engine.sync_weights(policy)     # after each update (version: default the next); the local engine shares the
                                    # trainer's weights, so it only counts
    engine.weight_version           # stamped on every sample
    engine.close()                  # stop what the engine started

The local engine prefills each distinct prompt once and shares its KV cache across the group
(``batch_repeat_interleave``), so the ledger counts prefill once per prompt (``prefix_cached=True``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from megaopd.batch import Sample
from megaopd.data.rows import Row
from megaopd.policy import HFPolicy, chat_prompt_ids_batch


class RolloutEngine(Protocol):
    weight_version: int
    prefix_cached: bool

    def generate(self, rows: list[Row], samples_per_prompt: int, temperature: float, top_p: float,
                 max_new_tokens: int, generator: torch.Generator) -> list[Sample]: ...

    def sync_weights(self, policy: HFPolicy, version: int | None = None) -> None: ...

    def close(self) -> None: ...


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample (or take the argmax at temperature 0) and return (token, logprob under the sampling distribution).

    At temperature 0 the logprob is the policy's own (temperature 1), which is what the trainer recomputes.
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    logprobs = (logits if temperature == 1.0 else logits / temperature).log_softmax(-1)
    if top_p < 1.0:
        sorted_lp, order = logprobs.sort(-1, descending=True)
        drop = sorted_lp.exp().cumsum(-1) - sorted_lp.exp() >= top_p  # keep the smallest set reaching top_p
        sorted_lp = sorted_lp.masked_fill(drop, -torch.inf)
        logprobs = torch.full_like(logprobs, -torch.inf).scatter(-1, order, sorted_lp).log_softmax(-1)
    # Inverse-CDF draw: one uniform per row, the first token whose cumulative probability exceeds it (zero-probability
    # tokens never are). Same distribution as torch.multinomial, which draws an exponential per vocabulary entry.
    cdf = logprobs.exp().cumsum(-1)
    u = torch.rand((cdf.shape[0], 1), generator=generator, device=cdf.device, dtype=cdf.dtype) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


class LocalEngine:
    """Batched KV-cache sampling with the trainer's own model (no copy, so no weight sync to get wrong)."""

    prefix_cached = True

    def __init__(self, policy: HFPolicy, batch_prompts: int = 64):
        self.policy = policy
        self.batch_prompts = batch_prompts
        self.weight_version = 0

    def sync_weights(self, policy: HFPolicy, version: int | None = None) -> None:
        assert policy is self.policy, "the local engine samples from the trainer's own model"
        self.weight_version = self.weight_version + 1 if version is None else version

    def close(self) -> None:
        pass  # nothing runs outside this process

    def generate(self, rows: list[Row], samples_per_prompt: int, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 64, generator: torch.Generator | None = None) -> list[Sample]:
        samples = []
        for start in range(0, len(rows), self.batch_prompts):
            chunk = rows[start: start + self.batch_prompts]
            samples += self._generate_chunk(chunk, start, samples_per_prompt, temperature, top_p, max_new_tokens,
                                            generator)
        return samples

    @staticmethod
    def _preallocate(cache, capacity: int) -> None:
        """Give each plain ``DynamicLayer`` of ``cache`` room for ``capacity`` positions: a decode step then writes its
        key / value into the next slot of a buffer allocated once, instead of concatenating (re-allocating and copying)
        the whole cache of every layer at every step. The layer's keys / values stay the used prefix of the buffer."""
        from transformers.cache_utils import DynamicLayer

        for layer in getattr(cache, "layers", []):
            if type(layer) is not DynamicLayer or not layer.is_initialized:
                continue
            used = layer.keys.shape[-2]
            buffers = []
            for states in (layer.keys, layer.values):
                buffers.append(states.new_empty((*states.shape[:-2], capacity, states.shape[-1])))
                buffers[-1][..., :used, :] = states

            def update(key_states, value_states, *args, _layer=layer, _buffers=tuple(buffers), **kwargs):
                start = _layer.keys.shape[-2]
                end = start + key_states.shape[-2]
                _buffers[0][..., start:end, :] = key_states
                _buffers[1][..., start:end, :] = value_states
                _layer.keys, _layer.values = _buffers[0][..., :end, :], _buffers[1][..., :end, :]
                return _layer.keys, _layer.values

            layer.update = update
            layer.keys, layer.values = buffers[0][..., :used, :], buffers[1][..., :used, :]

    DECODE_ATTENTION = "megaopd_decode"  # registered with transformers' AttentionInterface on first use

    @staticmethod
    def _decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        """Attention of one new token per row over the cache, given the additive [B, 1, 1, kv] mask built below: two
        small matmuls and a softmax, the query heads of each KV head as rows (no repeat of the cache for GQA). For
        a single query this is faster on CPU than SDPA's flash kernel; anything else goes to SDPA unchanged."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        batch, heads, q_len, dim = query.shape
        kv_heads = key.shape[1]
        if (q_len != 1 or attention_mask is None or attention_mask.dtype != query.dtype or dropout
                or kwargs.get("softcap") is not None or heads % kv_heads):
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
        scores = torch.matmul(query.reshape(batch, kv_heads, heads // kv_heads, dim), key.transpose(-1, -2))
        scores = scores.mul_(dim ** -0.5 if scaling is None else scaling).add_(attention_mask)
        out = torch.matmul(scores.softmax(-1), value)  # [B, kv heads, heads per kv head, dim]
        return out.reshape(batch, 1, heads, dim), None

    @staticmethod
    def _plain_causal(config) -> bool:
        """Full causal attention in every layer (no sliding window): a decode step then only needs a key-padding
        mask, which the fast decode path builds once. Other models keep HF's own mask construction."""
        layer_types = getattr(config, "layer_types", None) or ["full_attention"]
        return (all(t == "full_attention" for t in layer_types)
                and (getattr(config, "sliding_window", None) is None or not getattr(config, "use_sliding_window", True))
                and getattr(config, "_attn_implementation", None) == "sdpa")

    @torch.inference_mode()
    def _generate_chunk(self, rows, first_group, n, temperature, top_p, max_new_tokens, generator):
        from transformers import AttentionInterface, DynamicCache

        model, device, tokenizer = self.policy.model, self.policy.device, self.policy.tokenizer
        was_training = model.training
        model.eval()
        prompts = chat_prompt_ids_batch(tokenizer, [row.prompt for row in rows])
        width = max(map(len, prompts))
        # Left-pad so every prompt ends at the same column; positions count real tokens only.
        input_ids = torch.full((len(prompts), width), self.policy.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache,
                    use_cache=True)
        cache = out.past_key_values
        # Share the prompt's cache across its group instead of prefilling it n times.
        cache.batch_repeat_interleave(n)
        self._preallocate(cache, width + max_new_tokens)
        logits = out.logits[:, -1].repeat_interleave(n, 0)
        next_pos = positions[:, -1:].repeat_interleave(n, 0) + 1

        batch = logits.shape[0]
        # The attention mask of the whole generation, built once; a decode step passes the prefix up to its token.
        fast = self._plain_causal(model.config)
        if fast:
            # A decode step's single query is the newest token, so it needs no causal part: a ready 4D additive mask
            # [B, 1, 1, kv] (0 or -inf) which the model passes on as is (no mask rebuilt per step) to the decode
            # attention above.
            decode_mask = torch.zeros((batch, 1, 1, width + max_new_tokens), dtype=model.dtype, device=device)
            decode_mask[:, 0, 0, :width].masked_fill_(mask.repeat_interleave(n, 0) == 0, -torch.inf)
            AttentionInterface.register(self.DECODE_ATTENTION, self._decode_attention)
            attn_implementation = model.config._attn_implementation
            model.config._attn_implementation = self.DECODE_ATTENTION
        else:  # the 2D padding mask; HF builds the model's own (e.g. sliding-window) masks from it
            decode_mask = torch.ones((batch, width + max_new_tokens), dtype=mask.dtype, device=device)
            decode_mask[:, :width] = mask.repeat_interleave(n, 0)
        tokens = torch.zeros((batch, max_new_tokens), dtype=torch.long)
        logprobs = torch.zeros((batch, max_new_tokens))
        done = torch.zeros(batch, dtype=torch.bool)
        try:
            for t in range(max_new_tokens):
                token, logprob = sample_tokens(logits, temperature, top_p, generator)
                token_cpu = token.cpu()
                tokens[:, t], logprobs[:, t] = token_cpu, logprob.cpu()
                done |= token_cpu == self.policy.eos_id
                if t == max_new_tokens - 1 or bool(done.all()):
                    break
                out = model(input_ids=token[:, None], attention_mask=decode_mask[..., : width + t + 1],
                            position_ids=next_pos, cache=cache, use_cache=True)
                logits, next_pos = out.logits[:, -1], next_pos + 1
        finally:
            if fast:
                model.config._attn_implementation = attn_implementation
            model.train(was_training)

        # A response ends at its first EOS (the rows that finished early kept sampling until all had), else at the limit.
        is_eos = tokens == self.policy.eos_id
        lengths = torch.where(done, is_eos.int().argmax(-1) + 1, max_new_tokens).tolist()
        samples = []
        for i in range(batch):
            length = lengths[i]
            samples.append(Sample(
                row=rows[i // n], group=first_group + i // n, prompt_ids=prompts[i // n],
                response_ids=tokens[i, :length].tolist(), rollout_logprobs=logprobs[i, :length].tolist(),
                finish_reason="stop" if bool(done[i]) else "length", weight_version=self.weight_version))
        return samples
