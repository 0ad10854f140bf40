"""Cross-tokenizer OPD (megaopd/teachers/cross_tokenizer.py, docs/opd.md): a teacher of another tokenizer scores its own tokens of the
student's response, aligned on the response's bytes. The test classes of the design notes: the same-tokenizer
oracle, straddles and conservation, shifts, unicode and whitespace, ragged tails and desync; then the trainer with
such a teacher (its ledger, the FLOP audit, multi-teacher routing, the refusals). Tiny models, CPU.

The tiny pair: the embedded student's tokenizer spells every byte as a token of its own; ``bpe_teacher``'s is a BPE
with merges (conftest), another vocabulary with another chat template.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoTokenizer

from megaopd.teachers import cross_tokenizer as align
from megaopd.teachers.cross_tokenizer import Alignment, ByteVocabulary, CrossTokenizer, TeacherText
from megaopd.data.batch import Sample, collate
from megaopd.config import ConfigError, ModelConfig, OPDConfig, OptimConfig
from megaopd.data.rows import load_rows
from megaopd.models.embedded import build_tokenizer
from megaopd.errors import ModelError
from megaopd.objectives.losses import OPD
from megaopd.models.hf_policy import HFPolicy
from megaopd.rollout.local import LocalEngine
from megaopd.teachers.router import TeacherRouter, local_teachers
from conftest import bpe_tokenizer

ATOL = 1e-6
TEXTS = ["The sum is 12.", "  def f(x):\n        return x + 1\n\n", "naïve café 🙂 ok", "数学很有趣", "a\n\nb\n\n\nc"]


def markers(n: int) -> torch.Tensor:
    """Teacher token j's logprob -(j+1)/100: where each one lands shows which teacher tokens a student token got."""
    return -torch.arange(1, n + 1, dtype=torch.float64) / 100


def spell(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def byte_ids(tokenizer, data: bytes) -> list[int]:
    """Each byte as the tokenizer's single-byte token (the embedded student's ids are not the byte values)."""
    return [ByteVocabulary(tokenizer).byte_token[b] for b in data]


@pytest.fixture(scope="module")
def byte_tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def bpe_tok():
    return bpe_tokenizer(TEXTS * 20 + ["hello world, the teacher said"] * 20, vocab_size=400)


def aligned(student, teacher, text: str) -> tuple[list[int], list[int], Alignment]:
    ids = spell(student, text)
    teacher_ids, spans = TeacherText(teacher).encode(ByteVocabulary(student).text(ids))
    return ids, teacher_ids, align.align(ByteVocabulary(student).spans(ids), spans)


# ------------------------------------------------------------------------------------ 1. the same-tokenizer oracle

@pytest.mark.parametrize("text", TEXTS)
def test_the_students_own_tokenizer_aligns_one_to_one(bpe_tok, tmp_path, text):
    bpe_tok.save_pretrained(tmp_path)
    for teacher in (bpe_tok, AutoTokenizer.from_pretrained(tmp_path)):  # the same object, and loaded from a path
        ids, teacher_ids, alignment = aligned(bpe_tok, teacher, text)
        assert teacher_ids == ids
        assert alignment.student.tolist() == alignment.teacher.tolist() == list(range(len(ids)))
        assert torch.equal(alignment.weight, torch.ones(len(ids), dtype=torch.float64))
        assert bool(alignment.exact.all())
        assert torch.equal(alignment.credit(markers(len(ids))), markers(len(ids)))


# ----------------------------------------------------------------------------- 2. straddles and conservation

def test_one_student_token_over_three_teacher_tokens_and_three_inside_one():
    # bytes 0..9: student [0,6) [6,7) [7,8) [8,9); teacher [0,2) [2,4) [4,6) [6,9)
    alignment = align.align([(0, 6), (6, 7), (7, 8), (8, 9)], [(0, 2), (2, 4), (4, 6), (6, 9)])
    credit = alignment.credit(markers(4))
    assert credit[0] == pytest.approx(-(1 + 2 + 3) / 100)  # whole teacher tokens: their sum, exactly
    assert credit[1:].tolist() == pytest.approx([-4 / 300] * 3)  # one teacher token over three: a third each
    assert alignment.exact.tolist() == [True, False, False, False]
    assert float(credit.sum()) == pytest.approx(float(markers(4).sum()), abs=1e-15)
    # shares by bytes, not by count: one byte and three bytes of a four-byte teacher token
    assert align.align([(0, 1), (1, 4)], [(0, 4)]).credit(markers(1)).tolist() == pytest.approx([-0.0025, -0.0075])


@pytest.mark.parametrize("text", TEXTS)
def test_every_teacher_logprob_lands_once_both_ways(byte_tok, bpe_tok, text):
    for student, teacher in ((byte_tok, bpe_tok), (bpe_tok, byte_tok)):
        ids, teacher_ids, alignment = aligned(student, teacher, text)
        assert len(ids) != len(teacher_ids)  # the pair does tokenize differently
        for j in range(len(teacher_ids)):  # each teacher token's weights sum to 1
            assert float(alignment.weight[alignment.teacher == j].sum()) == pytest.approx(1.0, abs=1e-12)
        credit, lp = alignment.credit(markers(len(teacher_ids))), markers(len(teacher_ids))
        assert float(credit.sum()) == pytest.approx(float(lp.sum()), abs=1e-12)


def test_a_confident_student_gives_finite_signals(byte_tok, bpe_tok):
    """The credit is the teacher's alone (no division by the student's logprob, as DPCA's L_T / L_S has)."""
    ids, teacher_ids, alignment = aligned(byte_tok, bpe_tok, TEXTS[0])
    student_logprobs = torch.zeros(len(ids), dtype=torch.float64)  # L_S = 0 in every chunk
    signal = alignment.credit(markers(len(teacher_ids))) - student_logprobs
    assert bool(torch.isfinite(signal).all()) and float(signal.sum()) == pytest.approx(float(
        markers(len(teacher_ids)).sum()))


# ------------------------------------------------------------------------------------------------------ 3. shifts

def test_each_student_token_gets_the_markers_of_the_teacher_tokens_spelling_it(byte_tok, bpe_tok):
    """The byte-level student spells one byte per token: each gets its teacher token's marker times its share of
    that token's bytes; the BPE student, whose tokens are whole teacher tokens here, gets their markers exactly."""
    text = "hello world, the teacher said"
    ids, teacher_ids, alignment = aligned(byte_tok, bpe_tok, text)
    credit, lp = alignment.credit(markers(len(teacher_ids))), markers(len(teacher_ids))
    spans = TeacherText(bpe_tok).encode(text.encode())[1]
    for byte in range(len(ids)):
        j = next(j for j, (a, b) in enumerate(spans) if a <= byte < b)
        assert float(credit[byte]) == pytest.approx(float(lp[j]) / (spans[j][1] - spans[j][0]), abs=1e-12)
    ids, teacher_ids, alignment = aligned(bpe_tok, byte_tok, text)
    credit, lp = alignment.credit(markers(len(teacher_ids))), markers(len(teacher_ids))
    at = 0
    for i, token in enumerate(ids):
        width = len(ByteVocabulary(bpe_tok).spelled[token])
        assert float(credit[i]) == pytest.approx(float(lp[at:at + width].sum()), abs=1e-12)
        at += width
    assert bool(alignment.exact.all())


def test_a_bos_on_one_side_only_stays_out_of_the_response(byte_tok, bpe_tok):
    """A teacher whose tokenizer adds a BOS (its post-processor) scores the response without it: the teacher's
    prompt comes from its chat template, its response from the text alone."""
    from tokenizers import processors

    bos = bpe_tokenizer(TEXTS, vocab_size=300)
    bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos.convert_tokens_to_ids("<|im_start|>"))])
    assert bos.encode("ab")[0] == bos.convert_tokens_to_ids("<|im_start|>")  # it does add one
    ids, teacher_ids, alignment = aligned(byte_tok, bos, "ab cd")
    assert teacher_ids == spell(bos, "ab cd") and float(alignment.credit(markers(len(teacher_ids))).sum()) == \
        pytest.approx(float(markers(len(teacher_ids)).sum()))


# --------------------------------------------------------------------------------------- 4. unicode and whitespace

@pytest.mark.parametrize("text", ["🙂", "数学", "\n\n", "    x", " x", "naïve"])
def test_bytes_against_merged_tokens(byte_tok, bpe_tok, text):
    """A 4-byte emoji, CJK, blank lines and indentation spelled byte by byte on one side and merged on the other:
    the merged side's tokens are whole groups of the byte side's."""
    ids, teacher_ids, alignment = aligned(bpe_tok, byte_tok, text)
    assert len(ids) < len(teacher_ids) == len(text.encode()) and bool(alignment.exact.all())
    ids, teacher_ids, alignment = aligned(byte_tok, bpe_tok, text)
    assert float(alignment.credit(markers(len(teacher_ids))).sum()) == pytest.approx(
        float(markers(len(teacher_ids)).sum()))


def test_a_normalizing_teacher_is_aligned_through_its_offsets(byte_tok):
    """NFD text (e + combining acute) against a teacher that normalizes to NFC: its tokens spell other bytes than the
    student's, so their spans come from its character offsets; the text after it aligns exactly again."""
    from tokenizers import normalizers

    nfc = bpe_tokenizer(["café " * 50, "cafe\u0301 ok then"] * 20, vocab_size=300)
    nfc.backend_tokenizer.normalizer = normalizers.NFC()
    text = "cafe\u0301 ok then"
    ids, teacher_ids, alignment = aligned(byte_tok, nfc, text)
    assert teacher_ids == spell(nfc, "café ok then")
    credit, lp = alignment.credit(markers(len(teacher_ids))), markers(len(teacher_ids))
    assert float(credit.sum()) == pytest.approx(float(lp.sum()))
    # " ok then" (bytes 6..13) is the student's bytes 6.. one to one with whole teacher tokens' bytes
    assert ByteVocabulary(nfc).text(teacher_ids).endswith(b" ok then")


def test_a_teacher_that_adds_a_prefix_space_is_refused(byte_tok):
    from tokenizers import pre_tokenizers

    spaced = bpe_tokenizer(TEXTS, vocab_size=300)
    spaced.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    with pytest.raises(ModelError, match="prefix space"):
        TeacherText(spaced)


def test_a_tokenizer_that_is_not_byte_level_is_refused(byte_tok):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    word = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    word.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(ModelError, match="byte-level BPE tokenizers only"):
        ByteVocabulary(PreTrainedTokenizerFast(tokenizer_object=word))


# ---------------------------------------------------------------------------------- 5. ragged tails and desync

def sample(student, ids: list[int], finish: str, row) -> Sample:
    return Sample(row, 0, [1, 2], ids, [0.0] * len(ids), finish, 0)


def test_a_response_cut_mid_character_and_mid_teacher_token(byte_tok, bpe_tok, assets):
    """Cut after two of the emoji's four bytes: the teacher spells them with its single-byte tokens. Cut inside what
    the teacher would merge ("hel" of "hello"): it tokenizes what is there."""
    row = load_rows(assets / "data" / "arith_add" / "train.jsonl")[0][0]
    cross = CrossTokenizer(byte_tok, bpe_tok, len(bpe_tok))
    for text, cut in (("ok 🙂", 5), ("hello", 3)):
        ids = byte_ids(byte_tok, text.encode()[:cut])
        teacher_sample, alignment = cross.teacher_sample(sample(byte_tok, ids, "length", row))
        assert ByteVocabulary(bpe_tok).text(teacher_sample.response_ids) == text.encode()[:cut]
        credit = alignment.credit(markers(len(teacher_sample.response_ids)))
        assert float(credit.sum()) == pytest.approx(float(markers(len(teacher_sample.response_ids)).sum()))


def test_the_end_of_turn_maps_to_the_teachers_own(byte_tok, assets):
    """The student's EOS at the end of a stopped response is the teacher's EOS, whatever token each uses; a response
    cut at the length limit has none on either side."""
    row = load_rows(assets / "data" / "arith_add" / "train.jsonl")[0][0]
    other = bpe_tokenizer(TEXTS, vocab_size=300)
    other.eos_token = "<|endoftext|>"  # another end-of-turn token than the student's <|im_end|>
    cross = CrossTokenizer(byte_tok, other, len(other))
    ids = byte_ids(byte_tok, b"42") + [byte_tok.eos_token_id]
    stopped, alignment = cross.teacher_sample(sample(byte_tok, ids, "stop", row))
    assert stopped.response_ids[-1] == other.convert_tokens_to_ids("<|endoftext|>")
    assert alignment.credit(markers(len(stopped.response_ids)))[-1] == markers(len(stopped.response_ids))[-1]
    cut, _ = cross.teacher_sample(sample(byte_tok, ids[:-1], "length", row))
    assert cut.response_ids == stopped.response_ids[:-1]
    # the student's <|im_end|> in the text (not its stop) is text: the teacher spells it its own way
    inside, _ = cross.teacher_sample(sample(byte_tok, [byte_tok.eos_token_id] + byte_ids(byte_tok, b"1"), "length",
                                                row))
    assert ByteVocabulary(other).text(inside.response_ids) == b"<|im_end|>1"


def test_an_unalignable_start_leaves_the_rest_one_to_one(bpe_tok):
    """Bytes that are not UTF-8, then NFD text that the teacher (the student's BPE with an NFC normalizer) composes
    and tokenizes its own way: after them the two resynchronise, so the rest is scored token by token (weight 1,
    the same ids), not through one folded chunk."""
    from tokenizers import normalizers

    nfc = bpe_tok.__class__(tokenizer_object=bpe_tok.backend_tokenizer.__class__.from_str(
        bpe_tok.backend_tokenizer.to_str()), eos_token="<|im_end|>", pad_token="<|endoftext|>")
    nfc.backend_tokenizer.normalizer = normalizers.NFC()
    head, rest = b"\xff\xfe" + "cafe\u0301".encode(), " and the rest of it, the teacher said"
    student_ids = [ByteVocabulary(bpe_tok).byte_token[b] for b in head[:2]] + spell(bpe_tok, "cafe\u0301") + \
        spell(bpe_tok, rest)
    teacher_ids, spans = TeacherText(nfc).encode(ByteVocabulary(bpe_tok).text(student_ids))
    alignment = align.align(ByteVocabulary(bpe_tok).spans(student_ids), spans)
    tail = len(spell(bpe_tok, rest))
    assert teacher_ids[-tail:] == student_ids[-tail:] and teacher_ids[:-tail] != student_ids[:-tail]
    pairs = sorted(zip(alignment.student.tolist(), alignment.teacher.tolist(), alignment.weight.tolist()))
    offset = len(teacher_ids) - len(student_ids)
    assert pairs[-tail:] == [(i, i + offset, 1.0) for i in range(len(student_ids) - tail, len(student_ids))]
    assert bool(alignment.exact[-tail:].all())


# ------------------------------------------------------------------------- teachers, objective and gradients

@pytest.fixture(scope="module")
def rollouts(assets):
    """The tiny student's samples of four prompts (two domains), 2 each (random bytes, some not UTF-8), then each
    prompt with its worked solution as the response (text the BPE teacher merges), ended by the student's EOS."""
    student = HFPolicy(ModelConfig(path=str(assets / "models" / "qwen3-tiny")))
    rows = (load_rows(assets / "data" / "arith_add" / "train.jsonl")[0][:2]
            + load_rows(assets / "data" / "prog_trace" / "train.jsonl")[0][:2])
    samples = LocalEngine(student).generate(rows, 2, 1.0, 1.0, 12, torch.Generator().manual_seed(0))
    for row in rows:
        response = spell(student.tokenizer, row.extra_info["solution"]) + [student.eos_id]
        samples.append(Sample(row, len(samples), samples[2 * rows.index(row)].prompt_ids, response,
                              [0.0] * len(response), "stop", 0))
    return student, samples


def scored_update(assets, student, samples, router):
    """The sampled OPD objective's loss and gradients on the samples, teachers scored by `router`."""
    batch = collate(samples, student.pad_id)
    batch.old_logprobs = student.logprobs(batch)
    router.score(batch, samples, "sampled", micro_batch_size=3)
    objective = OPD(OPDConfig(form="sampled"))
    objective.prepare(batch, samples)
    policy = HFPolicy(ModelConfig(path=str(assets / "models" / "qwen3-tiny")), OptimConfig(lr=1e-3, grad_clip=0.0))
    metrics = policy.train_minibatch(batch, objective.token_loss, 3)
    return batch, metrics, torch.cat([p.grad.flatten() for p in policy.model.parameters()])


def test_same_tokenizer_oracle_gives_the_ordinary_losses_and_gradients(assets, rollouts, tmp_path, monkeypatch):
    """The student's own tokenizer, loaded from another directory, as the teacher's (opd.teacher_tokenizer): the
    cross-tokenizer path renders the same prompt, re-tokenizes the same ids and credits each token its own logprob,
    so the loss and every gradient are the ordinary path's. Shifting the alignment by one character breaks it."""
    student, samples = rollouts
    student.tokenizer.save_pretrained(tmp_path / "tokenizer")
    teacher = str(assets / "models" / "qwen3-tiny-seed1")
    load = local_teachers(ModelConfig())
    ordinary = TeacherRouter({"*": teacher}, load, student.tokenizer)
    cross = TeacherRouter({"*": teacher}, load, student.tokenizer, teacher_tokenizers={"*": str(tmp_path / "tokenizer")})
    assert not ordinary.aligners and list(cross.aligners) == ["*"]
    for s in samples:
        teacher_sample, alignment = cross.aligners["*"].teacher_sample(s)
        assert (teacher_sample.prompt_ids, teacher_sample.response_ids) == (s.prompt_ids, s.response_ids)
    reference, reference_metrics, reference_grad = scored_update(assets, student, samples, ordinary)
    batch, metrics, grad = scored_update(assets, student, samples, cross)
    assert torch.allclose(batch.teacher_logprobs, reference.teacher_logprobs, atol=ATOL, rtol=0)
    assert bool((batch.teacher_exact == batch.response_mask).all())
    assert metrics["loss"] == pytest.approx(reference_metrics["loss"], abs=ATOL)
    assert float((grad - reference_grad).norm() / reference_grad.norm()) < 1e-5
    # Negative control: the teacher's spans one byte (one character of this byte-level text) later.
    aligned_right = align.align
    monkeypatch.setattr(align, "align", lambda s, t: aligned_right(s, [(a + 1, b + 1) for a, b in t]))
    shifted, shifted_metrics, shifted_grad = scored_update(assets, student, samples, cross)
    assert not torch.allclose(shifted.teacher_logprobs, reference.teacher_logprobs, atol=1e-3)
    assert float((shifted_grad - reference_grad).norm() / reference_grad.norm()) > 1e-2
    # ... yet each response's sum is still the teacher's: only the per-token credit moved
    assert torch.allclose(shifted.teacher_logprobs.sum(-1), reference.teacher_logprobs.sum(-1), atol=1e-4)


def test_a_teacher_of_another_tokenizer_scores_its_own_tokens(assets, rollouts, bpe_teacher):
    """The BPE teacher scores its chat template's prompt and its tokens of each response, which its own forward
    over those ids reproduces; each response's summed credit is that forward's response logprob, exactly."""
    student, samples = rollouts
    router = TeacherRouter({"*": str(bpe_teacher)}, local_teachers(ModelConfig()), student.tokenizer,
                           teacher_tokenizers={"*": str(bpe_teacher)})
    batch = collate(samples, student.pad_id)
    router.score(batch, samples, "sampled", micro_batch_size=3)
    cross, teacher = router.aligners["*"], router.teachers["*"]
    converted = [cross.teacher_sample(s) for s in samples]
    assert all(teacher.tokenizer.decode(t.prompt_ids).startswith("<|im_start|>system\nYou are a careful teacher.")
               for t, _ in converted)  # its own template's default system message: not in the student's prompt
    assert sum(len(t.response_ids) for t, _ in converted) < sum(len(s.response_ids) for s in samples)  # merges
    for i, (t, _) in enumerate(converted):  # one sample at a time: no padding in the teacher's forward
        own = teacher.logprobs(collate([t], cross.teacher_pad)).sum()
        assert float(batch.teacher_logprobs[i].sum()) == pytest.approx(float(own), abs=1e-4)
    exact = batch.teacher_exact[batch.response_mask.bool()]
    assert 0 < float(exact.mean()) < 1  # whole teacher tokens where a byte token is one; split inside merges


def test_billing_a_scored_sample_reads_the_scoring_pass_token_counts(assets, rollouts, bpe_teacher, monkeypatch):
    """The scoring pass converts each sample once (chat template, re-tokenisation) and billing reads its counts back:
    the same numbers as a fresh conversion, no second conversion; a sample it did not score is converted anew."""
    import dataclasses

    student, samples = rollouts
    router = TeacherRouter({"*": str(bpe_teacher)}, local_teachers(ModelConfig()), student.tokenizer,
                           teacher_tokenizers={"*": str(bpe_teacher)})
    cross = router.aligners["*"]
    fresh = [(len(t.prompt_ids), len(t.response_ids)) for t, _ in map(cross.teacher_sample, samples)]
    calls = []
    convert = cross.teacher_sample
    monkeypatch.setattr(cross, "teacher_sample", lambda s: calls.append(s) or convert(s))
    router.score(collate(samples, student.pad_id), samples, "sampled", micro_batch_size=3)
    assert len(calls) == len(samples)
    prompts, responses = router.token_counts(samples, 1)
    assert list(zip(prompts, responses)) == fresh and len(calls) == len(samples)  # read back, not converted again
    copy = dataclasses.replace(samples[0])
    assert cross.token_counts(copy) == fresh[0] and calls[-1] is copy  # not scored: converted here


def test_the_teachers_of_another_tokenizer_are_found_and_their_kl_forms_refused(assets, bpe_teacher, tmp_path):
    """Found from each teacher's directory (another vocabulary) or named; the KL forms, and a name for a route that
    does not exist, refused before any model loads; a router never scores another vocabulary unaligned."""
    from megaopd.teachers.cross_tokenizer import alignment_tokenizers
    from megaopd.objectives.losses import check_opd

    student = str(assets / "models" / "qwen3-tiny")
    opd = OPDConfig(form="sampled", teachers={"arith_add": str(bpe_teacher),
                                              "prog_trace": str(assets / "models" / "qwen3-tiny-seed1")})
    assert alignment_tokenizers(student, opd) == {"arith_add": str(bpe_teacher)}
    opd.teacher_tokenizer = {"prog_trace": student}
    aligned = alignment_tokenizers(student, opd)
    assert aligned == {"arith_add": str(bpe_teacher), "prog_trace": student}
    check_opd(opd, "hf", aligned)
    for form, backend in (("topk", "hf"), ("full_vocab", "hf")):
        with pytest.raises(ConfigError, match="another tokenizer than the student.*set opd.form=sampled"):
            check_opd(OPDConfig(form=form, topk=4, teachers=opd.teachers), backend, aligned)
    with pytest.raises(ConfigError, match="runs on model.backend=hf"):
        check_opd(opd, "megatron", aligned)
    with pytest.raises(ConfigError, match="opd.teacher_tokenizer names route"):
        check_opd(OPDConfig(form="sampled", teachers={"*": str(bpe_teacher)}, teacher_tokenizer={"x": student}),
                  "hf")
    with pytest.raises(ModelError, match="different vocabulary from the student's and no alignment"):
        TeacherRouter({"*": str(bpe_teacher)}, local_teachers(ModelConfig()), AutoTokenizer.from_pretrained(student))


# ------------------------------------------------------------------------------------------------ the trainer

def cross_run(assets, run_dir, teachers: dict, **overrides):
    from conftest import run_config

    cfg = run_config(assets, run_dir, "opd", **{"opd.form": "sampled", "rollout.samples_per_prompt": 2,
                                               "train.steps": 1, **overrides})
    cfg.opd.teachers = {route: str(path) for route, path in teachers.items()}
    return cfg


def test_the_flop_audit_is_exact_on_a_cross_tokenizer_step(assets, bpe_teacher, tmp_path):
    """Every phase of one OPD step with the BPE teacher counted by FlopCounterMode: the teacher's pass runs over its
    own tokens of the prompt (its template) and of each response, which is what the ledger bills; the student's
    lengths would bill another number."""
    from megaopd.run.flop_audit import audit_step

    cfg = cross_run(assets, tmp_path / "run", {"*": bpe_teacher}, **{"train.prompts_per_step": 1,
                                                                      "train.micro_batch_size": 1})
    audit = audit_step(cfg)
    assert audit["teacher"].booked > 0 and audit["reference"].measured == audit["reference"].booked == 0
    assert audit.mismatches() == []
    for component, row in audit.items():
        assert row.booked == row.ledger_form, component
        assert row.measured == row.executed_form + row.recomputed, (component, row)
    # Negative control: a ledger billing the student's token counts for the teacher is caught.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TeacherRouter, "token_counts", lambda self, samples, n: (
            [len(s.prompt_ids) for s in samples[::n]], [len(s.response_ids) for s in samples]))
        wrong = audit_step(cross_run(assets, tmp_path / "wrong", {"*": bpe_teacher}, **{
            "train.prompts_per_step": 1, "train.micro_batch_size": 1}))["teacher"]
    assert wrong.measured == audit["teacher"].measured and wrong.measured != wrong.executed_form
    with pytest.raises(ValueError, match="train.micro_batch_size=1"):
        audit_step(cross_run(assets, tmp_path / "padded", {"*": bpe_teacher}, **{"train.prompts_per_step": 1,
                                                                                 "train.micro_batch_size": 2}))


def reference_gradient(student_dir, batch, samples, teachers: dict, temperature: float) -> torch.Tensor:
    """The sampled OPD gradient at the student's initial weights, computed another way than the trainer's: each
    sample scored alone by its domain's teacher (no routing, no batching across routes), and the clipped surrogate's
    gradient at ratio 1, -sum_t w_t A_t grad log p(y_t) / tokens with A_t = teacher - student logprob, from one plain
    transformers forward (no micro-batches, no chunked projection)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1] / temperature
    logp = logits.log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    credit = torch.zeros_like(logp)
    for i, s in enumerate(samples):
        alone = collate([s], 0)  # one sample: no padding
        teachers[s.row.domain].score(alone, [s], "sampled", micro_batch_size=1)
        credit[i, :alone.teacher_logprobs.shape[1]] = alone.teacher_logprobs[0]
    mask = batch.response_mask
    weights = batch.is_weights if batch.is_weights is not None else torch.ones_like(mask)
    (-(weights * (credit - logp.detach()) * logp * mask).sum() / mask.sum()).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_teachers_of_different_tokenizers_routed_by_domain(assets, bpe_teacher, tmp_path):
    """arith_add to the BPE teacher (its own tokens), prog_trace to a teacher of the student's tokenizer: one OPD step
    trains with the gradient computed another way (reference_gradient), each route's teacher bills its own tokens,
    and only the cross-tokenizer route splits credit."""
    from megaopd.accounting.flops import scoring_flops
    from megaopd.run.trainer import Trainer

    teachers = {"arith_add": bpe_teacher, "prog_trace": assets / "models" / "qwen3-tiny-seed1"}
    trainer = Trainer(cross_run(assets, tmp_path / "run", teachers))
    try:
        router, booked, trained = trainer.teachers, [], []
        assert list(router.aligners) == ["arith_add"]
        bill = trainer._book_flops
        trainer._book_flops = lambda rows, samples, *a: booked.append((rows, samples)) or bill(rows, samples, *a)
        update = trainer.policy.train_minibatch

        def recorded(part, *args):  # the batch and the gradient the optimizer stepped with
            metrics = update(part, *args)
            trained.append((part, torch.cat([p.grad.flatten() for p in trainer.policy.model.parameters()])))
            return metrics
        trainer.policy.train_minibatch = recorded
        step = trainer.step_fn(1)
    finally:
        trainer.close()
    [(batch, grad)] = trained
    alone = {domain: TeacherRouter({"*": str(path)}, local_teachers(ModelConfig()), trainer.policy.tokenizer,
                                   router.temperature, router.top_p,
                                   teacher_tokenizers={"*": str(path)} if domain in router.aligners else None)
             for domain, path in teachers.items()}
    reference = reference_gradient(assets / "models" / "qwen3-tiny", batch, booked[-1][1], alone, trainer.temperature)
    cosine = float(torch.nn.functional.cosine_similarity(grad.double(), reference.double(), dim=0))
    print(f"grad norm {step['train/grad_norm']:.6g} against {float(reference.norm()):.6g}, cosine {cosine:.8f}")
    assert step["train/grad_norm"] == pytest.approx(float(reference.norm()), rel=1e-4)  # measured 2.5e-6 apart
    assert cosine > 1 - 1e-6  # the direction, whatever train.grad_clip scaled
    assert step["train/teacher/prog_trace/exact_credit_share"] == 1.0
    assert step["train/teacher/arith_add/token_share"] > 0 and step["train/teacher/prog_trace/token_share"] > 0
    rows, samples = booked[-1]  # the rollout billed when generated, the rest in the step: the same samples
    prompts, responses = router.token_counts(samples, 2)
    cross = router.aligners["arith_add"]
    for k, row in enumerate(rows):  # each prompt's teacher, in its own tokens (the student's for prog_trace)
        group = samples[2 * k:2 * k + 2]
        own = [cross.token_counts(s) if row.domain == "arith_add" else (len(s.prompt_ids), len(s.response_ids))
               for s in group]
        assert prompts[k] == own[0][0] and responses[2 * k:2 * k + 2] == [r for _, r in own]
        assert (prompts[k] != len(group[0].prompt_ids)) == (row.domain == "arith_add")  # its template's system line
    assert trainer.ledger.own["teacher"] == sum(
        scoring_flops(router.shape(router.route(row.domain)), [prompts[k]], responses[2 * k:2 * k + 2], 2)
        for k, row in enumerate(rows))


def test_a_kl_form_with_a_teacher_of_another_tokenizer_stops_before_any_model_loads(assets, bpe_teacher, tmp_path,
                                                                                    monkeypatch):
    from megaopd.run import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "build_policy", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(ConfigError, match="set opd.form=sampled"):
        trainer_module.Trainer(cross_run(assets, tmp_path / "run", {"*": bpe_teacher},
                                         **{"opd.form": "topk", "opd.topk": 4}))
