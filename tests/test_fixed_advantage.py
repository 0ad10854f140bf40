"""The fixed-advantage control (train.algorithm=fixed_advantage, docs/opd.md): which tokens it selects, the sign of its
update, and that a run of it never builds a teacher or a reference. Its FLOP audit is in tests/test_methods.py (every
method). The entropy-scaled form (fixed_advantage.scale=entropy, the paper's OPSA): its advantages by hand, the
entropy each backend's old-logprob pass gives (HF against the full distribution, Megatron at TP2 against HF on the
same step), and its FLOP audit, exact, with a second projection for the entropy caught. The old spelling
(train.algorithm=opsa, an opsa: section), read for one release: the same config, one deprecation line."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megaopd.data.batch import collate
from megaopd.config import ConfigError, FixedAdvantageConfig, ModelConfig, OptimConfig
from megaopd.objectives.losses import (FixedAdvantage, check_fixed_advantage, entropy_scaled_advantages,
                                     lowest_logprob_tokens)
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
    metrics = FixedAdvantage(FixedAdvantageConfig(advantage=-0.7)).prepare(batch, [])
    selected = lowest_logprob_tokens(batch.old_logprobs, batch.response_mask, 0.2)
    assert torch.equal(batch.advantages, -0.7 * selected)
    assert metrics["fixed_advantage_selected_share"] == pytest.approx(float(selected.sum() / batch.response_mask.sum()))
    # On-policy (ratio 1) each selected token's loss is -A, the others' 0.
    loss, _ = FixedAdvantage(FixedAdvantageConfig(advantage=-0.7)).token_loss(batch.old_logprobs, None, batch)
    assert torch.allclose(loss, 0.7 * selected)


@pytest.mark.parametrize("advantage,direction", [(-0.5, -1), (0.5, 1)])
def test_a_negative_advantage_pushes_the_selected_tokens_down(assets, advantage, direction):
    """The sign: one update lowers the selected tokens' logprobs (and the positive control raises them)."""
    from megaopd.models.hf_policy import HFPolicy

    policy = HFPolicy(ModelConfig(path=str(assets / "models" / "qwen3-tiny")), OptimConfig(lr=1e-3))
    batch = collate(_samples(torch.Generator().manual_seed(3), 8), policy.pad_id)
    batch.old_logprobs = policy.logprobs(batch)
    objective = FixedAdvantage(FixedAdvantageConfig(advantage=advantage))
    objective.prepare(batch, [])
    selected = batch.advantages != 0
    policy.train_minibatch(batch, objective.token_loss, 8)
    moved = (policy.logprobs(batch) - batch.old_logprobs)[selected]
    assert direction * float(moved.mean()) > 0


@pytest.mark.parametrize("key,value,message", [
    ("fraction", 0.0, r"fixed_advantage\.fraction must be in \(0, 1\]"),
    ("fraction", 1.5, r"fixed_advantage\.fraction must be in"),
    ("advantage", 0.0, r"fixed_advantage\.advantage=0 trains nothing"),
    ("clip", 0.0, r"fixed_advantage\.clip must be > 0")])
def test_settings_that_train_nothing_are_refused(key, value, message):
    with pytest.raises(ConfigError, match=message):
        check_fixed_advantage(FixedAdvantageConfig(**{key: value}))


def test_an_entropy_no_pass_computes_is_refused(assets, tmp_path):
    from megaopd.run.trainer import Trainer

    cfg = run_config(assets, tmp_path, "fixed_advantage",
                     **{"fixed_advantage.scale": "entropy", "train.recompute_old_logprobs": False})
    with pytest.raises(ConfigError, match=r"^fixed_advantage\.scale=entropy reads each position's entropy from the "
                                          r"trainer's old-logprob pass, .*: set train\.recompute_old_logprobs=true$"):
        Trainer(cfg)


def test_entropy_scaled_advantages_by_hand():
    """-0.5 at the lowest entropy of a pool's selected tokens, -1 at its highest, linear between; one entropy for
    all of them: -1 (the paper's code); unselected tokens and empty pools 0."""
    entropy = torch.tensor([[9.0, 1.0, 2.0, 3.0, 0.0], [5.0, 0.5, 0.5, 7.0, 0.0], [0.0, 4.0, 0.0, 0.0, 0.0]])
    selected = torch.tensor([[0.0, 1, 1, 1, 0], [0.0, 1, 1, 0, 0], [0.0] * 5])
    by_response = entropy_scaled_advantages(entropy, selected, -0.5, -1.0)
    assert by_response.tolist() == [[0, -0.5, -0.75, -1.0, 0], [0, -1.0, -1.0, 0, 0], [0] * 5]
    # one pool: entropies 1, 2, 3, 0.5, 0.5 -> min 0.5, max 3
    pooled = entropy_scaled_advantages(entropy, selected, -0.5, -1.0, "batch")
    assert torch.allclose(pooled, torch.tensor([[0, -0.6, -0.8, -1.0, 0], [0, -0.5, -0.5, 0, 0], [0] * 5]))


def test_the_entropy_form_uses_the_old_entropy_and_the_fixed_form_ignores_it():
    batch = collate(_samples(torch.Generator().manual_seed(1), 8), pad_id=0)
    batch.old_logprobs = -torch.rand(batch.response_mask.shape, generator=torch.Generator().manual_seed(2)) * \
        batch.response_mask
    batch.old_entropy = torch.rand(batch.response_mask.shape, generator=torch.Generator().manual_seed(4)) * 3
    selected = lowest_logprob_tokens(batch.old_logprobs, batch.response_mask, 0.2, "batch")
    metrics = FixedAdvantage(FixedAdvantageConfig(scale="entropy", scope="batch")).prepare(batch, [])
    assert torch.equal(batch.advantages, entropy_scaled_advantages(batch.old_entropy, selected, -0.5, -1.0, "batch"))
    picked, others = batch.advantages[selected.bool()], batch.advantages[~selected.bool()]
    assert float(picked.max()) == -0.5 and float(picked.min()) == -1.0 and (others == 0).all()
    assert metrics["fixed_advantage_selected_advantage"] == pytest.approx(float(picked.mean()))
    assert FixedAdvantage(FixedAdvantageConfig()).needs_entropy is False
    assert FixedAdvantage(FixedAdvantageConfig(scale="entropy")).needs_entropy is True
    FixedAdvantage(FixedAdvantageConfig(scope="batch")).prepare(batch, [])
    assert torch.equal(batch.advantages, -0.5 * selected)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_hf_old_logprob_pass_gives_the_entropy_of_the_full_distribution(assets, temperature):
    """The entropy grid of ``logprobs_under(..., with_entropy=True)`` is -sum p log p of softmax(logits / T) at
    each response position (the model's own logits, unchunked), and the logprobs beside it are unchanged."""
    from megaopd.models.hf_policy import HFPolicy

    policy = HFPolicy(ModelConfig(path=str(assets / "models" / "qwen3-tiny")), logit_chunk_rows=7)  # several chunks
    batch = collate(_samples(torch.Generator().manual_seed(3), 8), policy.pad_id)
    logp, grid = policy.logprobs_under(batch, 3, [(temperature, 1.0)], with_entropy=True)
    with torch.no_grad():
        full = (policy.model(input_ids=batch.input_ids).logits[:, :-1].float() / temperature).log_softmax(-1)
    expected = -(full.exp() * full).sum(-1) * batch.response_mask
    assert float((grid - expected).abs().max()) < 1e-5 and float(expected.max()) > 1.0
    assert torch.equal(logp, policy.logprobs(batch, 3, temperature))


def entropy_run(assets, run_dir, **overrides):
    return run_config(assets, run_dir, "fixed_advantage", **{
        "fixed_advantage.scale": "entropy", "fixed_advantage.scope": "batch", "rollout.temperature": 0.7,
        "rollout.samples_per_prompt": 2, "train.prompts_per_step": 2, "train.micro_batch_size": 2, "rollout.max_new_tokens": 8, **overrides})


@pytest.mark.slow
def test_the_entropy_form_on_megatron_equals_the_hf_backend(assets, tmp_path):
    """One step of the entropy form on each backend (Megatron at TP2 under torchrun, its entropy an all-reduced sum
    of the vocabulary slices' shares): the same rollouts, the same old entropy and the same advantages."""
    from megaopd.config import save_config
    from megaopd.run.trainer import Trainer
    from tests.step_probe import step_gaps

    pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install -e '.[megatron]')")
    pytest.importorskip("mbridge", reason="mbridge not installed (pip install -e '.[megatron]')")
    save_config(entropy_run(assets, tmp_path / "megatron"), tmp_path / "fixed_advantage.yaml")
    worker = Path(__file__).parent / "step_worker.py"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(worker), str(tmp_path), "fixed_advantage"], env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    if proc.returncode:
        pytest.fail("step worker failed:\n" + "\n".join(proc.stderr.splitlines()[-60:]))
    megatron = json.loads((tmp_path / "fixed_advantage.json").read_text())
    hf = step_gaps(Trainer(entropy_run(assets, tmp_path / "hf")))
    entropy_m, entropy_h = torch.tensor(megatron["old_entropy"]), torch.tensor(hf["old_entropy"])
    assert entropy_m.shape == entropy_h.shape and float(entropy_h.min()) > 0.1
    assert float((entropy_m - entropy_h).abs().max()) < 1e-5
    # The same tokens selected; their advantages as close as the min-max normalisation allows (it divides the
    # entropies' float32 differences by their range over the selected tokens, ~0.1 on the near-uniform tiny model).
    advantages, expected = torch.tensor(megatron["advantages"]), torch.tensor(hf["advantages"])
    assert torch.equal(advantages != 0, expected != 0)
    assert float((advantages - expected).abs().max()) < 1e-4
    assert float(advantages.min()) == pytest.approx(-1.0) and float(advantages[advantages != 0].max()) == \
        pytest.approx(-0.5)


def test_the_flop_audit_is_exact_for_the_entropy_form(assets, tmp_path, monkeypatch):
    """The entropy comes from the old-logprob pass's logits (elementwise, 0 model FLOPs): the audit measures the same
    passes as the ledger books, at T = 0.7. A second projection for it (the negative control: an extra LM-head run
    over the response rows) shows in the measured old-logprob phase."""
    from megaopd.run.flop_audit import audit_step
    from megaopd.models.hf_policy import HFPolicy

    cfg = entropy_run(assets, tmp_path / "audit", **{"train.prompts_per_step": 1})
    audit = audit_step(cfg)
    for component, row in audit.items():
        assert row.booked == row.ledger_form and row.measured == row.executed_form, component
    assert audit["old_logprob"].booked > 0 and audit.mismatches() == []

    under = HFPolicy.logprobs_under

    def projected_again(self, batch, mbs, settings, keep=None, with_entropy=False):
        if with_entropy:
            with self._response_rows(batch) as (hidden, _):
                self._project(hidden)
        return under(self, batch, mbs, settings, keep, with_entropy)
    monkeypatch.setattr(HFPolicy, "logprobs_under", projected_again)
    old = audit_step(entropy_run(assets, tmp_path / "control", **{"train.prompts_per_step": 1}))["old_logprob"]
    assert old.measured > old.executed_form == audit["old_logprob"].executed_form


def test_a_run_builds_no_teacher_and_no_reference(assets, tmp_path, monkeypatch):
    """With opd.teachers set and the reference KL on (as an OPD or GRPO config would have them), a fixed_advantage run loads
    one model, its own: building a teacher or a second policy fails the test; it books no teacher or reference
    FLOPs."""
    from megaopd.teachers import router as teachers
    from megaopd.run import trainer

    def refuse(*args, **kwargs):
        raise AssertionError("a teacher was constructed")

    monkeypatch.setattr(teachers.TeacherRouter, "__init__", refuse)
    monkeypatch.setattr(trainer, "build_teachers", refuse)
    monkeypatch.setattr(trainer, "local_teachers", refuse)
    built = []
    build_policy = trainer.build_policy
    monkeypatch.setattr(trainer, "build_policy", lambda *a, **k: built.append(a) or build_policy(*a, **k))
    cfg = run_config(assets, tmp_path / "run", "fixed_advantage", **{
        "opd.teachers.*": assets / "models" / "qwen3-tiny-seed1", "grpo.kl_coef": 0.01, "train.steps": 2,
        "rollout.samples_per_prompt": 1})
    summary = trainer.train(cfg)
    assert len(built) == 1
    own = summary["ledger"]["own"]
    assert own["teacher"] == own["reference"] == 0 and own["rollout"] > 0 and own["train"] > 0


def test_the_old_spelling_reads_as_the_new_one_with_a_deprecation_line(tmp_path, caplog):
    """train.algorithm=opsa and the opsa: section (the names before this release) load as fixed_advantage, one
    deprecation line for each spelling naming the new one (however often it is used), from overrides and from a
    file (an old run directory's config.yaml), an override in the new spelling on top of it."""
    import logging

    from megaopd.config import load_config, save_config

    new = load_config(None, ["train.algorithm=fixed_advantage", "fixed_advantage.fraction=0.3",
                             "fixed_advantage.scale=entropy"])
    with caplog.at_level(logging.WARNING, logger="megaopd.config"):
        old = load_config(None, ["train.algorithm=opsa", "opsa.fraction=0.3", "opsa.scale=entropy"])
    assert old == new and old.train.algorithm == "fixed_advantage" and old.fixed_advantage.fraction == 0.3
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "config key 'opsa' is deprecated, renamed 'fixed_advantage': write 'fixed_advantage' (the "
                          "old name is read for one release)"),
        (logging.WARNING, "train.algorithm=opsa is deprecated, renamed train.algorithm=fixed_advantage: write "
                          "train.algorithm=fixed_advantage (the old name is read for one release)")]

    save_config(new, tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    assert "algorithm: fixed_advantage\n" in text and "\nfixed_advantage:\n" in text
    (tmp_path / "config.yaml").write_text(text.replace("algorithm: fixed_advantage\n", "algorithm: opsa\n")
                                          .replace("\nfixed_advantage:\n", "\nopsa:\n"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megaopd.config"):
        assert load_config(tmp_path / "config.yaml") == new
    assert len(caplog.records) == 2
    both = load_config(tmp_path / "config.yaml", ["fixed_advantage.clip=0.1"])
    assert both.fixed_advantage.clip == 0.1 and both.fixed_advantage.fraction == 0.3
    assert load_config(None, ["train.algorithm=fixed_advantage"]) == load_config(None, ["train.algorithm=opsa"])
