"""Check the FLOP ledger against what a real trainer step executes (``torch.utils.flop_counter.FlopCounterMode``).

``audit_rl_step(cfg)`` builds the run's ``Trainer`` and runs one ``rl_step`` with every phase counted on its own:
the rollout, the old-logprob recompute, the reference or teacher pass, the update. Attention runs eager, so the
counter sees its matmuls (the ledger's ``causal=False`` form; SDPA on CPU counts 0), and responses run to the length
limit (EOS never matches) with one prompt per step, so no row is padded and the executed work is the real one.

    from megaopd.config import load_config
    from megaopd.flop_audit import audit_rl_step
    audit_rl_step(load_config("my.yaml", ["train.prompts_per_step=1"]))   # {component: Audit}

``bench/flops_vs_counter.py`` prints it for both algorithms; ``tests/test_flops.py`` asserts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

from megaopd import flops
from megaopd.config import RunConfig
from megaopd.policy import HFPolicy


@dataclass
class Audit:
    measured: int  # FlopCounterMode over the phase
    executed_form: int  # the ledger's formula for the step's real lengths, attention un-halved (what eager runs)
    ledger_form: int  # the same formula with causal attention halved (the ledger's convention)
    booked: float  # what the trainer added to its ledger


def audit_rl_step(cfg: RunConfig) -> dict[str, Audit]:
    from torch.utils.flop_counter import FlopCounterMode

    from megaopd.trainer import Trainer

    if cfg.train.prompts_per_step != 1 or cfg.train.algorithm not in ("grpo", "opd"):
        raise ValueError("the audit runs one GRPO or OPD step of one prompt (train.prompts_per_step=1), "
                         "so that no sequence is padded")
    measured = dict.fromkeys(flops.COMPONENTS, 0)

    def counted(component, fn, inside=None):
        """Count fn's FLOPs as `component`; `inside`: a phase whose counter also sees them (nested: taken off it)."""
        def run(*args, **kwargs):
            with FlopCounterMode(display=False) as counter:
                out = fn(*args, **kwargs)
            measured[component] += counter.get_total_flops()
            if inside is not None:
                measured[inside] -= counter.get_total_flops()
            return out
        return run

    def counted_rows(full_rows):  # full-vocab teacher rows, recomputed inside the update: the teacher's work
        def run(*args, **kwargs):
            return counted("teacher", counted("teacher", full_rows, "train")(*args, **kwargs), "train")
        return run

    with mock.patch.object(HFPolicy, "eos_id", new_callable=mock.PropertyMock, return_value=-1):
        trainer = Trainer(cfg)
        try:
            rollout, samples = counted("rollout", trainer.engine.generate), []

            def generate(*args, **kwargs):  # keeps the step's samples: their real lengths give the formulas
                out = rollout(*args, **kwargs)
                samples.extend(out)
                return out

            trainer.engine.generate = generate
            trainer.policy.logprobs = counted("old_logprob", trainer.policy.logprobs)
            trainer.policy.train_minibatch = counted("train", trainer.policy.train_minibatch)
            frozen = {"reference": [trainer.reference] if trainer.reference else [],
                      "teacher": list({id(t): t for t in trainer.teachers.teachers.values()}.values())
                      if trainer.teachers else []}
            for component, models in frozen.items():
                for model in models:
                    model.logprobs = counted(component, model.logprobs)
                    model.full_logprobs = counted(component, model.full_logprobs)
                    if component == "teacher":
                        model.full_rows = counted_rows(model.full_rows)
            for policy in [trainer.policy, *frozen["reference"], *frozen["teacher"]]:
                policy.model.set_attn_implementation("eager")
            before = dict(trainer.ledger.own)
            trainer.rl_step(trainer.start_step + 1)
        finally:
            trainer.close()

    n = cfg.rollout.samples_per_prompt
    lengths = ([len(samples[0].prompt_ids)], [len(s.response_ids) for s in samples], n)
    common = dict(recompute_old=cfg.train.recompute_old_logprobs, epochs=cfg.train.epochs, prefix_cached=True)
    if trainer.teachers is None:
        def formula(causal):
            return flops.grpo_step_flops(trainer.policy.shape, *lengths, use_reference=trainer.reference is not None,
                                         causal=causal, **common)
    else:
        teacher = trainer.teachers.shape(trainer.teachers.route(samples[0].row.domain))

        def formula(causal):
            return flops.opd_step_flops(trainer.policy.shape, teacher, *lengths, causal=causal, **common,
                                        teacher_passes=flops.teacher_passes(cfg.opd.form, cfg.train.epochs))
    executed, ledger = formula(False), formula(True)
    return {c: Audit(measured[c], executed[c], ledger[c], trainer.ledger.own[c] - before[c]) for c in flops.COMPONENTS}
