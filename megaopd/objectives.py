"""Losses as the field implements them (see shared/reference/losses.md). Per-token losses only: the policy turns
them into a token-mean over the whole minibatch, so the aggregation stays right under gradient accumulation.

- GRPO: group-normalised advantages, PPO-clipped surrogate with separate low / high clip, optional k3 KL.
- OPD sampled-token form: per-token advantage -(logp_student_old - logp_teacher), detached, in the same clipped
  policy-gradient surrogate (never backprop through the sampled k1 value: its expected gradient is zero).
- OPD full-vocabulary form: KL(student || teacher) summed over the vocabulary at each response position.
"""

from __future__ import annotations

import torch

from megaopd.batch import Sample, TokenBatch
from megaopd.config import GRPOConfig, OPDConfig


def group_advantages(rewards: torch.Tensor, group_size: int, scale_std: bool = True,
                     eps: float = 1e-6) -> tuple[torch.Tensor, int]:
    """(r - mean_group) / (std_group + eps), or unscaled (Dr.GRPO). Returns advantages and #zero-variance groups."""
    grouped = rewards.view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True, unbiased=False)
    # A zero-variance group has centred == 0: its advantages are 0 with or without scaling (never 0/0).
    advantages = torch.where(std > 0, centred / (std + eps), 0.0) if scale_std else centred
    return advantages.reshape(-1), int((std.squeeze(1) == 0).sum())


def clipped_pg_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                    clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO surrogate per token: -min(ratio * A, clip(ratio, 1-low, 1+high) * A). Returns (loss, clipped flag)."""
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), (clipped < unclipped).float()


TIS_LEVELS = ("none", "token", "sequence")


def truncated_is_weights(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, level: str,
                         cap: float) -> torch.Tensor:
    """min(p_trainer / p_rollout, cap), detached: corrects for sampling with an engine whose numbers differ.

    ``token``: one ratio per token. ``sequence``: the product over the response, broadcast to its tokens (unbiased
    for sequence-level rewards, higher variance). 1 outside the response.
    """
    log_ratio = (trainer_logp - rollout_logp) * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(mask)
    elif level != "token":
        raise ValueError(f"truncated IS level must be token or sequence, got {level!r}")
    weights = log_ratio.exp().clamp(max=cap)
    return torch.where(mask.bool(), weights, 1.0).detach()


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || ref): exp(ref - logp) - (ref - logp) - 1, always >= 0."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def full_vocab_reverse_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """sum_v p_s(v) (log p_s(v) - log p_t(v)) at each position; differentiable in the student."""
    return (student_logprobs.exp() * (student_logprobs - teacher_logprobs)).sum(-1)


class GRPO:
    """Group-relative policy optimisation; advantages from rewards, one per sample, broadcast to its tokens."""

    full_vocab = False

    def __init__(self, cfg: GRPOConfig, group_size: int):
        self.cfg, self.group_size = cfg, group_size

    @property
    def needs_reference(self) -> bool:
        return self.cfg.kl_coef > 0

    def prepare(self, batch: TokenBatch, samples: list[Sample]) -> dict[str, float]:
        rewards = torch.tensor([s.reward for s in samples])
        advantages, zero_var = group_advantages(rewards, self.group_size, self.cfg.scale_std)
        batch.advantages = advantages[:, None] * batch.response_mask
        return {"zero_variance_groups": zero_var, "zero_variance_share": zero_var / (len(samples) / self.group_size)}

    def token_loss(self, logp, full, mb: TokenBatch):
        loss, clipped = clipped_pg_loss(logp, mb.old_logprobs, mb.advantages, self.cfg.clip_low, self.cfg.clip_high)
        if mb.is_weights is not None:
            loss = loss * mb.is_weights
        metrics = {"clip_fraction": clipped}
        if self.cfg.kl_coef > 0:
            kl = k3_kl(logp, mb.ref_logprobs)
            loss = loss + self.cfg.kl_coef * kl
            metrics["kl_ref"] = kl
        return loss, metrics


class OPD:
    """Vanilla reverse-KL on-policy distillation from a frozen teacher (one per domain with routing)."""

    needs_reference = False

    def __init__(self, cfg: OPDConfig):
        if cfg.form not in ("full_vocab", "sampled"):
            raise ValueError(f"opd.form must be 'full_vocab' or 'sampled', got {cfg.form!r}")
        self.cfg = cfg
        self.full_vocab = cfg.form == "full_vocab"

    def prepare(self, batch: TokenBatch, samples: list[Sample]) -> dict[str, float]:
        # Detached per-token advantage of the sampled form; for the full form it is logged as the k1 estimate.
        batch.advantages = -(batch.old_logprobs - batch.teacher_logprobs) * batch.response_mask
        return {}

    def token_loss(self, logp, full, mb: TokenBatch):
        if self.full_vocab:
            # `full` holds the student's N response positions only; the KL is computed there and placed in the grid.
            where, teacher = mb.response_mask.bool(), mb.teacher_full_logprobs
            teacher_n = teacher[where.to(teacher.device)].to(full.device)  # pick the N rows first, then move them
            kl_n = full_vocab_reverse_kl(full, teacher_n)
            kl = logp.new_zeros(logp.shape).index_put_(where.to(logp.device).nonzero(as_tuple=True), kl_n)
            return kl, {"reverse_kl": kl.detach()}
        loss, clipped = clipped_pg_loss(logp, mb.old_logprobs, mb.advantages, self.cfg.clip, self.cfg.clip)
        if mb.is_weights is not None:
            loss = loss * mb.is_weights
        return loss, {"clip_fraction": clipped, "reverse_kl_k1": -mb.advantages}
