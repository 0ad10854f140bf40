"""The teacher-free control (train.algorithm=opsa, docs/opd.md): which tokens it selects, the sign of its update, and
that a run of it never builds a teacher or a reference. Its FLOP audit is in tests/test_methods.py (every method)."""

from __future__ import annotations

import math

import pytest
import torch

from megaopd.batch import collate
from megaopd.config import ConfigError, ModelConfig, OptimConfig, OPSAConfig
from megaopd.objectives import OPSA, lowest_logprob_tokens
from tests.conftest import run_config
from tests.test_objectives import _samples


def test_the_lowest_fraction_of_each_response_is_selected():
    logp = torch.tensor([[0.0, -1.0, -3.0, -2.0, -5.0, -4.0, 0.0, -9.0],
                         [0.0, 0.0, -1.0, -1.0, -1.0, -9.0, -2.0, 0.0],
                         [-7.0, -8.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1, 1, 1, 1, 1, 0, 0],  # 5 tokens; the -9 beyond the response is not one
                         [0.0, 0, 1, 1, 1, 1, 1, 0],  # 5 tokens, three tied at -1
                         [0.0, 0, 0, 0, 0, 0, 0, 0]])  # an empty response
    # f = 0.4: floor(2.0) = 2 per response, the lowest two
    assert lowest_logprob_tokens(logp, mask, 0.4).tolist() == [[0, 0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 1, 1, 0],
                                                               [0] * 8]
    # f = 0.1: floor(0.5) = 0, at least one
    assert lowest_logprob_tokens(logp, mask, 0.1).tolist() == [[0, 0, 0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1, 0, 0],
                                                               [0] * 8]
    # f = 0.8: floor(4.0) = 4; of the three tied at -1 the earlier two
    assert lowest_logprob_tokens(logp, mask, 0.8)[1].tolist() == [0, 0, 1, 1, 0, 1, 1, 0]
    # f = 1: every response token, nothing else
    assert torch.equal(lowest_logprob_tokens(logp, mask, 1.0), mask)
    # batch: one pool of 10 tokens, floor(0.3 * 10) = 3: -9, -5, -4, wherever they are
    assert lowest_logprob_tokens(logp, mask, 0.3, "batch").tolist() == [[0, 0, 0, 0, 1, 1, 0, 0],
                                                                        [0, 0, 0, 0, 0, 1, 0, 0], [0] * 8]
    with pytest.raises(ValueError, match="a selection scope must be one of"):
        lowest_logprob_tokens(logp, mask, 0.2, "sample")


@pytest.mark.parametrize("fraction", [0.2, 0.35, 1.0])
def test_each_response_gets_max_one_floor_fraction_of_its_tokens(fraction):
    rng = torch.Generator().manual_seed(0)
    logp = -torch.rand(6, 30, generator=rng) * 5
    lengths = torch.tensor([1, 4, 5, 12, 29, 0])
    mask = (torch.arange(30)[None] < lengths[:, None]).float()
    selected = lowest_logprob_tokens(logp, mask, fraction)
    assert selected.sum(-1).tolist() == [max(1, math.floor(fraction * n)) if n else 0 for n in lengths.tolist()]
    for row, sel, m in zip(logp, selected.bool(), mask.bool()):  # every selected token below every unselected one
        if sel.any() and (m & ~sel).any():
            assert row[sel].max() < row[m & ~sel].min()


def test_the_advantage_is_the_fixed_value_on_the_selected_tokens_only():
    batch = collate(_samples(torch.Generator().manual_seed(1), 8), pad_id=0)
    batch.old_logprobs = -torch.rand(batch.response_mask.shape, generator=torch.Generator().manual_seed(2)) * \
        batch.response_mask
    metrics = OPSA(OPSAConfig(advantage=-0.7)).prepare(batch, [])
    selected = lowest_logprob_tokens(batch.old_logprobs, batch.response_mask, 0.2)
    assert torch.equal(batch.advantages, -0.7 * selected)
    assert metrics["opsa_selected_share"] == pytest.approx(float(selected.sum() / batch.response_mask.sum()))
    # On-policy (ratio 1) each selected token's loss is -A, the others' 0.
    loss, _ = OPSA(OPSAConfig(advantage=-0.7)).token_loss(batch.old_logprobs, None, batch)
    assert torch.allclose(loss, 0.7 * selected)


@pytest.mark.parametrize("advantage,direction", [(-0.5, -1), (0.5, 1)])
def test_a_negative_advantage_pushes_the_selected_tokens_down(assets, advantage, direction):
    """The sign: one update lowers the selected tokens' logprobs (and the positive control raises them)."""
    from megaopd.hf_policy import HFPolicy

    policy = HFPolicy(ModelConfig(path=str(assets / "models" / "qwen3-tiny")), OptimConfig(lr=1e-3))
    batch = collate(_samples(torch.Generator().manual_seed(3), 8), policy.pad_id)
    batch.old_logprobs = policy.logprobs(batch)
    objective = OPSA(OPSAConfig(advantage=advantage))
    objective.prepare(batch, [])
    selected = batch.advantages != 0
    policy.train_minibatch(batch, objective.token_loss, 8)
    moved = (policy.logprobs(batch) - batch.old_logprobs)[selected]
    assert direction * float(moved.mean()) > 0


@pytest.mark.parametrize("key,value,message", [
    ("fraction", 0.0, r"opsa\.fraction must be in \(0, 1\]"), ("fraction", 1.5, r"opsa\.fraction must be in"),
    ("advantage", 0.0, r"opsa\.advantage=0 trains nothing"), ("clip", 0.0, r"opsa\.clip must be > 0")])
def test_settings_that_train_nothing_are_refused(key, value, message):
    with pytest.raises(ConfigError, match=message):
        OPSA(OPSAConfig(**{key: value}))


def test_a_run_builds_no_teacher_and_no_reference(assets, tmp_path, monkeypatch):
    """With opd.teachers set and the reference KL on (as an OPD or GRPO config would have them), an opsa run loads
    one model, its own: building a teacher or a second policy fails the test; it books no teacher or reference
    FLOPs."""
    from megaopd import teachers, trainer

    def refuse(*args, **kwargs):
        raise AssertionError("a teacher was constructed")

    monkeypatch.setattr(teachers.TeacherRouter, "__init__", refuse)
    monkeypatch.setattr(trainer, "build_teachers", refuse)
    monkeypatch.setattr(trainer, "local_teachers", refuse)
    built = []
    build_policy = trainer.build_policy
    monkeypatch.setattr(trainer, "build_policy", lambda *a, **k: built.append(a) or build_policy(*a, **k))
    cfg = run_config(assets, tmp_path / "run", "opsa", **{
        "opd.teachers.*": assets / "models" / "qwen3-tiny-seed1", "grpo.kl_coef": 0.01, "train.steps": 2,
        "rollout.samples_per_prompt": 1})
    summary = trainer.train(cfg)
    assert len(built) == 1
    own = summary["ledger"]["own"]
    assert own["teacher"] == own["reference"] == 0 and own["rollout"] > 0 and own["train"] > 0
