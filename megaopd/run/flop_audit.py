"""Check the FLOP ledger against what a real trainer step executes (``torch.utils.flop_counter.FlopCounterMode``).

``audit_step(cfg)`` builds the run's ``Trainer`` and runs one step of its method (``rl_step``; an SFT run's
``sft_step``) under one ``FlopCounterMode``: every forward and backward the step executes is counted, whichever
call runs it, and compared with the ledger's bill for that step (``megaopd.accounting.flops``, booked by
``Trainer._book_flops``). A pass that no formula bills (a new forward added to the step) shows as the step measuring
more than its formula, and ``StepAudit.mismatches`` names it. The same count is split over the ledger's components
by the calls that run each one's passes (the engine's generation, the policy's scoring and update, the reference's
and teachers' scoring); what runs outside them is ``StepAudit.unattributed``.

Two numbers per component: the ledger's (what the trainer booked, model FLOPs) and the work executed (what the
counter measured: the same passes with the run's shared prompts, and the teachers' recomputation), each against its
formula; with the step's ``perf/hardware_flops``, the executed work in the ledger's convention. Attention runs eager,
so the counter sees its matmuls (the ledger's ``causal=False`` form; SDPA on CPU counts 0), and responses run to the
length limit (EOS never matches) with one prompt per step, so no row is padded and the executed work is the real
one. A teacher of another tokenizer scores its own tokens of the samples, whose lengths differ even then: its
micro-batches must hold one sample (``train.micro_batch_size=1``) to be unpadded.

What it covers: the step as this process executes it on its own thread, the generation included (the local
engine's prefill and decode, the rollout formula). What it does not: the trainer's construction, the evals around
the step (``fit``), work in another process (an SGLang rollout or teacher server: refused, the audit needs the
in-process engines), and what neither side counts (elementwise ops, the optimizer; FlopCounterMode counts matmuls
as the ledger does). Activation recomputation (``model.activation_checkpointing``) is hardware work the ledger does
not bill: the audit reports it as a mismatch of the update.

    from megaopd.config import load_config
    from megaopd.run.flop_audit import audit_step
    audit = audit_step(load_config("my.yaml", ["train.prompts_per_step=1"]))   # {component: Audit}
    assert not audit.mismatches()

``bench/flops_vs_counter.py`` prints it for GRPO and OPD; ``tests/test_flops.py`` and ``tests/test_methods.py``
assert it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from unittest import mock

from megaopd.accounting import flops
from megaopd.config import RunConfig
from megaopd.models.hf_policy import HFPolicy
from megaopd.objectives.methods import method


@dataclass
class Audit:
    measured: int  # FlopCounterMode over the component's calls
    executed_form: int  # the ledger's formula for the step's real lengths, attention un-halved (what eager runs)
    ledger_form: int  # the same formula with causal attention halved (the ledger's convention)
    booked: float  # what the trainer added to its ledger
    # Hardware work beyond the billed passes, in the executed form (the teachers' re-projections and re-runs:
    # TeacherRouter.recompute_flops); measured == executed_form + recomputed.
    recomputed: int = 0
    # The executed work in the ledger's convention (causal attention halved), recomputation included: what the
    # trainer's perf/hardware_flops sums over the components (StepAudit.hardware_logged).
    hardware_form: int = 0


class StepAudit(dict):
    """{component: Audit}; the whole step as FlopCounterMode measured it, and its perf/hardware_flops as the trainer
    logged it."""

    measured: int = 0  # every forward and backward of the step, inside a component's calls or not
    hardware_logged: float = 0.0

    @property
    def executed(self) -> int:
        """What the ledger's passes execute (its formula, in the executed form, plus the recomputation)."""
        return sum(row.executed_form + row.recomputed for row in self.values())

    @property
    def unattributed(self) -> int:
        """FLOPs the step ran outside every component's calls: passes no component's formula describes."""
        return self.measured - sum(row.measured for row in self.values())

    def mismatches(self) -> list[str]:
        """One line for each way the step departs from its bill; empty where the ledger accounts for every FLOP."""
        lines = [f"{c}: booked {row.booked:.0f}, its formula {row.ledger_form}" for c, row in self.items()
                 if row.booked != row.ledger_form]
        lines += [f"{c}: measured {row.measured}, its passes {row.executed_form + row.recomputed}"
                  for c, row in self.items() if row.measured != row.executed_form + row.recomputed]
        if self.measured != self.executed:
            lines.append(f"the step: measured {self.measured}, the ledger's passes {self.executed} "
                         f"({self.unattributed} outside every component's calls)")
        return lines


class _Phases:
    """Attributes the step's FLOPs to the ledger's components by the calls that run each one's passes; keeps the
    step's samples and update batches, whose real lengths give the formulas."""

    def __init__(self):
        self.measured = dict.fromkeys(flops.COMPONENTS, 0)
        self.active: list[str] = []  # the components counting now, innermost last
        self.samples, self.batches = [], []

    def counted(self, component, fn):
        """fn's FLOPs as `component`'s, and off the component it runs inside (whose counter also sees them)."""
        from torch.utils.flop_counter import FlopCounterMode

        def run(*args, **kwargs):
            self.active.append(component)
            try:
                with FlopCounterMode(display=False) as counter:
                    out = fn(*args, **kwargs)
            finally:
                self.active.pop()
            self.measured[component] += counter.get_total_flops()
            if self.active:
                self.measured[self.active[-1]] -= counter.get_total_flops()
            return out
        return run

    def counted_rows(self, rows_fn):  # full-vocab teacher rows: their lookups run inside the update, the teacher's
        def run(*args, **kwargs):
            out = self.counted("teacher", rows_fn)(*args, **kwargs)
            return (*out[:-1], self.counted("teacher", out[-1])) if isinstance(out, tuple) \
                else self.counted("teacher", out)
        return run

    def generated(self, generate):  # keeps the step's samples: their real lengths give the formulas
        def run(*args, **kwargs):
            out = generate(*args, **kwargs)
            self.samples.extend(out)
            return out
        return run

    def attach(self, trainer) -> None:
        policy, frozen = trainer.policy, _frozen(trainer)
        trainer.engine.generate = self.generated(self.counted("rollout", trainer.engine.generate))
        policy.logprobs = self.counted("old_logprob", policy.logprobs)
        # At T != 1 the old logprobs and the sampling-distribution ones come from one forward (logprobs_under;
        # HFPolicy.logprobs goes through it too, counted once: the nested phase is the same component).
        policy.logprobs_under = self.counted("old_logprob", policy.logprobs_under)
        update = self.counted("train", policy.train_minibatch)
        # keeps the batch: an SFT step's lengths come from it
        policy.train_minibatch = lambda batch, *a, **k: self.batches.append(batch) or update(batch, *a, **k)
        for component, models in frozen.items():
            for model in models:  # every form's call: sampled, top-k, full (and the tests' full grid)
                for name in ("logprobs", "topk_logprobs", "full_logprobs"):
                    setattr(model, name, self.counted(component, getattr(model, name)))
                if component == "teacher":
                    model.full_rows = self.counted_rows(model.full_rows)
                    model.scored_rows = self.counted_rows(model.scored_rows)
        for model in [policy, *frozen["reference"], *frozen["teacher"]]:
            model.model.set_attn_implementation("eager")

    def lengths(self) -> tuple[list[int], list[int]]:
        """(prompt lengths, response lengths) of the step: its samples', or an SFT step's one row."""
        if self.samples:
            return [len(self.samples[0].prompt_ids)], [len(s.response_ids) for s in self.samples]
        response = int(self.batches[0].response_mask.sum())
        return [int(self.batches[0].attention_mask.sum()) - response], [response]


def _frozen(trainer) -> dict[str, list]:
    return {"reference": [trainer.reference] if trainer.reference else [],
            "teacher": list({id(t): t for t in trainer.teachers.teachers.values()}.values())
            if trainer.teachers else []}


def _check_auditable(cfg: RunConfig) -> None:
    if cfg.train.prompts_per_step != 1:
        raise ValueError("the audit runs one step of one prompt (train.prompts_per_step=1), so that no sequence is "
                         "padded")
    if "sglang" in (cfg.rollout.engine, cfg.opd.teacher_engine):
        raise ValueError("the audit counts what this process executes: audit with rollout.engine=local and "
                         "opd.teacher_engine=local (a server's work is in another process)")


def _check_unpadded(trainer, cfg: RunConfig) -> None:
    if trainer.teachers and trainer.teachers.aligners and cfg.train.micro_batch_size > 1:
        raise ValueError("a teacher of another tokenizer scores its own tokens, as many per sample as its "
                         "tokenizer makes, so its micro-batches would be padded: audit with "
                         "train.micro_batch_size=1")


def audit_step(cfg: RunConfig) -> StepAudit:
    from torch.utils.flop_counter import FlopCounterMode

    from megaopd.run.trainer import Trainer

    _check_auditable(cfg)
    phases = _Phases()
    # Rollouts never stop early; an SFT target keeps its real EOS.
    to_length = mock.patch.object(HFPolicy, "eos_id", new_callable=mock.PropertyMock, return_value=-1) \
        if method(cfg.train.algorithm).rollouts else contextlib.nullcontext()
    with to_length:
        trainer = Trainer(cfg)
        try:
            _check_unpadded(trainer, cfg)
            phases.attach(trainer)
            before = dict(trainer.ledger.own)
            with FlopCounterMode(display=False) as step:  # every op of the step, inside a component's calls or not
                metrics = trainer.step_fn(trainer.start_step + 1)
        finally:
            trainer.close()
    audit = _against_the_ledger(trainer, phases, before)
    audit.measured = step.get_total_flops()
    audit.hardware_logged = metrics["perf/hardware_flops"] if trainer.method.rollouts else 0.0
    return audit


def _against_the_ledger(trainer, phases: _Phases, before: dict) -> StepAudit:
    """Each component's measured FLOPs beside its formula for the step's real lengths and what the trainer booked."""
    cfg, samples = trainer.cfg, phases.samples
    prompt_lens, response_lens = phases.lengths()
    teachers = [trainer.teachers.shape(trainer.teachers.route(samples[0].row.domain))] if trainer.teachers else None
    teacher_lens = trainer.teachers.token_counts(samples, len(samples)) if trainer.teachers else None

    def formula(causal, shared=False):
        return trainer.method.step_flops(cfg.train, cfg.rollout, cfg.grpo, trainer.policy.shape, teachers, prompt_lens,
                                         response_lens, causal, teacher_lens, shared_prompt=shared)
    shared = cfg.train.shared_prompt  # as the trainer resolved it
    executed, ledger, hardware = formula(False, shared), formula(True), formula(True, shared)

    def recomputed(causal):
        return {"teacher": trainer.teachers.recompute_flops(causal=causal)} if trainer.teachers else {}
    dense, halved = recomputed(False), recomputed(True)
    return StepAudit({c: Audit(phases.measured[c], executed[c], ledger[c], trainer.ledger.own[c] - before[c],
                               dense.get(c, 0), hardware[c] + halved.get(c, 0)) for c in flops.COMPONENTS})
