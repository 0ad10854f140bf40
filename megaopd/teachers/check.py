"""The teacher check of an external-teacher OPD stage: before its first step, each teacher and the student it starts
from answer the stage's validation prompts (the domains the stage trains on and the teacher serves) at the run's
token cap, greedily and sampled at the rollout's temperature and top-p; a teacher whose greedy accuracy is not above
the student's is refused in one line, unless ``opd.allow_weaker_teacher`` runs it on purpose. With a teacher at or
below its student, OPD cannot reach what a stronger teacher's OPD would, so "OPD vs GRPO" would not be asked.

The numbers go to ``<run_dir>/teacher_check.json``; the report prints them beside the stage and marks a finding
whose target lies above the teacher's accuracy "not measured (teacher below target)". A resumed stage reads the file
instead of measuring again.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from megaopd.config import ModelConfig, OPDConfig, RolloutConfig, teacher_route
from megaopd.data.rows import Row
from megaopd.errors import UserError
from megaopd.accounting.metrics import per_domain_means

log = logging.getLogger(__name__)
CHECK_FILE = "teacher_check.json"


class WeakTeacher(UserError):
    what = "teacher check"


def teacher_domains(teachers: dict[str, str], domains: list[str]) -> dict[str, list[str]]:
    """Route -> the trained domains it serves (``config.teacher_route``, as the router routes them)."""
    served: dict[str, list[str]] = {}
    for domain in domains:
        route = teacher_route(teachers, domain)
        if route is not None:
            served.setdefault(route, []).append(domain)
    return served


def answer(model: ModelConfig, rollout: RolloutConfig, seed: int, rows: list[Row]) -> dict:
    """One model's (``model.path``, on the student's device and dtype) validation answers at the run's token cap: per
    mode, accuracy per domain and their mean, mean response length and the share cut at the cap. Greedy, then sampled
    at the rollout's settings."""
    from megaopd.run.evaluate import score_samples  # here: the report reads CHECK_FILE without loading torch
    from megaopd.models.hf_policy import HFPolicy
    from megaopd.rollout.local import LocalEngine, sampling_generator

    policy = HFPolicy(model)  # generation only: no optimizer, the HF backend on any run
    engine = LocalEngine(policy, rollout.batch_prompts)
    r, out = rollout, {"path": model.path, "prompts": len(rows)}
    for mode, temperature, top_p in (("greedy", 0.0, 1.0), ("sampled", r.temperature, r.top_p)):
        generator = sampling_generator(policy.device, seed)
        samples = engine.generate(rows, 1, temperature, top_p, r.max_new_tokens, generator)
        score_samples(policy.tokenizer, samples)
        accuracy = per_domain_means(samples, lambda s: s.reward)
        out[mode] = {"accuracy": accuracy | {"mean": sum(accuracy.values()) / len(accuracy)},
                     "length": sum(len(s.response_ids) for s in samples) / len(samples),
                     "truncated": sum(s.finish_reason == "length" for s in samples) / len(samples)}
    return out


def measure(opd: OPDConfig, model: ModelConfig, rollout: RolloutConfig, seed: int, limit: int,
            valid_rows: list[Row], train_domains: list[str]) -> dict:
    """The student's (``model``) and every teacher's answers on the validation prompts of the domains each teacher
    serves: the first ``limit`` of each domain, as the stage's final validation eval reads them
    (eval.final_prompts_per_domain; 0: all)."""
    by_domain: dict[str, list[Row]] = {}
    for row in valid_rows:
        by_domain.setdefault(row.domain, []).append(row)
    rows = {d: (by_domain[d][:limit] if limit > 0 else by_domain[d]) for d in train_domains if d in by_domain}
    if not rows:
        raise WeakTeacher(f"the teacher check needs validation prompts of the trained domains {train_domains}; set "
                          "data.validation to their validation split")
    served = teacher_domains(opd.teachers, sorted(rows))
    from megaopd.rollout.serving.leader import on_leader

    def run() -> dict:
        student = answer(model, rollout, seed, [r for d in sorted(rows) for r in rows[d]])
        teachers = {route: answer(replace(model, path=opd.teachers[route]), rollout, seed,
                                  [r for d in domains for r in rows[d]]) | {"domains": domains}
                    for route, domains in served.items()}
        return {"max_new_tokens": rollout.max_new_tokens, "temperature": rollout.temperature,
                "top_p": rollout.top_p, "student": student, "teachers": teachers}

    return on_leader(run)  # under torchrun: one rank measures, every rank decides alike


def weaker(check: dict) -> dict[str, tuple[float, float]]:
    """Route -> (teacher, student) greedy validation accuracy on its domains, for every teacher not above."""
    out = {}
    for route, t in check["teachers"].items():
        domains = t["domains"]
        student = sum(check["student"]["greedy"]["accuracy"][d] for d in domains) / len(domains)
        if t["greedy"]["accuracy"]["mean"] <= student:
            out[route] = (t["greedy"]["accuracy"]["mean"], student)
    return out


def gate(opd: OPDConfig, model: ModelConfig, rollout: RolloutConfig, seed: int, limit: int, run_dir: Path,
         valid_rows: list[Row], train_domains: list[str]) -> dict:
    """Measure (``measure``; or read, on resume) the check, write it, and refuse a teacher not above its student
    unless ``opd.allow_weaker_teacher``."""
    path = run_dir / CHECK_FILE
    check = json.loads(path.read_text()) if path.exists() else measure(opd, model, rollout, seed, limit, valid_rows,
                                                                        train_domains)
    below = weaker(check)
    check["allowed_weaker"] = bool(below) and opd.allow_weaker_teacher  # the report marks its findings
    path.write_text(json.dumps(check, indent=1) + "\n")  # also when refused: the numbers behind the refusal
    for route, (teacher, student) in below.items():
        domains = ", ".join(check["teachers"][route]["domains"])
        line = (f"teacher {check['teachers'][route]['path']} scores {teacher:.3f} greedy on validation ({domains}; "
                f"{check['max_new_tokens']} new tokens) and the student {model.path} {student:.3f}")
        if not opd.allow_weaker_teacher:
            raise WeakTeacher(f"{line}: a teacher not above its student cannot show what OPD from a stronger one "
                              "does; use a stronger teacher or a token cap it answers within, or set "
                              "allow_weaker_teacher: true on the stage (opd.allow_weaker_teacher=true) to run it on "
                              "purpose")
        log.warning("%s: running it anyway (opd.allow_weaker_teacher); the report marks its findings", line)
    return check
