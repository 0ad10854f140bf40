"""Staleness per response token, counted when its batch trains (``rollout.max_staleness: K``): the trainer's weight
version then, less the version that computed the token's logits (``Sample.versions``). Counted at training time, it
includes the time the batch waited after its generation, not only how far behind the generating weights were; with
in-flight updates (``rollout.inflight_updates``) the tokens of one response differ.

A token more than K versions old is refused (``rollout.stale_tokens=refuse``: the run stops, naming the step) or
masked (``mask``): its loss terms are zeroed in every method's loss (``masked_loss``), and it stays in the
token-mean's denominator, as the IS mask's tokens do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megaopd.data.batch import Sample, TokenBatch


class StaleRollouts(RuntimeError):
    """Response tokens more than rollout.max_staleness versions old when their batch trains (stale_tokens=refuse)."""


def token_staleness(samples: list[Sample], version: int) -> list[int]:
    """Each response token's staleness at trainer version `version`, the samples' tokens in order."""
    return [version - v for s in samples for v in s.versions()]


def check_staleness(step: int, staleness: list[int], max_staleness: int, stale_tokens: str) -> int:
    """The number of tokens past the bound; refused (``StaleRollouts``) under stale_tokens=refuse."""
    stale = sum(x > max_staleness for x in staleness)
    if stale and stale_tokens == "refuse":
        raise StaleRollouts(f"step {step}: {stale} of {len(staleness)} response tokens are up to {max(staleness)} "
                            f"weight versions old when their batch trains, more than rollout.max_staleness="
                            f"{max_staleness}; set rollout.stale_tokens=mask to train the batch without them, or "
                            "raise rollout.max_staleness")
    return stale


def fresh_tokens(batch: TokenBatch, version: int, max_staleness: int) -> torch.Tensor | None:
    """[B, S-1] 0 at the response tokens more than `max_staleness` versions old at trainer version `version`, 1
    elsewhere; None where there are none."""
    stale = batch.response_mask.bool() & (version - batch.token_versions > max_staleness)
    return (~stale).to(batch.response_mask.dtype) if stale.any() else None


def masked_loss(token_loss: Callable) -> Callable:
    """An objective's ``token_loss`` with every term zeroed at the micro-batch's stale tokens (``fresh_mask``)."""
    def loss(logp, vocab, mb: TokenBatch):
        per_token, metrics = token_loss(logp, vocab, mb)
        return per_token * mb.fresh_mask, metrics
    return loss
