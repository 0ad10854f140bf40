"""Off-policy correction (docs/serving.md, "Train/rollout mismatch"): the IS ratio compares like with like (the
trainer's logprobs under the rollout's sampling distribution against the engine's), the two-sided mask, which terms
the weights touch under grpo_opd, the metrics, and the settings refused at start-up."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megaopd.data.batch import TokenBatch
from megaopd.config import ConfigError, GRPOConfig, OPDConfig, TrainConfig, load_config
from megaopd.objectives.methods import method
from megaopd.objectives.losses import (GRPOWithOPD, clipped_pg_loss, is_correction, prefix_weights, ratio_mask,
                                       truncated_is_weights)
from megaopd.run.resolve import check_is_correction, resolve_tis
from megaopd.rollout.local import reported_sampling


def test_the_mask_zeroes_tokens_outside_the_band_and_keeps_the_rest():
    trainer = torch.tensor([[0.0, -1.0, -2.0, -0.5, 0.0]])
    rollout = torch.tensor([[0.0, -1.5, -0.5, -0.4, -9.0]])  # ratios e^0.5 = 1.65, e^-1.5 = 0.22, e^-0.1 = 0.90
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])  # a prompt target, three response tokens, padding
    token = ratio_mask(trainer, rollout, mask, "token", low=0.5, high=2.0)
    assert token.tolist() == [[1.0, 1.0, 0.0, 1.0, 1.0]]  # only the 0.22 token leaves; off the response stays 1
    # sequence: the product e^-1.1 = 0.33 is outside [0.5, 2]: the whole response goes, inside [0.3, 2] it stays
    assert ratio_mask(trainer, rollout, mask, "sequence", 0.5, 2.0).tolist() == [[1.0, 0.0, 0.0, 0.0, 1.0]]
    assert ratio_mask(trainer, rollout, mask, "sequence", 0.3, 2.0).tolist() == [[1.0] * 5]
    # with truncation: a kept token keeps its truncated weight, a masked one gets 0, and the stats say which
    train = TrainConfig(tis="token", tis_cap=1.5, is_mask="token", is_mask_low=0.5, is_mask_high=2.0)
    correction = is_correction(trainer, rollout, mask, train)
    assert torch.allclose(correction.weights, torch.tensor([[1.0, 1.5, 0.0, math.exp(-0.1), 1.0]]))
    assert correction.truncated.tolist() == [[False, True, False, False, False]]
    assert correction.masked.tolist() == [[False, False, True, False, False]]
    # truncation alone is today's weights exactly; nothing on: no weights at all
    alone = is_correction(trainer, rollout, mask, TrainConfig(tis="token", tis_cap=1.5))
    assert torch.equal(alone.weights, truncated_is_weights(trainer, rollout, mask, "token", 1.5))
    assert alone.masked is None and is_correction(trainer, rollout, mask, TrainConfig(tis="none")) is None


@pytest.mark.parametrize("form", ["sampled", "topk"])
def test_grpo_opd_weights_its_opd_part_as_opd_does(form):
    """IS weights w weight both parts of grpo_opd, each as its own method takes them: the sampled form's one clipped
    surrogate of A_group + coef * A_opd by the token's w_t (a token masked to w = 0 leaves with its OPD signal), a
    KL form's GRPO surrogate by w_t and its KL by the prefix's w_{t-1} (``prefix_weights``). w = 1 is the unweighted
    loss bit for bit. Negative control: the GRPO term weighted alone (grpo_opd before) is another loss."""
    torch.manual_seed(0)
    mask = torch.ones(4, 5)
    old, teacher, vocab = -torch.rand(4, 5), -torch.rand(4, 5), torch.rand(4, 5)
    logp = old + 0.1 * torch.randn(4, 5)  # ratios around 1, some clipped
    samples = [SimpleNamespace(reward=r) for r in (1.0, 0.0, 0.0, 1.0)]
    group = torch.tensor([1.0, -1.0, -1.0, 1.0])[:, None].expand(4, 5)  # each group of 2: rewards (1, 0), (0, 1)
    opd = -(old - teacher)

    def loss_with(weights):
        batch = TokenBatch(torch.zeros(4, 6, dtype=torch.long), torch.ones(4, 6, dtype=torch.long), mask,
                           torch.zeros(4, 5), old_logprobs=old, teacher_logprobs=teacher, is_weights=weights)
        objective = GRPOWithOPD(GRPOConfig(), OPDConfig(form=form, topk=4, coef=0.5), group_size=2)
        objective.prepare(batch, samples)
        return objective.token_loss(logp, vocab, batch)[0]

    plain = loss_with(None)
    assert torch.equal(loss_with(torch.ones(4, 5)), plain)
    weights = torch.rand(4, 5) + 0.5
    weights[0, 0] = 0.0
    weighted = loss_with(weights)
    surrogate = lambda advantages: clipped_pg_loss(logp, old, advantages, 0.2, 0.2)[0]  # noqa: E731
    if form == "sampled":
        assert torch.allclose(plain, surrogate(group + 0.5 * opd), atol=1e-6)
        expected, group_only = weights * plain, surrogate(weights * group + 0.5 * opd)
        assert float(weighted[0, 0]) == 0.0
    else:
        assert torch.allclose(plain, surrogate(group) + 0.5 * vocab, atol=1e-6)
        expected = weights * surrogate(group) + 0.5 * prefix_weights(weights) * vocab
        group_only = weights * surrogate(group) + 0.5 * vocab
    assert torch.allclose(weighted, expected, atol=1e-6)
    assert not torch.allclose(weighted, group_only, atol=1e-3)


def checked(*overrides, algorithm="grpo"):
    cfg = load_config(None, [f"train.algorithm={algorithm}", *overrides])
    check_is_correction(resolve_tis(cfg, method(algorithm)), method(algorithm))


@pytest.mark.parametrize("overrides,message", [
    (["train.tis=token", "train.tis_cap=0"], r"^train\.tis_cap must be > 0 .*; set e\.g\. 2$"),
    (["train.is_mask=token", "train.is_mask_low=1.2"], r"^train\.is_mask keeps ratios in .* got \[1\.2, 5\]; set"),
    (["train.is_mask=sequence", "train.is_mask_high=1"], r"must hold 1 \(0 <= low < 1 < high\), got \[0\.5, 1\]"),
    (["train.recompute_old_logprobs=false", "rollout.temperature=0.7", "rollout.top_p=0.9"],
     r"^train\.recompute_old_logprobs=false makes .* rollout\.temperature=0\.7 rollout\.top_p=0\.9 .* \(temperature "
     r"0\.7, no top-p cut\); set train\."),
    (["train.recompute_old_logprobs=false", "rollout.top_p=0.9"], r"rollout\.top_p=0\.9 they are of the sampling"),
    (["model.backend=megatron", "rollout.top_p=0.9"], r"^model\.backend=megatron scores at a temperature only"),
])
def test_ill_formed_or_unlike_corrections_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        checked(*overrides)


def test_settings_that_compare_like_with_like_pass():
    checked("train.recompute_old_logprobs=false")  # 1 / 1: the rollout logprobs are the loss's distribution
    checked("train.recompute_old_logprobs=false", "rollout.temperature=0")  # greedy: both engines report T = 1
    checked("train.recompute_old_logprobs=false", "rollout.temperature=0.7")  # the loss's own: one temperature
    checked("train.recompute_old_logprobs=false", "rollout.engine=sglang", "rollout.top_p=0.9")  # before its cut
    checked("model.backend=megatron", "rollout.engine=sglang", "rollout.top_p=0.9", "rollout.temperature=0.7")
    checked("train.is_mask=token", "train.is_mask_low=0", "train.is_mask_high=inf")
    assert reported_sampling("local", 0.7, 0.9) == (0.7, 0.9) and reported_sampling("sglang", 0.7, 0.9) == (0.7, 1.0)
    checked("train.is_mask=token", "opd.form=topk", algorithm="opd")  # the KL forms take prefix weights
    with pytest.raises(ConfigError, match=r"^train\.tis=token weights .* every weight would be 1: set train\."
                                          r"recompute_old_logprobs=true, or train\.tis=none$"):
        checked("train.tis=token", "train.recompute_old_logprobs=false")


@pytest.mark.parametrize("algorithm,overrides,tis", [
    ("grpo", ["rollout.max_staleness=1"], "token"),  # rollouts a version old: corrected unless told otherwise
    ("grpo_opd", ["rollout.max_staleness=2", "opd.form=topk", "opd.topk=4"], "token"),  # both terms
    ("opd", ["rollout.max_staleness=1", "opd.form=sampled"], "token"),
    ("fixed_advantage", ["rollout.max_staleness=1"], "token"),  # its fixed advantage weights sampled tokens too
    ("grpo", [], "none"),  # K=0: the synchronous loop as it was
    ("opd", ["rollout.max_staleness=1"], "token"),  # full_vocab: each position by its prefix's weight
    ("opd", ["rollout.max_staleness=1", "opd.form=topk", "opd.topk=4"], "token"),
    ("grpo", ["rollout.max_staleness=1", "train.recompute_old_logprobs=false"], "none"),  # the PPO ratio's, already
    ("sft", ["rollout.max_staleness=1"], "none"),
    ("grpo", ["rollout.max_staleness=1", "train.tis=none"], "none"),  # what the user sets stands
    ("grpo", ["train.tis=sequence"], "sequence"),
])
def test_tis_auto_corrects_stale_rollouts_only(algorithm, overrides, tis):
    """train.tis=auto (the default) is token-level truncated IS where rollouts can be stale and a term can take it:
    at K=1 without it the embedded GRPO expert trailed K=0 (docs/serving.md, "Bounded staleness")."""
    cfg = load_config(None, [f"train.algorithm={algorithm}", *overrides])
    resolved = resolve_tis(cfg, method(algorithm))
    assert resolved.train.tis == tis
    check_is_correction(resolved, method(algorithm))


@pytest.mark.timeout(120)
def test_at_temperature_07_the_ratio_compares_like_with_like(assets, tmp_path):
    """The local engine samples with the trainer's own model: under the sampling distribution (T = 0.7) the IS
    weights are 1 and KL(behaviour || trainer) is 0 up to float rounding, and the old logprobs, taken at the same
    temperature (docs/opd.md, "One temperature"), are the engine's too: the PPO ratio starts at 1."""
    from conftest import run_config
    from megaopd.run.trainer import Trainer

    cfg = run_config(assets, tmp_path / "run", "grpo", **{
        "rollout.temperature": 0.7, "train.tis": "token", "train.is_mask": "token", "train.is_mask_low": 0.9,
        "train.is_mask_high": 1.1, "train.prompts_per_step": 2})
    trainer = Trainer(cfg)
    batches, prepare = [], trainer.objective.prepare
    trainer.objective.prepare = lambda batch, samples: batches.append(batch) or prepare(batch, samples)
    try:
        metrics = trainer.rl_step(1)
    finally:
        trainer.close()
    assert metrics["rollout/tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["rollout/is_masked_share"] == 0.0 and metrics["rollout/tis_truncated_share"] == 0.0
    assert 0 <= metrics["rollout/behaviour_kl"] < 1e-6 and metrics["rollout/logprob_gap_max"] < 1e-4
    (batch,) = batches
    mask = batch.response_mask
    # Before the one-temperature rule the old logprobs were taken at T = 1: mean |log ratio| to the engine's 0.075
    # on this near-uniform tiny model, 16% of tokens outside [0.9, 1.1].
    old_ratio = truncated_is_weights(batch.old_logprobs, batch.rollout_logprobs, mask, "token", math.inf)
    assert float(old_ratio[mask.bool()].log().abs().max()) < 1e-4


@pytest.mark.timeout(120)
def test_the_second_temperature_costs_no_flops_the_audit_does_not_see(assets, tmp_path):
    """At T != 1 the old logprobs and the sampling-distribution ones come from one forward and one projection: the
    audit measures the old-logprob phase as exactly the one pass the ledger books."""
    from conftest import run_config
    from megaopd.run.flop_audit import audit_step

    cfg = run_config(assets, tmp_path / "run", "grpo", **{
        "train.prompts_per_step": 1, "rollout.samples_per_prompt": 2, "rollout.temperature": 0.7,
        "rollout.top_p": 0.9, "train.tis": "sequence", "train.micro_batch_size": 2})
    old = audit_step(cfg)["old_logprob"]
    assert old.measured == old.executed_form and old.booked == old.ledger_form > 0
