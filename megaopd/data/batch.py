"""The records that pass between rollout, rewards, teachers and the trainer. Tokens are the unit everywhere."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from megaopd.data.rows import Row


@dataclass
class Sample:
    """One sampled response to one prompt."""

    row: Row  # the dataset row: verifier, routing key and ground truth come from here
    group: int  # index of the prompt within the step; GRPO normalises rewards within a group
    prompt_ids: list[int]
    response_ids: list[int]  # includes the EOS token when the model stopped by itself
    rollout_logprobs: list[float]  # per response token, from the engine that sampled it (behaviour policy)
    finish_reason: str  # "stop" (EOS) or "length" (hit max_new_tokens)
    weight_version: int  # the policy version that produced it (its first token's): stale-weight bugs show up here
    reward: float = 0.0
    # The version that produced each response token, where an in-flight weight update landed during the generation
    # (rollout.inflight_updates); None: every token is weight_version's.
    token_versions: list[int] | None = None

    def versions(self) -> list[int]:
        """The weight version of each response token."""
        return self.token_versions or [self.weight_version] * len(self.response_ids)


@dataclass
class TokenBatch:
    """Prompt + response sequences, right-padded, with everything a loss needs aligned to target positions.

    Position t of the per-token tensors scores token t+1 of ``input_ids`` (the usual next-token shift).
    """

    input_ids: torch.Tensor  # [B, S] long
    attention_mask: torch.Tensor  # [B, S] long
    response_mask: torch.Tensor  # [B, S-1] float: 1 where the target token belongs to the response
    rollout_logprobs: torch.Tensor  # [B, S-1] float, 0 outside the response
    advantages: torch.Tensor | None = None  # [B, S-1] per-token advantage (GRPO broadcasts per sample)
    # [B, S-1] policy logprobs before this step's update, at the run's temperature (rollout.policy_temperature)
    old_logprobs: torch.Tensor | None = None
    # [B, S-1] the same policy's logprobs under the distribution the engine reports its logprobs at (the rollout's
    # temperature / top-p: rollout.reported_sampling); the IS ratio and the mismatch metrics compare these with
    # rollout_logprobs. The old logprobs themselves where the engine reports the loss's distribution (no top-p cut).
    sampling_logprobs: torch.Tensor | None = None
    # [B, S-1] entropy of the policy's distribution at each position before the update, from the old-logprob pass
    # (at the run's temperature); only where the objective reads it (fixed_advantage.scale=entropy), else None
    old_entropy: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None  # [B, S-1] reference policy, for the KL penalty
    teacher_logprobs: torch.Tensor | None = None  # [B, S-1] teacher logprob of each realised token
    # opd.form=topk: the teacher's K most likely tokens at each response position, their logprobs, and the log of
    # the mass outside them (the tail bucket). The full form holds no [B, S-1, V] grid: see teachers.py.
    teacher_topk_ids: torch.Tensor | None = None  # [B, S-1, K] long
    teacher_topk_logprobs: torch.Tensor | None = None  # [B, S-1, K]
    teacher_tail: torch.Tensor | None = None  # [B, S-1]
    # [B, S-1] 1 where a token's teacher logprob is the teacher's own: all of them but where a teacher of another
    # tokenizer split one of its tokens over several of the student's (megaopd.teachers.cross_tokenizer); None without such a teacher
    teacher_exact: torch.Tensor | None = None
    teacher_route: torch.Tensor | None = None  # [B] long: index of each sample's teacher in TeacherRouter.routes
    teacher_row_start: torch.Tensor | None = None  # [B] long: first row of each sample's kept full-vocab teacher rows
    # [B, S-1] policy-gradient weights from p_trainer / p_rollout: truncated IS (train.tis) x mask (train.is_mask)
    is_weights: torch.Tensor | None = None
    token_versions: torch.Tensor | None = None  # [B, S-1] long: the weight version of each response token, 0 elsewhere
    # [B, S-1] 0 at response tokens more than rollout.max_staleness versions old when the batch trains
    # (rollout.stale_tokens=mask), 1 elsewhere; None: none are
    fresh_mask: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: slice | torch.Tensor) -> "TokenBatch":
        """A micro-batch: every tensor field sliced along the sample dimension."""
        kwargs = {name: (value[index] if isinstance(value, torch.Tensor) else value)
                  for name, value in self.__dict__.items()}
        return TokenBatch(**kwargs)

    def to(self, device: torch.device | str) -> "TokenBatch":
        """Every tensor field on `device` (where the loss meets the logprobs: a CUDA op refuses CPU operands)."""
        return TokenBatch(**{name: (value.to(device) if isinstance(value, torch.Tensor) else value)
                             for name, value in self.__dict__.items()})


def collate(samples: list[Sample], pad_id: int) -> TokenBatch:
    """The samples as right-padded rows. Built from flat token lists with masks (a boolean index fills row by row),
    not row by row: a step of 128 samples took 4.6 ms in ~800 small tensor ops before."""
    prompt_lens = torch.tensor([len(s.prompt_ids) for s in samples])
    response_lens = torch.tensor([len(s.response_ids) for s in samples])
    lengths = prompt_lens + response_lens
    column = torch.arange(int(lengths.max()))
    attention_mask = (column < lengths[:, None]).long()
    input_ids = torch.full(attention_mask.shape, pad_id, dtype=torch.long)
    input_ids[attention_mask.bool()] = torch.tensor([t for s in samples for t in (*s.prompt_ids, *s.response_ids)],
                                                    dtype=torch.long)
    # Target position t scores token t + 1: a response's tokens are scored from its prompt's last position on.
    target = column[:-1]
    in_response = (target >= prompt_lens[:, None] - 1) & (target < (prompt_lens + response_lens)[:, None] - 1)
    rollout_logprobs = torch.zeros(in_response.shape)
    rollout_logprobs[in_response] = torch.tensor([lp for s in samples for lp in s.rollout_logprobs],
                                                 dtype=rollout_logprobs.dtype)
    token_versions = torch.zeros(in_response.shape, dtype=torch.long)
    token_versions[in_response] = torch.tensor([v for s in samples for v in s.versions()], dtype=torch.long)
    return TokenBatch(input_ids, attention_mask, in_response.float(), rollout_logprobs,
                      token_versions=token_versions)


@dataclass
class TeacherScores:
    """What the teachers put on a batch (its ``teacher_*`` fields, by ``TeacherRouter.score``) and each route's
    samples, apart from the batch: teacher servers score a step's samples as they arrive (``rollout_pipeline``), and
    a checkpoint holds the scores of the batches generated ahead."""

    fields: dict[str, torch.Tensor | None]  # TokenBatch field name -> its value
    routes: dict[str, list[int]]  # route -> indices of its samples
    seconds: float  # wall seconds the scoring took (on whichever thread ran it)

    @classmethod
    def of(cls, batch: TokenBatch, routes: dict[str, list[int]], seconds: float) -> "TeacherScores":
        return cls({name: getattr(batch, name) for name in TEACHER_FIELDS}, routes, seconds)

    def fill(self, batch: TokenBatch) -> dict[str, list[int]]:
        """Puts the scores on `batch` (the same samples, collated the same way); returns the routes."""
        for name, value in self.fields.items():
            setattr(batch, name, value)
        return self.routes


TEACHER_FIELDS = tuple(f.name for f in fields(TokenBatch) if f.name.startswith("teacher_"))
