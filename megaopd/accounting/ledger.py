"""The FLOP ledger: cumulative model FLOPs of a run by component, plus the ledgers of the models it builds on.

Components of a run's own FLOPs: ``rollout`` (generation), ``old_logprob`` (recompute), ``reference``,
``teacher`` (teacher forwards) and ``train`` (forward + backward of the updates); an SFT run books ``train`` only.

A run that starts from a model, or distils from a teacher, made by another megaopd run carries that run's ledger
(saved beside the model as ``megaopd_ledger.json``) as an upstream edge. The three totals of flops.md are then:

1. ``stage``: this run's own FLOPs;
2. ``with_teachers``: plus every upstream run that counts as ``training`` (the self-GRPO teacher, the per-domain
   experts, a further-trained teacher's GRPO), each counted once even when reached twice;
3. ``with_cold_start``: plus every upstream run that counts as ``cold_start`` (the SFT that made the base).

Runs that count as ``external`` (a post-trained teacher made "elsewhere") are reported but in no total.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from megaopd.config import CountsAs, choices
from megaopd.accounting.flops import COMPONENTS

LEDGER_FILE = "megaopd_ledger.json"
SUMMARY = "summary.json"  # a run's end (its stop, final evals and this ledger), in the run directory; run.finished reads it


class Ledger:
    def __init__(self, name: str, counts_as: str = "training"):
        if counts_as not in choices(CountsAs):
            raise ValueError(f"counts_as must be one of {', '.join(choices(CountsAs))}, got {counts_as!r}")
        self.run_id = uuid.uuid4().hex
        self.name = name
        self.counts_as = counts_as
        self.own = {c: 0.0 for c in COMPONENTS}
        self.upstream: list[dict] = []  # [{"role": "init" | "teacher:<route>", "ledger": <state dict>}]
        self.stop: dict | None = None  # why the run ended (megaopd/run/stopping.py), once it has

    def add(self, component: str, flops: float) -> None:
        if component not in self.own:
            raise KeyError(f"unknown ledger component {component!r}; known: {COMPONENTS}")
        self.own[component] += float(flops)

    def add_upstream(self, role: str, model_dir: str | Path) -> None:
        """Carry the ledger of the run that made `model_dir`, if megaopd made it (a downloaded model has none)."""
        path = Path(model_dir) / LEDGER_FILE
        if path.exists():
            self.upstream.append({"role": role, "ledger": json.loads(path.read_text())})

    @property
    def stage_total(self) -> float:
        return sum(self.own.values())

    def _upstream_runs(self) -> dict[str, dict]:
        """Every distinct upstream run (by run id), walking the whole graph."""
        runs: dict[str, dict] = {}
        stack = [edge["ledger"] for edge in self.upstream]
        while stack:
            state = stack.pop()
            if state["run_id"] not in runs:
                runs[state["run_id"]] = state
                stack += [edge["ledger"] for edge in state["upstream"]]
        return runs

    def totals(self) -> dict[str, float]:
        by_kind = dict.fromkeys(choices(CountsAs), 0.0)
        for state in self._upstream_runs().values():
            by_kind[state["counts_as"]] += sum(state["own"].values())
        stage = self.stage_total
        return {"stage": stage, "with_teachers": stage + by_kind["training"],
                "with_cold_start": stage + by_kind["training"] + by_kind["cold_start"],
                "external": by_kind["external"]}

    def state_dict(self) -> dict:
        return {"run_id": self.run_id, "name": self.name, "counts_as": self.counts_as, "own": dict(self.own),
                "upstream": self.upstream, "totals": self.totals(), "stop": self.stop}

    def load_state_dict(self, state: dict) -> None:
        self.run_id, self.name, self.counts_as = state["run_id"], state["name"], state["counts_as"]
        self.own = dict(state["own"])
        self.upstream = list(state["upstream"])
        self.stop = state.get("stop")  # ledgers saved before stop reasons were recorded have none

    def save(self, model_dir: str | Path) -> None:
        Path(model_dir, LEDGER_FILE).write_text(json.dumps(self.state_dict(), indent=1))
