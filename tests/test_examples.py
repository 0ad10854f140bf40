"""examples/grpo.py and examples/opd.py: their losses are the framework's, a GRPO step moves toward the rewarded
sample, and a seeded OPD run lowers the KL to its teacher."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from megaopd.objectives import losses as objectives

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def grpo():
    return example("grpo")


@pytest.fixture(scope="module")
def opd():
    return example("opd")


def test_grpo_example_loss_is_the_frameworks(grpo):
    g = torch.Generator().manual_seed(0)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    old = torch.randn(8, 5, generator=g) - 2
    logp = old + 0.4 * torch.randn(8, 5, generator=g)  # ratios well beyond the clip range on both sides
    ours = grpo.grpo_token_loss(logp, old, grpo.group_advantages(rewards), clip=0.2)
    advantages, _ = objectives.group_advantages(rewards, group_size=8)
    theirs, clipped = objectives.clipped_pg_loss(logp, old, advantages[:, None].expand(8, 5), 0.2, 0.2)
    assert clipped.any() and not clipped.all()
    assert torch.allclose(ours, theirs, atol=1e-6)
    assert (grpo.group_advantages(torch.ones(8)) == 0).all()  # a group that scored alike gives no signal


def test_grpo_example_step_raises_the_rewarded_sample(grpo, assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = assets / "models" / "qwen3-tiny"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = grpo.load_rows(assets / "data" / "arith_add" / "train.jsonl")[:1]
    group = grpo.rollout(model, tokenizer, rows, 4, 12, torch.Generator().manual_seed(0))[0]
    group["rewards"] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # as if the verifier had accepted the first only

    def sequence_logprobs():
        with torch.no_grad():
            return (grpo.response_logprobs(model, group["prompt"], group["tokens"]) * group["mask"]).sum(1)

    before = sequence_logprobs()
    metrics = grpo.update(model, torch.optim.AdamW(model.parameters(), lr=1e-3), [group])
    change = sequence_logprobs() - before
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert change[0] > 0 and change[1:].mean() < 0


def test_grpo_example_runs(grpo, assets):
    history = grpo.train(assets / "models" / "qwen3-tiny", assets / "data" / "arith_add" / "train.jsonl", steps=2,
                         prompts_per_step=2, group=4, max_new_tokens=8)
    assert [h["step"] for h in history] == [0, 1]
    assert all(math.isfinite(h["loss"]) and 0 <= h["reward"] <= 1 for h in history)


def test_opd_example_kl_is_the_frameworks(opd):
    g = torch.Generator().manual_seed(0)
    student = torch.randn(6, 7, 259, generator=g).log_softmax(-1)
    teacher = torch.randn(6, 7, 259, generator=g).log_softmax(-1)
    assert torch.allclose(opd.reverse_kl(student, teacher), objectives.full_vocab_kl(student, teacher, "reverse"))


@pytest.mark.slow
def test_opd_example_lowers_the_kl_to_its_teacher(opd, assets):
    history = opd.train(assets / "models" / "qwen3-tiny", assets / "models" / "qwen3-tiny-seed1",
                        assets / "data" / "arith_add" / "train.jsonl", steps=6)
    kls = [h["kl"] for h in history]
    assert all(math.isfinite(k) and k > 0 for k in kls)
    assert sum(kls[-2:]) / 2 < kls[0], kls
