"""The ``Teacher`` contract (megaopd/teachers/router.py) on both engines, an in-process ``HFPolicy`` and an ``SGLangTeacher``
server: the same cases, measured against transformers' own forward, on the tiny teacher of another tokenizer than
the student's (``bpe_teacher``), so the last case is also cross-tokenizer OPD on each engine (the server scores the
teacher's own token ids)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from megaopd.teachers.cross_tokenizer import CrossTokenizer
from megaopd.data.batch import Sample, collate
from megaopd.config import ModelConfig
from megaopd.data.rows import load_rows
from megaopd.models.embedded import build_tokenizer
from megaopd.accounting.flops import ModelShape
from megaopd.models.hf_policy import HFPolicy
from megaopd.teachers.router import Teacher
from policy_contract import realised, reference_logprobs

K = 5


@pytest.fixture(scope="module", params=["local", pytest.param("sglang", marks=[pytest.mark.sglang, pytest.mark.slow])])
def engine(request, bpe_teacher, tmp_path_factory):
    """(teacher, tolerance against transformers' float32 forward)."""
    if request.param == "local":
        yield HFPolicy(ModelConfig(path=str(bpe_teacher))), 1e-5
        return
    from megaopd.rollout.serving.teacher import SGLangTeacher
    from test_sglang import TOLERANCE, server_config

    served = SGLangTeacher(str(bpe_teacher), [], server_config(), "float32", tmp_path_factory.mktemp("served"),
                           "teacher")
    try:
        yield served, TOLERANCE
    finally:
        served.close()


@pytest.fixture(scope="module")
def scored(assets, bpe_teacher):
    """Worked solutions as the byte-level student spells them (ended by its EOS), the same samples in the teacher's
    tokens (its chat template, its tokens of the text), collated, and transformers' log-softmax over the latter."""
    student, local = build_tokenizer(), HFPolicy(ModelConfig(path=str(bpe_teacher)))
    cross = CrossTokenizer(student, local.tokenizer, local.shape.vocab_size)
    rows = load_rows(assets / "data" / "arith_add" / "train.jsonl")[0][:3] + \
        load_rows(assets / "data" / "prog_trace" / "train.jsonl")[0][:2]
    samples = []
    for i, row in enumerate(rows):
        response = student.encode(row.extra_info["solution"], add_special_tokens=False) + [student.eos_token_id]
        prompt = student.encode(student.apply_chat_template(row.prompt, add_generation_prompt=True, tokenize=False),
                                add_special_tokens=False)
        samples.append(Sample(row, i, prompt, response, [0.0] * len(response), "stop", 0))
    theirs = collate([cross.teacher_sample(s)[0] for s in samples], cross.teacher_pad)
    return cross, samples, collate(samples, student.pad_token_id), theirs, reference_logprobs(bpe_teacher, theirs)


def test_it_is_a_teacher_with_its_directorys_shape(engine, bpe_teacher):
    teacher, _ = engine
    assert isinstance(teacher, Teacher)
    assert teacher.shape == ModelShape.from_hf_config(json.loads((bpe_teacher / "config.json").read_text()))
    assert teacher.tokenizer.get_vocab() == AutoTokenizer.from_pretrained(bpe_teacher).get_vocab()


def test_realised_logprobs_are_transformers_at_the_response_only(engine, scored):
    teacher, tolerance = engine
    _, _, _, batch, reference = scored
    mine = teacher.logprobs(batch, micro_batch_size=2)
    assert mine.shape == batch.response_mask.shape
    assert bool((mine[batch.response_mask == 0] == 0).all())
    assert float((mine - realised(reference, batch)).abs().max()) < tolerance


def test_topk_view_is_transformers_topk(engine, scored):
    teacher, tolerance = engine
    _, _, _, batch, reference = scored
    view = teacher.topk_logprobs(batch, K, micro_batch_size=2)
    where = batch.response_mask.bool()
    top = reference[where].topk(K, dim=-1).values
    assert float((view["topk"][where] - top).abs().max()) < tolerance
    # each id's logprob is the reference's at that id (near-ties may order ids differently)
    at_ids = reference[where].gather(-1, view["topk_ids"][where])
    assert float((at_ids - view["topk"][where]).abs().max()) < tolerance
    assert float((view["realised"] - realised(reference, batch)).abs().max()) < tolerance
    tail = (1 - top.exp().sum(-1)).log()
    assert float((view["tail"][where] - tail).abs().max()) < 1e-3


def test_cross_tokenizer_credit_is_the_teachers_own_logprob_of_each_response(engine, scored):
    """CrossTokenizer.score with this engine: each student response's summed credit is transformers' logprob of the
    teacher's tokens of it (the sequence-level log-ratio is exact on either engine)."""
    teacher, tolerance = engine
    cross, samples, batch, theirs, reference = scored
    credit, exact = cross.score(teacher, batch, samples, micro_batch_size=2)
    assert bool((credit[batch.response_mask == 0] == 0).all()) and 0 < float(exact.sum()) < float(
        batch.response_mask.sum())
    own = realised(reference, theirs).sum(-1)
    assert float((credit.sum(-1) - own).abs().max()) < tolerance * theirs.response_mask.sum(-1).max()
