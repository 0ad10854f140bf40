"""The local engine: logprobs it reports are the trainer's teacher-forced logprobs; EOS and length stop it."""

import pytest
import torch

from megaopd.batch import collate
from megaopd.config import ModelConfig
from megaopd.data.rows import load_rows
from megaopd.policy import HFPolicy
from megaopd.rollout import LocalEngine, sample_tokens


@pytest.mark.parametrize("preset", ["qwen3-tiny", "llama-tiny"])
def test_rollout_logprobs_equal_teacher_forced(assets, preset):
    policy = HFPolicy(ModelConfig(path=str(assets / "models" / preset)))
    rows, _ = load_rows(assets / "data" / "arith_add" / "train.jsonl")
    rows = rows[:3] + load_rows(assets / "data" / "prog_trace" / "train.jsonl")[0][:3]  # varied prompt lengths
    samples = LocalEngine(policy).generate(rows, 3, 1.0, 1.0, 10, torch.Generator().manual_seed(0))
    assert len(samples) == 18 and [s.group for s in samples] == [i // 3 for i in range(18)]
    assert len({len(s.prompt_ids) for s in samples}) > 1
    batch = collate(samples, policy.pad_id)
    recomputed = policy.logprobs(batch)
    assert torch.allclose(recomputed, batch.rollout_logprobs, atol=1e-5)
    # The group shares a prompt, not a sample: with temperature 1 the three responses differ.
    assert len({tuple(s.response_ids) for s in samples[:3]}) > 1


def test_same_generator_state_gives_same_rollouts(assets):
    policy = HFPolicy(ModelConfig(path=str(assets / "models" / "qwen3-tiny")))
    rows = load_rows(assets / "data" / "arith_add" / "train.jsonl")[0][:4]
    engine = LocalEngine(policy)
    a = engine.generate(rows, 2, 1.0, 1.0, 8, torch.Generator().manual_seed(5))
    b = engine.generate(rows, 2, 1.0, 1.0, 8, torch.Generator().manual_seed(5))
    assert [s.response_ids for s in a] == [s.response_ids for s in b]


def test_stop_on_eos_and_length():
    eos = 3
    logits = torch.full((2, 5), -1e9)
    logits[0, eos] = 0.0  # row 0 always emits EOS
    logits[1, 1] = 0.0
    token, logprob = sample_tokens(logits, 1.0, 1.0, torch.Generator().manual_seed(0))
    assert token.tolist() == [eos, 1] and torch.allclose(logprob, torch.zeros(2))


def test_engine_stops_at_eos_or_length(assets):
    policy = HFPolicy(ModelConfig(path=str(assets / "models" / "qwen3-tiny")))
    rows = load_rows(assets / "data" / "arith_add" / "train.jsonl")[0][:1]
    engine = LocalEngine(policy)
    first = engine.generate(rows, 1, 1.0, 1.0, 8, torch.Generator().manual_seed(0))[0]
    assert first.finish_reason == "length" and len(first.response_ids) == 8
    # Declare the sampled path's k-th token (its first occurrence) to be EOS: generation must stop right there.
    k = next(i for i in range(1, 8) if first.response_ids[i] not in first.response_ids[:i])
    policy.tokenizer.eos_token = policy.tokenizer.convert_ids_to_tokens(first.response_ids[k])
    again = engine.generate(rows, 1, 1.0, 1.0, 8, torch.Generator().manual_seed(0))[0]
    assert again.finish_reason == "stop" and again.response_ids == first.response_ids[: k + 1]


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = {int(sample_tokens(logits, 1.0, 0.7, torch.Generator().manual_seed(i))[0]) for i in range(200)}
    assert draws == {0, 1}
