"""The cases every ``megaopd.rollout.engine_protocol.RolloutEngine`` must pass, measured against the trainer's policy:
``check_engine`` drives an engine through the protocol (tests/test_rollout.py: the local engine; tests/test_sglang.py:
an SGLang server)."""

from __future__ import annotations

import torch

from megaopd.data.batch import collate
from megaopd.models.chat import chat_prompt_ids
from megaopd.rollout.engine_protocol import RolloutEngine

N, NEW_TOKENS = 2, 8


def nll(logp, vocab, mb):
    """Raise every sampled token's logprob: an update that moves the weights."""
    return -logp, {}


def _check_samples(engine, policy, rows, samples, tolerance: float) -> None:
    assert len(samples) == len(rows) * N
    for i, s in enumerate(samples):
        row = rows[i // N]
        assert s.row is row and s.group == i // N  # grouped consecutively, in the rows' order
        assert s.prompt_ids == chat_prompt_ids(policy.tokenizer, row.prompt)
        assert 1 <= len(s.response_ids) <= NEW_TOKENS and len(s.rollout_logprobs) == len(s.response_ids)
        stopped = s.response_ids[-1] == policy.eos_id
        assert s.finish_reason == ("stop" if stopped else "length")
        assert s.finish_reason == "stop" or len(s.response_ids) == NEW_TOKENS
        assert s.weight_version == engine.weight_version
    batch = collate(samples, policy.pad_id)
    gap = float(((policy.logprobs(batch) - batch.rollout_logprobs).abs() * batch.response_mask).max())
    assert gap < tolerance, f"the engine's logprobs differ from the policy's by {gap:.2e}"


def check_engine(engine, policy, rows, tolerance: float) -> None:
    """Samples as the protocol says, logprobs of the policy it serves; after an update and a sync, the next version
    and the updated weights' logprobs (so a sync that does not reach the engine fails here)."""
    assert isinstance(engine, RolloutEngine)
    generator = torch.Generator().manual_seed(0)
    before = engine.generate(rows, N, 1.0, 1.0, NEW_TOKENS, generator)
    _check_samples(engine, policy, rows, before, tolerance)

    version = engine.weight_version
    policy.train_minibatch(collate(before, policy.pad_id), nll, 64)
    engine.sync_weights(policy)
    assert engine.weight_version == version + 1
    after = engine.generate(rows, N, 1.0, 1.0, NEW_TOKENS, generator)
    _check_samples(engine, policy, rows, after, tolerance)
