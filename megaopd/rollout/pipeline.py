"""Bounded-staleness rollouts (``rollout.max_staleness: K``): the trainer asks for the rollouts of step k, and
before handing them over the pipeline makes sure the batches of steps k..k+K exist, drawn from the prompt sampler
in step order and generated with the engine's current weights.

    rollouts = pipeline.take(step)      # StepRollouts: its rows, its samples, how long their generation took (and
                                        # the teacher servers' scores, when they scored it as it arrived)
    ... rewards, teachers, update ...
    pipeline.sync_weights(policy)       # waits for a generation in flight (unless updates land in it), then pushes
    metrics, generated = pipeline.step_end()  # the batches generated during this step, for the ledger

So the first K+1 batches come from weight version 0 and every later one trains exactly K versions after the one that
generated it (K=1: one-step-off-policy); K=0 is the synchronous loop, with the same sampler draws and generator use.
Staleness is counted per response token when its batch trains (``megaopd.rollout.staleness``): by construction none
is more than K versions old; one that is (a batch that waited longer) stops the run or is masked
(``rollout.stale_tokens``).

In-flight updates (``rollout.inflight_updates``), on the local engine: the batches ahead are generations paused between
chunks of ``rollout.inflight_chunk`` decode steps. ``take(k)`` runs batch k's to its end and advances each later one by
a chunk, so the update after step k lands in their pauses and one response carries several versions, each token
stamped with its own (``Sample.token_versions``); a batch started in step k - K trains in step k, its first chunk K
versions old. A checkpoint runs the paused generations to their end (the trainer bills them there). On SGLang
servers the sync does not wait for the generation in flight: it aborts the requests running, and the generation
resumes each from its partial response under the new weights (``serving.inflight``).

Where the generation runs: an engine that samples from the trainer's own model (``LocalEngine``) generates inline
when the pipeline is refilled: the same staleness, no overlap. An engine with its own copy of the weights (SGLang
servers) generates on one background thread, one generation in flight, so that batch k+K is generated while step k
trains. Under torchrun only rank 0 talks to the servers (``serving.leader``): its thread generates ``leader_only``
(no collective off the main thread), every other rank makes the same generator draws on its main thread, and the
batch reaches every rank by broadcast when it is collected, a point of the loop all ranks share. Without in-flight
updates the weight sync waits for the generation in flight before it pushes (no weight update mid-generation);
either way a checkpoint collects it first, so a checkpoint holds whole responses only.

Teacher servers (OPD, ``score``) score each batch on that thread right after its generation, at K >= 1: a frozen
teacher's scores of a sample hold whatever weights generated it, so they overlap the update as the generation does,
and the batch comes with them (``StepRollouts.teacher``). Local teachers share the trainer's devices, and at K=0
there is nothing to overlap: the training step scores those, as before the pipeline existed.

The trainer bills a batch's rollout FLOPs once, in the step that generated it (``step_end`` hands it over then;
one that SGLang servers generate across an in-flight update, in the step or checkpoint that collects it), with
its teacher FLOPs when the servers scored it there; the lookahead stops at the stage's last step, so only a plateau
stop leaves batches generated and never trained (up to K, billed: work done; paused ones are run to their end and
billed by the checkpoint the stop forces). A checkpoint holds the generated-but-untrained batches, with their teacher
scores; the resumed run trains them as the uninterrupted one would, without scoring them again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

from megaopd.data.batch import Sample, TeacherScores
from megaopd.config import ConfigError
from megaopd.data.rows import Row
from megaopd.data.sampler import PromptSampler
from megaopd.rollout.local import resume, run_to_end
from megaopd.rollout.serving.leader import is_leader, leader_only, on_leader
from megaopd.rollout.staleness import check_staleness, token_staleness


@dataclass
class StepRollouts:
    """One step's prompts and the samples generated for them."""

    rows: list[Row]
    samples: list[Sample]
    draw_index: int  # prompts the sampler had drawn before this batch: consecutive batches advance it by one batch
    seconds: float  # wall seconds the generation took (on whichever thread ran it)
    teacher: TeacherScores | None = None  # the teacher servers' scores, when they scored the samples as they arrived


@dataclass
class _InFlight:
    """A batch whose generation is paused between chunks of decode steps (rollout.inflight_updates)."""

    rows: list[Row]
    draw_index: int
    generation: Generator[None, None, list[Sample]]
    seconds: float = 0.0


class RolloutPipeline:
    def __init__(self, engine, sampler: PromptSampler, generate: Callable[[list[Row]], list[Sample]],
                 max_staleness: int, last_step: int, score: Callable[[list[Sample]], TeacherScores] | None = None,
                 generation: Callable[[list[Row]], Generator[None, None, list[Sample]]] | None = None,
                 stale_tokens: str = "refuse"):
        """``generate(rows)``: the engine's samples with the run's sampling settings and generator;
        ``score(samples)``: the teacher servers' scores (None: no teachers, or local ones); ``generation(rows)``:
        the same samples as a generation that pauses between chunks of decode steps, where weight updates land
        (rollout.inflight_updates; None: off); ``stale_tokens``: rollout.stale_tokens."""
        self.engine, self.sampler, self.generate = engine, sampler, generate
        self.max_staleness, self.last_step = max_staleness, last_step
        self.background = not engine.shares_policy_weights
        # An engine with its own weights takes in-flight updates into the generation itself (SGLangEngine)
        self.generation = None if self.background else generation
        self.stale_tokens = stale_tokens
        self._paused: dict[int, _InFlight] = {}  # step -> its batch's paused generation (in-flight updates)
        self.score = score if self.background and max_staleness > 0 else None  # else the training step scores
        self._pool: ThreadPoolExecutor | None = None
        self._ready: dict[int, StepRollouts] = {}  # step -> its generated batch, in step order
        self._in_flight: tuple[int, list[Row], Future | None] | None = None  # step, its rows, rank 0's job
        self._drawn = 0  # the last step whose prompts were drawn
        self._row_index = {id(row): i for i, row in enumerate(sampler.rows)}  # rows go to a checkpoint by index
        self._wait = self._sync = 0.0  # this step's seconds waiting for rollouts, and pushing weights
        self._generated: list[StepRollouts] = []  # this step's generations, for the trainer to bill
        self._staleness: list[int] = []  # this step's trained tokens' staleness, and how many were past the bound
        self._stale = 0
        self._draw_index = 0

    # ---- one step ----
    def take(self, step: int) -> StepRollouts:
        """The batch step `step` trains on. Its tokens' staleness is counted now, when it trains: a token more than
        K versions old is refused or left to the trainer to mask (rollout.stale_tokens; a batch trains whole: its
        groups and teacher scores are by sample index)."""
        start = time.perf_counter()
        for ahead in range(self._drawn + 1, min(step + self.max_staleness, self.last_step) + 1):
            self._launch(ahead)
        if self._paused:
            self._advance(step)
        if step not in self._ready:
            self._collect()  # it is the one in flight
        batch = self._ready.pop(step)
        self._wait += time.perf_counter() - start
        staleness = token_staleness(batch.samples, self.engine.weight_version)
        self._stale += check_staleness(step, staleness, self.max_staleness, self.stale_tokens)
        self._staleness += staleness
        self._draw_index = batch.draw_index
        return batch

    def sync_weights(self, policy) -> None:
        """After the update: wait for the generation in flight (it samples the previous weights), then push; an
        engine that takes updates in flight pushes at once."""
        start = time.perf_counter()
        if self._in_flight is not None and not getattr(self.engine, "updates_in_flight", False):
            self._collect()
        self._wait += time.perf_counter() - start
        start = time.perf_counter()
        self.engine.sync_weights(policy)
        self._sync += time.perf_counter() - start

    def step_end(self) -> tuple[dict[str, float], list[StepRollouts]]:
        """This step's metrics, and the batches generated during it (billed in this step's ledger, whichever step
        trains on them)."""
        tokens = max(len(self._staleness), 1)
        metrics = {"rollout/staleness_mean": sum(self._staleness) / tokens,
                   "rollout/staleness_max": max(self._staleness, default=0),
                   "rollout/staleness_masked_share": self._stale / tokens, "rollout/draw_index": self._draw_index,
                   "perf/rollout_wait_seconds": self._wait, "perf/weight_sync_seconds": self._sync}
        self._wait, self._sync, self._staleness, self._stale = 0.0, 0.0, [], 0
        return metrics, self.drain_generated()

    def drain_generated(self) -> list[StepRollouts]:
        """The batches generated since the last call (for the trainer to bill)."""
        generated, self._generated = self._generated, []
        return generated

    # ---- generation ----
    def _launch(self, step: int) -> None:
        draw_index = self.sampler.drawn
        rows = self.sampler.next_batch()
        self._drawn = step
        if self.generation is not None:  # started by _advance, with the batches in flight before it
            self._paused[step] = _InFlight(rows, draw_index, self.generation(rows))
            return
        if not self.background:
            self._store(step, self._generate(rows, draw_index))
            return
        if self._in_flight is not None:  # one generation at a time: the generator's draws stay in step order
            self._collect()
        job = None
        if is_leader():
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollouts")
            job = self._pool.submit(self._generate_leader_only, rows, draw_index)
        else:
            with leader_only():
                self.generate(rows)  # rank 0's generator draws: its samples arrive when the batch is collected
        self._in_flight = (step, rows, job)

    def _generate_leader_only(self, rows: list[Row], draw_index: int) -> StepRollouts:
        with leader_only():
            return self._generate(rows, draw_index)

    def _generate(self, rows: list[Row], draw_index: int) -> StepRollouts:
        start = time.perf_counter()
        samples = self.generate(rows)
        batch = StepRollouts(rows, samples, draw_index, time.perf_counter() - start)
        return replace(batch, teacher=self.score(samples)) if self.score else batch

    def _advance(self, step: int | None) -> None:
        """In-flight updates: batch `step`'s generation run to its end, every later one by one more chunk of decode
        steps (None: every one to its end), in step order (the generator's draws); the weight update after this step
        lands in their pauses."""
        for ahead in sorted(self._paused):
            paused = self._paused[ahead]
            start = time.perf_counter()
            samples = run_to_end(paused.generation) if step in (None, ahead) else resume(paused.generation)
            paused.seconds += time.perf_counter() - start
            if samples is not None:
                del self._paused[ahead]
                self._store(ahead, StepRollouts(paused.rows, samples, paused.draw_index, paused.seconds))

    def _collect(self) -> None:
        step, rows, job = self._in_flight
        self._in_flight = None
        batch = on_leader(lambda: job.result())  # rank 0's batch (or its error) to every rank, from the main thread
        if batch.rows is not rows:  # a broadcast copy: its samples point at the rank's own rows again (a
            copies = {id(copy): row for copy, row in zip(batch.rows, rows)}  # checkpoint finds them by identity)
            batch = replace(batch, rows=rows, samples=[replace(s, row=copies[id(s.row)]) for s in batch.samples])
        self._store(step, batch)

    def _store(self, step: int, batch: StepRollouts) -> None:
        self._generated.append(batch)
        self._ready[step] = batch

    # ---- checkpoint ----
    def state_dict(self) -> list[dict]:
        """The generated-but-untrained batches, in step order (the sampler's and generator's states are after them).
        Nothing is in flight at a checkpoint: paused generations are run to their end here (``drain_generated``
        hands them over for billing)."""
        if self._in_flight is not None:
            self._collect()
        self._advance(None)
        self._ready = dict(sorted(self._ready.items()))  # a batch ahead may have ended before the ones before it
        return [{"rows": [self._row_index[id(row)] for row in b.rows], "draw_index": b.draw_index,
                 "seconds": b.seconds, "samples": [dict(vars(s), row=self._row_index[id(s.row)]) for s in b.samples],
                 "teacher": vars(b.teacher) if b.teacher else None}
                for b in self._ready.values()]

    def load_state_dict(self, batches: list[dict], step: int) -> None:
        """Batches saved at `step`: they are the next steps' (their FLOPs are in the resumed ledger already)."""
        if len(batches) > self.max_staleness:
            raise ConfigError(f"the checkpoint holds {len(batches)} rollout batch(es) generated ahead, more than "
                              f"rollout.max_staleness={self.max_staleness} allows; resume with "
                              f"rollout.max_staleness={len(batches)} or more")
        rows = self.sampler.rows
        self._ready = {step + 1 + i: StepRollouts([rows[r] for r in b["rows"]],
                                           [Sample(**(s | {"row": rows[s["row"]]})) for s in b["samples"]],
                                           b["draw_index"], b["seconds"],
                                           TeacherScores(**b["teacher"]) if b.get("teacher") else None)
                       for i, b in enumerate(batches)}
        self._drawn = step + len(batches)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
