"""The training algorithms, one row each: what a ``train.algorithm`` needs, which objective terms it trains with, which
FLOP components it books, and the one function that gives a step's FLOPs by component.

The trainer, the planner (``megaopd plan``), the Slurm renderer, the rehearsal and the FLOP audit read this table;
none of them tests an algorithm's name (the benches name the algorithms they compare). The table is the list of
algorithm names: ``method(name)`` refuses any other where a run starts. A new method is one row here (and, if it
brings a new loss, its class in ``megaopd.objectives.losses``).

    from megaopd.objectives.methods import method
    spec = method(cfg.train.algorithm)
    spec.rollouts, spec.uses_reference(cfg.grpo), spec.local_teachers(cfg.opd),
    spec.step_flops(cfg.train, cfg.rollout, cfg.grpo, student, ...)

Each predicate reads the one config section it depends on; ``step_flops`` the three that decide a step's passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megaopd.accounting import flops
from megaopd.config import GRPOConfig, OPDConfig, RolloutConfig, TrainConfig, unknown_choice


@dataclass(frozen=True)
class Method:
    name: str
    label: str  # how a report writes it (with the OPD form beside it: objectives.form_label)
    # Samples responses from the policy every step (local engine or rollout servers), rewards them and updates with a
    # policy-gradient or KL objective; False: teacher-forced NLL on the rows' worked solutions (the cold start).
    rollouts: bool
    group_term: bool  # GRPO's group-relative advantage from verifier rewards (+ k3 KL to a reference if kl_coef > 0)
    teacher_term: bool  # frozen teachers score the rollouts: the OPD term, in one of the forms of opd.form
    # The fixed-advantage control (fixed_advantage): a fixed advantage on the policy's own lowest-logprob sampled
    # tokens; it reads no reward and no model beside the policy
    self_term: bool = False

    @property
    def components(self) -> tuple[str, ...]:
        """The ledger components this method can book (the others stay 0)."""
        if not self.rollouts:
            return ("train",)
        return tuple(c for c in flops.COMPONENTS if (c != "reference" or self.group_term)
                     and (c != "teacher" or self.teacher_term))

    def samples_per_prompt(self, rollout: RolloutConfig) -> int:
        return rollout.samples_per_prompt if self.rollouts else 1

    def shares_prompts(self, rollout: RolloutConfig) -> bool:
        """Whether a prompt has two samples or more, so ``train.shared_prompt`` has a prompt to share (the rule
        ``megaopd.run.resolve.shared_prompt_problem`` refuses by and the memory plan lays micro-batches out by)."""
        return self.samples_per_prompt(rollout) >= 2

    def uses_reference(self, grpo: GRPOConfig) -> bool:
        """A frozen copy of the initial policy for GRPO's KL penalty."""
        return self.group_term and grpo.kl_coef > 0

    def teachers(self, opd: OPDConfig) -> dict[str, str]:
        """Route -> teacher model directory, wherever the teachers run."""
        return dict(opd.teachers) if self.teacher_term else {}

    def local_teachers(self, opd: OPDConfig) -> dict[str, str]:
        """The teachers loaded in the trainer's process (their weights share the trainer's GPUs)."""
        return self.teachers(opd) if opd.teacher_engine == "local" else {}

    def teacher_servers(self, opd: OPDConfig) -> bool:
        return self.teacher_term and opd.teacher_engine == "sglang"

    def vocab_kl(self, opd: OPDConfig) -> bool:
        """A KL over the vocabulary in the training step (top-k with its tail, or full): more [rows x V] tensors
        beside the student's log-softmax in each chunk."""
        return self.teacher_term and opd.form != "sampled"

    def step_flops(self, train: TrainConfig, rollout: RolloutConfig, grpo: GRPOConfig, student: flops.ModelShape,
                   teachers: Sequence[flops.ModelShape] | None, prompt_lens: Sequence[int],
                   response_lens: Sequence[int], causal: bool = True, teacher_lens: flops.Lengths | None = None,
                   shared_prompt: bool = False) -> dict[str, int]:
        """One step's FLOPs by component (every key of flops.COMPONENTS): ``prompt_lens`` one per prompt,
        ``response_lens`` one per sample (``samples_per_prompt`` per prompt, consecutive; for SFT the solutions),
        ``teachers`` one (routed) teacher shape per prompt when the method has a teacher term, and ``teacher_lens``
        the same lengths in the teachers' own tokens where they tokenise otherwise than the student. Generation is
        billed one prefill per prompt, whatever the engine (docs/flops.md, "Shared work"). ``shared_prompt``: the
        work the student's passes execute with train.shared_prompt (the ledger's is without)."""
        return flops.step_flops(student, prompt_lens, response_lens, self.samples_per_prompt(rollout),
                                generate=self.rollouts, recompute_old=self.rollouts and train.recompute_old_logprobs,
                                use_reference=self.uses_reference(grpo), epochs=train.epochs if self.rollouts else 1,
                                teachers=teachers if self.teacher_term else None, teacher_lens=teacher_lens,
                                causal=causal, shared_prompt=shared_prompt)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("sft", "sft", rollouts=False, group_term=False, teacher_term=False),
    Method("grpo", "grpo", rollouts=True, group_term=True, teacher_term=False),
    Method("opd", "opd", rollouts=True, group_term=False, teacher_term=True),
    Method("grpo_opd", "grpo+opd", rollouts=True, group_term=True, teacher_term=True),  # GRPO + opd.coef x OPD
    # OPD's control without the teacher (arXiv 2608.31046's fixed-advantage control; scale=entropy: its OPSA)
    Method("fixed_advantage", "fixed_advantage", rollouts=True, group_term=False, teacher_term=False, self_term=True),
)}


def method(name: str) -> Method:
    if name not in METHODS:
        raise unknown_choice(name, tuple(METHODS), "train.algorithm")
    return METHODS[name]
