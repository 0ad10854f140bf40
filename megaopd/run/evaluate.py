"""Held-out evaluation and reward scoring: accuracy per domain (greedy and sampled) and mean response length.

Each evaluation can also write its per-prompt results (``evals/step_NNNNNN.json``, ``evals/final.json`` in the run
directory): one reward per held-out prompt in file order, per domain and mode, plus the greedy response lengths.
The report resamples these prompts to put bootstrap intervals on every accuracy and on what is computed from them.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from megaopd.data.batch import Sample
from megaopd.config import EvalConfig
from megaopd.data.rows import Row
from megaopd.accounting.metrics import per_domain_means
from megaopd.rollout.local import sampling_generator
from megaopd.rollout.serving.leader import on_leader
from megaopd.verifiers import score, verifier_errors


def response_text(tokenizer, sample: Sample) -> str:
    return tokenizer.decode(sample.response_ids, skip_special_tokens=True)


def score_samples(tokenizer, samples: list[Sample]) -> tuple[float, int]:
    """Set each sample's reward from its row's verifier; returns the verifiers' wall time (0 model FLOPs) and how
    many of them failed (each scored 0). Under torchrun every rank holds the same samples: rank 0 scores them once
    and every rank gets its rewards, since a verifier's wall-clock limit can fire on one rank and not another and
    ranks that disagree on a reward would compute different advantages for one update."""

    def score_all() -> tuple[list[float], float, int]:
        start, before = time.perf_counter(), sum(verifier_errors().values())
        rewards = [score(s.row, response_text(tokenizer, s)) for s in samples]
        return rewards, time.perf_counter() - start, sum(verifier_errors().values()) - before

    rewards, seconds, errors = on_leader(score_all)
    for s, reward in zip(samples, rewards, strict=True):
        s.reward = reward
    return seconds, errors


# The metric prefixes of the splits' periodic evals: eval/<domain>/accuracy_<mode> (the test split, which the report
# judges) and valid/<domain>/accuracy_greedy (the validation split, which stop rules read).
TEST, VALID = "eval", "valid"


def final_prefix(prefix: str) -> str:
    """The prefix of a split's final eval: final/ (test), final_valid/ (validation)."""
    return "final" if prefix == TEST else f"final_{prefix}"


class Evaluator:
    """Fixed held-out prompts: a subset per domain during training, all of them (or a stated number) at the end."""

    def __init__(self, rows: list[Row], cfg: EvalConfig, max_new_tokens: int, seed: int,
                 device: torch.device | str = "cpu", prefix: str = TEST):
        """`prefix`: of the metric keys, ``<prefix>/<domain>/accuracy_<mode>`` (TEST or VALID; at the end
        ``final_prefix(prefix)``)."""
        self.cfg, self.seed, self.device = cfg, seed, device  # device: the policy's, where sampling draws
        self.prefix = prefix
        self.max_new_tokens = cfg.max_new_tokens or max_new_tokens
        self.by_domain: dict[str, list[Row]] = defaultdict(list)
        for row in rows:
            self.by_domain[row.domain].append(row)

    def _rows(self, final: bool) -> list[Row]:
        limit = self.cfg.final_prompts_per_domain if final else self.cfg.prompts_per_domain
        return [r for rows in self.by_domain.values() for r in (rows[:limit] if limit > 0 else rows)]

    def run(self, engine, tokenizer, step: int, final: bool = False, record: Path | None = None) -> dict[str, float]:
        """Accuracy per domain and mode; with `record`, also write every prompt's reward there (see module doc)."""
        rows = self._rows(final)
        if not rows:
            return {}
        metrics: dict[str, float] = {}
        prefix = final_prefix(self.prefix) if final else self.prefix
        per_prompt: dict = {"step": step, "final": final, "prompts": {}, "reward": {}, "response_length": {}}
        modes = [("greedy", 0.0)] + ([("sampled", 1.0)] if self.cfg.sampled else [])
        for mode, temperature in modes:
            # Its own generator, seeded by step: evaluation never moves the training RNG (resume stays exact).
            generator = sampling_generator(self.device, self.seed * 100_003 + step)
            samples = engine.generate(rows, 1, temperature, 1.0, self.max_new_tokens, generator)
            score_samples(tokenizer, samples)
            per_prompt["reward"][mode] = _by_domain(samples, lambda s: _compact(s.reward))
            accuracy = per_domain_means(samples, lambda s: s.reward)
            for domain, acc in accuracy.items():
                metrics[f"{prefix}/{domain}/accuracy_{mode}"] = acc
            metrics[f"{prefix}/mean/accuracy_{mode}"] = sum(accuracy.values()) / len(accuracy)
            if mode == "greedy":
                for domain, length in per_domain_means(samples, lambda s: len(s.response_ids)).items():
                    metrics[f"{prefix}/{domain}/response_length"] = length
                per_prompt["response_length"] = _by_domain(samples, lambda s: len(s.response_ids))
        if record is not None:
            # The prompts' identity (count and a hash of their texts): the report pairs only evals of the same prompts.
            texts: dict[str, list[str]] = defaultdict(list)
            for row in rows:
                texts[row.domain].append(json.dumps(row.prompt, sort_keys=True))
            per_prompt["prompts"] = {d: {"n": len(t), "sha1": hashlib.sha1("\n".join(t).encode()).hexdigest()[:16]}
                                     for d, t in sorted(texts.items())}
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps(per_prompt, separators=(",", ":")) + "\n")
        return metrics


def _by_domain(samples: list[Sample], value) -> dict[str, list]:
    """value(sample) per domain, in the samples' (the held-out file's) order."""
    out: dict[str, list] = defaultdict(list)
    for s in samples:
        out[s.row.domain].append(value(s))
    return dict(sorted(out.items()))


def _compact(reward: float) -> float | int:
    return int(reward) if float(reward).is_integer() else reward
