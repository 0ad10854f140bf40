"""Cross-tokenizer OPD: a teacher whose tokenizer is not the student's scores the student's response under its own
tokens, and its logprobs reach the student's tokens through an alignment on the response's bytes (docs/opd.md).

Every teacher engine scores through ``CrossTokenizer.score``: it renders each prompt with the teacher's own chat
template, tokenizes the response's text with the teacher's tokenizer, has the engine (a local ``HFPolicy``, an
``SGLangTeacher`` server) score those teacher ids, and carries the teacher's per-token logprobs to the student's
response tokens:

- **Bytes.** Both tokenizers must be byte-level BPE (GPT-2's byte alphabet: SmolLM2, Qwen, Llama 3, the embedded
  models). A student token spells exact bytes, so its span on the response's bytes is known. The teacher tokenizes
  the text (each maximal valid UTF-8 run; a byte that is not valid UTF-8, e.g. a response cut mid-character, as the
  teacher's single-byte token); its tokens' spans are the bytes they spell, or, where its normalizer changed the
  text (NFC), its character offsets; tokens that share a character (an emoji in byte pieces) form one unit.
- **Credit.** Each teacher unit's logprob is split over the student tokens that spell its bytes, in proportion to the
  bytes each spells. A student token whose span is whole teacher units gets exactly their summed logprob (the
  chain rule); only a teacher unit straddling student tokens is split. Every teacher logprob lands on the student's
  tokens once, so the response's summed credit is the teacher's log-probability of the response:
  sum_i (s_i - credit_i) = log p_student(response) - log p_teacher(response), exactly. ``exact`` marks the student
  tokens whose credit needs no split.
- **End of turn.** A response that stopped ends with the student's EOS; the teacher's own EOS stands for it
  (one to one), whatever each spells.
"""

from __future__ import annotations

import bisect
import re
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from megaopd.data.batch import Sample, TokenBatch, collate
from megaopd.models.chat import chat_prompt_ids
from megaopd.errors import ModelError
from megaopd.accounting.flops import HF_CONFIG

_ESCAPED = re.compile("([\udc80-\udcff])")  # bytes that are not UTF-8, as `surrogateescape` decodes them


def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character each byte is written as -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(c): b for c, b in zip(printable + [256 + k for k in range(len(others))], printable + others)}


class ByteVocabulary:
    """The bytes each id of a byte-level BPE tokenizer spells (an added token: its text), and each byte's own token."""

    def __init__(self, tokenizer):
        decoder = type(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)).__name__
        if decoder != "ByteLevel":
            raise ModelError(f"cross-tokenizer OPD aligns on bytes and reads byte-level BPE tokenizers only (GPT-2's "
                             f"byte alphabet: SmolLM2, Qwen, Llama 3); {tokenizer.name_or_path!r} decodes with "
                             f"{decoder}: use a teacher of the student's tokenizer or a byte-level one")
        alphabet = byte_alphabet()
        added = {i: token.content for i, token in tokenizer.added_tokens_decoder.items()}
        vocab = tokenizer.get_vocab()
        self.spelled = [b""] * (max(vocab.values()) + 1)
        for token, i in vocab.items():
            self.spelled[i] = added[i].encode() if i in added else bytes(alphabet[c] for c in token)
        # byte -> its single-byte token (some vocabularies lack the bytes UTF-8 never uses, 0xC0, 0xC1, 0xF5-0xFF)
        self.byte_token = {b: vocab[c] for c, b in alphabet.items() if c in vocab}

    def bytes_of(self, token: int) -> bytes:
        """What a token spells: nothing for an id past the tokenizer's (a model's padded embedding rows)."""
        return self.spelled[token] if token < len(self.spelled) else b""

    def spans(self, ids: list[int]) -> list[tuple[int, int]]:
        """Each token's [start, end) on the bytes the ids spell."""
        ends, out = 0, []
        for i in ids:
            out.append((ends, ends + len(self.bytes_of(i))))
            ends = out[-1][1]
        return out

    def text(self, ids: list[int]) -> bytes:
        return b"".join(map(self.bytes_of, ids))


class TeacherText:
    """A teacher tokenizer's ids for some bytes, with each token's [start, end) on those bytes."""

    def __init__(self, tokenizer):
        from tokenizers import Tokenizer

        self.vocabulary = ByteVocabulary(tokenizer)
        # The backend without its post-processor: no BOS added, offsets as the pre-tokenizer cut them (untrimmed).
        self.backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        self.backend.post_processor = None
        probe = "x = 1"
        spelled = self.vocabulary.text(self.backend.encode(probe, add_special_tokens=False).ids)
        if spelled != probe.encode():  # it would score other text than the response's, e.g. " x = 1"
            raise ModelError(f"the teacher tokenizer {tokenizer.name_or_path!r} spells {probe!r} as {spelled!r}: it "
                             "adds a prefix space (add_prefix_space) or rewrites plain text, so its tokens of a "
                             "response would not be the response; give a tokenizer without add_prefix_space")

    def encode(self, data: bytes) -> tuple[list[int], list[tuple[int, int]]]:
        ids, spans, start = [], [], 0
        for piece in _ESCAPED.split(data.decode("utf-8", "surrogateescape")):
            if not piece:
                continue
            if _ESCAPED.fullmatch(piece):  # a byte that is not UTF-8: the teacher's token for that byte, or its
                byte = ord(piece) - 0xDC00  # tokens of U+FFFD (what a decoder shows) where it has none
                spelled = [self.vocabulary.byte_token[byte]] if byte in self.vocabulary.byte_token else \
                    self.backend.encode("\ufffd", add_special_tokens=False).ids
                ids += spelled
                spans += [(start, start + 1)] * len(spelled)
                start += 1
                continue
            encoding = self.backend.encode(piece, add_special_tokens=False)
            ids += encoding.ids
            if self.vocabulary.text(encoding.ids) == piece.encode():  # the tokens spell the text: exact byte spans
                spans += [(start + a, start + b) for a, b in self.vocabulary.spans(encoding.ids)]
                start += len(piece.encode())
                continue
            at = [start]  # its normalizer changed the text (NFC): character offsets, mapped to bytes
            for ch in piece:
                at.append(at[-1] + len(ch.encode()))
            spans += [(at[a], at[b]) for a, b in encoding.offsets]
            start = at[-1]
        return ids, spans


@dataclass
class Alignment:
    """How one response's teacher logprobs become the student's: student token ``student[e]`` gets ``weight[e]``
    of teacher token ``teacher[e]``'s logprob; each teacher token's weights sum to 1."""

    student: torch.Tensor  # [E] long: index into the student's response tokens
    teacher: torch.Tensor  # [E] long: index into the teacher's response tokens
    weight: torch.Tensor  # [E] float64
    exact: torch.Tensor  # [n_student] bool: the token's credit is whole teacher units (no split)
    n_student: int

    def credit(self, teacher_logprobs: torch.Tensor) -> torch.Tensor:
        """The student tokens' share of the teacher's logprobs [n_teacher] -> [n_student] (same sum)."""
        values = teacher_logprobs.double()[self.teacher] * self.weight
        return torch.zeros(self.n_student, dtype=torch.float64).index_add_(0, self.student, values).to(
            teacher_logprobs.dtype)


def teacher_units(spans: list[tuple[int, int]], length: int) -> list[tuple[list[int], int, int]]:
    """Teacher tokens grouped into units that tile [0, length): consecutive tokens whose spans overlap (pieces of one
    character) are one unit; a token with an empty span joins the next unit (the last one at the end). Bytes no
    token's offsets cover (a combining mark the teacher's normalizer composed into the character before it) join
    the unit before them."""
    units: list[tuple[list[int], int, int]] = []
    waiting: list[int] = []
    for j, (a, b) in enumerate(spans):
        if a == b:
            waiting.append(j)
        elif units and a < units[-1][2]:
            tokens, start, end = units[-1]
            units[-1] = (tokens + waiting + [j], start, max(end, b))
            waiting = []
        else:
            units.append((waiting + [j], a, b))
            waiting = []
    if waiting:  # empty spans at the end: the last unit's (or, on empty text, a unit of no bytes)
        tokens, start, end = units.pop() if units else ([], length, length)
        units.append((tokens + waiting, start, end))
    bounds = [0] + [start for _, start, _ in units[1:]] + [length]
    return [(tokens, start, end) for (tokens, _, _), start, end in zip(units, bounds, bounds[1:])]


def align(student_spans: list[tuple[int, int]], teacher_spans: list[tuple[int, int]]) -> Alignment:
    """The byte-share credit of the module docstring, for two tokenizations of the same bytes."""
    length = student_spans[-1][1] if student_spans else 0
    rows, cols, weights = [], [], []
    boundaries = {0}
    starts = [a for a, _ in student_spans]
    for tokens, a, b in teacher_units(teacher_spans, length):
        boundaries.add(b)
        if a == b:  # bytes of its own, none: the student token at that position
            covering = [max(0, min(len(student_spans) - 1, _index_at(starts, a)))]
            shares = [1.0]
        else:
            covering = list(range(_index_at(starts, a), bisect.bisect_left(starts, b)))
            shares = [(min(b, student_spans[i][1]) - max(a, student_spans[i][0])) / (b - a) for i in covering]
        for j in tokens:
            rows += covering
            cols += [j] * len(covering)
            weights += shares
    exact = torch.tensor([a in boundaries and b in boundaries for a, b in student_spans], dtype=torch.bool)
    return Alignment(torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long),
                     torch.tensor(weights, dtype=torch.float64), exact, len(student_spans))


def _index_at(starts: list[int], position: int) -> int:
    """The student token whose span holds byte `position` (starts ascending)."""
    return max(bisect.bisect_right(starts, position) - 1, 0)


class CrossTokenizer:
    """A student tokenizer and a teacher's: the teacher's own tokens of a sample, and the student's credit."""

    def __init__(self, student_tokenizer, teacher_tokenizer, teacher_vocab_size: int):
        self.student = ByteVocabulary(student_tokenizer)
        self.teacher = TeacherText(teacher_tokenizer)
        self.tokenizer = teacher_tokenizer
        if len(self.teacher.vocabulary.spelled) > teacher_vocab_size:
            raise ModelError(f"the teacher tokenizer {teacher_tokenizer.name_or_path!r} has ids up to "
                             f"{len(self.teacher.vocabulary.spelled) - 1}, beyond its model's vocabulary of "
                             f"{teacher_vocab_size}: give the tokenizer the teacher was trained with")
        self.student_stop, self.teacher_stop = student_tokenizer.eos_token_id, teacher_tokenizer.eos_token_id
        self.teacher_pad = teacher_tokenizer.pad_token_id if teacher_tokenizer.pad_token_id is not None \
            else self.teacher_stop
        # The teacher's token counts of the samples its last two scoring passes converted (this step's, and the
        # next step's when the rollout pipeline's thread scored it ahead), read back by ``token_counts`` so billing
        # a sample does not convert it again: {id(sample): (sample, (prompt, response))}, the sample kept to tell a
        # reused id from the same object.
        self._scored: deque[dict[int, tuple[Sample, tuple[int, int]]]] = deque(maxlen=2)
        self._scored_lock = threading.Lock()

    def teacher_sample(self, sample: Sample) -> tuple[Sample, Alignment]:
        """The sample in the teacher's tokens (its chat template's prompt, its tokens of the response) and how the
        teacher's response logprobs map onto the student's response tokens."""
        response = sample.response_ids
        stops = bool(response) and sample.finish_reason == "stop" and response[-1] == self.student_stop
        text_ids = response[:-1] if stops else response
        data = self.student.text(text_ids)
        teacher_ids, teacher_spans = self.teacher.encode(data)
        alignment = align(self.student.spans(text_ids), teacher_spans)
        if stops:  # the end of turn: the student's EOS <-> the teacher's, one to one
            alignment = Alignment(torch.cat([alignment.student, torch.tensor([len(text_ids)])]),
                                  torch.cat([alignment.teacher, torch.tensor([len(teacher_ids)])]),
                                  torch.cat([alignment.weight, torch.ones(1, dtype=torch.float64)]),
                                  torch.cat([alignment.exact, torch.ones(1, dtype=torch.bool)]), len(response))
            teacher_ids = teacher_ids + [self.teacher_stop]
        prompt = chat_prompt_ids(self.tokenizer, sample.row.prompt)
        return Sample(sample.row, sample.group, prompt, teacher_ids, [0.0] * len(teacher_ids), sample.finish_reason,
                      sample.weight_version), alignment

    def token_counts(self, sample: Sample) -> tuple[int, int]:
        """The teacher's own prompt and response token counts for this sample (what its scoring pass costs): those of
        its scoring pass when ``score`` converted this very sample, else converted here."""
        with self._scored_lock:
            for scored in self._scored:
                kept = scored.get(id(sample))
                if kept is not None and kept[0] is sample:
                    return kept[1]
        teacher_sample, _ = self.teacher_sample(sample)
        return len(teacher_sample.prompt_ids), len(teacher_sample.response_ids)

    def score(self, teacher, batch: TokenBatch, samples: list[Sample], micro_batch_size: int,
              temperature: float = 1.0, top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's credit for each student response token [B, S-1] (0 elsewhere), and where it is exact
        (1.0; 0 where a teacher unit was split): ``teacher`` scores its own tokens of ``samples`` (``batch``)."""
        converted = [self.teacher_sample(s) for s in samples]
        with self._scored_lock:
            self._scored.append({id(s): (s, (len(t.prompt_ids), len(t.response_ids)))
                                 for s, (t, _) in zip(samples, converted)})
        teacher_batch = collate([s for s, _ in converted], self.teacher_pad)
        scored = teacher.logprobs(teacher_batch, micro_batch_size, temperature=temperature, top_p=top_p)
        credit, exact = torch.zeros_like(batch.response_mask), torch.zeros_like(batch.response_mask)
        for i, ((teacher_sample, alignment), sample) in enumerate(zip(converted, samples)):
            first = len(teacher_sample.prompt_ids) - 1  # the column that scores the teacher's first response token
            theirs = scored[i, first:first + len(teacher_sample.response_ids)]
            mine = slice(len(sample.prompt_ids) - 1, len(sample.prompt_ids) - 1 + len(sample.response_ids))
            credit[i, mine] = alignment.credit(theirs)
            exact[i, mine] = alignment.exact.to(exact.dtype)
        return credit, exact



def alignment_tokenizers(student_path: str, opd, read_models: bool = True) -> dict[str, str]:
    """Route -> tokenizer directory of each teacher that scores through the alignment: one named in
    ``opd.teacher_tokenizer``, or (``read_models``) one whose directory's tokenizer has another vocabulary than the
    student's. Read before any model loads (tokenizers only); a directory without a model is left to the model's
    loader to refuse."""
    from transformers import AutoTokenizer

    tokenizers: dict[str, object] = {}

    def tokenizer(path: str):
        if path not in tokenizers:
            tokenizers[path] = AutoTokenizer.from_pretrained(path)
        return tokenizers[path]

    out = dict(opd.teacher_tokenizer)
    if not read_models or not (Path(student_path) / HF_CONFIG).exists():
        return out
    for route, path in opd.teachers.items():
        if (route not in out and (Path(path) / HF_CONFIG).exists()
                and other_vocabulary(tokenizer(student_path), tokenizer(path))):
            out[route] = path
    return out


def other_vocabulary(student_tokenizer, teacher_tokenizer) -> bool:
    """Whether a teacher's tokenizer has another vocabulary than the student's: such a teacher scores its own tokens
    through the alignment (``alignment_tokenizers`` names it) or is refused (``refuse_unaligned``)."""
    return teacher_tokenizer.get_vocab() != student_tokenizer.get_vocab()


def refuse_unaligned(route: str, path: str, student_tokenizer, teacher_tokenizer) -> None:
    """Refuse the teacher of route ``route`` (directory ``path``) if its vocabulary is not the student's and it has
    no alignment (no tokenizer named for it)."""
    if other_vocabulary(student_tokenizer, teacher_tokenizer):
        raise ModelError(f"teacher {path} has a different vocabulary from the student's and no alignment: "
                         f"name its tokenizer in teacher_tokenizers (opd.teacher_tokenizer.{route}=DIR)")
