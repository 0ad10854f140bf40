"""Hand-computed cases for the GRPO and OPD losses, and the aggregation under gradient accumulation."""

import math

import pytest
import torch

from megaopd.data.batch import Sample, collate
from megaopd.config import GRPOConfig, ModelConfig, OPDConfig, OptimConfig, FixedAdvantageConfig
from megaopd.objectives.losses import (GRPO, OPD, FixedAdvantage, clipped_pg_loss, full_vocab_kl, group_advantages, k3_kl,
                                truncated_is_weights)


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv, zero = group_advantages(rewards, 4, scale_std=True, eps=0.0)
    std = math.sqrt(0.1875)  # population std of (1,0,0,0)
    assert adv[:4].tolist() == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std])
    assert adv[4:].tolist() == [0.0] * 4 and zero == 1
    unscaled, _ = group_advantages(rewards, 4, scale_std=False)
    assert unscaled[:4].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_clipped_surrogate_by_hand():
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.7]))
    old = torch.zeros(4)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, clipped = clipped_pg_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)
    # ratio 1.5, A>0: clipped at 1.28 -> -1.28; ratio 0.5, A<0: min(-0.5, -0.8) -> 0.8 (pessimistic);
    # ratio 1.1, A>0: inside -> -1.1; ratio 0.7, A<0: min(-0.7, -0.8) = -0.8 -> 0.8
    assert loss.tolist() == pytest.approx([-1.28, 0.8, -1.1, 0.8])
    assert clipped.tolist() == [1.0, 1.0, 0.0, 1.0]


def test_truncated_is_weights_by_hand():
    trainer = torch.tensor([[0.0, -1.0, -2.0, 0.0]])
    rollout = torch.tensor([[0.0, -1.5, -1.0, -9.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])  # a prompt target, two response tokens, padding
    token = truncated_is_weights(trainer, rollout, mask, "token", cap=1.5)
    assert torch.allclose(token, torch.tensor([[1.0, 1.5, math.exp(-1.0), 1.0]]))  # e^0.5 = 1.65 capped
    sequence = truncated_is_weights(trainer, rollout, mask, "sequence", cap=1.5)
    assert torch.allclose(sequence, torch.tensor([[1.0, math.exp(-0.5), math.exp(-0.5), 1.0]]))
    with pytest.raises(ValueError, match="token or sequence"):
        truncated_is_weights(trainer, rollout, mask, "sample", cap=2.0)


def test_k3_kl_is_nonnegative_and_zero_at_equality():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    assert k3_kl(logp, logp).tolist() == [0.0, 0.0, 0.0]
    ref = torch.tensor([-1.5, -1.0, -0.5])
    expected = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1, 0.0]
    assert k3_kl(logp, ref).tolist() == pytest.approx(expected)


def test_full_vocab_reverse_kl_by_hand():
    p_s = torch.tensor([0.5, 0.25, 0.25])
    p_t = torch.tensor([0.25, 0.5, 0.25])
    expected = 0.5 * math.log(2) + 0.25 * math.log(0.5)
    assert float(full_vocab_kl(p_s.log(), p_t.log(), "reverse")) == pytest.approx(expected)


def test_sampled_token_gradient_equals_full_vocab_gradient_in_expectation():
    """E_{y~p_s}[grad of the sampled-token surrogate] = grad KL(p_s || p_t), exactly and by Monte Carlo."""
    torch.manual_seed(0)
    student_logits = torch.randn(6, requires_grad=True)
    teacher_logp = torch.randn(6).log_softmax(-1)

    kl = full_vocab_kl(student_logits.log_softmax(-1), teacher_logp, "reverse")
    (full_grad,) = torch.autograd.grad(kl, student_logits)

    logp = student_logits.log_softmax(-1)
    advantage = -(logp - teacher_logp).detach()  # per-token advantage, detached
    probs = logp.exp().detach()
    surrogate, _ = clipped_pg_loss(logp, logp.detach(), advantage, 0.2, 0.2)  # ratio 1: on-policy
    (exact_grad,) = torch.autograd.grad((probs * surrogate).sum(), student_logits)
    assert torch.allclose(exact_grad, full_grad, atol=1e-6)

    samples = torch.multinomial(probs, 200_000, replacement=True, generator=torch.Generator().manual_seed(1))
    counts = torch.bincount(samples, minlength=6).float() / len(samples)
    logp = student_logits.log_softmax(-1)
    surrogate, _ = clipped_pg_loss(logp, logp.detach(), advantage, 0.2, 0.2)
    (mc_grad,) = torch.autograd.grad((counts * surrogate).sum(), student_logits)
    assert torch.allclose(mc_grad, full_grad, atol=5e-3)
    # Backpropagating through the sampled k1 value itself would be wrong: its expected gradient is zero.
    logp = student_logits.log_softmax(-1)
    (k1_grad,) = torch.autograd.grad((probs * (logp - teacher_logp)).sum(), student_logits)
    assert not torch.allclose(k1_grad, full_grad, atol=1e-3)


def _samples(rng: torch.Generator, count: int, vocab: int = 40) -> list[Sample]:
    out = []
    for i in range(count):
        p, r = 3 + i % 3, 2 + (i * 5) % 7
        ids = torch.randint(1, vocab, (p + r,), generator=rng).tolist()
        out.append(Sample(row=None, group=i // 4, prompt_ids=ids[:p], response_ids=ids[p:],
                          rollout_logprobs=[0.0] * r, finish_reason="stop", weight_version=0,
                          reward=float(i % 3 == 0)))
    return out


class OneTeacher:
    """``TeacherRouter.full_rows`` with one local teacher for samples without dataset rows (no domain to route)."""

    def __init__(self, teacher):
        self.teacher = teacher

    def full_rows(self, mb):
        return self.teacher.full_rows(mb)


@pytest.mark.parametrize("objective_name", ["grpo", "opd_sampled", "opd_full", "fixed_advantage"])
def test_gradient_accumulation_matches_one_big_batch(assets, objective_name):
    """Token-mean over the whole minibatch: micro-batches of 2 give the same update as one batch of 8."""
    from megaopd.models.hf_policy import HFPolicy

    model_dir = assets / "models" / "qwen3-tiny"
    samples = _samples(torch.Generator().manual_seed(0), 8)
    updated = []
    for micro in (8, 2, 3):
        policy = HFPolicy(ModelConfig(path=str(model_dir)), OptimConfig(lr=1e-2))
        batch = collate(samples, policy.pad_id)
        batch.old_logprobs = policy.logprobs(batch) + 0.05 * batch.response_mask  # ratio != 1: clipping active
        if objective_name == "grpo":
            objective = GRPO(GRPOConfig(), group_size=4)
        elif objective_name == "fixed_advantage":
            objective = FixedAdvantage(FixedAdvantageConfig(scope="batch"))  # the pool spans micro-batches
        else:
            teacher = HFPolicy(ModelConfig(path=str(assets / "models" / "qwen3-tiny-seed1")))
            objective = OPD(OPDConfig(form="full_vocab" if objective_name == "opd_full" else "sampled"),
                            OneTeacher(teacher))
            batch.teacher_logprobs = teacher.logprobs(batch)
        objective.prepare(batch, samples)
        stats = policy.train_minibatch(batch, objective.token_loss, micro, objective.vocab_term)
        # Compare the accumulated gradients: Adam's first step is ~lr * sign(grad), which turns float noise on
        # near-zero gradients into lr-sized weight differences.
        updated.append((stats, [p.grad.clone() for p in policy.model.parameters()]))
    (ref_stats, ref_grads) = updated[0]
    for stats, grads in updated[1:]:
        assert stats["loss"] == pytest.approx(ref_stats["loss"], abs=1e-6)
        assert stats["grad_norm"] == pytest.approx(ref_stats["grad_norm"], rel=1e-5)
        for a, b in zip(grads, ref_grads):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-8)
    assert ref_stats["grad_norm"] > 0


def test_grpo_update_raises_logprob_of_rewarded_samples(assets):
    from megaopd.models.hf_policy import HFPolicy

    samples = _samples(torch.Generator().manual_seed(3), 8)
    policy = HFPolicy(ModelConfig(path=str(assets / "models" / "qwen3-tiny")), OptimConfig(lr=1e-3))
    batch = collate(samples, policy.pad_id)
    batch.old_logprobs = policy.logprobs(batch)
    objective = GRPO(GRPOConfig(), group_size=4)
    objective.prepare(batch, samples)
    policy.train_minibatch(batch, objective.token_loss, 8)
    delta = ((policy.logprobs(batch) - batch.old_logprobs) * batch.response_mask).sum(-1)
    sample_adv = batch.advantages.sum(-1) / batch.response_mask.sum(-1)
    assert float((delta * sample_adv).sum()) > 0  # moves toward positive-advantage samples
