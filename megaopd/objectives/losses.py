"""Losses as the field implements them (see docs/opd.md). Per-token losses only: the
policy turns them into a token-mean over the whole minibatch, so the aggregation stays right under gradient
accumulation.

- GRPO: group-normalised advantages, PPO-clipped surrogate with separate low / high clip, optional k3 KL.
- OPD sampled-token form: per-token advantage -(logp_student_old - logp_teacher), detached, in the same clipped
  policy-gradient surrogate (never backprop through the sampled k1 value: its expected gradient is zero).
- OPD full-vocabulary form: KL(student || teacher) (or the forward KL) summed over the vocabulary at each response
  position; the teacher's log-softmax is computed per chunk of rows inside the student's chunked projection.
- OPD top-k form: the same KL restricted to the teacher's top-K tokens plus one tail bucket holding the rest of
  both distributions' mass, exact when K covers the vocabulary.
- GRPO + OPD in one objective: GRPO's group advantage plus ``opd.coef`` times the OPD term (the sampled-token
  advantage, or the KL added to the loss).
- The fixed-advantage control of OPD (arXiv 2608.31046's): a fixed negative advantage on the lowest-logprob
  fraction of each response's sampled tokens under the policy before the step, 0 elsewhere, in the same clipped
  surrogate; no teacher, no reward, no reference. Its entropy-scaled form (``fixed_advantage.scale=entropy``, the
  paper's OPSA) grades that advantage by each selected token's entropy under the policy before the step.
- SFT (the cold start): the NLL of the worked solution's tokens.

A KL form hands the policy a ``VocabTerm``: per micro-batch, a function from the student's log-softmax on a chunk of
response rows (``distributions.VocabView``: whole on the HF backend, a TP rank's slice on Megatron's) to one
differentiable number per row, so no [rows x V] tensor exists beyond one chunk. The objective owns the term; a
backend only hands it its view of the student's distribution. ``check_opd`` is the one place that refuses an OPD
setting a backend or teacher engine cannot run.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Callable

import torch

from megaopd.data.batch import Sample, TokenBatch
from megaopd.config import (ConfigError, FixedAdvantageConfig, FixedAdvantageScope, GRPOConfig, OPDConfig, TrainConfig,
                            choices)
from megaopd.models.distributions import TAIL_FLOOR, VocabView, WholeVocab
from megaopd.objectives.methods import Method, method

# (the student's distribution at rows ``index`` of the micro-batch's rows, [c, V]; ``index``) -> one KL per row [c]
RowTerm = Callable[[VocabView, slice], torch.Tensor]


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


def weighted_clipped_loss(logp: torch.Tensor, mb: TokenBatch, clip_low: float, clip_high: float,
                          weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped surrogate of ``mb.advantages`` against ``mb.old_logprobs``, times the IS weights when given (the
    one block GRPO, OPD's sampled form and the fixed-advantage control share). Returns (loss, clipped flag)."""
    loss, clipped = clipped_pg_loss(logp, mb.old_logprobs, mb.advantages, clip_low, clip_high)
    if weights is not None:
        loss = loss * weights
    return loss, clipped


def _log_ratio(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
               level: str) -> torch.Tensor:
    """log p_trainer / p_rollout per token (``token``), or summed over the response and broadcast to its tokens
    (``sequence``); 0 outside the response."""
    log_ratio = (trainer_logp - rollout_logp) * mask
    if level == "sequence":
        return log_ratio.sum(-1, keepdim=True).expand_as(mask)
    if level != "token":
        raise ValueError(f"an importance-ratio level must be token or sequence, got {level!r}")
    return log_ratio


def truncated_is_weights(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, level: str,
                         cap: float) -> torch.Tensor:
    """min(p_trainer / p_rollout, cap), detached: corrects for sampling with an engine whose numbers differ.

    ``token``: one ratio per token. ``sequence``: the product over the response, broadcast to its tokens (unbiased
    for sequence-level rewards, higher variance). 1 outside the response.
    """
    weights = _log_ratio(trainer_logp, rollout_logp, mask, level).exp().clamp(max=cap)
    return torch.where(mask.bool(), weights, 1.0).detach()


def ratio_mask(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, level: str, low: float,
               high: float) -> torch.Tensor:
    """IcePop's two-sided mask: 0 at response tokens whose ratio p_trainer / p_rollout (per token, or the product
    over the response) lies outside [low, high], 1 elsewhere. Masked tokens leave the policy-gradient term and
    stay in the token-mean's denominator (the loss's aggregation does not change with the mask)."""
    ratio = _log_ratio(trainer_logp, rollout_logp, mask, level).exp()
    outside = mask.bool() & ((ratio < low) | (ratio > high))
    return torch.where(outside, 0.0, 1.0)


@dataclass
class ISCorrection:
    """One step's policy-gradient weights (train.tis x train.is_mask) and the response tokens each one touched."""

    weights: torch.Tensor  # [B, S-1], detached; 1 off the response
    truncated: torch.Tensor | None  # [B, S-1] bool: response tokens whose weight is tis_cap (None: train.tis=none)
    masked: torch.Tensor | None  # [B, S-1] bool: response tokens outside the band (None: train.is_mask=none)


def is_correction(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                  train: TrainConfig) -> ISCorrection | None:
    """The weights from the trainer's and the engine's logprobs of the sampled tokens, both taken under the same
    (sampling) distribution; None when both corrections are off."""
    if train.tis == "none" and train.is_mask == "none":
        return None
    response = mask.bool()
    weights, truncated, masked = torch.ones_like(mask), None, None
    if train.tis != "none":
        weights = truncated_is_weights(trainer_logp, rollout_logp, mask, train.tis, train.tis_cap)
        truncated = response & (weights >= train.tis_cap)
    if train.is_mask != "none":
        keep = ratio_mask(trainer_logp, rollout_logp, mask, train.is_mask, train.is_mask_low, train.is_mask_high)
        weights, masked = weights * keep, keep == 0
    return ISCorrection(weights.detach(), truncated, masked)


def prefix_weights(weights: torch.Tensor) -> torch.Tensor:
    """The IS weights of OPD's KL forms: position t's KL is taken over the whole vocabulary at the prefix the
    sampled tokens before it drew, so the ratio of token t itself integrates out (its weight would be 1 in
    expectation) and what staleness changes is the prefix: position t takes the weight of token t - 1, the first
    response position (the prompt's prefix) 1. Per token, the last draw's ratio; per sequence, the response's
    product (unbiased: the later tokens' ratios average 1). ``weights``: [B, S-1], 1 off the response."""
    return torch.cat([torch.ones_like(weights[:, :1]), weights[:, :-1]], -1)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || ref): exp(ref - logp) - (ref - logp) - 1, always >= 0."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def full_vocab_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                  direction: str = "reverse") -> torch.Tensor:
    """reverse: sum_v p_s (log p_s - log p_t); forward: sum_v p_t (log p_t - log p_s). Differentiable in the student.
    Additive over the vocabulary, so a vocabulary slice gives that slice's share (Megatron's TP ranks)."""
    if direction == "reverse":
        return (student_logprobs.exp() * (student_logprobs - teacher_logprobs)).sum(-1)
    return (teacher_logprobs.exp() * (teacher_logprobs - student_logprobs)).sum(-1)


def topk_kl(student: VocabView, teacher_ids: torch.Tensor, teacher_topk: torch.Tensor, teacher_tail: torch.Tensor,
            direction: str = "reverse") -> torch.Tensor:
    """The KL between the two distributions coarsened to {teacher's top-K tokens, everything else}, per row.

    student: the student's distribution at c rows (a ``VocabView``: whole, or a TP rank's slice); teacher_ids /
    teacher_topk: [c, K] token ids and teacher logprobs; teacher_tail: [c] log of the teacher's remaining mass. By
    the data-processing inequality it is a lower bound of the full KL that tightens as K grows, and equals it when K
    covers the vocabulary (both tails are then 0: no tail and no 0 * log 0 to differentiate).
    """
    p, q = student.logprobs_of(teacher_ids), teacher_topk
    if direction == "forward":
        p, q = q, p
    head = (p.exp() * (p - q)).sum(-1)
    if teacher_ids.shape[-1] >= student.vocab_size:
        return head
    p_tail, q_tail = student.tail(teacher_ids), teacher_tail.clamp(min=TAIL_FLOOR)
    if direction == "forward":
        p_tail, q_tail = q_tail, p_tail
    return head + p_tail.exp() * (p_tail - q_tail)


class VocabTerm:
    """The KL to the teacher at a micro-batch's rows, for the policy's chunked vocabulary projection.

    ``rows(mb)`` returns a ``RowTerm`` over the micro-batch's response rows in ``response_mask.nonzero()`` order (the
    HF backend projects those only); ``sequences(mb)`` over its whole sequences, every target position [c, S-1]
    (Megatron's output layer projects whole sequences; the loss masks the rest). The top-k form reads the teacher's
    top-K from the batch; the full form asks the teachers for their distribution on those rows only
    (``TeacherRouter.full_rows``), so neither side ever holds [rows x V] beyond one chunk.
    """

    def __init__(self, form: str, direction: str, teachers=None):
        self.form, self.direction, self.teachers = form, direction, teachers

    def rows(self, mb: TokenBatch) -> RowTerm:
        if self.form == "topk":
            where = mb.response_mask.bool()
            return self._topk(mb.teacher_topk_ids[where], mb.teacher_topk_logprobs[where], mb.teacher_tail[where])
        teacher_rows = self.teachers.full_rows(mb)

        def term(student: WholeVocab, index: slice) -> torch.Tensor:
            return full_vocab_kl(student.logprobs, teacher_rows(index).to(student.device), self.direction)
        return term

    def sequences(self, mb: TokenBatch) -> RowTerm:
        return self._topk(mb.teacher_topk_ids, mb.teacher_topk_logprobs, mb.teacher_tail)  # check_opd: top-k only

    def _topk(self, ids: torch.Tensor, topk: torch.Tensor, tail: torch.Tensor) -> RowTerm:
        def term(student: VocabView, index: slice) -> torch.Tensor:
            device = student.device
            return topk_kl(student, ids[index].to(device), topk[index].to(device), tail[index].to(device),
                           self.direction)
        return term


def form_label(algorithm: str, opd: OPDConfig) -> str:
    """What a report calls a run's objective: e.g. ``opd:topk(K=16,reverse)``, ``grpo+opd:sampled(coef=0.5)``."""
    spec = method(algorithm)
    if not spec.teacher_term:
        return spec.label
    detail = [f"K={opd.topk}"] * (opd.form == "topk") + [opd.kl] * (opd.form != "sampled") + \
        [f"coef={opd.coef:g}"] * spec.group_term
    return f"{spec.label}:{opd.form}" + (f"({','.join(detail)})" if detail else "")


def check_opd(opd: OPDConfig, backend: str, aligned: Collection[str] = ()) -> None:
    """Refuses, before any model loads, an OPD setting that the backend or the teacher engine cannot run: the one
    place these refusals live (``megaopd.run.resolve.resolve_run`` calls it). ``aligned``: the routes
    whose teacher has another tokenizer than the student (``align.alignment_tokenizers``, read by ``resolve_run``)."""
    if unknown := sorted(set(opd.teacher_tokenizer) - set(opd.teachers)):
        raise ConfigError(f"opd.teacher_tokenizer names route(s) {unknown} that opd.teachers does not have "
                          f"({sorted(opd.teachers)}); key it by the teacher's route")
    if aligned and opd.form != "sampled":
        raise ConfigError(f"the teacher(s) of route(s) {sorted(aligned)} have another tokenizer than the student: "
                          f"the two distributions are over different vocabularies, so opd.form={opd.form} has no "
                          "per-token KL to compute; set opd.form=sampled (its log-ratio is aligned on the text)")
    if aligned and backend == "megatron":
        raise ConfigError(f"the teacher(s) of route(s) {sorted(aligned)} have another tokenizer than the student: "
                          "cross-tokenizer OPD runs on model.backend=hf (local or SGLang teachers)")
    if opd.form == "topk" and opd.topk < 1:
        raise ConfigError(f"opd.form=topk needs opd.topk=K >= 1 (teacher logprobs kept per position), got {opd.topk}; "
                          "set opd.topk=K (e.g. opd.topk=8)")
    if opd.form == "full_vocab" and opd.teacher_engine == "sglang":
        raise ConfigError("teacher servers return at most a top-k per position; set opd.form=topk (opd.topk=K) or "
                          "sampled, or opd.teacher_engine=local for the full-vocabulary form")
    if opd.teacher_dtype and opd.teacher_engine == "local" and backend == "megatron":
        raise ConfigError(f"opd.teacher_dtype={opd.teacher_dtype} applies to HF and SGLang teachers; Megatron teachers "
                          "run in model.dtype: leave opd.teacher_dtype empty")
    if opd.form == "full_vocab" and backend == "megatron":
        raise ConfigError("model.backend=megatron computes the top-k OPD form, not full_vocab (docs/opd.md): set "
                          "opd.form=topk with opd.topk=K (K = the vocabulary size is the exact full loss)")


class GRPO:
    """Group-relative policy optimisation; advantages from rewards, one per sample, broadcast to its tokens."""

    vocab_term = None
    needs_entropy = False  # whether prepare reads batch.old_entropy (the trainer's old-logprob pass gives it)

    def __init__(self, cfg: GRPOConfig, group_size: int):
        self.cfg, self.group_size = cfg, group_size

    def prepare(self, batch: TokenBatch, samples: list[Sample]) -> dict[str, float]:
        rewards = torch.tensor([s.reward for s in samples])
        advantages, zero_var = group_advantages(rewards, self.group_size, self.cfg.scale_std)
        batch.advantages = advantages[:, None] * batch.response_mask
        return {"zero_variance_groups": zero_var, "zero_variance_share": zero_var / (len(samples) / self.group_size)}

    def token_loss(self, logp, vocab, mb: TokenBatch):
        return self.surrogate(logp, mb, mb.is_weights)

    def surrogate(self, logp, mb: TokenBatch, weights: torch.Tensor | None):
        """The clipped surrogate of ``mb.advantages``, times the IS weights when given, plus the k3 KL."""
        loss, clipped = weighted_clipped_loss(logp, mb, self.cfg.clip_low, self.cfg.clip_high, weights)
        metrics = {"clip_fraction": clipped}
        if self.cfg.kl_coef > 0:
            kl = k3_kl(logp, mb.ref_logprobs)
            loss = loss + self.cfg.kl_coef * kl
            metrics["kl_ref"] = kl
        return loss, metrics


class OPD:
    """Vanilla on-policy distillation from a frozen teacher (one per domain with routing), in one of three forms."""

    needs_entropy = False

    def __init__(self, cfg: OPDConfig, teachers=None):
        self.cfg, self.form = cfg, cfg.form
        self.vocab_term = None if cfg.form == "sampled" else VocabTerm(cfg.form, cfg.kl, teachers)

    def prepare(self, batch: TokenBatch, samples: list[Sample]) -> dict[str, float]:
        # The sampled form's detached per-token advantage; the KL forms read the teacher in the loss instead.
        if self.vocab_term is None:
            batch.advantages = -(batch.old_logprobs - batch.teacher_logprobs) * batch.response_mask
        return {}

    def token_loss(self, logp, vocab, mb: TokenBatch):
        if self.vocab_term is not None:  # stale samples: each position's KL by its prefix's IS weight
            loss = vocab if mb.is_weights is None else vocab * prefix_weights(mb.is_weights)
            return loss, {f"{self.cfg.kl}_kl": vocab.detach()}
        loss, clipped = weighted_clipped_loss(logp, mb, self.cfg.clip, self.cfg.clip, mb.is_weights)
        return loss, {"clip_fraction": clipped, "reverse_kl_k1": -mb.advantages}


class GRPOWithOPD:
    """GRPO's group advantage plus ``opd.coef`` times the OPD term, per token, in one objective.

    Sampled form: A_t = A_group + coef * -(logp_s_old(y_t) - logp_t(y_t)) in GRPO's clipped surrogate. KL forms: the
    GRPO surrogate plus coef * KL(student, teacher) at each position. coef = 0 is GRPO exactly; all-zero rewards
    (every group has zero variance) leave the OPD term alone, which is OPD exactly when grpo's clip equals opd.clip.

    IS weights w_t (train.tis, train.is_mask) weight both parts as each method alone takes them: the sampled form's
    one surrogate of the combined advantage by the token's own ratio, w_t * surrogate(A_group + coef * A_opd); the KL
    forms' w_t * surrogate(A_group) + coef * w_{t-1} * KL_t (``prefix_weights``, as ``OPD``). w = 1 is the
    unweighted loss bit for bit.
    """

    needs_entropy = False

    def __init__(self, grpo: GRPOConfig, opd: OPDConfig, group_size: int, teachers=None):
        self.grpo, self.opd = GRPO(grpo, group_size), OPD(opd, teachers)
        self.coef = opd.coef
        self.vocab_term = self.opd.vocab_term

    def prepare(self, batch: TokenBatch, samples: list[Sample]) -> dict[str, float]:
        metrics = self.grpo.prepare(batch, samples)
        group = batch.advantages
        tokens = batch.response_mask.sum().clamp(min=1)
        metrics["group_advantage"] = float(group.abs().sum() / tokens)
        if self.vocab_term is not None:  # a KL form: its term is in the loss, the advantage is GRPO's
            return metrics
        self.opd.prepare(batch, samples)
        opd_advantage = self.coef * batch.advantages
        batch.advantages = group + opd_advantage
        return metrics | {"opd_advantage": float(opd_advantage.abs().sum() / tokens)}

    def token_loss(self, logp, vocab, mb: TokenBatch):
        loss, metrics = self.grpo.surrogate(logp, mb, mb.is_weights)
        if self.vocab_term is not None:  # OPD's own KL term, each position by its prefix's weight
            kl, kl_metrics = self.opd.token_loss(logp, vocab, mb)
            loss, metrics = loss + self.coef * kl, metrics | kl_metrics
        return loss, metrics


def lowest_logprob_tokens(logprobs: torch.Tensor, mask: torch.Tensor, fraction: float,
                          scope: str = "response") -> torch.Tensor:
    """1 at the max(1, floor(fraction * N)) response tokens of lowest logprob, 0 elsewhere: N counts each response's
    tokens (``response``) or the batch's (``batch``: one pool). Ties go to the earlier token; an empty response
    has none. ``logprobs``, ``mask``: [B, S-1]."""
    if scope not in choices(FixedAdvantageScope):
        raise ValueError(f"a selection scope must be one of {choices(FixedAdvantageScope)}, got {scope!r}")
    shape, response = logprobs.shape, mask.bool()
    if scope == "batch":
        logprobs, response = logprobs.reshape(1, -1), response.reshape(1, -1)
    n = response.sum(-1, keepdim=True)
    k = torch.where(n > 0, (fraction * n.double()).floor().clamp(min=1), 0)
    # Each token's rank among its row's response tokens by logprob (non-response positions rank last).
    rank = torch.where(response, logprobs, math.inf).argsort(dim=-1, stable=True).argsort(dim=-1)
    return (response & (rank < k)).to(mask.dtype).reshape(shape)


def entropy_scaled_advantages(entropy: torch.Tensor, selected: torch.Tensor, at_lowest: float, at_highest: float,
                              scope: str = "response") -> torch.Tensor:
    """The paper's OPSA advantage (arXiv 2608.31046; its code, slime's ``compute_opsa``): at each selected token
    at_lowest + (at_highest - at_lowest) * r, r its entropy min-max normalised over the selected tokens of its pool
    (a response, or the batch: ``scope``, as ``lowest_logprob_tokens``); r = 1 where they all have one entropy (the
    paper's code: every token gets at_highest). 0 at the others. ``entropy``, ``selected``: [B, S-1]."""
    shape, chosen = entropy.shape, selected.bool()
    if scope == "batch":
        entropy, chosen = entropy.reshape(1, -1), chosen.reshape(1, -1)
    low = torch.where(chosen, entropy, math.inf).amin(-1, keepdim=True)
    span = torch.where(chosen, entropy, -math.inf).amax(-1, keepdim=True) - low
    rank = torch.where(span > 1e-12, (entropy - low) / span, 1.0)  # the paper's code's threshold
    return torch.where(chosen, at_lowest + (at_highest - at_lowest) * rank, 0.0).to(selected.dtype).reshape(shape)


def check_fixed_advantage(cfg: FixedAdvantageConfig, recompute_old_logprobs: bool = True) -> None:
    """Refuses, before any model loads, settings of the fixed-advantage control that would train nothing or read an
    entropy nothing computes."""
    if not 0 < cfg.fraction <= 1:
        raise ConfigError(f"fixed_advantage.fraction must be in (0, 1] (the share of tokens given the advantage), "
                          f"got {cfg.fraction:g}; set e.g. fixed_advantage.fraction=0.2")
    if cfg.advantage == 0:
        raise ConfigError("fixed_advantage.advantage=0 trains nothing; set the fixed advantage, e.g. "
                          "fixed_advantage.advantage=-0.5")
    if not cfg.clip > 0:
        raise ConfigError(f"fixed_advantage.clip must be > 0 (the importance ratio's clip), got {cfg.clip:g}; set "
                          "e.g. 0.2")
    if cfg.scale == "entropy" and not recompute_old_logprobs:
        raise ConfigError("fixed_advantage.scale=entropy reads each position's entropy from the trainer's "
                          "old-logprob pass, which train.recompute_old_logprobs=false skips: set "
                          "train.recompute_old_logprobs=true")


class FixedAdvantage:
    """OPD's control without the teacher (docs/opd.md): ``fixed_advantage.advantage`` on the
    ``fixed_advantage.fraction`` of sampled tokens with the lowest logprob under the policy before the step (the old
    logprobs), 0 on the others, in the clipped surrogate; with ``fixed_advantage.scale=entropy`` (the paper's OPSA)
    graded by each selected token's entropy (``entropy_scaled_advantages``). Every selected token is pushed the same
    way: no teacher, reward or reference decides anything."""

    vocab_term = None

    def __init__(self, cfg: FixedAdvantageConfig):  # checked by resolve_run (check_fixed_advantage)
        self.cfg = cfg
        self.needs_entropy = cfg.scale == "entropy"

    def prepare(self, batch: TokenBatch, samples: list[Sample]) -> dict[str, float]:
        cfg = self.cfg
        selected = lowest_logprob_tokens(batch.old_logprobs, batch.response_mask, cfg.fraction, cfg.scope)
        chosen = selected.sum().clamp(min=1)
        metrics = {"fixed_advantage_selected_share": float(selected.sum() / batch.response_mask.sum().clamp(min=1)),
                   "fixed_advantage_selected_logprob": float((batch.old_logprobs * selected).sum() / chosen)}
        if not self.needs_entropy:
            batch.advantages = cfg.advantage * selected
            return metrics
        batch.advantages = entropy_scaled_advantages(batch.old_entropy, selected, cfg.advantage,
                                                     cfg.entropy_advantage, cfg.scope)
        return metrics | {"fixed_advantage_selected_entropy": float((batch.old_entropy * selected).sum() / chosen),
                          "fixed_advantage_selected_advantage": float(batch.advantages.sum() / chosen)}

    def token_loss(self, logp, vocab, mb: TokenBatch):
        loss, clipped = weighted_clipped_loss(logp, mb, self.cfg.clip, self.cfg.clip, mb.is_weights)
        return loss, {"clip_fraction": clipped}


class SFT:
    """The cold start: the NLL of the worked solution's tokens (teacher-forced, no rollouts)."""

    vocab_term = None
    needs_entropy = False

    def token_loss(self, logp, vocab, mb: TokenBatch):
        return -logp, {}


def build_objective(spec: Method, grpo: GRPOConfig, opd: OPDConfig, fixed_advantage: FixedAdvantageConfig,
                    group_size: int, teachers=None):
    """The objective of a method's terms, from their config sections; ``group_size``: the samples per prompt
    (``Method.samples_per_prompt``)."""
    if spec.self_term:
        return FixedAdvantage(fixed_advantage)
    if spec.group_term and spec.teacher_term:
        return GRPOWithOPD(grpo, opd, group_size, teachers)
    if spec.group_term:
        return GRPO(grpo, group_size)
    return OPD(opd, teachers) if spec.teacher_term else SFT()
