"""Check the FLOP ledger against what a real trainer step executes (``torch.utils.flop_counter.FlopCounterMode``).

``audit_step(cfg)`` builds the run's ``Trainer`` and runs one step of its method with every phase counted on its
own: the rollout, the old-logprob recompute, the reference and teacher passes, the update (an SFT step: the update
only). Two numbers per component: the ledger's (what the trainer booked, model FLOPs) and the work executed (what
the counter measured: the same passes with the run's shared prompts, and the teachers' recomputation), each against
its formula; with the step's ``perf/hardware_flops``, the executed work in the ledger's convention. Attention runs
eager, so the counter sees its matmuls (the ledger's ``causal=False`` form; SDPA on CPU counts 0), and responses
run to the length limit (EOS never matches) with one prompt per step, so no row is padded and the executed work is
the real one. A teacher of another tokenizer scores its own tokens of the samples, whose lengths differ even
then: its micro-batches must hold one sample (``train.micro_batch_size=1``) to be unpadded.

    from megaopd.config import load_config
    from megaopd.flop_audit import audit_step
    audit_step(load_config("my.yaml", ["train.prompts_per_step=1"]))   # {component: Audit}

``bench/flops_vs_counter.py`` prints it for GRPO and OPD; ``tests/test_flops.py`` and ``tests/test_methods.py``
assert it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from unittest import mock

from megaopd import flops
from megaopd.config import RunConfig
from megaopd.hf_policy import HFPolicy
from megaopd.methods import method


@dataclass
class Audit:
    measured: int  # FlopCounterMode over the phase
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
    """{component: Audit}, and the step's perf/hardware_flops as the trainer logged it."""

    hardware_logged: float = 0.0


def audit_step(cfg: RunConfig) -> StepAudit:
    from torch.utils.flop_counter import FlopCounterMode

    from megaopd.trainer import Trainer

    if cfg.train.prompts_per_step != 1:
        raise ValueError("the audit runs one step of one prompt (train.prompts_per_step=1), so that no sequence is "
                         "padded")
    measured = dict.fromkeys(flops.COMPONENTS, 0)
    active: list[str] = []  # the phases counting now, innermost last

    def counted(component, fn):
        """Count fn's FLOPs as `component`, and off the phase it runs inside (whose counter also sees them)."""
        def run(*args, **kwargs):
            active.append(component)
            try:
                with FlopCounterMode(display=False) as counter:
                    out = fn(*args, **kwargs)
            finally:
                active.pop()
            measured[component] += counter.get_total_flops()
            if active:
                measured[active[-1]] -= counter.get_total_flops()
            return out
        return run

    def counted_rows(rows_fn):  # full-vocab teacher rows: their lookups run inside the update, the teacher's work
        def run(*args, **kwargs):
            out = counted("teacher", rows_fn)(*args, **kwargs)
            return (*out[:-1], counted("teacher", out[-1])) if isinstance(out, tuple) else counted("teacher", out)
        return run

    # Rollouts never stop early; an SFT target keeps its real EOS.
    to_length = mock.patch.object(HFPolicy, "eos_id", new_callable=mock.PropertyMock, return_value=-1) \
        if method(cfg.train.algorithm).rollouts else contextlib.nullcontext()
    with to_length:
        trainer = Trainer(cfg)
        try:
            if trainer.teachers and trainer.teachers.aligners and cfg.train.micro_batch_size > 1:
                raise ValueError("a teacher of another tokenizer scores its own tokens, as many per sample as its "
                                 "tokenizer makes, so its micro-batches would be padded: audit with "
                                 "train.micro_batch_size=1")
            rollout, samples = counted("rollout", trainer.engine.generate), []

            def generate(*args, **kwargs):  # keeps the step's samples: their real lengths give the formulas
                out = rollout(*args, **kwargs)
                samples.extend(out)
                return out

            trainer.engine.generate = generate
            trainer.policy.logprobs = counted("old_logprob", trainer.policy.logprobs)
            # At T != 1 the old logprobs and the sampling-distribution ones come from one forward (logprobs_under;
            # HFPolicy.logprobs goes through it too, counted once: the nested phase is the same component).
            trainer.policy.logprobs_under = counted("old_logprob", trainer.policy.logprobs_under)
            update, batches = counted("train", trainer.policy.train_minibatch), []

            def train_minibatch(batch, *args, **kwargs):  # keeps the batch: an SFT step's lengths come from it
                batches.append(batch)
                return update(batch, *args, **kwargs)

            trainer.policy.train_minibatch = train_minibatch
            frozen = {"reference": [trainer.reference] if trainer.reference else [],
                      "teacher": list({id(t): t for t in trainer.teachers.teachers.values()}.values())
                      if trainer.teachers else []}
            for component, models in frozen.items():
                for model in models:  # every form's call: sampled, top-k, full (and the tests' full grid)
                    model.logprobs = counted(component, model.logprobs)
                    model.topk_logprobs = counted(component, model.topk_logprobs)
                    model.full_logprobs = counted(component, model.full_logprobs)
                    if component == "teacher":
                        model.full_rows = counted_rows(model.full_rows)
                        model.scored_rows = counted_rows(model.scored_rows)
            for policy in [trainer.policy, *frozen["reference"], *frozen["teacher"]]:
                policy.model.set_attn_implementation("eager")
            before = dict(trainer.ledger.own)
            metrics = trainer.step_fn(trainer.start_step + 1)
        finally:
            trainer.close()

    if samples:
        prompt_lens, response_lens = [len(samples[0].prompt_ids)], [len(s.response_ids) for s in samples]
    else:  # SFT: one row of prompt + solution
        response = int(batches[0].response_mask.sum())
        prompt_lens, response_lens = [int(batches[0].attention_mask.sum()) - response], [response]
    teachers = [trainer.teachers.shape(trainer.teachers.route(samples[0].row.domain))] if trainer.teachers else None
    teacher_lens = trainer.teachers.token_counts(samples, len(samples)) if trainer.teachers else None

    def formula(causal, shared=False):
        return trainer.method.step_flops(cfg, trainer.policy.shape, teachers, prompt_lens, response_lens, causal,
                                         teacher_lens, shared_prompt=shared)
    shared = trainer.cfg.train.shared_prompt  # as the trainer resolved it
    executed, ledger, hardware = formula(False, shared), formula(True), formula(True, shared)

    def recomputed(causal):
        return {"teacher": trainer.teachers.recompute_flops(causal=causal)} if trainer.teachers else {}
    dense, halved = recomputed(False), recomputed(True)
    audit = StepAudit({c: Audit(measured[c], executed[c], ledger[c], trainer.ledger.own[c] - before[c],
                                dense.get(c, 0), hardware[c] + halved.get(c, 0)) for c in flops.COMPONENTS})
    audit.hardware_logged = metrics["perf/hardware_flops"] if trainer.method.rollouts else 0.0
    return audit
