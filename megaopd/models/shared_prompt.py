"""A GRPO group's prompt forwarded once (``train.shared_prompt``): the layout both backends run, backend-neutral. The
HF attention over it is ``megaopd.models.hf_shared_prompt``, Megatron's ``megaopd.models.megatron.shared_prompt``;
when the switch applies to a run, ``megaopd.run.resolve`` (``shared_prompt_problem``). docs/shared_prompt.md is the
design.

The rows of a micro-batch (prompt + response, right-padded: ``batch.collate``'s layout) become one flat sequence of
T tokens: each group's prompt once, padded to the longest prompt (Pp), then each sample's response, padded to the
longest response (Rp)::

    [ prompt_0 | ... | prompt_{G-1} | response_0 | ... | response_{b-1} ]      T = G*Pp + b*Rp
      G x Pp                          b x Rp

A group is a run of consecutive rows with equal prompt tokens (the samples of one prompt). Response token t of a
sample whose prompt has P tokens sits at position P + t, as in its own row. The model's body (projections, MLP,
norms) runs on the T tokens; attention runs per segment through the backend's own kernel: each prompt causally over
itself, each response over its prompt's keys and values (the same tensors for every sample of the group, so autograd
sums their gradients) and causally over its own. The hidden state that predicts a response's first token is the
prompt's last one, shared by the group.

    groups = PromptGroups.of(batch.input_ids, batch.attention_mask, batch.response_mask, pad_id)  # None: no sharing
    hidden_flat[groups.source]   # [b, S, H]: each row position's hidden state, as the row's own forward gives it
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PromptGroups:
    input_ids: torch.Tensor  # [T] long: the flat sequence
    positions: torch.Tensor  # [T] long: each token's position in its own row
    group_of: torch.Tensor  # [b] long: each sample's group
    prompt_lens: torch.Tensor  # [G] long
    response_lens: torch.Tensor  # [b] long
    prompt_width: int  # Pp
    response_width: int  # Rp
    # [b, S] long: where each position of the rows sits in the flat sequence (a group's prompt for prompt positions;
    # 0 for padding, which nothing reads)
    source: torch.Tensor
    group_size: int  # samples in every group where all groups have as many (a GRPO batch), else 0

    @classmethod
    def of(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
           pad_id: int, always: bool = False) -> "PromptGroups | None":
        """The layout of right-padded rows, or None where the rows are not right-padded, or where no two
        consecutive rows share a prompt (nothing to save) unless ``always`` (a backend whose micro-batches must all
        take one form). A row without response tokens is its own group, all prompt."""
        found = group_rows(input_ids, attention_mask, response_mask)
        if found is None:
            return None
        group_of, prompt_lens, response_lens = found
        ids, (rows, width) = input_ids, input_ids.shape
        if int(group_of[-1]) + 1 == rows and not always:  # every row its own group
            return None
        column = torch.arange(width, device=ids.device)
        first = torch.cat([group_of.new_ones(1, dtype=torch.bool), group_of[1:] != group_of[:-1]]).nonzero()[:, 0]
        group_prompts = prompt_lens[first]
        groups, pp, rp = len(first), max(int(group_prompts.max()), 1), max(int(response_lens.max()), 1)

        prompt_cols = torch.arange(pp, device=ids.device)
        prompt_tokens = torch.where(prompt_cols < group_prompts[:, None], ids[first][:, :pp], pad_id)
        response_cols = torch.arange(rp, device=ids.device)
        at = (prompt_lens[:, None] + response_cols).clamp(max=width - 1)
        response_tokens = torch.where(response_cols < response_lens[:, None], ids.gather(1, at), pad_id)
        flat = torch.cat([prompt_tokens.flatten(), response_tokens.flatten()])
        positions = torch.cat([prompt_cols.expand(groups, pp).flatten(),
                               (prompt_lens[:, None] + response_cols).flatten()])

        in_prompt = column < prompt_lens[:, None]
        in_response = (column >= prompt_lens[:, None]) & (column < (prompt_lens + response_lens)[:, None])
        sample = torch.arange(rows, device=ids.device)[:, None]
        source = torch.where(in_prompt, group_of[:, None] * pp + column, 0)
        source = torch.where(in_response, groups * pp + sample * rp + column - prompt_lens[:, None], source)
        sizes = torch.bincount(group_of)
        group_size = int(sizes[0]) if bool((sizes == sizes[0]).all()) else 0
        return cls(flat, positions, group_of, group_prompts, response_lens, pp, rp, source, group_size)

    @property
    def groups(self) -> int:
        return len(self.prompt_lens)

    @property
    def samples(self) -> int:
        return len(self.group_of)

    @property
    def length(self) -> int:
        return len(self.input_ids)

    def sizes(self) -> list[tuple[int, list[int]]]:
        """(prompt length, its samples' response lengths) of each group: what ``saved_flops`` counts."""
        sizes = [(p, []) for p in self.prompt_lens.tolist()]
        for group, r in zip(self.group_of.tolist(), self.response_lens.tolist()):
            sizes[group][1].append(r)
        return sizes

    def to(self, device: torch.device | str) -> "PromptGroups":
        return PromptGroups(**{name: value.to(device) if isinstance(value, torch.Tensor) else value
                               for name, value in self.__dict__.items()})

    def response_visible(self) -> torch.Tensor:
        """[b, 1, Rp, Pp + Rp] bool, True where a response's query attends: its prompt's real tokens, then its own
        tokens causally (padding queries see the prompt too: no row is empty)."""
        prompt = torch.arange(self.prompt_width, device=self.group_of.device) < self.prompt_lens[self.group_of, None]
        own = torch.ones(self.response_width, self.response_width, dtype=torch.bool, device=prompt.device).tril()
        return torch.cat([prompt[:, None, :].expand(-1, self.response_width, -1),
                          own.expand(self.samples, -1, -1)], -1)[:, None]

    def split(self, x: torch.Tensor, seq_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A flat tensor (T along ``seq_dim``, a batch of one beside it) as (prompts [G, Pp, ...], responses
        [b, Rp, ...]); the other dimensions follow in their order, the batch of one dropped."""
        x = x.movedim(seq_dim, 0)[:, 0]
        cut = self.groups * self.prompt_width
        return (x[:cut].unflatten(0, (self.groups, self.prompt_width)),
                x[cut:cut + self.samples * self.response_width].unflatten(0, (self.samples, self.response_width)))

    def spans(self) -> list[tuple[int, int, int, int]]:
        """(group, its first sample, the sample after its last, its prompt length) of each group."""
        ends = torch.bincount(self.group_of, minlength=self.groups).cumsum(0).tolist()
        return [(g, start, end, length) for g, (start, end, length)
                in enumerate(zip([0, *ends[:-1]], ends, self.prompt_lens.tolist()))]

    def response_keys(self, prompt: torch.Tensor, own: torch.Tensor, batch_dim: int, seq_dim: int,
                      span: tuple[int, int, int, int] | None = None) -> torch.Tensor:
        """Each response's keys (or values): its group's prompt's, then its own, along ``seq_dim``. With a ``span``
        (``spans``): that group's samples only (``own`` is theirs), its prompt cut to its real tokens."""
        if span is None:
            return torch.cat([self._per_sample(prompt, batch_dim), own], seq_dim)
        group, _, _, length = span
        part = prompt.narrow(batch_dim, group, 1).narrow(seq_dim, 0, length)
        sizes = list(part.shape)
        sizes[batch_dim] = own.shape[batch_dim]
        return torch.cat([part.expand(sizes), own], seq_dim)

    def _per_sample(self, prompt: torch.Tensor, batch_dim: int) -> torch.Tensor:
        """A per-group tensor repeated for each sample of its group: by index, or where every group has as many
        samples (a GRPO batch) by ``_RepeatPerGroup``, whose backward gives the same sums without the gather's."""
        if not self.group_size:
            return prompt.index_select(batch_dim, self.group_of)
        return _RepeatPerGroup.apply(prompt, batch_dim, self.group_size)

    def join(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """(prompts [G, Pp, ...], responses [b, Rp, ...]) back to the flat [T, ...]."""
        return torch.cat([prompts.flatten(0, 1), responses.flatten(0, 1)])


class _RepeatPerGroup(torch.autograd.Function):
    """Each slice of ``dim`` repeated ``size`` times in a row, as ``index_select`` by ``arange(G).repeat_interleave``.
    The gather's backward scatter-adds the gradient one row at a time (the GRPO bench's update: ~1.3 ms in each of 2
    layers on CPU); this one adds each group's sample slices in sample order onto zeros, the order and rounding of the
    gather's backward, in ``size`` vector adds (a sum over the group, which orders its additions its own way, would
    move the shared-prompt run off the gather's numbers)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
        ctx.dim, ctx.size = dim, size
        sizes = list(x.shape)
        sizes.insert(dim + 1, size)
        return x.unsqueeze(dim + 1).expand(sizes).flatten(dim, dim + 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        per_sample = grad.unflatten(ctx.dim, (-1, ctx.size))
        total = torch.zeros_like(per_sample.select(ctx.dim + 1, 0))
        for i in range(ctx.size):
            total += per_sample.select(ctx.dim + 1, i)
        return total, None, None


def group_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor):
    """(each row's group [b], its prompt length [b], its response length [b]) of right-padded rows (None if they are
    not): a group is a run of consecutive rows with the same prompt tokens and a response each."""
    ids, mask = input_ids, attention_mask.bool()
    if not len(ids) or not bool((mask[:, 1:] <= mask[:, :-1]).all()):
        return None
    response = response_mask.bool()
    has_response = response.any(1)
    # The prompt ends where the response starts: target position P-1 scores the response's first token.
    prompt_lens = torch.where(has_response, response.int().argmax(1) + 1, mask.sum(1))
    column = torch.arange(ids.shape[1], device=ids.device)
    same_tokens = ((ids[1:] == ids[:-1]) | (column >= prompt_lens[1:, None])).all(1)
    same = same_tokens & (prompt_lens[1:] == prompt_lens[:-1]) & has_response[1:] & has_response[:-1]
    group_of = torch.cat([same.new_ones(1), ~same]).long().cumsum(0) - 1
    return group_of, prompt_lens, response.sum(1)


def saved_flops(shape, ran: list[tuple[int, list[int], int]], causal: bool = True) -> int:
    """The FLOPs shared-prompt passes did not run: for each group (prompt length, response lengths, passes: 1 for a
    forward, 3 with its backward) as it ran, its unshared passes less its shared ones (``flops.scoring_flops``)."""
    from megaopd.accounting.flops import scoring_flops

    return sum(passes * (scoring_flops(shape, [p], r, len(r), causal)
                         - scoring_flops(shape, [p], r, len(r), causal, shared_prompt=True)) for p, r, passes in ran)
