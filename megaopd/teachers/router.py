"""Frozen teachers and multi-teacher routing: each sample goes to exactly one teacher, by its row's domain.

``opd.teachers`` maps a domain (``extra_info.domain``, else ``data_source``) to an HF directory; ``"*"`` serves every
domain not named. A domain with no teacher is an error before the first step, not a silent skip. A teacher is
a ``Teacher`` (below): an in-process ``HFPolicy``, or an ``SGLangTeacher`` (``megaopd.rollout.serving.teacher``);
``load(route, path)`` builds one per distinct directory.

What the batch holds per form (docs/opd.md): sampled, the teacher's logprob of each realised token [B, S-1]; topk,
also its top-K ids and logprobs [B, S-1, K] and the log of its remaining mass [B, S-1]; full_vocab, only the
realised tokens' logprobs, never the [B, S-1, V] distribution: one teacher forward per sample (``scored_rows``) gives
the realised logprobs and the response rows' [N, H] hidden states, kept for the step, which the training step
projects to the vocabulary chunk by chunk (``full_rows``). Where the memory plan cannot keep them
(``recompute``), the teacher runs again per micro-batch inside the training step; every re-projection and re-run is
hardware work (``recompute_flops``), never billed in the ledger (``flops.teacher_passes``).
All of them score at the run's one temperature, the student's (``rollout.policy_temperature``), and local teachers
cut to the rollout's top-p when ``opd.match_sampling``; ``run.resolve.check_temperature`` refuses the rest.

A teacher of another tokenizer (or one named in ``opd.teacher_tokenizer``) scores its own tokens of each sample
through ``megaopd.teachers.cross_tokenizer``, whichever engine it runs on, in the sampled form only; ``token_counts`` gives the
ledger its tokens.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from megaopd.teachers.cross_tokenizer import CrossTokenizer, refuse_unaligned
from megaopd.data.batch import Sample, TokenBatch
from megaopd.config import ConfigError, ModelConfig, teacher_route
from megaopd.accounting.flops import ModelShape, recompute_flops
from megaopd.models.hf_policy import HFPolicy

log = logging.getLogger(__name__)


@runtime_checkable
class Teacher(Protocol):
    """What ``TeacherRouter`` asks of a teacher engine (``HFPolicy`` in process, ``SGLangTeacher`` on servers,
    ``MegatronPolicy``): the tokenizer its directory reads text with, its shape (what the ledger bills), and its
    scores of a batch of its own token ids: each realised token's logprob [B, S-1] and a top-k view (``realised``,
    ``topk_ids``, ``topk``, ``tail``), 0 off the response, under the given sampling settings (an engine that cannot
    follow them refuses). A teacher of another tokenizer asks nothing more: ``megaopd.teachers.cross_tokenizer`` hands it its own ids.
    Local teachers also give the full form's rows (``scored_rows``, ``full_rows``); a server cannot.
    tests/test_teacher_contract.py runs the same cases on the local and the server engine."""

    tokenizer: Any
    shape: ModelShape

    def logprobs(self, batch: TokenBatch, micro_batch_size: int = 64, temperature: float = 1.0,
                 top_p: float = 1.0) -> torch.Tensor: ...

    def topk_logprobs(self, batch: TokenBatch, k: int, micro_batch_size: int = 64, temperature: float = 1.0,
                      top_p: float = 1.0) -> dict[str, torch.Tensor]: ...


def local_teachers(model_cfg: ModelConfig, logit_chunk_rows: int = 1024,
                   dtype: str = "") -> Callable[[str, str], HFPolicy]:
    """Teachers as frozen in-process HF models on the student's device, in `dtype` ("": the student's)."""
    return lambda route, path: HFPolicy(ModelConfig(path=path, dtype=dtype or model_cfg.dtype,
                                                    device=model_cfg.device), logit_chunk_rows=logit_chunk_rows)


class TeacherRouter:
    def __init__(self, teachers: dict[str, str], load: Callable[[str, str], Teacher], student_tokenizer,
                 temperature: float = 1.0, top_p: float = 1.0, recompute: bool = False, servers: bool = False,
                 teacher_tokenizers: dict[str, str] | None = None):
        """``teacher_tokenizers``: route -> tokenizer directory of each teacher that scores through the alignment
        (``align.alignment_tokenizers``; its own directory for a teacher of another vocabulary)."""
        from transformers import AutoTokenizer

        if not teachers:
            raise ConfigError("OPD needs at least one teacher; set opd.teachers.<domain>=<HF dir> (or '*')")
        self.paths = dict(teachers)
        # Servers of their own need nothing of the trainer's devices: the rollout pipeline's thread can run ``score``
        # while the trainer updates (the trainer reads ``work`` and ``kept`` only after the weight sync waited for it).
        self.servers = servers
        self.temperature, self.top_p = temperature, top_p  # the sampling settings the teachers score under
        self.recompute = recompute  # the memory plan's call: full-vocabulary rows re-run per micro-batch, not kept
        self.kept: dict[str, Callable] = {}  # route -> this step's full-vocabulary rows(index) (one forward/sample)
        self.work: dict[str, list] = {}  # route -> [rows re-projected, sequence lengths re-run] this step
        loaded: dict[str, Teacher] = {}
        for route, path in self.paths.items():
            if path not in loaded:
                loaded[path] = load(route, path)
        # route -> the alignment of a teacher of another tokenizer: it scores its own tokens (megaopd.teachers.cross_tokenizer)
        self.aligners: dict[str, CrossTokenizer] = {}
        for route, path in self.paths.items():
            teacher, named = loaded[path], (teacher_tokenizers or {}).get(route)
            if named is not None:
                tokenizer = teacher.tokenizer if named == path else AutoTokenizer.from_pretrained(named)
                self.aligners[route] = CrossTokenizer(student_tokenizer, tokenizer, teacher.shape.vocab_size)
                continue
            refuse_unaligned(route, path, student_tokenizer, teacher.tokenizer)  # alignment_tokenizers' job
            # The teacher scores the prompt as the student's chat template renders it; its own template is unused.
            if getattr(teacher.tokenizer, "chat_template", None) != getattr(student_tokenizer, "chat_template", None):
                log.warning("teacher %s has another chat template than the student: it scores prompts in the "
                            "student's format", path)
        self.teachers = {domain: loaded[path] for domain, path in self.paths.items()}
        self.routes = sorted(self.teachers)  # TokenBatch.teacher_route indexes this list

    def route(self, domain: str) -> str:
        route = teacher_route(self.teachers, domain)
        if route is not None:
            return route
        raise KeyError(f"no teacher for domain {domain!r}; opd.teachers routes {sorted(self.teachers)} "
                       f"(add opd.teachers.{domain}=<dir> or a '*' entry)")

    def close(self) -> None:
        for teacher in set(self.teachers.values()):
            getattr(teacher, "close", lambda: None)()  # servers stop; in-process models need nothing

    def check_domains(self, domains: set[str]) -> None:
        for domain in sorted(domains):
            self.route(domain)

    def token_counts(self, samples: list[Sample], samples_per_prompt: int) -> tuple[list[int], list[int]]:
        """The routed teachers' own token counts, what their scoring passes run over: one prompt length per prompt
        (its group's first sample) and one response length per sample; the student's where a teacher shares its
        tokenizer."""
        counts = [self.aligners[route].token_counts(s) if (route := self.route(s.row.domain)) in self.aligners
                  else (len(s.prompt_ids), len(s.response_ids)) for s in samples]
        return [p for p, _ in counts[::samples_per_prompt]], [r for _, r in counts]

    def shape(self, route: str) -> ModelShape:
        return self.teachers[route].shape

    def _groups(self, samples: list[Sample]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = defaultdict(list)
        for i, s in enumerate(samples):
            groups[self.route(s.row.domain)].append(i)
        return dict(groups)

    def score(self, batch: TokenBatch, samples: list[Sample], form: str, micro_batch_size: int,
              topk: int = 0) -> dict[str, list[int]]:
        """Fill the batch's teacher fields for ``form`` (see the module docstring); returns route -> sample indices.
        The batch keeps each sample's route, so that ``full_rows`` asks the right teacher later."""
        groups = self._groups(samples)
        sampling = dict(temperature=self.temperature, top_p=self.top_p)
        self.release()
        self.work = {route: [0, []] for route in groups}
        batch.teacher_logprobs = torch.zeros_like(batch.response_mask)
        batch.teacher_topk_ids = batch.teacher_topk_logprobs = batch.teacher_tail = None  # sized by the first view
        batch.teacher_route = torch.tensor([self.routes.index(self.route(s.row.domain)) for s in samples])
        batch.teacher_row_start = torch.zeros(len(samples), dtype=torch.long)
        batch.teacher_exact = batch.response_mask.clone() if self.aligners else None
        for route, indices in groups.items():
            sub, teacher = batch.select(torch.tensor(indices)), self.teachers[route]
            if route in self.aligners:  # its own tokens of the samples, credited to the student's (align.py)
                batch.teacher_logprobs[indices], batch.teacher_exact[indices] = self.aligners[route].score(
                    teacher, sub, [samples[i] for i in indices], micro_batch_size, **sampling)
                continue
            if form == "full_vocab" and not self.recompute:
                batch.teacher_logprobs[indices], self.kept[route] = teacher.scored_rows(
                    sub, micro_batch_size, **sampling)
                rows = sub.response_mask.sum(1).long()
                batch.teacher_row_start[indices] = rows.cumsum(0) - rows  # each sample's first row in the route's
                continue
            if form != "topk":
                batch.teacher_logprobs[indices] = teacher.logprobs(sub, micro_batch_size, **sampling)
                continue
            view = teacher.topk_logprobs(sub, topk, micro_batch_size, **sampling)
            if batch.teacher_topk_ids is None:  # K, or the vocabulary size where opd.topk exceeds it
                k = view["topk"].shape[-1]
                batch.teacher_topk_ids = torch.zeros((*batch.response_mask.shape, k), dtype=torch.long)
                batch.teacher_topk_logprobs = torch.zeros((*batch.response_mask.shape, k))
                batch.teacher_tail = torch.zeros_like(batch.response_mask)
            batch.teacher_logprobs[indices] = view["realised"]
            batch.teacher_topk_ids[indices] = view["topk_ids"]
            batch.teacher_topk_logprobs[indices] = view["topk"]
            batch.teacher_tail[indices] = view["tail"]
        return groups

    def full_rows(self, mb: TokenBatch):
        """Each routed teacher's log-softmax at a micro-batch's response rows, on demand (``VocabTerm``): returns
        ``rows(slice) -> [rows, V]``, from the rows ``score`` kept (or, under ``recompute``, one teacher forward per
        route now), one vocabulary projection per call."""
        routes = [self.routes[i] for i in mb.teacher_route.tolist()]
        row_sample = mb.response_mask.nonzero(as_tuple=True)[0]
        parts = []  # (route's rows among the micro-batch's, route's row lookup)
        for route in sorted(set(routes)):
            indices = [i for i, r in enumerate(routes) if r == route]
            parts.append((torch.isin(row_sample, torch.tensor(indices, device=row_sample.device)),
                          self._rows(route, mb.select(torch.tensor(indices)))))
        if len(parts) == 1:
            return parts[0][1]

        def rows(index: slice) -> torch.Tensor:
            out = None
            for mine, lookup in parts:
                chunk_mine = mine[index]
                if not chunk_mine.any():
                    continue
                # the route's own row numbers of this chunk's rows: its rows come in the micro-batch's order
                local = torch.cumsum(mine.long(), 0)[index][chunk_mine] - 1
                values = lookup(local)
                if out is None:
                    out = values.new_zeros((chunk_mine.shape[0], values.shape[-1]))
                out[chunk_mine.to(out.device)] = values
            return out
        return rows

    def _rows(self, route: str, sub: TokenBatch) -> Callable:
        """One route's rows of a micro-batch (its samples ``sub``), each call's projection counted as hardware work."""
        work = self.work.setdefault(route, [0, []])
        if route in self.kept:
            counts = sub.response_mask.sum(1).long().tolist()
            index = torch.cat([torch.arange(s, s + c) for s, c in zip(sub.teacher_row_start.tolist(), counts)])
            index, kept = index.to(sub.response_mask.device), self.kept[route]
        else:
            work[1] += sub.attention_mask.sum(1).tolist()
            index, kept = None, self.teachers[route].full_rows(sub, self.temperature, self.top_p)

        def counted(rows):
            out = kept(rows if index is None else index[rows])
            work[0] += out.shape[0]
            return out
        return counted

    def release(self) -> None:
        """Free the step's kept full-vocabulary rows (after the update: the rollout's KV cache needs the room)."""
        self.kept = {}

    def recompute_flops(self, causal: bool = True) -> int:
        """The teachers' hardware FLOPs of the last step beyond their billed pass (``flops.recompute_flops``)."""
        return sum(recompute_flops(self.shape(route), rows, seqs, causal) for route, (rows, seqs) in self.work.items())
