"""OPD forms and objectives (docs/opd.md): the top-k form against the full-vocabulary one, chunked projection against
one big projection, its memory bound, GRPO + OPD at its two limits, and teacher scoring under the rollout's
sampling settings. Tiny models, fp32, CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megaopd.data.batch import collate
from megaopd.config import GRPOConfig, ModelConfig, OPDConfig, OptimConfig
from megaopd.data.rows import load_rows
from megaopd.models.distributions import WholeVocab, tail_logprob
from megaopd.models.hf_policy import HFPolicy, sampling_logprobs
from megaopd.objectives.losses import GRPO, OPD, GRPOWithOPD, full_vocab_kl, topk_kl
from megaopd.rollout.local import LocalEngine
from megaopd.teachers.router import TeacherRouter, local_teachers

ATOL = 1e-6


@pytest.fixture(scope="module")
def setup(assets):
    """Student, teacher router and one scored batch of rollouts with rewards (two domains, varied lengths)."""
    models = assets / "models"
    student_path, teacher_path = str(models / "qwen3-tiny"), str(models / "qwen3-tiny-seed1")
    student = HFPolicy(ModelConfig(path=student_path))
    rows = (load_rows(assets / "data" / "arith_add" / "train.jsonl")[0][:2]
            + load_rows(assets / "data" / "prog_trace" / "train.jsonl")[0][:2])
    samples = LocalEngine(student).generate(rows, 2, 1.0, 1.0, 10, torch.Generator().manual_seed(0))
    for i, s in enumerate(samples):
        s.reward = float(i % 3 == 0)
    batch = collate(samples, student.pad_id)
    batch.old_logprobs = student.logprobs(batch)
    return student_path, teacher_path, samples, batch, student.model.config.vocab_size


def _router(teacher_path, tokenizer, chunk_rows=1024, **sampling):
    return TeacherRouter({"*": teacher_path}, local_teachers(ModelConfig(), chunk_rows), tokenizer, **sampling)


def _update(student_path, batch, objective, micro=3, chunk_rows=5):
    """Loss, metrics and gradients of one train_minibatch (no optimizer step effects compared: gradients only)."""
    policy = HFPolicy(ModelConfig(path=student_path), OptimConfig(lr=1e-3, grad_clip=0.0), logit_chunk_rows=chunk_rows)
    metrics = policy.train_minibatch(batch, objective.token_loss, micro, objective.vocab_term)
    return metrics, [p.grad.clone() for p in policy.model.parameters()]


def _grad_error(grads, ref) -> float:
    return float(torch.cat([(g - r).flatten() for g, r in zip(grads, ref)]).norm()
                 / torch.cat([r.flatten() for r in ref]).norm())


def test_topk_kl_by_hand_and_its_tail():
    student = torch.tensor([[0.5, 0.3, 0.2]]).log()
    teacher = torch.tensor([[0.6, 0.1, 0.3]]).log()
    ids = torch.tensor([[0]])
    tail_t = tail_logprob(teacher, ids)
    assert float(tail_t.exp()) == pytest.approx(0.4)
    # coarsened to {token 0, rest}: reverse 0.5 log(0.5/0.6) + 0.5 log(0.5/0.4); forward the other way round
    assert float(topk_kl(WholeVocab(student), ids, teacher.gather(-1, ids), tail_t)) == pytest.approx(
        0.5 * torch.log(torch.tensor(0.5 / 0.6)).item() + 0.5 * torch.log(torch.tensor(0.5 / 0.4)).item(), abs=1e-6)
    assert float(topk_kl(WholeVocab(student), ids, teacher.gather(-1, ids), tail_t, "forward")) == pytest.approx(
        0.6 * torch.log(torch.tensor(0.6 / 0.5)).item() + 0.4 * torch.log(torch.tensor(0.4 / 0.5)).item(), abs=1e-6)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_topk_with_k_equal_to_vocab_is_the_full_vocab_loss_and_gradient(setup, direction):
    student_path, teacher_path, samples, batch, vocab = setup
    router = _router(teacher_path, HFPolicy(ModelConfig(path=student_path)).tokenizer)
    topk_batch, full_batch = copy.copy(batch), copy.copy(batch)
    router.score(topk_batch, samples, "topk", 4, topk=vocab)
    router.score(full_batch, samples, "full_vocab", 4)
    full_m, full_g = _update(student_path, full_batch, OPD(OPDConfig(form="full_vocab", kl=direction), router))
    topk_m, topk_g = _update(student_path, topk_batch, OPD(OPDConfig(form="topk", topk=vocab, kl=direction), router))
    assert full_m["loss"] > 0 and abs(topk_m["loss"] - full_m["loss"]) < ATOL
    for a, b in zip(topk_g, full_g):
        assert torch.allclose(a, b, atol=ATOL, rtol=0)


def test_topk_gradient_error_shrinks_as_k_grows(setup):
    """The gradient of the top-K + tail KL against the full-vocabulary one, on the tiny models' real distributions
    (vocabulary 259): reported per K, and decreasing to zero at K = V."""
    student_path, teacher_path, samples, batch, vocab = setup
    router = _router(teacher_path, HFPolicy(ModelConfig(path=student_path)).tokenizer)
    full_batch = copy.copy(batch)
    router.score(full_batch, samples, "full_vocab", 4)
    _, full_g = _update(student_path, full_batch, OPD(OPDConfig(form="full_vocab"), router))
    errors = {}
    for k in (1, 4, 16, 64, 128, vocab):
        topk_batch = copy.copy(batch)
        router.score(topk_batch, samples, "topk", 4, topk=k)
        _, grads = _update(student_path, topk_batch, OPD(OPDConfig(form="topk", topk=k), router))
        errors[k] = _grad_error(grads, full_g)
    print("relative gradient error of topk vs full_vocab by K:", {k: f"{e:.3g}" for k, e in errors.items()})
    values = list(errors.values())
    assert all(later < earlier for earlier, later in zip(values, values[1:])), errors
    assert errors[vocab] < 1e-5 and errors[1] > 1e-2


def test_chunked_projection_equals_one_projection(setup):
    """logit_chunk_rows only changes how many rows are projected at a time: same loss and gradients (topk form)."""
    student_path, teacher_path, samples, batch, vocab = setup
    router = _router(teacher_path, HFPolicy(ModelConfig(path=student_path)).tokenizer)
    batch = copy.copy(batch)
    router.score(batch, samples, "topk", 4, topk=8)
    objective = OPD(OPDConfig(form="topk", topk=8), router)
    one_m, one_g = _update(student_path, batch, objective, micro=8, chunk_rows=10_000)
    chunk_m, chunk_g = _update(student_path, batch, objective, micro=8, chunk_rows=3)
    assert abs(one_m["loss"] - chunk_m["loss"]) < ATOL
    for a, b in zip(chunk_g, one_g):
        assert torch.allclose(a, b, atol=ATOL, rtol=0)


class LargestVocabTensor(TorchDispatchMode):
    """Records the largest tensor with a vocabulary-sized last dimension that any op produces (forward, the
    checkpoint's recomputation and backward alike), other than the [V, H] / [H, V] weights and their gradients."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.vocab, self.hidden, self.largest = vocab, hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab and \
                    tuple(t.shape) != (self.hidden, self.vocab):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_larger_than_chunk_rows_by_vocab(setup):
    """Full-vocab OPD (student and teacher rows) and the top-k scoring never build more than chunk_rows x V at once;
    with one big chunk the same probe sees all the micro-batch's rows (the negative control)."""
    student_path, teacher_path, samples, batch, vocab = setup
    hidden = HFPolicy(ModelConfig(path=student_path)).model.config.hidden_size
    rows_per_micro = int(batch.response_mask[:8].sum())
    largest = {}
    for chunk in (4, 10_000):
        router = _router(teacher_path, HFPolicy(ModelConfig(path=student_path)).tokenizer, chunk_rows=chunk)
        scored = copy.copy(batch)
        router.score(scored, samples, "full_vocab", 8)
        probe = LargestVocabTensor(vocab, hidden)
        with probe:
            router.score(copy.copy(batch), samples, "topk", 8, topk=4)
            _update(student_path, scored, OPD(OPDConfig(form="full_vocab"), router), micro=8, chunk_rows=chunk)
        largest[chunk] = probe.largest
    assert 0 < largest[4] <= 4 * vocab
    assert largest[10_000] >= rows_per_micro * vocab > 4 * vocab


@pytest.mark.parametrize("form", ["sampled", "full_vocab"])
def test_grpo_opd_limits(setup, form):
    """opd.coef = 0 is GRPO exactly; all-zero rewards leave OPD exactly (same clip for both)."""
    student_path, teacher_path, samples, batch, vocab = setup
    router = _router(teacher_path, HFPolicy(ModelConfig(path=student_path)).tokenizer)
    batch = copy.copy(batch)
    router.score(batch, samples, form, 4)

    def run(objective, rewards):
        b = copy.copy(batch)
        for s, r in zip(samples, rewards):
            s.reward = r
        objective.prepare(b, samples)
        return _update(student_path, b, objective)
    rewards = [float(i % 3 == 0) for i in range(len(samples))]
    grpo_cfg, opd_cfg = GRPOConfig(), OPDConfig(form=form, coef=0.0)
    pairs = [(run(GRPOWithOPD(grpo_cfg, opd_cfg, 2, router), rewards), run(GRPO(grpo_cfg, 2), rewards)),
             (run(GRPOWithOPD(grpo_cfg, OPDConfig(form=form), 2, router), [0.0] * len(samples)),
              run(OPD(OPDConfig(form=form), router), [0.0] * len(samples)))]
    for (mixed_m, mixed_g), (ref_m, ref_g) in pairs:
        assert mixed_m["grad_norm"] > 0 and abs(mixed_m["loss"] - ref_m["loss"]) < ATOL
        for a, b in zip(mixed_g, ref_g):
            assert torch.allclose(a, b, atol=ATOL, rtol=0)
    # And with both a reward and a teacher, the update is neither of them.
    both_m, both_g = run(GRPOWithOPD(grpo_cfg, OPDConfig(form=form), 2, router), rewards)
    assert _grad_error(both_g, pairs[0][1][1]) > 1e-3 and _grad_error(both_g, pairs[1][1][1]) > 1e-3


def test_teacher_scores_under_the_rollout_sampling_settings(setup):
    """Temperature T divides the teacher's logits, top-p cuts its distribution to its nucleus: the teacher signal
    (k1 per token) of a T=0.6 / top-p=0.9 rollout differs from the temperature-1 one, and equals the reference."""
    student_path, teacher_path, samples, batch, vocab = setup
    tokenizer = HFPolicy(ModelConfig(path=student_path)).tokenizer
    plain, matched = copy.copy(batch), copy.copy(batch)
    _router(teacher_path, tokenizer).score(plain, samples, "sampled", 4)
    _router(teacher_path, tokenizer, temperature=0.6, top_p=0.9).score(matched, samples, "sampled", 4)
    teacher = HFPolicy(ModelConfig(path=teacher_path))
    with torch.no_grad():
        logits = teacher.model(input_ids=batch.input_ids).logits[:, :-1].float()
    mask = batch.response_mask.bool()
    reference = sampling_logprobs(logits / 0.6, 0.9).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    assert torch.allclose(matched.teacher_logprobs[mask], reference[mask], atol=1e-5)
    k1_plain = float(((batch.old_logprobs - plain.teacher_logprobs) * batch.response_mask).sum())
    k1_matched = float(((batch.old_logprobs - matched.teacher_logprobs) * batch.response_mask).sum())
    print(f"teacher k1 summed over the batch: temperature 1 {k1_plain:.3f}, T=0.6/top-p 0.9 {k1_matched:.3f}")
    assert abs(k1_plain - k1_matched) > 1.0
    # top-p: the nucleus is renormalised and tokens outside it get the floor, not -inf
    nucleus = sampling_logprobs(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), 0.7)
    assert float(nucleus[0, :2].exp().sum()) == pytest.approx(1.0) and float(nucleus[0, 2]) == -30.0


def test_full_vocab_kl_is_a_sum_over_vocabulary_slices():
    """What the Megatron TP ranks rely on: each slice's share adds up to the KL, both directions."""
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, 10, generator=g).log_softmax(-1), torch.randn(3, 10, generator=g).log_softmax(-1)
    for direction in ("reverse", "forward"):
        parts = full_vocab_kl(s[:, :4], t[:, :4], direction) + full_vocab_kl(s[:, 4:], t[:, 4:], direction)
        assert torch.allclose(parts, full_vocab_kl(s, t, direction), atol=1e-6)


@pytest.mark.parametrize("form", ["full_vocab", "topk"])
def test_truncated_is_without_the_trainers_logprobs_is_refused_before_any_model_loads(assets, tmp_path, form):
    """The KL forms take IS weights (each position by its prefix's: docs/opd.md, "Stale samples"), but without the
    recomputed logprobs the ratio is the rollout's over itself: every weight would silently be 1."""
    from conftest import run_config
    from megaopd.run.trainer import Trainer

    cfg = run_config(assets, tmp_path / "run", "opd", **{"train.tis": "token", "opd.form": form, "opd.topk": 4,
                                                        "train.recompute_old_logprobs": False,
                                                        "opd.teachers.*": "/nonexistent"})
    with pytest.raises(ValueError, match="train.tis=token weights .* every weight would be 1"):
        Trainer(cfg)
    assert not (tmp_path / "run").exists()


def test_a_teacher_dtype_for_megatron_teachers_is_refused_before_any_model_loads(assets, tmp_path):
    """Megatron's frozen teachers run in model.dtype; opd.teacher_dtype (HF and SGLang teachers) would be ignored."""
    from conftest import run_config
    from megaopd.config import ConfigError
    from megaopd.run.trainer import Trainer

    cfg = run_config(assets, tmp_path / "run", "opd", **{"model.backend": "megatron", "opd.form": "topk",
                                                        "opd.topk": 4, "opd.teacher_dtype": "bfloat16",
                                                        "opd.teachers.*": "/nonexistent"})
    with pytest.raises(ConfigError, match="opd.teacher_dtype=bfloat16 applies to HF and SGLang teachers"):
        Trainer(cfg)
    assert not (tmp_path / "run").exists()
