"""Frozen teachers and multi-teacher routing: each sample goes to exactly one teacher, by its row's domain.

``opd.teachers`` maps a domain (``extra_info.domain``, else ``data_source``) to an HF directory; ``"*"`` serves every
domain not named. A domain with no teacher is an error before the first step, not a silent skip. A teacher is
anything with ``tokenizer``, ``shape``, ``logprobs`` and ``full_logprobs``: an in-process ``HFPolicy``, or an
``SGLangTeacher`` (``megaopd.serving.teacher``); ``load(route, path)`` builds one per distinct directory.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

from megaopd.batch import Sample, TokenBatch
from megaopd.config import ModelConfig
from megaopd.flops import ModelShape
from megaopd.policy import HFPolicy

ANY_DOMAIN = "*"


def local_teachers(model_cfg: ModelConfig) -> Callable[[str, str], HFPolicy]:
    """Teachers as frozen in-process HF models, in the student's dtype and on its device."""
    return lambda route, path: HFPolicy(ModelConfig(path=path, dtype=model_cfg.dtype, device=model_cfg.device))


class TeacherRouter:
    def __init__(self, teachers: dict[str, str], load: Callable[[str, str], object], student_tokenizer):
        if not teachers:
            raise ValueError("OPD needs at least one teacher: set opd.teachers.<domain>=<HF dir> (or '*')")
        self.paths = dict(teachers)
        loaded: dict[str, object] = {}
        for route, path in self.paths.items():
            if path in loaded:
                continue
            loaded[path] = load(route, path)
            if loaded[path].tokenizer.get_vocab() != student_tokenizer.get_vocab():
                raise ValueError(f"teacher {path} has a different tokenizer from the student: per-token "
                                 "supervision needs the same vocabulary and chat template")
        self.teachers = {domain: loaded[path] for domain, path in self.paths.items()}

    def route(self, domain: str) -> str:
        if domain in self.teachers:
            return domain
        if ANY_DOMAIN in self.teachers:
            return ANY_DOMAIN
        raise KeyError(f"no teacher for domain {domain!r}; opd.teachers routes {sorted(self.teachers)} "
                       f"(add opd.teachers.{domain}=<dir> or a '*' entry)")

    def close(self) -> None:
        for teacher in set(self.teachers.values()):
            getattr(teacher, "close", lambda: None)()  # servers stop; in-process models need nothing

    def check_domains(self, domains: set[str]) -> None:
        for domain in sorted(domains):
            self.route(domain)

    def shape(self, route: str) -> ModelShape:
        return self.teachers[route].shape

    def score(self, batch: TokenBatch, samples: list[Sample], full_vocab: bool,
              micro_batch_size: int) -> dict[str, list[int]]:
        """Fill the batch's teacher logprobs (and full log-softmax when asked); returns route -> sample indices."""
        groups: dict[str, list[int]] = defaultdict(list)
        for i, s in enumerate(samples):
            groups[self.route(s.row.domain)].append(i)
        batch.teacher_logprobs = torch.zeros_like(batch.response_mask)
        for route, indices in groups.items():
            sub = batch.select(torch.tensor(indices))
            teacher = self.teachers[route]
            if not full_vocab:
                batch.teacher_logprobs[indices] = teacher.logprobs(sub, micro_batch_size)
                continue
            # One teacher pass: the realised tokens' logprobs are read off the full log-softmax.
            full = teacher.full_logprobs(sub, micro_batch_size)
            if len(groups) == 1:  # one teacher scores the whole batch: keep its tensor, no [B, S-1, V] copy
                batch.teacher_full_logprobs = full
            else:
                if batch.teacher_full_logprobs is None:
                    batch.teacher_full_logprobs = torch.zeros((*batch.response_mask.shape, full.shape[-1]))
                batch.teacher_full_logprobs[indices] = full
            realised = full.gather(-1, sub.input_ids[:, 1:, None]).squeeze(-1)
            batch.teacher_logprobs[indices] = realised * sub.response_mask
        return dict(groups)
