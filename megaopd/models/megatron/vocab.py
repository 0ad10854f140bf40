"""Log-probabilities from vocab-parallel logits, without gathering the vocabulary on one rank.

Each TP rank holds logits for a contiguous slice of the (padded) vocabulary. The log-softmax needs one global
number per position, the log-sum-exp, built from a max and a sum all-reduced over the TP group; the realised
token's logit is read on the rank that owns it and summed over the group.

Gradients: every all-reduce here is ``_AllReduceSum``, whose backward is the all-reduce of the incoming
gradients. So the loss each rank back-propagates is its *share* of the total:

* a loss computed from the realised-token logprobs is the same on every rank: back-propagate ``loss / tp``;
* the top-k KL reads the K tokens' logprobs and the tail mass through the same all-reduces, so it is the same on
  every rank too: ``loss / tp`` as well.

The vocabulary is padded to a multiple of ``model.megatron.vocab_multiple * tp`` (128 * tp by default, as Megatron-LM
does). The padded columns, at the end of the last ranks' slices, are cut off before the softmax (``VocabShard`` keeps
only the real columns of its slice), so they carry no mass and no padded logit is ever read.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megaopd.models.distributions import entropy


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; the gradient of each rank's input is the sum of the gradients of all ranks' outputs."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _sum(x: torch.Tensor, group) -> torch.Tensor:
    return _AllReduceSum.apply(x, group) if dist.get_world_size(group) > 1 else x


def _logsumexp(local: torch.Tensor, group) -> torch.Tensor:
    """log-sum-exp over the last dimension of every rank's slice [..., columns] (a slice may be empty): a max and a
    sum all-reduced over the TP group."""
    local_max = local.amax(-1) if local.shape[-1] else torch.full(local.shape[:-1], -torch.inf, device=local.device)
    global_max = local_max.detach()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    return torch.log(_sum((local - global_max.unsqueeze(-1)).exp().sum(-1), group)) + global_max


class VocabShard:
    """The log-softmax of one TP rank's vocabulary slice: ``log_softmax`` is [b, s, real columns of the slice]; the
    objectives' ``distributions.VocabView`` on the Megatron backend."""

    def __init__(self, logits: torch.Tensor, vocab_size: int, group):
        width = logits.shape[-1]
        self.start = dist.get_rank(group) * width
        self.end = min(self.start + width, vocab_size)  # columns past the real vocabulary are padding
        self.group, self.vocab_size, self.device = group, vocab_size, logits.device
        local = logits[..., : max(self.end - self.start, 0)].float()
        self.logsumexp = _logsumexp(local, group)
        self.log_softmax = local - self.logsumexp.unsqueeze(-1)

    def entropy(self) -> torch.Tensor:
        """The entropy at each position [b, s] on every rank: each slice's share, summed over the TP group."""
        return _sum(entropy(self.log_softmax), self.group)

    def logprobs_of(self, targets: torch.Tensor) -> torch.Tensor:
        """log p(target) on every rank: the owner reads it off its slice, the others add zero. ``targets`` is
        [b, s] (one token per position) or [b, s, K] (K tokens per position)."""
        owned = (targets >= self.start) & (targets < self.end)
        local_index = (targets - self.start).clamp(0, max(self.end - self.start - 1, 0))
        several = targets.dim() == self.log_softmax.dim()
        index = local_index if several else local_index.unsqueeze(-1)
        picked = self.log_softmax.gather(-1, index) if self.end > self.start \
            else torch.zeros_like(index, dtype=self.log_softmax.dtype)
        picked = picked if several else picked.squeeze(-1)
        return _sum(torch.where(owned, picked, 0.0), self.group)

    def tail(self, ids: torch.Tensor) -> torch.Tensor:
        """log of the mass outside ``ids`` [..., K], on every rank: ``distributions.tail_logprob`` over the TP
        slices, by the same logsumexp, each rank leaving out the ids it owns (at least one token stays: K < V)."""
        kept = self.log_softmax
        if self.end > self.start:  # drop the owned ids (a max of 1 where owned: other ids clamp to any column)
            owned = (ids >= self.start) & (ids < self.end)
            local = (ids - self.start).clamp(0, self.end - self.start - 1)
            drop = torch.zeros_like(kept).scatter_reduce(-1, local, owned.to(kept.dtype), reduce="amax") > 0
            kept = kept.masked_fill(drop, -torch.inf)
        return _logsumexp(kept, self.group)
