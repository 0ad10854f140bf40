"""Rollout engines: sample responses with per-token logprobs. ``local`` runs in-process; ``sglang`` on servers
(``megaopd.rollout.serving.engine``).

The interface every engine implements:

    engine.generate(rows, samples_per_prompt, temperature, top_p, max_new_tokens, generator) -> list[Sample]
    engine.sync_weights(policy)     # after each update (version: default the next); the local engine shares the
                                    # trainer's weights, so it only counts
    engine.weight_version           # stamped on every sample
    engine.shares_policy_weights    # True: samples from the trainer's own model (megaopd.rollout.pipeline)
    engine.updates_in_flight        # optional; True: a sync may land while a generation runs, which resumes what it
                                    # interrupted (SGLangEngine with rollout.inflight_updates)
    engine.close()                  # stop what the engine started

The local engine prefills each distinct prompt once and shares its KV cache across the group
(``batch_repeat_interleave``), the prefill the ledger bills (docs/flops.md, "Shared work"). Decode steps go
through ``megaopd.rollout.decode.FusedDecoder`` for the families it knows, else through the model's own forward.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager

import torch

from megaopd.data.batch import Sample
from megaopd.models.chat import chat_prompt_ids_batch
from megaopd.config import ConfigError
from megaopd.rollout.decode import FusedDecoder, cache_argument
from megaopd.data.rows import Row
from megaopd.models.distributions import nucleus
from megaopd.models.policy_protocol import Policy


def sampling_generator(device: torch.device | str, seed: int) -> torch.Generator:
    """The generator the sampler draws with, on the device where the logits it samples live: a CUDA tensor refuses a
    CPU generator, so the trainer and the evaluator both take theirs from here with the policy's device."""
    return torch.Generator(device=device).manual_seed(seed)


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
        logprobs = nucleus(logprobs, top_p)
    # Inverse-CDF draw: one uniform per row, the first token whose cumulative probability exceeds it (zero-probability
    # tokens never are). Same distribution as torch.multinomial, which draws an exponential per vocabulary entry.
    cdf = logprobs.exp().cumsum(-1)
    u = torch.rand((cdf.shape[0], 1), generator=generator, device=cdf.device, dtype=cdf.dtype) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def policy_temperature(temperature: float) -> float:
    """The run's one temperature T (docs/opd.md, "One temperature"), for a rollout at ``temperature``: the policy
    the loss trains is softmax(logits / T), the one the rollout samples from, so the student's old logprobs, the
    loss's logprobs, the reference's and the teachers' scores are all taken at T and every ratio and advantage
    compares one distribution (verl, TRL, slime and NeMo-RL divide the trainer's logits by the rollout temperature
    too). A greedy rollout (0) samples from no tempered distribution: 1."""
    return 1.0 if temperature == 0 else temperature


def reported_sampling(engine: str, temperature: float, top_p: float) -> tuple[float, float]:
    """The (temperature, top_p) under which an engine's reported logprobs are taken, for a rollout at these settings:
    what the trainer's logprobs must be taken at to compare like with like (the IS ratio, ``rollout/behaviour_kl``).

    At temperature 0 both engines report the policy's own logprobs (1, 1). The local engine reports the
    distribution it samples from (``sample_tokens``: tempered, cut to the nucleus, renormalised); SGLang (0.5.23,
    ``Sampler.forward``) reports log softmax(logits / T), taken before its top-p cut, so its top-p is 1."""
    if temperature == 0:
        return 1.0, 1.0
    return temperature, top_p if engine == "local" else 1.0


class LocalEngine:
    """Batched KV-cache sampling with the trainer's own model (no copy, so no weight sync to get wrong)."""

    shares_policy_weights = True  # generating while the trainer updates would sample half-updated weights

    def __init__(self, policy: Policy, batch_prompts: int = 64):
        """``batch_prompts``: prompts per generation chunk (``rollout.batch_prompts``); the KV cache of a chunk,
        batch_prompts x samples x (prompt + new tokens) positions, is all that exists at once."""
        if batch_prompts < 1:
            raise ConfigError(f"rollout.batch_prompts must be >= 1, got {batch_prompts}; set a positive number")
        self.policy = policy
        self.batch_prompts = batch_prompts
        self.weight_version = 0

    def sync_weights(self, policy: Policy, version: int | None = None) -> None:
        assert policy is self.policy, "the local engine samples from the trainer's own model"
        self.weight_version = self.weight_version + 1 if version is None else version

    def take_resumed_prefills(self) -> list[int]:
        return []  # an update lands between decode chunks, the KV cache kept: nothing is prefilled again

    def close(self) -> None:
        pass  # nothing runs outside this process

    def generate(self, rows: list[Row], samples_per_prompt: int, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 64, generator: torch.Generator | None = None) -> list[Sample]:
        return run_to_end(self.generation(rows, samples_per_prompt, temperature, top_p, max_new_tokens, generator))

    def generation(self, rows: list[Row], samples_per_prompt: int, temperature: float = 1.0, top_p: float = 1.0,
                   max_new_tokens: int = 64, generator: torch.Generator | None = None,
                   chunk: int = 0) -> Generator[None, None, list[Sample]]:
        """``generate`` as a generation that pauses (yields) after every ``chunk`` decode steps (0: never), its
        samples the generation's return value. A weight update may land at a pause (rollout.inflight_updates): the
        tokens decoded after it are the new version's, over the KV cache the earlier version wrote (as in-flight
        updates do on servers), and each token records its version."""
        samples = []
        for start in range(0, len(rows), self.batch_prompts):
            chunk_rows = rows[start: start + self.batch_prompts]
            samples += yield from each_resume(self._sampling, self._generate_chunk(
                chunk_rows, start, samples_per_prompt, temperature, top_p, max_new_tokens, generator, chunk))
        return samples

    @contextmanager
    def _sampling(self):
        """Inference mode, dropout off, for one stretch of a generation (never across a pause, where the trainer
        updates). Dropout goes off by torch's own switch: transformers' train() and eval() also kernelize the model
        again at each switch (its hub ``kernels`` integration, on wherever that package is installed: ~0.6 ms a
        switch, two a chunk), and the kernels it chose for training run forward passes too."""
        model = self.policy.model
        was_training = model.training
        torch.nn.Module.train(model, False)
        try:
            with torch.inference_mode():
                yield
        finally:
            torch.nn.Module.train(model, was_training)

    def _generate_chunk(self, rows, first_group, n, temperature, top_p, max_new_tokens, generator, chunk):
        prompts = chat_prompt_ids_batch(self.policy.tokenizer, [row.prompt for row in rows])
        logits, decode = self._prefill(prompts, n, max_new_tokens)
        tokens, logprobs, versions, done = yield from self._decode_loop(logits, decode, temperature, top_p,
                                                                        max_new_tokens, generator, chunk)
        return self._samples(rows, prompts, first_group, n, tokens, logprobs, versions, done)

    def _prefill(self, prompts: list[list[int]], n: int,
                 max_new_tokens: int) -> tuple[torch.Tensor, Callable[[torch.Tensor, int], torch.Tensor]]:
        """Run each prompt once and share its KV cache across its group of `n` samples.

        Returns the next-token logits of every sample, [len(prompts) * n, V], and ``decode(token, t)``, which feeds
        the t-th sampled token of every sample through the cache and returns the logits after it.
        """
        from transformers import DynamicCache

        model, device = self.policy.model, self.policy.device
        width = max(map(len, prompts))
        capacity = width + max_new_tokens
        # Left-pad so every prompt ends at the same column; positions count real tokens only.
        input_ids = torch.full((len(prompts), width), self.policy.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # Prefill: only the last prompt position's logits are used (and billed).
        cache = DynamicCache()
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    logits_to_keep=1, **cache_argument(model, cache))
        # Share the prompt's cache across its group instead of prefilling it n times.
        cache.batch_repeat_interleave(n)
        logits = out.logits[:, -1].repeat_interleave(n, 0)
        first_pos = positions[:, -1].repeat_interleave(n, 0) + 1  # RoPE position of the first generated token
        key_mask = mask.repeat_interleave(n, 0)
        batch = logits.shape[0]
        if FusedDecoder.supports(model):
            decoder = FusedDecoder(model, cache, capacity)
            packed = self.weight_version
            additive_mask = torch.zeros((batch, 1, 1, capacity), dtype=model.dtype, device=device)
            additive_mask[:, 0, 0, :width].masked_fill_(key_mask == 0, -torch.inf)

            def decode(token: torch.Tensor, t: int) -> torch.Tensor:
                nonlocal packed
                if packed != self.weight_version:  # an in-flight update landed: its packed copies are the old weights
                    decoder.pack(self.policy.model)  # (a Megatron policy refreshes its HF copy on this access)
                    packed = self.weight_version
                return decoder.step(token, first_pos + t, width + t, additive_mask)
        else:  # other families: the model's own forward, which builds its masks from the 2D padding mask
            padding_mask = torch.ones((batch, capacity), dtype=mask.dtype, device=device)
            padding_mask[:, :width] = key_mask

            cache_kwarg = cache_argument(model, cache)

            def decode(token: torch.Tensor, t: int) -> torch.Tensor:
                # the policy's model at each step: an in-flight update refreshes a Megatron policy's HF copy on access
                return self.policy.model(input_ids=token[:, None], attention_mask=padding_mask[:, : width + t + 1],
                                         position_ids=(first_pos + t)[:, None], use_cache=True,
                                         **cache_kwarg).logits[:, -1]
        return logits, decode

    def _decode_loop(self, logits: torch.Tensor, decode: Callable[[torch.Tensor, int], torch.Tensor],
                     temperature: float, top_p: float, max_new_tokens: int, generator: torch.Generator | None,
                     chunk: int = 0) -> Generator[None, None, tuple[torch.Tensor, ...]]:
        """Sample up to `max_new_tokens` per row, until every row has sampled EOS, pausing after every `chunk` decode
        steps (0: never): returns (tokens, logprobs, versions, done), on CPU, versions the weight version that
        computed each token's logits."""
        batch = logits.shape[0]
        tokens = torch.zeros((batch, max_new_tokens), dtype=torch.long)
        logprobs = torch.zeros((batch, max_new_tokens))
        versions = torch.zeros((batch, max_new_tokens), dtype=torch.long)
        done = torch.zeros(batch, dtype=torch.bool)
        for t in range(max_new_tokens):
            token, logprob = sample_tokens(logits, temperature, top_p, generator)
            token_cpu = token.cpu()
            tokens[:, t], logprobs[:, t], versions[:, t] = token_cpu, logprob.cpu(), self.weight_version
            done |= token_cpu == self.policy.eos_id
            if t == max_new_tokens - 1 or bool(done.all()):
                break  # the last sampled token is never fed back
            if chunk and (t + 1) % chunk == 0:
                yield  # a weight update may land here: the logits of token t + 1 on are the next version's
            logits = decode(token, t)
        return tokens, logprobs, versions, done

    def _samples(self, rows: list[Row], prompts: list[list[int]], first_group: int, n: int, tokens: torch.Tensor,
                 logprobs: torch.Tensor, versions: torch.Tensor, done: torch.Tensor) -> list[Sample]:
        """One Sample per row of the decode loop: `n` consecutive rows per prompt, each cut at its end; per-token
        versions only where an update landed during the generation."""
        # A response ends at its first EOS (rows that finished early kept sampling until all had), else at the limit.
        is_eos = tokens == self.policy.eos_id
        lengths = torch.where(done, is_eos.int().argmax(-1) + 1, tokens.shape[1]).tolist()
        samples = []
        for i, (row_tokens, row_logprobs, row_versions, stopped) in enumerate(zip(
                tokens.tolist(), logprobs.tolist(), versions.tolist(), done.tolist())):
            own = row_versions[:lengths[i]]
            samples.append(Sample(
                row=rows[i // n], group=first_group + i // n, prompt_ids=prompts[i // n],
                response_ids=row_tokens[:lengths[i]], rollout_logprobs=row_logprobs[:lengths[i]],
                finish_reason="stop" if stopped else "length", weight_version=own[0],
                token_versions=own if own[0] != own[-1] else None))
        return samples


def each_resume(context: Callable, generation: Generator):
    """Runs `generation` with `context()` entered on each resume and left at each pause (``yield from`` it): what
    the context switches (inference mode, dropout) is the trainer's again while the generation is paused."""
    while True:
        with context():
            value = resume(generation)
        if value is not None:
            return value
        yield


def resume(generation: Generator):
    """Resumes `generation` to its next pause (None) or its end (its return value)."""
    try:
        next(generation)
    except StopIteration as end:
        return end.value
    return None


def run_to_end(generation: Generator):
    """A generation's return value, resumed at each pause without pausing."""
    while (value := resume(generation)) is None:
        pass
    return value
