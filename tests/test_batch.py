"""``batch.collate`` (built from flat token lists and masks) against the rows written out one by one."""

from __future__ import annotations

import random

import torch

from megaopd.data.batch import Sample, collate


def _row_by_row(samples: list[Sample], pad_id: int):
    """The definition: each sample's prompt + response from column 0, right-padded; target position t scores token
    t + 1, so the response's tokens sit at targets P - 1 .. P + R - 2."""
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
    response_mask = torch.zeros((len(samples), width - 1))
    rollout_logprobs = torch.zeros((len(samples), width - 1))
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, :p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        attention_mask[i, :p + r] = 1
        response_mask[i, p - 1:p - 1 + r] = 1
        rollout_logprobs[i, p - 1:p - 1 + r] = torch.tensor(s.rollout_logprobs)
    return input_ids, attention_mask, response_mask, rollout_logprobs


def test_collate_equals_the_rows_written_one_by_one():
    rng = random.Random(0)
    for _ in range(200):
        samples = []
        for i in range(rng.randint(1, 10)):
            p, r = rng.randint(1, 9), rng.randint(0, 7)  # responses of different lengths, some empty
            samples.append(Sample(None, i, [rng.randrange(300) for _ in range(p)],
                                  [rng.randrange(300) for _ in range(r)], [rng.uniform(-5, 0) for _ in range(r)],
                                  "stop", 0))
        batch = collate(samples, pad_id=7)
        got = (batch.input_ids, batch.attention_mask, batch.response_mask, batch.rollout_logprobs)
        for name, expected, value in zip(("input_ids", "attention_mask", "response_mask", "rollout_logprobs"),
                                         _row_by_row(samples, 7), got):
            assert value.dtype == expected.dtype and torch.equal(value, expected), name
