"""Rollout engines: sample responses with per-token logprobs. ``local`` runs in-process; SGLang comes later.

The interface every engine implements:

    engine.generate(rows, samples_per_prompt, temperature, top_p, max_new_tokens, generator) -> list[Sample]
    engine.sync_weights(policy)     # after each update; the local engine shares the weights, so it only counts
    engine.weight_version           # stamped on every sample

The local engine prefills each distinct prompt once and shares its KV cache across the group
(``batch_repeat_interleave``), so the ledger counts prefill once per prompt (``prefix_cached=True``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from megaopd.batch import Sample
from megaopd.data.rows import Row
from megaopd.policy import HFPolicy, chat_prompt_ids


class RolloutEngine(Protocol):
    weight_version: int
    prefix_cached: bool

    def generate(self, rows: list[Row], samples_per_prompt: int, temperature: float, top_p: float,
                 max_new_tokens: int, generator: torch.Generator) -> list[Sample]: ...

    def sync_weights(self, policy: HFPolicy) -> None: ...


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample (or take the argmax at temperature 0) and return (token, logprob under the sampling distribution).

    At temperature 0 the logprob is the policy's own (temperature 1), which is what the trainer recomputes.
    """
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    logprobs = (logits / temperature).log_softmax(-1)
    if top_p < 1.0:
        sorted_lp, order = logprobs.sort(-1, descending=True)
        drop = sorted_lp.exp().cumsum(-1) - sorted_lp.exp() >= top_p  # keep the smallest set reaching top_p
        sorted_lp = sorted_lp.masked_fill(drop, -torch.inf)
        logprobs = torch.full_like(logprobs, -torch.inf).scatter(-1, order, sorted_lp).log_softmax(-1)
    tokens = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


class LocalEngine:
    """Batched KV-cache sampling with the trainer's own model (no copy, so no weight sync to get wrong)."""

    prefix_cached = True

    def __init__(self, policy: HFPolicy, batch_prompts: int = 64):
        self.policy = policy
        self.batch_prompts = batch_prompts
        self.weight_version = 0

    def sync_weights(self, policy: HFPolicy) -> None:
        assert policy is self.policy, "the local engine samples from the trainer's own model"
        self.weight_version += 1

    def generate(self, rows: list[Row], samples_per_prompt: int, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 64, generator: torch.Generator | None = None) -> list[Sample]:
        samples = []
        for start in range(0, len(rows), self.batch_prompts):
            chunk = rows[start: start + self.batch_prompts]
            samples += self._generate_chunk(chunk, start, samples_per_prompt, temperature, top_p, max_new_tokens,
                                            generator)
        return samples

    @torch.no_grad()
    def _generate_chunk(self, rows, first_group, n, temperature, top_p, max_new_tokens, generator):
        from transformers import DynamicCache

        model, device = self.policy.model, self.policy.device
        was_training = model.training
        model.eval()
        prompts = [chat_prompt_ids(self.policy.tokenizer, row.prompt) for row in rows]
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
        logits = out.logits[:, -1].repeat_interleave(n, 0)
        mask = mask.repeat_interleave(n, 0)
        next_pos = positions[:, -1:].repeat_interleave(n, 0) + 1

        batch = logits.shape[0]
        tokens = torch.zeros((batch, max_new_tokens), dtype=torch.long)
        logprobs = torch.zeros((batch, max_new_tokens))
        lengths = torch.full((batch,), max_new_tokens)
        done = torch.zeros(batch, dtype=torch.bool)
        for t in range(max_new_tokens):
            token, logprob = sample_tokens(logits, temperature, top_p, generator)
            tokens[:, t], logprobs[:, t] = token.cpu(), logprob.cpu()
            finished_now = (token.cpu() == self.policy.eos_id) & ~done
            lengths[finished_now] = t + 1
            done |= finished_now
            if bool(done.all()) or t == max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=device)], dim=1)
            out = model(input_ids=token[:, None], attention_mask=mask, position_ids=next_pos,
                        cache=cache, use_cache=True)
            logits, next_pos = out.logits[:, -1], next_pos + 1
        model.train(was_training)

        samples = []
        for i in range(batch):
            length = int(lengths[i])
            samples.append(Sample(
                row=rows[i // n], group=first_group + i // n, prompt_ids=prompts[i // n],
                response_ids=tokens[i, :length].tolist(), rollout_logprobs=logprobs[i, :length].tolist(),
                finish_reason="stop" if bool(done[i]) else "length", weight_version=self.weight_version))
        return samples
