"""Why a stage stops: at its cap (``train.steps``), at the cold start's accuracy band, or, with
``train.stop.rule=plateau``, once the metric it watches has stopped improving, so that each method pays for what it
needs rather than for a step count in a file (docs/budgets.md).

The plateau rule: after every eval, smooth the watched value as the report does (trailing mean of 3 evals); stop
when the best smoothed value of the last ``window`` evals is not at least ``min_delta`` above the best before them.
What a stage watches is part of the study: an expert its own domain, joint GRPO the mean, OPD ``teacher_gap`` (its
distance below its teachers' final accuracy, read from the teacher runs' ``summary.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

from megaopd.analysis.curves import smooth
from megaopd.config import ConfigError, StopConfig

TEACHER_GAP = "teacher_gap"
METRIC = "accuracy_greedy"  # always evaluated (eval.sampled may be off)


def plateaued(values: list[float], window: int, min_delta: float) -> bool:
    """True when no smoothed value of the last `window` evals beats the best before them by `min_delta`."""
    if window < 1 or len(values) <= window:
        return False
    s = smooth(values)
    return max(s[-window:]) < max(s[:-window]) + min_delta


def teacher_accuracy(model_dir: str, domain: str) -> float:
    """A teacher's final held-out accuracy on `domain`, from the summary.json of the megaopd run that made it."""
    summary = Path(model_dir).parent / "summary.json"
    value = json.loads(summary.read_text())["final"].get(f"final/{domain}/{METRIC}") if summary.exists() else None
    if value is None:
        raise ConfigError(f"train.stop.metric={TEACHER_GAP}: no final {domain} accuracy in {summary} (the teacher "
                          "must be a megaopd run's final model); watch a domain or 'mean' instead")
    return value


class StopRule:
    """The stage's stop rule, fed every eval's metrics; `record` says why the stage ended, for the summary and
    the ledger."""

    def __init__(self, stop: StopConfig, cap: int, teachers: dict[str, str], domains: list[str],
                 eval_domains: list[str], logged: list[dict] = ()):
        """`cap`: train.steps; `teachers`: the stage's OPD teachers by route (none without a teacher term);
        `domains`: those the stage trains on (each teacher's, for the gap); `eval_domains`: those evaluated."""
        self.stop, self.cap = stop, cap
        self.reason = None
        self.teachers = {}
        if self.stop.rule == "plateau":
            if self.stop.metric == TEACHER_GAP:
                if not teachers:
                    raise ConfigError(f"train.stop.metric={TEACHER_GAP} needs opd.teachers (an OPD run); watch a "
                                      "domain or 'mean' instead")
                self.teachers = {d: teacher_accuracy(teachers.get(d) or teachers["*"], d) for d in domains}
            elif self.stop.metric != "mean" and self.stop.metric not in eval_domains:
                raise ConfigError(f"train.stop.metric={self.stop.metric!r} is not evaluated: use 'mean', "
                                  f"{TEACHER_GAP} or a domain of data.eval ({', '.join(eval_domains)})")
        self.values = [v for m in logged if (v := self._value(m)) is not None]  # a resumed run's evals so far
        if self.stop.rule == "plateau" and plateaued(self.values, self.stop.window, self.stop.min_delta):
            self.reason = "plateau"  # it had stopped (and checkpointed) before it was interrupted or run again

    def _value(self, metrics: dict) -> float | None:
        """The watched number of one eval, higher is better (the teacher gap negated); None if not an eval."""
        if self.teachers:
            accs = {d: metrics.get(f"eval/{d}/{METRIC}") for d in self.teachers}
            if None in accs.values():
                return None
            return -sum(max(0.0, t - accs[d]) for d, t in self.teachers.items()) / len(self.teachers)
        return metrics.get(f"eval/{self.stop.metric}/{METRIC}")

    def observe(self, metrics: dict, sft_band: bool = False) -> bool:
        """One eval's metrics: True when the stage stops here (and why is kept in `reason`)."""
        if sft_band:
            self.reason = "sft_band"
            return True
        value = self._value(metrics) if self.stop.rule == "plateau" else None
        if value is not None:
            self.values.append(value)
            if plateaued(self.values, self.stop.window, self.stop.min_delta):
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
        return {"reason": self.reason or "max_steps", "step": step, **rule}
