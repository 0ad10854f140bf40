"""Multi-teacher routing: each sample to its domain's teacher, loudly failing on a domain with none."""

import pytest
import torch

from megaopd.data.batch import collate
from megaopd.config import ModelConfig
from megaopd.data.rows import load_rows
from megaopd.models.hf_policy import HFPolicy
from megaopd.rollout.local import LocalEngine
from megaopd.teachers.router import TeacherRouter, local_teachers


def _rollouts(assets, student):
    rows = (load_rows(assets / "data" / "arith_add" / "train.jsonl")[0][:2]
            + load_rows(assets / "data" / "prog_trace" / "train.jsonl")[0][:2])
    samples = LocalEngine(student).generate(rows, 2, 1.0, 1.0, 6, torch.Generator().manual_seed(0))
    return samples, collate(samples, student.pad_id)


def test_each_sample_is_scored_by_its_domains_teacher(assets):
    models = assets / "models"
    student = HFPolicy(ModelConfig(path=str(models / "qwen3-tiny")))
    router = TeacherRouter({"arith_add": str(models / "qwen3-tiny-seed1"), "prog_trace": str(models / "qwen3-tiny")},
                           local_teachers(ModelConfig()), student.tokenizer)
    samples, batch = _rollouts(assets, student)
    vocab = student.model.config.vocab_size
    routes = router.score(batch, samples, "topk", micro_batch_size=4, topk=vocab)
    assert routes == {"arith_add": [0, 1, 2, 3], "prog_trace": [4, 5, 6, 7]}
    # prog_trace's teacher is the student itself: its logprobs equal the student's; arith_add's differ.
    student_logp = student.logprobs(batch)
    assert torch.allclose(batch.teacher_logprobs[4:], student_logp[4:], atol=1e-6)
    assert not torch.allclose(batch.teacher_logprobs[:4], student_logp[:4], atol=1e-3)
    other = HFPolicy(ModelConfig(path=str(models / "qwen3-tiny-seed1")))
    assert torch.allclose(batch.teacher_logprobs[:4], other.logprobs(batch.select(slice(0, 4))), atol=1e-6)
    # A top-K covering the vocabulary is the full log-softmax, reordered: it agrees with the realised tokens' logprobs.
    full = batch.teacher_topk_logprobs.new_zeros((*batch.response_mask.shape, vocab)).scatter(
        -1, batch.teacher_topk_ids, batch.teacher_topk_logprobs)
    gathered = full.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    assert torch.allclose(gathered * batch.response_mask, batch.teacher_logprobs, atol=1e-5)
    assert bool((batch.teacher_tail[batch.response_mask.bool()] == -torch.inf).all())  # no mass left outside


def test_unknown_domain_fails_loudly_and_star_serves_the_rest(assets):
    models = assets / "models"
    student = HFPolicy(ModelConfig(path=str(models / "qwen3-tiny")))
    router = TeacherRouter({"arith_add": str(models / "qwen3-tiny-seed1")}, local_teachers(ModelConfig()),
                           student.tokenizer)
    with pytest.raises(KeyError, match="no teacher for domain 'prog_trace'"):
        router.check_domains({"arith_add", "prog_trace"})
    router = TeacherRouter({"arith_add": str(models / "qwen3-tiny-seed1"), "*": str(models / "qwen3-tiny")},
                           local_teachers(ModelConfig()), student.tokenizer)
    assert router.route("prog_trace") == "*" and router.route("arith_add") == "arith_add"


def test_teacher_with_another_vocabulary_is_refused_unaligned(assets):
    """Another vocabulary scores only through the alignment (megaopd.teachers.cross_tokenizer, tests/test_cross_tokenizer.py): a router
    not told to align it refuses rather than compare logprobs of different token ids."""
    from transformers import AutoTokenizer

    models = assets / "models"
    other = AutoTokenizer.from_pretrained(models / "qwen3-tiny")
    other.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match="teacher .* has a different vocabulary from the student's and no alignment"):
        TeacherRouter({"*": str(models / "qwen3-tiny")}, local_teachers(ModelConfig()), other)
    aligned = TeacherRouter({"*": str(models / "qwen3-tiny")}, local_teachers(ModelConfig()), other,
                            teacher_tokenizers={"*": str(models / "qwen3-tiny")})
    assert list(aligned.aligners) == ["*"]


def test_teacher_with_another_chat_template_is_used_with_a_warning(assets, caplog):
    """Only the vocabulary must match: prompts reach the teacher as the student's chat template renders them."""
    from transformers import AutoTokenizer

    models = assets / "models"
    student = AutoTokenizer.from_pretrained(models / "qwen3-tiny")
    student.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with caplog.at_level("WARNING", logger="megaopd.teachers.router"):
        router = TeacherRouter({"*": str(models / "qwen3-tiny-seed1")}, local_teachers(ModelConfig()), student)
    assert router.route("arith_add") == "*"
    assert "another chat template than the student" in caplog.text
