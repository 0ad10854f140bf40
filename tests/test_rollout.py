"""The local engine: logprobs it reports are the trainer's teacher-forced logprobs; EOS and length stop it; it
samples from the tempered, nucleus-cut distribution."""

import pytest
import torch

from engine_contract import check_engine
from megaopd.data.batch import collate
from megaopd.config import ModelConfig, OptimConfig
from megaopd.data.rows import load_rows
from megaopd.models.hf_policy import HFPolicy
from megaopd.rollout.local import LocalEngine, sample_tokens


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


def test_the_local_engine_keeps_the_engine_contract(assets):
    policy = HFPolicy(ModelConfig(path=str(assets / "models" / "qwen3-tiny")), OptimConfig(lr=1e-2))
    rows = load_rows(assets / "data" / "arith_add" / "train.jsonl")[0][:2] + \
        load_rows(assets / "data" / "prog_trace" / "train.jsonl")[0][:1]
    check_engine(LocalEngine(policy), policy, rows, 1e-4)


def test_same_generator_state_gives_same_rollouts(assets):
    policy = HFPolicy(ModelConfig(path=str(assets / "models" / "qwen3-tiny")))
    rows = load_rows(assets / "data" / "arith_add" / "train.jsonl")[0][:4]
    engine = LocalEngine(policy)
    a = engine.generate(rows, 2, 1.0, 1.0, 8, torch.Generator().manual_seed(5))
    b = engine.generate(rows, 2, 1.0, 1.0, 8, torch.Generator().manual_seed(5))
    assert [s.response_ids for s in a] == [s.response_ids for s in b]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sample_tokens_draws_from_the_tempered_distribution(temperature):
    """20,000 draws per row from two real (non-degenerate) distributions: each token's frequency is within 4.5
    binomial standard deviations of softmax(logits / T), and each draw's logprob is that distribution's."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [-0.5, 0.3, 0.3, 1.5, -2.0]])
    draws = 20_000
    expected = (logits / temperature).softmax(-1)
    tokens, logprobs = sample_tokens(logits.repeat(draws, 1), temperature, 1.0, torch.Generator().manual_seed(0))
    tokens = tokens.view(draws, 2)
    for row in range(2):
        freq = torch.bincount(tokens[:, row], minlength=5).double() / draws
        sd = (expected[row] * (1 - expected[row]) / draws).sqrt()
        assert ((freq - expected[row]).abs() <= 4.5 * sd).all(), (row, freq, expected[row])
    assert torch.allclose(logprobs.view(draws, 2), expected.log().gather(-1, tokens.T).T, atol=1e-6)
    greedy, own = sample_tokens(logits, 0.0, 1.0, torch.Generator().manual_seed(0))
    assert greedy.tolist() == [0, 3] and torch.allclose(own, logits.log_softmax(-1)[[0, 1], [0, 3]])


def test_batch_rows_stop_on_eos_or_length_independently(assets):
    """Four sampled rows in one batch; a token that some rows sample is declared EOS: those rows stop right after
    its first occurrence, the others run to the length limit with the very same tokens (rows that are done keep
    drawing, so the shared generator stream is not shifted)."""
    policy = HFPolicy(ModelConfig(path=str(assets / "models" / "qwen3-tiny")))
    rows = load_rows(assets / "data" / "arith_add" / "train.jsonl")[0][:2]
    engine = LocalEngine(policy)
    first = engine.generate(rows, 2, 1.0, 1.0, 10, torch.Generator().manual_seed(1))
    assert [s.finish_reason for s in first] == ["length"] * 4
    seen = [set(s.response_ids) for s in first]
    stop = next(t for t in sorted(set().union(*seen)) if 0 < sum(t in ids for ids in seen) < 4
                and all(s.response_ids.index(t) < 9 for s in first if t in s.response_ids))
    policy.tokenizer.eos_token = policy.tokenizer.convert_ids_to_tokens(stop)
    again = engine.generate(rows, 2, 1.0, 1.0, 10, torch.Generator().manual_seed(1))
    for before, after in zip(first, again):
        if stop in before.response_ids:
            cut = before.response_ids.index(stop) + 1
            assert after.finish_reason == "stop" and after.response_ids == before.response_ids[:cut]
            assert after.rollout_logprobs == before.rollout_logprobs[:cut]
        else:
            assert after.finish_reason == "length" and after.response_ids == before.response_ids


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
