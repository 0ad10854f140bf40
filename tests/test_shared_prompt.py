"""Shared-prompt passes (train.shared_prompt) on the HF backend give the unshared passes' logprobs and gradients.

A batch of real rollouts: six prompts of different lengths (two domains) in one micro-batch, three samples each,
responses cut to different lengths (padding differs per row) and one cut to its first token. Each check compares a
policy with shared prompts against one without, from the same weights: logprobs (several micro-batchings), one
update's loss and every clipped gradient (GRPO, and the full-vocabulary KL through the vocabulary term), with
activation checkpointing too. A negative control lets each response attend to another sample's response: the
comparison must fail. The Megatron backend's are in tests/test_megatron.py, the real checkpoint's in
tests/test_real.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from megaopd.data.batch import collate
from megaopd.config import ModelConfig, OPDConfig, OptimConfig
from megaopd.data.rows import load_rows
from megaopd.objectives.losses import OPD, clipped_pg_loss
from megaopd.models.hf_policy import HFPolicy, _group_cuts
from megaopd.rollout.local import LocalEngine
from megaopd.models import hf_shared_prompt, shared_prompt
from megaopd.models.shared_prompt import PromptGroups
from megaopd.teachers.router import TeacherRouter, local_teachers

ATOL = 1e-6  # fp32
GROUP = 3


@pytest.fixture(scope="module")
def rollout(assets):
    rows = (load_rows(assets / "data" / "arith_add" / "train.jsonl")[0][:3]
            + load_rows(assets / "data" / "prog_trace" / "train.jsonl")[0][:3])
    policy = HFPolicy(ModelConfig(path=str(assets / "models" / "qwen3-tiny")))
    samples = LocalEngine(policy).generate(rows, GROUP, 1.0, 1.0, 9, torch.Generator().manual_seed(0))
    for i, s in enumerate(samples):
        s.reward = float(i % 3)
        keep = (9, 5, 1)[i % 3]  # unequal padding per row, and a response that ends at its first token
        s.response_ids, s.rollout_logprobs = s.response_ids[:keep], s.rollout_logprobs[:keep]
    batch = collate(samples, policy.pad_id)
    batch.old_logprobs = (batch.rollout_logprobs + 0.3 * torch.randn(batch.rollout_logprobs.shape,
                                                                     generator=torch.Generator().manual_seed(1)))
    batch.old_logprobs *= batch.response_mask
    batch.advantages = torch.linspace(-1, 1, batch.size)[:, None] * batch.response_mask
    return samples, batch


@pytest.fixture(params=["one masked call", "per group"])
def sdpa_form(request, monkeypatch):
    """SDPA's two forms for the responses' attention: one masked call (the CPU's) and one maskless call per group (a
    GPU's, ``hf_shared_prompt.PER_GROUP_DEVICES``), both run here on CPU."""
    if request.param == "per group":
        monkeypatch.setattr(hf_shared_prompt, "PER_GROUP_DEVICES", ("cpu",))
    return request.param


def test_the_layout_holds_every_row(rollout):
    """Each row position's token sits at its source in the flat sequence, at the row's own position; a group per
    prompt, its prompt once."""
    samples, batch = rollout
    prompts = {len(s.prompt_ids) for s in samples}
    assert len(prompts) > 1 and min(len(s.response_ids) for s in samples) == 1  # the cases the issue names
    groups = PromptGroups.of(batch.input_ids, batch.attention_mask, batch.response_mask, 256)
    real = batch.attention_mask.bool()
    assert groups.groups == len(samples) // GROUP and groups.group_of.tolist() == [s.group for s in samples]
    assert groups.group_size == GROUP  # every group of one size: the prompt's keys repeat without a gather
    short = batch.select(slice(0, batch.size - 1))  # the last group one sample short: gathered by index instead
    assert PromptGroups.of(short.input_ids, short.attention_mask, short.response_mask, 256).group_size == 0
    assert torch.equal(groups.input_ids[groups.source][real], batch.input_ids[real])
    columns = torch.arange(batch.input_ids.shape[1]).expand_as(batch.input_ids)
    assert torch.equal(groups.positions[groups.source][real], columns[real])
    assert groups.length == groups.groups * groups.prompt_width + batch.size * groups.response_width
    # One sample per prompt, or a left-padded batch: nothing to share.
    single = batch.select(slice(0, None, GROUP))
    assert PromptGroups.of(single.input_ids, single.attention_mask, single.response_mask, 256) is None
    assert PromptGroups.of(batch.input_ids, batch.attention_mask.flip(-1), batch.response_mask, 256) is None


@pytest.mark.parametrize("dim", [0, 1])  # the HF layout's batch dimension, and Megatron's [S, b, ...]
def test_the_repeat_per_group_is_the_gather_to_the_bit(dim):
    """_RepeatPerGroup gives index_select's values and, from a strided upstream gradient (a cat's backward slice),
    its gradient bit for bit: the same sums in the same order, so a shared-prompt run does not move with it. A sum
    over the group (expand's backward) orders its additions its own way and, in the HF layout, misses the bits (the
    negative control; in Megatron's the group is not the innermost reduced run and its sum happens to agree)."""
    generator = torch.Generator().manual_seed(0)
    sum_misses = 0
    for groups, size, length in [(16, 8, 43), (5, 3, 17), (3, 7, 60), (1, 4, 9)]:
        shape = [groups, 2, length, 16] if dim == 0 else [length, groups, 2, 16]
        x = torch.randn(shape, generator=generator, requires_grad=True)
        gather = x.index_select(dim, torch.arange(groups).repeat_interleave(size))
        repeat = shared_prompt._RepeatPerGroup.apply(x, dim, size)
        expanded = x.unsqueeze(dim + 1).expand(*shape[:dim + 1], size, *shape[dim + 1:]).flatten(dim, dim + 1)
        seq = 2 if dim == 0 else 0
        upstream = torch.randn([*gather.shape[:seq], length + 5, *gather.shape[seq + 1:]],
                               generator=generator).narrow(seq, 0, length)
        (want,), (got,), (summed,) = (torch.autograd.grad(y, x, upstream) for y in (gather, repeat, expanded))
        assert torch.equal(repeat, gather) and torch.equal(got, want)
        sum_misses += not torch.equal(summed, want)
    assert sum_misses > 0 or dim == 1


def test_micro_batches_take_whole_groups():
    groups = [0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2]
    assert _group_cuts(groups, 6) == [0, 6]
    assert _group_cuts(groups, 4) == [0, 3, 6, 10]  # the five-sample group larger than a micro-batch: in parts
    assert _group_cuts(groups, 100) == [0]


def policies(assets, preset: str, **kwargs) -> tuple[HFPolicy, HFPolicy]:
    path = str(assets / "models" / preset)
    plain = HFPolicy(ModelConfig(path=path, **kwargs), OptimConfig(lr=1e-3, grad_clip=1.0), logit_chunk_rows=7)
    shared = HFPolicy(ModelConfig(path=path, **kwargs), OptimConfig(lr=1e-3, grad_clip=1.0), logit_chunk_rows=7,
                      shared_prompt=True)
    shared.model.load_state_dict(plain.model.state_dict())
    return plain, shared


@pytest.mark.parametrize("preset", ["qwen3-tiny", "llama-tiny"])
def test_logprobs_equal_the_unshared_pass(assets, rollout, preset, sdpa_form):
    _, batch = rollout
    plain, shared = policies(assets, preset)
    expected = plain.logprobs(batch, 64)
    for mbs in (64, 4):  # one micro-batch of six groups; one group per micro-batch
        assert torch.allclose(shared.logprobs(batch, mbs), expected, atol=ATOL, rtol=0)
    # A second setting from the same forward (logprobs_under) and the no-grad full rows.
    both = shared.logprobs_under(batch, 64, [(1.0, 1.0), (0.7, 1.0)])
    assert torch.allclose(both[1], plain.logprobs(batch, 64, temperature=0.7), atol=ATOL, rtol=0)
    assert torch.allclose(shared.full_logprobs(batch), plain.full_logprobs(batch), atol=ATOL, rtol=0)
    saved = shared.take_prompt_saving()
    assert saved > 0 and shared.take_prompt_saving() == 0  # taken once


def _grpo_loss(logp, full, mb):
    loss, clipped = clipped_pg_loss(logp, mb.old_logprobs, mb.advantages, 0.2, 0.2)
    return loss, {"clip_fraction": clipped}


def assert_same_update(plain: HFPolicy, shared: HFPolicy, batch, loss_fn, mbs: int, vocab_term=None) -> None:
    expected = plain.train_minibatch(batch, loss_fn, mbs, vocab_term)
    got = shared.train_minibatch(batch, loss_fn, mbs, vocab_term)
    assert shared.take_prompt_saving() > 0 and plain.take_prompt_saving() == 0  # the shared pass ran
    assert expected["grad_norm"] > 1e-2  # a real gradient
    assert abs(got["loss"] - expected["loss"]) < ATOL
    assert abs(got["grad_norm"] - expected["grad_norm"]) < 1e-5 * expected["grad_norm"]
    grads = dict(plain.model.named_parameters())
    for name, param in shared.model.named_parameters():
        assert torch.allclose(param.grad, grads[name].grad, atol=ATOL, rtol=0), name


@pytest.mark.parametrize("preset", ["qwen3-tiny", "llama-tiny"])
@pytest.mark.parametrize("micro_batch_size", [64, 4])
def test_grpo_update_equals_the_unshared_update(assets, rollout, preset, micro_batch_size, sdpa_form):
    _, batch = rollout
    assert_same_update(*policies(assets, preset), batch, _grpo_loss, micro_batch_size)


def test_update_over_groups_of_unequal_size_equals_the_unshared_update(assets, rollout, sdpa_form):
    """The last group one sample short: the prompt's keys gathered by index for each sample, not expanded."""
    _, batch = rollout
    assert_same_update(*policies(assets, "qwen3-tiny"), batch.select(slice(0, batch.size - 1)), _grpo_loss, 64)


def test_full_vocabulary_kl_update_equals_the_unshared_update(assets, rollout):
    samples, batch = rollout
    batch = copy.copy(batch)
    teacher = str(assets / "models" / "qwen3-tiny-seed1")
    router = TeacherRouter({"*": teacher}, local_teachers(ModelConfig(), logit_chunk_rows=7),
                           HFPolicy(ModelConfig(path=teacher)).tokenizer)
    router.score(batch, samples, "full_vocab", 64)
    objective = OPD(OPDConfig(form="full_vocab"), router)
    assert_same_update(*policies(assets, "qwen3-tiny"), batch, objective.token_loss, 64, objective.vocab_term)


def test_update_with_activation_checkpointing_equals_the_unshared_update(assets, rollout):
    """Checkpointed layers re-run their forward in the backward: through the same per-segment attention."""
    _, batch = rollout
    plain, shared = policies(assets, "qwen3-tiny", activation_checkpointing=True)
    assert shared.model.is_gradient_checkpointing
    assert_same_update(plain, shared, batch, _grpo_loss, 64)


def test_a_response_that_sees_another_response_fails_the_comparison(assets, rollout, monkeypatch, sdpa_form):
    """Negative control: each response attends to its prompt and, instead of its own, the next sample's tokens."""
    _, batch = rollout
    plain, shared = policies(assets, "qwen3-tiny")
    expected = plain.logprobs(batch, 64)
    keys = PromptGroups.response_keys
    monkeypatch.setattr(PromptGroups, "response_keys", lambda self, prompt, own, batch_dim, *rest: keys(
        self, prompt, own.roll(1, batch_dim), batch_dim, *rest))
    leaked = shared.logprobs(batch, 64)
    assert (leaked - expected).abs().max() > 1e3 * ATOL


def test_the_switch_is_off_with_its_reason_where_it_cannot_apply(assets, tmp_path, caplog):
    """One sample per prompt, or a model with sliding-window layers: off, the reason logged once, and the resolved
    config (what config.yaml holds) says so; a GRPO group on a full-attention model keeps it."""
    import json
    import logging
    import shutil

    from conftest import run_config
    from megaopd.errors import ModelError
    from megaopd.objectives.methods import method
    from megaopd.run.resolve import resolve_shared_prompt

    def resolve(cfg):
        return resolve_shared_prompt(cfg, method(cfg.train.algorithm))

    on = {"train.shared_prompt": True}
    assert resolve(run_config(assets, tmp_path / "grpo", **on)).train.shared_prompt
    with caplog.at_level(logging.INFO, logger="megaopd.run.resolve"):
        single = resolve(run_config(assets, tmp_path / "opd", "opd", **on, **{
            "rollout.samples_per_prompt": 1, "opd.teachers.*": assets / "models" / "qwen3-tiny-seed1"}))
    assert not single.train.shared_prompt
    assert [r.getMessage() for r in caplog.records] == [
        "train.shared_prompt: off: one sample per prompt, so no prompt is shared"]
    sliding = tmp_path / "sliding"
    shutil.copytree(assets / "models" / "qwen3-tiny", sliding)
    config = json.loads((sliding / "config.json").read_text())
    config |= {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1,
               "layer_types": ["full_attention", "sliding_attention"]}
    (sliding / "config.json").write_text(json.dumps(config))
    assert not resolve(run_config(assets, tmp_path / "s", **on, **{"model.path": sliding})).train.shared_prompt
    with pytest.raises(ModelError, match="sliding_attention"):  # a policy asked directly refuses it
        HFPolicy(ModelConfig(path=str(sliding)), shared_prompt=True)


def test_logprobs_equal_the_unshared_pass_under_a_dispatch_mode(assets, rollout, monkeypatch):
    """Under a TorchDispatchMode (here torch's FLOP counter) the per-group form's causal mask cannot be a CausalBias;
    the boolean mask that stands in gives the same logprobs."""
    from torch.utils.flop_counter import FlopCounterMode

    monkeypatch.setattr(hf_shared_prompt, "PER_GROUP_DEVICES", ("cpu",))
    _, batch = rollout
    plain, shared = policies(assets, "qwen3-tiny")
    expected = plain.logprobs(batch, 64)
    with FlopCounterMode(display=False):
        assert torch.allclose(shared.logprobs(batch, 64), expected, atol=ATOL, rtol=0)
