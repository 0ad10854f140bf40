"""Why a stage stops: at its cap (``train.steps``), at the cold start's accuracy band, or, with
``train.stop.rule=plateau``, once the metric it watches has stopped improving, so that each method pays for what it
needs rather than for a step count in a file (docs/budgets.md). Every rule reads the validation split
(``data.validation``, the ``valid/`` metrics); the report judges the test split.

The plateau rule: after every eval, smooth the watched value as the report does (trailing mean of 3 evals); stop
when the best smoothed value of the last ``window`` evals is not at least ``min_delta`` above the best before them.
What a stage watches is part of the study: an expert its own domain, joint GRPO the mean, OPD ``teacher_gap`` (its
distance below its teachers' final validation accuracy, read from the teacher runs' ``summary.json``).

Budgets that cover each other (``train.stop.cover``): a stage compared with another (its partner) is not ended by
the plateau before, for each partner, its smoothed validation accuracy has reached the partner's target (the last
point of the partner's smoothed validation curve) or it has spent (1 + margin) x the partner's FLOPs-to-target on
that curve. The cap still ends it.
"""

from __future__ import annotations

import json
from pathlib import Path

from megaopd.analysis.curves import flops_to_target, smooth
from megaopd.config import ConfigError, CoverConfig, StopConfig
from megaopd.run.evaluate import VALID, final_prefix
from megaopd.run.finished import SUMMARY
from megaopd.accounting.metrics import read_metrics

TEACHER_GAP = "teacher_gap"
METRIC = "accuracy_greedy"  # always evaluated (eval.sampled may be off)
FLOPS = "flops/total_stage"  # the x of a cover's budget: the stage's own FLOPs, as the report's curves


def valid_key(domain: str, final: bool = False) -> str:
    """The metric key of a domain's (or 'mean') greedy validation accuracy, periodic or final."""
    return f"{final_prefix(VALID) if final else VALID}/{domain}/{METRIC}"


def plateaued(values: list[float], window: int, min_delta: float) -> bool:
    """True when no smoothed value of the last `window` evals beats the best before them by `min_delta`."""
    if len(values) <= window:
        return False
    s = smooth(values)
    return max(s[-window:]) < max(s[:-window]) + min_delta


def teacher_accuracy(model_dir: str, domain: str) -> float:
    """A teacher's final validation accuracy on `domain`, from the summary.json of the megaopd run that made it."""
    summary = Path(model_dir).parent / SUMMARY
    key = valid_key(domain, final=True)
    value = json.loads(summary.read_text())["final"].get(key) if summary.exists() else None
    if value is None:
        raise ConfigError(f"train.stop.metric={TEACHER_GAP}: no {key} in {summary} (the teacher must be a megaopd "
                          "run's final model, trained with data.validation); watch a domain or 'mean' instead")
    return value


class Cover:
    """One `train.stop.cover` entry: the partner's target and FLOPs-to-target on its smoothed validation curve,
    read when the stage starts, and when (and how) this stage met it."""

    def __init__(self, cover: CoverConfig, valid_domains: list[str]):
        self.cfg = cover
        where = f"train.stop.cover run={cover.run!r}"
        if cover.domain != "mean" and cover.domain not in valid_domains:
            raise ConfigError(f"{where}: domain {cover.domain!r} is not in data.validation "
                              f"({', '.join(valid_domains)}); use 'mean' or one of them")
        if cover.margin < 0:
            raise ConfigError(f"{where}: margin {cover.margin} would stop it short of its partner's FLOPs-to-target; "
                              "set a margin >= 0")
        if not (Path(cover.run) / SUMMARY).exists():
            raise ConfigError(f"{where}: no finished run there ({SUMMARY} missing); run the partner stage first")
        points = [(m[FLOPS], m[valid_key(cover.domain)]) for m in read_metrics(cover.run)
                  if valid_key(cover.domain) in m]
        if not points:
            raise ConfigError(f"{where}: its metrics.jsonl has no {valid_key(cover.domain)}; train the partner "
                              "with data.validation")
        flops, accuracy = [f for f, _ in points], [a for _, a in points]
        self.target = smooth(accuracy)[-1]
        self.partner_flops = flops_to_target(flops, accuracy, self.target)  # never None: its last point reaches it
        self.min_flops = (1 + cover.margin) * self.partner_flops
        self.values: list[float] = []  # this stage's validation accuracy on the domain, every eval
        self.met, self.met_at_step = None, None

    def observe(self, step: int, metrics: dict) -> None:
        self.values.append(metrics[valid_key(self.cfg.domain)])
        if self.met is None:
            if smooth(self.values)[-1] >= self.target:
                self.met, self.met_at_step = "target", step
            elif metrics[FLOPS] >= self.min_flops:
                self.met, self.met_at_step = "budget", step

    def record(self) -> dict:
        return {"run": self.cfg.run, "domain": self.cfg.domain, "target": self.target,
                "partner_flops_to_target": self.partner_flops, "min_flops": self.min_flops, "met": self.met,
                "met_at_step": self.met_at_step}


def check_stop(stop: StopConfig, teachers: dict[str, str]) -> None:
    """Refuses what the config alone makes wrong in a stop rule (``StopRule`` refuses what it cannot read);
    `teachers`: the stage's OPD teachers by route."""
    if stop.cover and stop.rule != "plateau":
        raise ConfigError("train.stop.cover holds back the plateau rule: set train.stop.rule=plateau (a steps "
                          "stage runs to its cap anyway) or drop the cover")
    if stop.rule == "plateau" and stop.metric == TEACHER_GAP and not teachers:
        raise ConfigError(f"train.stop.metric={TEACHER_GAP} needs opd.teachers (an OPD run); watch a "
                          "domain or 'mean' instead")


class StopRule:
    """The stage's stop rule, fed every eval's metrics; `record` says why the stage ended, for the summary and
    the ledger. Built before any model loads: what it cannot read is refused then."""

    def __init__(self, stop: StopConfig, cap: int, teachers: dict[str, str], domains: list[str],
                 valid_domains: list[str], sft_band: float = 0.0):
        """`cap`: train.steps; `teachers`: the stage's OPD teachers by route (none without a teacher term);
        `domains`: those the stage trains on (each teacher's, for the gap, and the cold start's band);
        `valid_domains`: those of data.validation; `sft_band`: the cold start's sft.stop_at_accuracy (0: none)."""
        self.stop, self.cap, self.domains, self.sft_band = stop, cap, domains, sft_band
        self.reason = None
        self.teachers = {}
        for key, needed in (("train.stop.rule=plateau", stop.rule == "plateau"),
                            (f"sft.stop_at_accuracy={sft_band}", sft_band > 0)):
            if needed and not valid_domains:
                raise ConfigError(f"{key} reads the validation split: set data.validation (validation.jsonl "
                                  "files, disjoint from data.eval)")
        if stop.rule == "plateau":
            if stop.metric == TEACHER_GAP:
                if set(domains) - set(valid_domains):
                    raise ConfigError(f"train.stop.metric={TEACHER_GAP} compares on the training domains: add "
                                      f"{', '.join(sorted(set(domains) - set(valid_domains)))} to data.validation")
                self.teachers = {d: teacher_accuracy(teachers.get(d) or teachers["*"], d) for d in domains}
            elif stop.metric != "mean" and stop.metric not in valid_domains:
                raise ConfigError(f"train.stop.metric={stop.metric!r} is not evaluated: use 'mean', "
                                  f"{TEACHER_GAP} or a domain of data.validation ({', '.join(valid_domains)})")
        self.covers = [Cover(c, valid_domains) for c in stop.cover]
        self.values: list[float] = []

    def resume(self, logged: list[dict]) -> None:
        """A resumed run's evals so far (its metrics.jsonl up to its checkpoint)."""
        for m in logged:
            if valid_key("mean") in m:
                self.observe(m["step"], m)

    def _value(self, metrics: dict) -> float | None:
        """The watched number of one eval, higher is better (the teacher gap negated)."""
        if self.teachers:
            return -sum(max(0.0, t - metrics[valid_key(d)]) for d, t in self.teachers.items()) / len(self.teachers)
        return metrics[valid_key(self.stop.metric)]

    def observe(self, step: int, metrics: dict) -> bool:
        """One eval's metrics (the validation ones and the stage's FLOPs among them): True when the stage stops
        here (and why is kept in `reason`)."""
        # The cold start's band: every training domain at it. Domains stay in the mix until then: dropping one that
        # reached the band made it forget within ten steps.
        if self.sft_band > 0 and all(metrics.get(valid_key(d), 0.0) >= self.sft_band for d in self.domains):
            self.reason = "sft_band"
        elif self.stop.rule == "plateau":
            for cover in self.covers:
                cover.observe(step, metrics)
            self.values.append(self._value(metrics))
            covered = all(cover.met for cover in self.covers)
            if covered and plateaued(self.values, self.stop.window, self.stop.min_delta):
                self.reason = "plateau"
        return self.reason is not None

    def record(self, step: int) -> dict:
        """Why the stage ended at `step`: plateau, sft_band or max_steps (the cap), with the rule behind it."""
        stop = self.stop
        rule = {"rule": stop.rule, "cap": self.cap}
        if stop.rule == "plateau":
            rule |= {"metric": stop.metric, "window": stop.window, "min_delta": stop.min_delta}
            if self.teachers:
                rule["teacher_accuracy"] = self.teachers
            if self.covers:
                rule["cover"] = [cover.record() for cover in self.covers]
        return {"reason": self.reason or "max_steps", "step": step, **rule}
