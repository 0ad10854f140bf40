"""The training algorithms, one row each: what a ``train.algorithm`` needs, which objective terms it trains with, which
FLOP components it books, and the one function that gives a step's FLOPs by component.

The trainer, the planner (``megaopd plan``), the Slurm renderer, the rehearsal, the FLOP audit and the benches read
this table; none of them tests an algorithm's name. A new method is one row here plus its name in
``config.TrainConfig.algorithm``'s ``Literal`` (and, if it brings a new loss, its class in ``megaopd.objectives``).

    from megaopd.methods import method
    spec = method(cfg.train.algorithm)
    spec.rollouts, spec.uses_reference(cfg), spec.local_teachers(cfg), spec.step_flops(cfg, student, ...)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megaopd import flops
from megaopd.config import ConfigError, RunConfig

OPD_FORMS = ("sampled", "topk", "full_vocab")  # docs/opd.md


@dataclass(frozen=True)
class Method:
    name: str
    label: str  # how a report writes it (with the OPD form beside it: objectives.form_label)
    # Samples responses from the policy every step (local engine or rollout servers), rewards them and updates with a
    # policy-gradient or KL objective; False: teacher-forced NLL on the rows' worked solutions (the cold start).
    rollouts: bool
    group_term: bool  # GRPO's group-relative advantage from verifier rewards (+ k3 KL to a reference if kl_coef > 0)
    teacher_term: bool  # frozen teachers score the rollouts: the OPD term, in one of OPD_FORMS (opd.form)

    @property
    def opd_forms(self) -> tuple[str, ...]:
        return OPD_FORMS if self.teacher_term else ()

    @property
    def components(self) -> tuple[str, ...]:
        """The ledger components this method can book (the others stay 0)."""
        if not self.rollouts:
            return ("train",)
        return tuple(c for c in flops.COMPONENTS if (c != "reference" or self.group_term)
                     and (c != "teacher" or self.teacher_term))

    def samples_per_prompt(self, cfg: RunConfig) -> int:
        return cfg.rollout.samples_per_prompt if self.rollouts else 1

    def uses_reference(self, cfg: RunConfig) -> bool:
        """A frozen copy of the initial policy for GRPO's KL penalty."""
        return self.group_term and cfg.grpo.kl_coef > 0

    def teachers(self, cfg: RunConfig) -> dict[str, str]:
        """Route -> teacher model directory, wherever the teachers run."""
        return dict(cfg.opd.teachers) if self.teacher_term else {}

    def local_teachers(self, cfg: RunConfig) -> dict[str, str]:
        """The teachers loaded in the trainer's process (their weights share the trainer's GPUs)."""
        return self.teachers(cfg) if cfg.opd.teacher_engine == "local" else {}

    def teacher_servers(self, cfg: RunConfig) -> bool:
        return self.teacher_term and cfg.opd.teacher_engine == "sglang"

    def vocab_kl(self, cfg: RunConfig) -> bool:
        """A KL over the vocabulary in the training step (top-k with its tail, or full): more [rows x V] tensors
        beside the student's log-softmax in each chunk."""
        return self.teacher_term and cfg.opd.form != "sampled"

    def has_policy_gradient(self, cfg: RunConfig) -> bool:
        """Whether some term weights sampled tokens' policy gradients (what train.tis corrects)."""
        return self.group_term or (self.teacher_term and cfg.opd.form == "sampled")

    def step_flops(self, cfg: RunConfig, student: flops.ModelShape, teachers: Sequence[flops.ModelShape] | None,
                   prompt_lens: Sequence[int], response_lens: Sequence[int], prefix_cached: bool = True,
                   causal: bool = True) -> dict[str, int]:
        """One step's FLOPs by component (every key of flops.COMPONENTS): ``prompt_lens`` one per prompt,
        ``response_lens`` one per sample (``samples_per_prompt`` per prompt, consecutive; for SFT the solutions),
        ``teachers`` one (routed) teacher shape per prompt when the method has a teacher term."""
        if not self.rollouts:  # SFT: one training pass over prompt + solution
            return dict.fromkeys(flops.COMPONENTS, 0) | {
                "train": 3 * flops.scoring_flops(student, prompt_lens, response_lens, 1, causal)}
        n, t = self.samples_per_prompt(cfg), cfg.train
        common = dict(recompute_old=t.recompute_old_logprobs, epochs=t.epochs, prefix_cached=prefix_cached,
                      causal=causal)
        parts = flops.grpo_step_flops(student, prompt_lens, response_lens, n, use_reference=self.uses_reference(cfg),
                                      **common)
        if self.teacher_term:  # the student's passes as above, plus the teachers'
            parts["teacher"] = flops.opd_step_flops(student, teachers, prompt_lens, response_lens, n,
                                                    **common)["teacher"]
        return parts


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("sft", "sft", rollouts=False, group_term=False, teacher_term=False),
    Method("grpo", "grpo", rollouts=True, group_term=True, teacher_term=False),
    Method("opd", "opd", rollouts=True, group_term=False, teacher_term=True),
    Method("grpo_opd", "grpo+opd", rollouts=True, group_term=True, teacher_term=True),  # GRPO + opd.coef x OPD
)}


def method(name: str) -> Method:
    if name not in METHODS:
        raise ConfigError(f"train.algorithm must be one of {', '.join(METHODS)}, got {name!r}")
    return METHODS[name]
