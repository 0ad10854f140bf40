"""The trainer: one loop for SFT (cold start), GRPO and OPD. Read ``rl_step`` top to bottom for the data flow:

    prompts -> rollouts -> rewards -> teacher logprobs -> loss / update -> weight sync -> ledger

(prompts -> rollouts through ``megaopd.rollout.pipeline``, which generates up to ``rollout.max_staleness`` steps
ahead, and where teacher servers score the samples as they arrive)

and ``fit`` for what happens around every step (eval, metrics, checkpoint) and at the end (final eval, HF export
with the ledger beside the weights, ``summary.json``).

    megaopd train configs/embedded/grpo.yaml model.path=... run_dir=runs/grpo
"""

from __future__ import annotations

import logging
import math
import random
import shutil
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from megaopd import verifiers
from megaopd.run import environment
from megaopd.data.batch import Sample, TeacherScores, TokenBatch, collate
from megaopd.models.chat import chat_prompt_ids
from megaopd.models.checkpoint import Checkpointer, rng_state, set_rng_state, state_bytes
from megaopd.config import ModelConfig, OPDConfig, OptimConfig, RolloutConfig, RunConfig, TrainConfig, save_config
from megaopd.data.sampler import PromptSampler
from megaopd.data.synthetic import corrupt
from megaopd.errors import UserError, space_for
from megaopd.run.evaluate import VALID, Evaluator, score_samples
from megaopd.run.finished import FINAL_DIR, finished_summary, write_summary
from megaopd.models.hf_policy import HFPolicy
from megaopd.accounting import flops
from megaopd.accounting.ledger import Ledger
from megaopd.accounting.metrics import MetricsLogger, read_metrics, rollout_metrics
from megaopd.objectives.losses import ISCorrection, build_objective, form_label, is_correction
from megaopd.models.policy_protocol import Policy
from megaopd.run.resolve import resolve_run
from megaopd.rollout.local import LocalEngine, policy_temperature, reported_sampling, sampling_generator
from megaopd.rollout.pipeline import RolloutPipeline, StepRollouts
from megaopd.rollout.staleness import fresh_tokens, masked_loss
from megaopd.teachers.check import gate as teacher_gate
from megaopd.teachers.router import TeacherRouter, local_teachers

log = logging.getLogger(__name__)
# Exit status after a preemption signal: the checkpoint is written and the same command resumes (EX_TEMPFAIL).
PREEMPTED_EXIT = 75


def build_policy(model: ModelConfig, train: TrainConfig, run_dir: str, keep: int,
                 optim: OptimConfig | None = None) -> Policy:
    """The student (with ``optim``: trainable) or a frozen copy of it (the reference). ``run_dir`` and ``keep`` (the
    checkpoints kept) place the Megatron backend's distributed checkpoints."""
    if model.backend == "megatron":  # megatron-core under torchrun; imported only when chosen
        from megaopd.models.megatron import require

        require()
        from megaopd.models.megatron.policy import MegatronPolicy

        ckpt = model.megatron.checkpoint_dir or str(Path(run_dir) / "megatron_checkpoints")
        return MegatronPolicy(model, optim, seed=train.seed, checkpoint_dir=ckpt, keep=keep,
                              logit_chunk_rows=train.logit_chunk_rows, shared_prompt=train.shared_prompt)
    return HFPolicy(model, optim, logit_chunk_rows=train.logit_chunk_rows, shared_prompt=train.shared_prompt)


def build_engine(rollout: RolloutConfig, model: ModelConfig, run_dir: str, policy):
    if rollout.engine == "sglang":
        from megaopd.rollout.serving.engine import SGLangEngine

        return SGLangEngine(rollout, model, run_dir, policy)
    return LocalEngine(policy, rollout.batch_prompts)


def build_teachers(opd: OPDConfig, rollout: RolloutConfig, model: ModelConfig, logit_chunk_rows: int, run_dir: str,
                   student_tokenizer, recompute: bool = False,
                   aligned: dict[str, str] | None = None) -> TeacherRouter:
    """The OPD teachers: in-process models of the student's backend (``model``), or SGLang servers (launched per
    teacher, or attached by route). They score at the run's one temperature (``rollout.policy_temperature``), and cut
    to the rollout's top-p when ``opd.match_sampling`` (local HF teachers; ``check_temperature`` refused the rest).
    ``recompute``: the memory plan cannot keep the full form's teacher rows for the step (Plan.teacher_recompute).
    ``aligned``: route -> tokenizer directory of the teachers of another tokenizer (``align.alignment_tokenizers``).
    What each backend and engine can score was checked before (``objectives.check_opd``)."""
    _, top_p = reported_sampling("local", rollout.temperature, rollout.top_p)  # the local sampler's cut
    sampling = dict(temperature=policy_temperature(rollout.temperature),
                    top_p=top_p if opd.match_sampling else 1.0)
    teacher_dtype = opd.teacher_dtype or model.dtype
    if opd.teacher_engine == "local":
        if model.backend == "megatron":  # frozen megatron models at model.megatron.teacher_tp, in model.dtype
            from megaopd.models.megatron.policy import megatron_teachers

            return TeacherRouter(opd.teachers, megatron_teachers(model), student_tokenizer, **sampling)
        return TeacherRouter(opd.teachers, local_teachers(model, logit_chunk_rows, teacher_dtype),
                             student_tokenizer, **sampling, recompute=recompute,
                             teacher_tokenizers=aligned)
    from megaopd.rollout.serving.teacher import SGLangTeacher

    urls = opd.teacher_urls  # a multi-node job's servers among them (megaopd.run.environment)
    return TeacherRouter(opd.teachers, lambda route, path: SGLangTeacher(
        path, urls.get(route, []), rollout.sglang, teacher_dtype, run_dir, f"teacher_{route}"),
        student_tokenizer, **sampling, servers=True, teacher_tokenizers=aligned)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def merge_updates(updates: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """One step's training metrics from its optimizer updates (minibatches x epochs), each given as (what
    ``train_minibatch`` returned, the minibatch's response tokens). Losses and per-token metrics are token-means of
    each minibatch: weighted by its tokens they give the step's token-mean. The gradient norm is the mean over the
    updates, with their max beside it; the learning rate is the last update's."""
    weights = [max(tokens, 1.0) for _, tokens in updates]  # train_minibatch divides by at least one token too
    merged = {key: sum(u[key] * w for (u, _), w in zip(updates, weights)) / sum(weights)
              for key in updates[0][0] if key not in ("grad_norm", "lr")}
    norms = [u["grad_norm"] for u, _ in updates]
    return merged | {"grad_norm": sum(norms) / len(norms), "grad_norm_max": max(norms), "lr": updates[-1][0]["lr"]}


class Trainer:
    def __init__(self, cfg: RunConfig):
        # Every setting derived and refused (megaopd.run.resolve), the data read, before the run directory is made and
        # any model is loaded; config.yaml holds what the run does.
        run = resolve_run(cfg)
        self.method = spec = run.method
        self.cfg = cfg = run.cfg
        self.stop, self.plan, aligned = run.stop, run.plan, run.aligned
        train_rows, valid_rows, test_rows = run.splits.train, run.splits.validation, run.splits.eval
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.run_dir / "config.yaml")
        # The distribution every logprob of an RL step is taken under: the rollout's, softmax(logits / T)
        # (docs/opd.md, "One temperature"); SFT trains the model's own (1).
        self.temperature = policy_temperature(cfg.rollout.temperature)
        if spec.teacher_term and cfg.opd.check_teacher:  # before the student loads: one model in memory at a time
            teacher_gate(cfg.opd, cfg.model, cfg.rollout, cfg.train.seed, cfg.eval.final_prompts_per_domain,
                         self.run_dir, valid_rows, sorted({r.domain for r in train_rows}))
        seed_everything(cfg.train.seed)

        # The parts, each built from its own sections of the resolved config.
        self.policy = build_policy(cfg.model, cfg.train, cfg.run_dir, cfg.checkpoint.keep, cfg.optim)
        self.engine = build_engine(cfg.rollout, cfg.model, cfg.run_dir, self.policy)
        self.sampler = PromptSampler(train_rows, cfg.train.prompts_per_step, cfg.train.seed)
        self.evaluator = Evaluator(test_rows, cfg.eval, cfg.rollout.max_new_tokens, cfg.train.seed, self.policy.device)
        # The validation split, greedy only (what the stop rules read); its per-prompt results are not recorded
        self.validator = Evaluator(valid_rows, replace(cfg.eval, sampled=False), cfg.rollout.max_new_tokens,
                                   cfg.train.seed, self.policy.device, VALID) if valid_rows else None
        # The rows the run scores: an SFT run's training rows never are (a chat dataset may have no verifier)
        verifiers.check_ready((train_rows if spec.rollouts else []) + valid_rows + test_rows, cfg.verifier.sandbox)
        self.verifier_watch = verifiers.ErrorWatch(cfg.verifier.max_error_share, cfg.verifier.error_steps)
        self.generator = sampling_generator(self.policy.device, cfg.train.seed)  # rollout sampling only
        self.ledger = Ledger(self.run_dir.name, cfg.counts_as)
        self.ledger.add_upstream("init", cfg.model.path)

        self.teachers = self.reference = None
        if spec.teacher_term:
            self.teachers = build_teachers(cfg.opd, cfg.rollout, cfg.model, cfg.train.logit_chunk_rows, cfg.run_dir,
                                           self.policy.tokenizer, bool(self.plan and self.plan.teacher_recompute),
                                           aligned)
            self.teachers.check_domains(self.sampler.domains())
            for route, path in spec.teachers(cfg.opd).items():
                self.ledger.add_upstream(f"teacher:{route}", path)
        r = cfg.rollout
        sampling = (r.samples_per_prompt, r.temperature, r.top_p, r.max_new_tokens, self.generator)
        self.rollouts = RolloutPipeline(
            self.engine, self.sampler, lambda rows: self.engine.generate(rows, *sampling),
            r.max_staleness, cfg.train.steps, self._score_teachers if self.teachers and self.teachers.servers else None,
            (lambda rows: self.engine.generation(rows, *sampling, r.inflight_chunk)) if r.inflight_updates else None,
            r.stale_tokens)
        self.objective = build_objective(spec, cfg.grpo, cfg.opd, cfg.fixed_advantage,
                                         spec.samples_per_prompt(cfg.rollout), self.teachers)
        if spec.uses_reference(cfg.grpo):
            self.reference = build_policy(cfg.model, cfg.train, cfg.run_dir, cfg.checkpoint.keep)
        self.step_fn = self.rl_step if spec.rollouts else self.sft_step

        self.checkpointer = Checkpointer(self.run_dir, cfg.checkpoint.every, cfg.checkpoint.keep)
        self.start_step = self._resume()
        self.metrics = MetricsLogger(self.run_dir, self.start_step)
        self.stop.resume(read_metrics(self.run_dir))  # a resumed run's evals (up to its checkpoint)
        self.preempted = False

    def _on_preempt(self, signum, frame) -> None:
        log.warning("signal %d: checkpointing after this step, then exiting %d", signum, PREEMPTED_EXIT)
        self.preempted = True

    # ---- one RL step: GRPO and OPD differ only in the objective and in whether teachers score the rollouts ----
    def rl_step(self, step: int) -> dict[str, float]:
        cfg, policy = self.cfg, self.policy
        t0 = time.perf_counter()
        rollouts = self.rollouts.take(step)  # generated up to rollout.max_staleness weight versions ago
        rows, samples = rollouts.rows, rollouts.samples
        verifier_seconds, verifier_errors = score_samples(policy.tokenizer, samples)  # errors: each scored 0
        self.verifier_watch.check(verifier_errors, len(samples))  # a broken verifier stops the run here
        batch = collate(samples, policy.pad_id)
        # Tokens past rollout.max_staleness now (rollout.stale_tokens=mask; under refuse take() stopped the run)
        batch.fresh_mask = fresh_tokens(batch, self.engine.weight_version, cfg.rollout.max_staleness)
        token_loss = self.objective.token_loss if batch.fresh_mask is None else masked_loss(self.objective.token_loss)

        mbs = cfg.train.micro_batch_size
        correction = self.score_old_logprobs(batch)
        if self.reference is not None:
            batch.ref_logprobs = self.reference.logprobs(batch, mbs, self.temperature)
        # Teacher servers scored the samples as they arrived (rollout_pipeline), if they could; else they score now.
        scores = (rollouts.teacher or self._score_teachers(samples, batch)) if self.teachers else None
        routes = scores.fill(batch) if scores else {}
        metrics = {f"train/{k}": v for k, v in self.objective.prepare(batch, samples).items()}

        minibatch = math.ceil(batch.size / cfg.train.minibatches)
        update_start, updates = time.perf_counter(), []
        for _ in range(cfg.train.epochs):
            for start in range(0, batch.size, minibatch):
                part = batch.select(slice(start, start + minibatch))
                updates.append((policy.train_minibatch(part, token_loss, mbs, self.objective.vocab_term,
                                                       self.temperature), float(part.response_mask.sum())))
        applied = self._applied(step, updates, batch)
        metrics |= {f"train/{k}": v for k, v in merge_updates(applied or updates).items()}
        metrics |= self._skipped_metric(updates, applied)
        update_seconds = time.perf_counter() - update_start
        self.rollouts.sync_weights(policy)  # after the generation in flight, or into it (rollout.inflight_updates)

        # Each step's ledger holds the work done in it: the batches generated during this step (their rollout, and
        # the teachers' scoring when the servers scored them then: _billed_ahead), and the rest of the trained one's.
        pipeline_metrics, generated = self.rollouts.step_end()
        trained = tuple(c for c in self.method.components if c not in self._billed_ahead(rollouts))
        model_flops = sum(self._book_flops(b.rows, b.samples, self._billed_ahead(b)) for b in generated)
        model_flops += self._book_flops(rows, samples, trained)
        # Hardware work beside the ledger's model FLOPs: less what shared prompts did not run, plus the teachers'
        # recomputation and the prefills of requests an in-flight update interrupted (billed whole: an upper bound,
        # as a group's prompt may come from the server's prefix cache).
        shared = sum(p.take_prompt_saving() for p in (policy, self.reference) if p is not None)
        resumed = sum(flops.prefill_flops(policy.shape, n) for n in self.engine.take_resumed_prefills())
        hardware = model_flops - shared + resumed
        if self.teachers:
            self.teachers.release()
            recomputed = self.teachers.recompute_flops()
            hardware += recomputed
            metrics |= {"perf/teacher_recompute_flops": recomputed,
                        # scored ahead, the step's wait for it is in perf/rollout_wait_seconds
                        "perf/teacher_seconds": scores.seconds,
                        "perf/teacher_wait_seconds": 0.0 if rollouts.teacher else scores.seconds}
        metrics |= {"perf/hardware_flops": hardware, "perf/shared_prompt_saved_flops": shared,
                    "perf/resume_prefill_flops": resumed}
        metrics |= rollout_metrics(samples, batch, routes, correction)
        metrics["rollout/verifier_errors"] = verifier_errors
        metrics |= pipeline_metrics
        metrics |= {"perf/rollout_seconds": rollouts.seconds, "perf/verifier_seconds": verifier_seconds,
                    "perf/update_seconds": update_seconds, "perf/step_seconds": time.perf_counter() - t0}
        return metrics

    def score_old_logprobs(self, batch: TokenBatch) -> ISCorrection | None:
        """Sets the batch's old logprobs (the PPO ratio's), its sampling logprobs (the trainer's, under the
        distribution the engine reports its logprobs at), the old entropy where the objective reads it, and its IS
        weights; returns the correction (None: off)."""
        cfg, mbs = self.cfg, self.cfg.train.micro_batch_size
        # The PPO ratio's old logprobs are the loss's own distribution (the run's temperature, no top-p cut); the
        # mismatch with the engine is measured under the distribution its logprobs are reported at: both from one
        # forward.
        loss = (self.temperature, 1.0)
        reported = reported_sampling(cfg.rollout.engine, cfg.rollout.temperature, cfg.rollout.top_p)
        entropy = self.objective.needs_entropy  # from the same logits (check_fixed_advantage: never without this pass)
        if not cfg.train.recompute_old_logprobs:  # refused unless the engine reports the loss's (check_is_correction)
            batch.old_logprobs = batch.sampling_logprobs = batch.rollout_logprobs
        elif reported == loss and not entropy:
            batch.old_logprobs = batch.sampling_logprobs = self.policy.logprobs(batch, mbs, self.temperature)
        else:
            settings = [loss] + [reported] * (reported != loss)
            scored = self.policy.logprobs_under(batch, mbs, settings, with_entropy=entropy)
            batch.old_logprobs, batch.sampling_logprobs = scored[0], scored[len(settings) - 1]
            batch.old_entropy = scored[-1] if entropy else None
        # The engine sampled from slightly different numbers than the trainer computes.
        correction = is_correction(batch.sampling_logprobs, batch.rollout_logprobs, batch.response_mask, cfg.train)
        batch.is_weights = correction.weights if correction else None
        return correction

    def _score_teachers(self, samples: list[Sample], batch: TokenBatch | None = None) -> TeacherScores:
        """The teachers' scores of these samples: in the training step (onto its `batch`, collated once), or on the
        rollout pipeline's thread as they arrive (teacher servers: collated there)."""
        cfg, start = self.cfg, time.perf_counter()
        batch = batch if batch is not None else collate(samples, self.policy.pad_id)
        routes = self.teachers.score(batch, samples, cfg.opd.form, cfg.train.micro_batch_size, cfg.opd.topk)
        return TeacherScores.of(batch, routes, time.perf_counter() - start)

    @staticmethod
    def _billed_ahead(rollouts: StepRollouts) -> tuple[str, ...]:
        """The components billed in the step that generated the batch: the rollout, and the teachers' scoring when
        the servers scored it then (each step's ledger holds the work done in it)."""
        return ("rollout", "teacher") if rollouts.teacher else ("rollout",)

    def _book_flops(self, rows, samples: list[Sample], components: tuple[str, ...] | None = None) -> int:
        """Books the model FLOPs of these samples in the ledger, of `components` (default: every one the method
        books); returns their sum. The one place a step's FLOPs are billed."""
        cfg = self.cfg
        n = self.method.samples_per_prompt(cfg.rollout)
        prompt_lens = [len(samples[i * n].prompt_ids) for i in range(len(rows))]
        teachers = [self.teachers.shape(self.teachers.route(row.domain)) for row in rows] if self.teachers else None
        parts = self.method.step_flops(cfg.train, cfg.rollout, cfg.grpo, self.policy.shape, teachers, prompt_lens,
                                       [len(s.response_ids) for s in samples],
                                       teacher_lens=self.teachers.token_counts(samples, n) if self.teachers else None)
        components = self.method.components if components is None else components
        for component in components:
            self.ledger.add(component, parts[component])
        return sum(parts[c] for c in components)

    # ---- one SFT step (cold start): teacher-forced NLL on worked solutions, a share of them corrupted ----
    def sft_step(self, step: int) -> dict[str, float]:
        cfg, policy = self.cfg, self.policy
        noise_rng = random.Random(cfg.train.seed * 1_000_003 + step)
        samples, rows = [], self.sampler.next_batch()
        for i, row in enumerate(rows):
            target = row.extra_info["solution"]
            if noise_rng.random() < cfg.sft.noise:
                target = corrupt(target, noise_rng)
            response = policy.tokenizer.encode(target, add_special_tokens=False) + [policy.eos_id]
            samples.append(Sample(row, i, chat_prompt_ids(policy.tokenizer, row.prompt), response,
                                  [0.0] * len(response), "stop", 0))
        batch = collate(samples, policy.pad_id)
        update = policy.train_minibatch(batch, self.objective.token_loss, cfg.train.micro_batch_size)
        self._book_flops(rows, samples)
        applied = self._applied(step, [(update, 1.0)], batch)
        return {f"train/{k}": v for k, v in update.items()} | self._skipped_metric([update], applied)

    def _applied(self, step: int, updates: list[tuple[dict[str, float], float]], batch: TokenBatch) -> list:
        """The updates the policy applied: it applies none whose loss or gradient norm is non-finite. Such an update
        stops the run here (before the step's checkpoint) in one line naming the step and the quantity, or with
        train.nonfinite=skip is left out (and counted: ``_skipped_metric``)."""
        def finite(update: dict[str, float]) -> bool:
            return all(math.isfinite(update.get(k, 0.0)) for k in ("loss", "grad_norm"))

        applied = [u for u in updates if finite(u[0])]
        if len(applied) == len(updates):
            return applied
        quantity = nonfinite_quantity(next(u for u, _ in updates if not finite(u)), batch)
        if self.cfg.train.nonfinite == "stop":
            raise NonFiniteStep(f"step {step}: {quantity}; the update was not applied and the run stopped before "
                                "the step's checkpoint (the earlier ones are kept); find the cause, or set "
                                "train.nonfinite=skip to leave such updates out")
        log.warning("step %d: %s; update left out (train.nonfinite=skip)", step, quantity)
        return applied

    def _skipped_metric(self, updates: list, applied: list) -> dict[str, float]:
        """train/nonfinite_skipped: the step's updates left out, logged under train.nonfinite=skip only."""
        return {"train/nonfinite_skipped": len(updates) - len(applied)} if self.cfg.train.nonfinite == "skip" else {}

    # ---- the loop around every step ----
    def fit(self) -> dict:
        # Slurm sends SIGUSR1 (--signal=B:USR1@N) before the time limit and SIGTERM on preemption: finish the
        # step in flight, checkpoint, and exit so that the requeued job resumes with its ledger intact. The
        # previous handlers come back afterwards (a study runs several trainers in one process).
        sigs = (signal.SIGUSR1, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
        previous = {sig: signal.signal(sig, self._on_preempt) for sig in sigs}
        try:
            return self._fit()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.close()

    def close(self) -> None:
        """Stop the servers this run launched (SGLang rollout and teacher servers); a no-op for local ones."""
        self.rollouts.close()
        self.engine.close()
        if self.teachers is not None:
            self.teachers.close()

    def _fit(self) -> dict:
        cfg = self.cfg
        if self.start_step == 0:
            first = self._eval(0) | self._flop_metrics()
            self.stop.observe(0, first)  # the plateau rule's baseline
            self.metrics.log(0, first)
        stopped_early = False
        step = self.start_step
        last = self.start_step if self.stop.reason else cfg.train.steps  # a resumed run that had already stopped
        for step in tqdm(range(self.start_step + 1, last + 1), desc=f"{cfg.train.algorithm} {self.run_dir}",
                         initial=self.start_step, total=last, mininterval=5):
            metrics = self.step_fn(step)
            if step % cfg.eval.every == 0 or step == cfg.train.steps:
                metrics |= self._eval(step)
                stopped_early = self.stop.observe(step, metrics | self._flop_metrics())
            self.metrics.log(step, metrics | self._flop_metrics())
            self.checkpointer.maybe_save(step, lambda: self._state(step), force=stopped_early or self.preempted)
            if self.preempted:
                self.metrics.close()
                raise SystemExit(PREEMPTED_EXIT)
            if stopped_early:
                break
        return self._finish(step)

    def _eval(self, step: int, final: bool = False) -> dict[str, float]:
        """The test split's metrics (eval/, at the end final/) and the validation split's (valid/, final_valid/)."""
        # Per-prompt results of the test split beside the metrics, for the report's bootstrap (a resumed run
        # rewrites its own steps).
        record = self.run_dir / "evals" / ("final.json" if final else f"step_{step:06d}.json")
        earlier = sorted(record.parent.glob("*.json"))  # about the size of the one to write
        with space_for(record, earlier[-1].stat().st_size if earlier else None, partial=[record]):
            metrics = self.evaluator.run(self.engine, self.policy.tokenizer, step, final, record)
        if self.validator is not None:
            metrics |= self.validator.run(self.engine, self.policy.tokenizer, step, final)
        return metrics

    def _flop_metrics(self) -> dict[str, float]:
        out = {f"flops/{c}": v for c, v in self.ledger.own.items()}
        return out | {f"flops/total_{k}": v for k, v in self.ledger.totals().items()}

    def _state(self, step: int) -> dict:
        # The rollouts generated ahead first: the sampler's and the generator's states are after their draws. The
        # generations it ran to their end (in-flight updates) are billed now, before the ledger is saved.
        rollouts = self.rollouts.state_dict()
        for b in self.rollouts.drain_generated():
            self._book_flops(b.rows, b.samples, self._billed_ahead(b))
        return {"step": step, "policy": self.policy.state_dict(), "ledger": self.ledger.state_dict(),
                "sampler": self.sampler.state_dict(), "rng": rng_state(), "generator": self.generator.get_state(),
                "weight_version": self.engine.weight_version, "rollouts": rollouts}

    def _resume(self) -> int:
        state = self.checkpointer.latest()
        if state is None:
            return 0
        self.policy.load_state_dict(state["policy"])
        self.ledger.load_state_dict(state["ledger"])
        self.sampler.load_state_dict(state["sampler"])
        self.rollouts.load_state_dict(state.get("rollouts", []), state["step"])  # none in older checkpoints
        set_rng_state(state["rng"])
        self.generator.set_state(state["generator"])
        # Servers (if any) start from the initial weights: push the resumed ones under their version.
        self.engine.sync_weights(self.policy, version=state["weight_version"])
        log.info("resumed %s from step %d", self.run_dir, state["step"])
        return state["step"]

    def _finish(self, step: int) -> dict:
        final_metrics = self._eval(step, final=True)
        self.metrics.log(step, final_metrics | self._flop_metrics())
        self.metrics.close()
        out = self.run_dir / FINAL_DIR
        tmp = self.run_dir / f".tmp_{FINAL_DIR}"
        model = self.policy.model.state_dict() if isinstance(self.policy, HFPolicy) else None  # no copy
        with space_for(tmp, state_bytes(model) if model else None, partial=[tmp]):
            self.policy.save_hf(tmp)
            self.ledger.stop = self.stop.record(step)
            self.ledger.save(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        summary = {"run_dir": str(self.run_dir), "algorithm": self.cfg.train.algorithm,
                   "form": form_label(self.cfg.train.algorithm, self.cfg.opd), "steps": step,
                   "stop": self.ledger.stop, "final": final_metrics, "ledger": self.ledger.state_dict()}
        write_summary(self.run_dir, summary)
        return summary


class NonFiniteStep(UserError):
    what = "non-finite step"


def nonfinite_quantity(update: dict[str, float], batch: TokenBatch) -> str:
    """Which quantity of a non-finite update went wrong first: a teacher's logprobs (NaN or +inf on a response
    token), else the loss, else the gradient norm. Run only when one is non-finite: no cost to a finite step."""
    mask = batch.response_mask.bool()
    for name in ("teacher_logprobs", "teacher_topk_logprobs", "teacher_tail"):
        values = getattr(batch, name)
        if values is not None:
            values = values.detach().float().cpu()
            rows = mask.cpu() if values.dim() == 2 else mask.cpu()[..., None].expand_as(values)
            bad = (torch.isnan(values) | torch.isposinf(values)) & rows
            if bad.any():
                return f"the teacher's logprobs ({name}) are non-finite at {int(bad.sum())} response positions"
    if not math.isfinite(update.get("loss", 0.0)):
        return f"the loss is {update['loss']}"
    return f"the gradient norm is {update['grad_norm']}"


def train(cfg: RunConfig, stage_dir: str | None = None) -> dict:
    """Train the run `cfg` describes, unless it already ended under the same step cap (``megaopd.run.finished``).
    `stage_dir`: the run directory every rank shares where cfg.run_dir is a rank's own (megaopd.models.megatron.launch):
    all ranks decide alike.

    A preemption signal that lands after the last step (in the final eval or the export) still requeues the job
    (torchrun exits 1 after any signal): the requeued run must not train the finished stage again. A larger
    train.steps continues a finished run from its latest checkpoint. What a launch script hands over in environment
    variables (servers, interpreters) enters the config here, once (``megaopd.run.environment``)."""
    run_dir = Path(stage_dir or cfg.run_dir)
    summary = finished_summary(run_dir, cfg.train.steps)
    if summary is not None:
        log.info("%s ended at step %d of %d (%s): nothing to train; remove it, choose another run_dir or raise "
                 "train.steps to train on", run_dir, summary["steps"], cfg.train.steps, summary["stop"]["reason"])
        return summary
    return Trainer(environment.apply(cfg)).fit()
