"""The distribution helpers every backend shares: the top-p nucleus cut, the entropy, the top-k view of a
log-softmax, and the top-k tail (the mass outside the K tokens, always by logsumexp) with its floor. The HF policy,
the local sampler, the Megatron policy, the objectives and the SGLang teacher call these (the Megatron vocabulary shard's tail is the
same logsumexp over TP slices: ``megaopd.models.megatron.vocab``).

``VocabView`` is how a training backend hands the objectives the student's distribution at a chunk of rows: the HF
policy holds it whole (``WholeVocab``), a Megatron TP rank one slice of the vocabulary (``VocabShard``); the KL terms
read it only through this interface, so they are the same code on every backend."""

from __future__ import annotations

from typing import Protocol

import torch

TAIL_FLOOR = -30.0  # log of the smallest tail mass a server's rounded top-k can leave (its sum may reach 1)


def nucleus(logprobs: torch.Tensor, top_p: float, outside: float = -torch.inf) -> torch.Tensor:
    """A log-softmax [..., V] cut to its top-p nucleus (the smallest set of most likely tokens reaching ``top_p``)
    and renormalised; tokens outside get ``outside``. Ties keep sort order."""
    sorted_lp, order = logprobs.sort(-1, descending=True)
    before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()  # mass of the strictly more likely tokens
    keep = torch.zeros_like(logprobs, dtype=torch.bool).scatter(-1, order, before < top_p)
    return torch.where(keep, logprobs.masked_fill(~keep, -torch.inf).log_softmax(-1), outside)


def entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """-sum_v p log p of a log-softmax [..., V] -> [...]. Additive over the vocabulary: a slice gives its share (a
    Megatron TP rank's, summed over the group). A token of probability 0 (-inf) adds 0, not nan."""
    return -(logprobs.exp() * logprobs.clamp(min=torch.finfo(logprobs.dtype).min)).sum(-1)


def tail_logprob(logprobs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log of the mass outside ``ids`` of a log-softmax [..., V], computed exactly (not as 1 - sum: cancellation).
    -inf where the ids cover the vocabulary."""
    return logprobs.scatter(-1, ids, -torch.inf).logsumexp(-1)


def topk_tail(top: torch.Tensor) -> torch.Tensor:
    """The tail given only the K logprobs [..., K] (a server's answer): log(1 - their mass), the mass by logsumexp
    in float64; -inf where none is left (a rounded top-k's mass may reach 1: the KL reads it at TAIL_FLOOR)."""
    left = -torch.expm1(top.double().logsumexp(-1))
    return torch.where(left > 0, left.log(), -torch.inf).float()


def topk_view(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs [..., K], ids [..., K], tail [...]) of the K most likely tokens of a log-softmax [..., V] (K is at
    most V)."""
    top, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return top, ids, tail_logprob(logprobs, ids)


class VocabView(Protocol):
    """A student's log-softmax at some rows [..., V], as a backend holds it."""

    vocab_size: int
    device: torch.device  # where the rows are: the teacher's numbers meet them there

    def logprobs_of(self, ids: torch.Tensor) -> torch.Tensor:
        """log p of the tokens ``ids`` [..., K] at each row, differentiable, on every rank."""

    def tail(self, ids: torch.Tensor) -> torch.Tensor:
        """log of the mass outside ``ids`` [..., K] at each row [...] (``tail_logprob``), on every rank."""


class WholeVocab:
    """The whole vocabulary on one device: a log-softmax [c, V] (the HF backend's chunk of response rows)."""

    def __init__(self, logprobs: torch.Tensor):
        self.logprobs, self.vocab_size, self.device = logprobs, logprobs.shape[-1], logprobs.device

    def logprobs_of(self, ids: torch.Tensor) -> torch.Tensor:
        return self.logprobs.gather(-1, ids)

    def tail(self, ids: torch.Tensor) -> torch.Tensor:
        return tail_logprob(self.logprobs, ids)
