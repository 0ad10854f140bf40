"""The rollout pipeline's order of sampler draws, generations and weight syncs (rollout.max_staleness), with a
recording engine: what these tests pin is the order of calls, which a real engine would only make slower to see.
tests/test_train.py runs the real trainer through it (K=1 kill -9 / resume; K=0 against the code before the
pipeline), tests/test_sglang.py with SGLang rollout and teacher servers (K=1)."""

import collections
import io
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megaopd.data.batch import Sample, TeacherScores
from megaopd.config import ConfigError, load_config
from megaopd.data.rows import Row
from megaopd.data.sampler import PromptSampler
from megaopd.rollout.pipeline import RolloutPipeline
from megaopd.rollout.serving.leader import on_leader

PROMPTS = 2


class RecordingEngine:
    """Records generate / sync calls; each sample consumes one draw of the generator, like SGLang's seeds."""

    def __init__(self, shares_policy_weights: bool, seconds: float = 0.0):
        self.shares_policy_weights = shares_policy_weights
        self.seconds = seconds
        self.weight_version = 0
        self.events: list[tuple] = []
        self.generating = threading.Event()

    def generate(self, rows, generator):
        self.generating.set()
        draws = torch.rand(len(rows), generator=generator).tolist()
        time.sleep(self.seconds)
        self.events.append(("generate", self.weight_version, [r.ground_truth for r in rows], draws))
        self.generating.clear()
        return [Sample(row, i, [1], [2], [0.0], "stop", self.weight_version) for i, row in enumerate(rows)]

    def sync_weights(self, policy) -> None:
        assert not self.generating.is_set(), "weights pushed while a generation was in flight"
        self.weight_version += 1
        self.events.append(("sync", self.weight_version))


GATE_S = 20.0  # how long a gated generation waits for its update: only a pipeline that does not overlap waits it out


class GatedEngine(RecordingEngine):
    """A server-backed engine (generation in the background) whose generation k >= 2 starts only once the update of
    step k - 1 is under way (``updates[k - 1]``, set by the test): one that a pipeline runs anywhere but beside that
    update (inside take() or sync_weights()) waits out the gate, and ``overlapped`` records it. No wall-clock bound:
    what is asserted is which call each generation ran beside."""

    def __init__(self, seconds: float):
        super().__init__(False, seconds)
        self.updates: dict[int, threading.Event] = collections.defaultdict(threading.Event)
        self.overlapped: list[bool] = []

    def generate(self, rows, generator):
        self.gate()
        return super().generate(rows, generator)

    def gate(self) -> None:
        k = generations(self) + 1  # one generation at a time: the ones before it are all recorded
        if k > 1:
            self.generating.set()  # a weight sync now would be one mid-generation
            self.overlapped.append(self.updates[k - 1].wait(GATE_S))


def generations(engine) -> int:
    return sum(e[0] == "generate" for e in engine.events)


def wait_until(condition) -> bool:
    """Whether `condition()` came true within GATE_S (polled: the pipeline's thread makes it true, not this one)."""
    deadline = time.monotonic() + GATE_S
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def rows():
    return [Row("src", [{"role": "user", "content": str(i)}], i) for i in range(7)]


def pipeline(engine, max_staleness, last_step, score=None, generator=None):
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    sampler = PromptSampler(rows(), PROMPTS, seed=0)
    return RolloutPipeline(engine, sampler, lambda batch: engine.generate(batch, generator), max_staleness,
                           last_step, score)


def recording_teacher(engine, seconds=0.0):
    """A teacher server's ``score``: records the thread and the prompts it scored in the engine's events."""
    def score(samples):
        time.sleep(seconds)
        prompts = [s.row.ground_truth for s in samples]
        engine.events.append(("score", threading.current_thread().name, prompts))
        return TeacherScores({"teacher_logprobs": torch.tensor(prompts)}, {"*": list(range(len(samples)))}, seconds)
    return score


def synchronous_events(steps):
    """Today's loop, written out: draw, generate, (train), sync."""
    engine, generator = RecordingEngine(True), torch.Generator().manual_seed(0)
    sampler = PromptSampler(rows(), PROMPTS, seed=0)
    for _ in range(steps):
        engine.generate(sampler.next_batch(), generator)
        engine.sync_weights(None)
    return engine.events


def run(pipe, engine, steps, train_seconds=0.0, generated=None):
    """`generated`: each step's generated batches' sizes (what the trainer bills in that step) are appended."""
    taken, metrics = [], []
    for step in range(1, steps + 1):
        batch = pipe.take(step)
        taken.append([s.row.ground_truth for s in batch.samples])
        time.sleep(train_seconds)  # the update
        pipe.sync_weights(None)
        step_metrics, batches = pipe.step_end()
        metrics.append(step_metrics)
        if generated is not None:
            generated.append([len(b.samples) for b in batches])
    return taken, metrics


def test_zero_staleness_is_the_synchronous_loop():
    engine, generated = RecordingEngine(True), []
    _, metrics = run(pipeline(engine, 0, 5), engine, 5, generated=generated)
    assert engine.events == synchronous_events(5)
    assert generated == [[PROMPTS]] * 5
    assert all(m["rollout/staleness_max"] == 0 for m in metrics)
    assert [m["rollout/draw_index"] for m in metrics] == [PROMPTS * i for i in range(5)]


@pytest.mark.parametrize("background", [False, True])
def test_each_batch_trains_k_versions_after_it_was_generated(background):
    steps, k = 6, 2
    engine, billed = RecordingEngine(not background, seconds=0.02 if background else 0.0), []
    taken, metrics = run(pipeline(engine, k, steps), engine, steps, train_seconds=0.01, generated=billed)
    assert billed == [[PROMPTS] * 3, [PROMPTS], [PROMPTS], [PROMPTS], [], []]  # once each, when generated
    generated = [e for e in engine.events if e[0] == "generate"]
    assert [e[1] for e in generated] == [0, 0, 0, 1, 2, 3]  # the first K+1 from version 0, then one per step
    assert [m["rollout/staleness_max"] for m in metrics] == [0, 1, 2, 2, 2, 2]
    assert all(m["rollout/staleness_mean"] == m["rollout/staleness_max"] for m in metrics)
    assert len(generated) == steps  # the lookahead stops at the stage's last step
    # Same prompts, same generator draws, in step order, wherever the generation ran; each batch trained once.
    order = [e for e in synchronous_events(steps) if e[0] == "generate"]
    assert [(e[2], e[3]) for e in generated] == [(e[2], e[3]) for e in order]
    assert taken == [e[2] for e in order]


def test_background_generation_overlaps_the_update_and_the_sync_waits_for_it():
    """Batch k+1 is generated during step k's update; a sync called while it is still in flight waits for it."""
    engine, generated, metrics = GatedEngine(seconds=0.3), [], []
    pipe = pipeline(engine, 1, 3)
    for step in range(1, 4):
        pipe.take(step)
        engine.updates[step].set()  # step's update is under way
        if step == 1:  # batch 2 is generated within it, with no call into the pipeline
            assert wait_until(lambda: generations(engine) == 2), "batch 2 was not generated during update 1"
        if step == 2:  # batch 3 is in flight (0.3 s): the sync must wait for it (the engine refuses one mid-generation)
            assert wait_until(engine.generating.is_set)
        pipe.sync_weights(None)
        step_metrics, batches = pipe.step_end()
        metrics.append(step_metrics)
        generated.append([len(b.samples) for b in batches])
    assert engine.overlapped == [True, True]
    assert metrics[0]["perf/rollout_wait_seconds"] > 0.25  # batch 1: nothing to overlap with
    assert generated == [[PROMPTS, PROMPTS], [PROMPTS], []]  # each billed once, in the step that generated it


@pytest.mark.parametrize("background, k", [(True, 2), (True, 0), (False, 2)])
def test_teacher_servers_score_each_batch_on_the_pipelines_thread_as_it_arrives(background, k):
    """With rollouts generated in the background at K >= 1, each batch is scored right after its generation, on
    that thread, and comes with its scores; at K=0, or with an inline engine, the training step scores (none here)."""
    engine = RecordingEngine(not background)
    taken = []
    pipe = pipeline(engine, k, 4, recording_teacher(engine))
    for step in range(1, 5):
        taken.append(pipe.take(step))
        pipe.sync_weights(None)
        pipe.step_end()
    scored = [e for e in engine.events if e[0] == "score"]
    if not (background and k):
        assert scored == [] and all(b.teacher is None for b in taken)
        return
    after = [engine.events[i - 1] for i, e in enumerate(engine.events) if e[0] == "score"]
    assert [e[0] for e in after] == ["generate"] * 4 and [e[2] for e in after] == [e[2] for e in scored]
    assert {e[1] for e in scored} == {"rollouts_0"}  # the pipeline's thread, never the trainer's
    assert [b.teacher.fields["teacher_logprobs"].tolist() for b in taken] == [e[2] for e in scored]


def test_teacher_scoring_overlaps_the_update():
    """Batch k+1 is generated and scored during step k's update."""
    engine, metrics = GatedEngine(seconds=0.15), []
    pipe = pipeline(engine, 1, 3, recording_teacher(engine, seconds=0.15))
    for step in range(1, 4):
        pipe.take(step)
        engine.updates[step].set()
        if step < 3:
            assert wait_until(lambda: sum(e[0] == "score" for e in engine.events) == step + 1), \
                f"batch {step + 1} was not scored during update {step}"
        pipe.sync_weights(None)
        metrics.append(pipe.step_end()[0])
    assert engine.overlapped == [True, True]
    assert metrics[0]["perf/rollout_wait_seconds"] > 0.25  # batch 1's generation and scoring: nothing to overlap


def test_a_sample_older_than_k_is_never_trained_on():
    engine = RecordingEngine(True)
    pipe = pipeline(engine, 1, 4)
    pipe.take(1)
    pipe.sync_weights(None)
    engine.sync_weights(None)  # a version the pipeline did not see: batch 2 is now 2 versions old
    with pytest.raises(RuntimeError, match="more than rollout.max_staleness=1"):
        pipe.take(2)


def test_checkpointed_batches_resume_in_place():
    engine = RecordingEngine(True)
    straight, _ = run(pipeline(engine, 1, 5), engine, 5)

    engine = RecordingEngine(True)
    first = pipeline(engine, 1, 5)
    before, _ = run(first, engine, 3)
    state = first.state_dict()
    assert len(state) == 1  # batch 4, generated during step 3
    resumed = pipeline(engine, 1, 5)
    resumed.sampler.load_state_dict(first.sampler.state_dict())
    resumed.load_state_dict(state, 3)
    batch = resumed.take(4)
    assert before + [[s.row.ground_truth for s in batch.samples]] == straight[:4]
    assert batch.draw_index == 3 * PROMPTS
    with pytest.raises(ConfigError, match="rollout.max_staleness=1 or more"):
        pipeline(engine, 0, 5).load_state_dict(state, 3)


def test_a_checkpoint_holds_the_teacher_scores_of_the_batches_scored_ahead():
    """Their scores are saved with them (their teacher FLOPs are in the saved ledger): the resumed run trains on
    the same scores without asking the teacher again."""
    engine = RecordingEngine(False)
    first = pipeline(engine, 1, 5, recording_teacher(engine))
    run(first, engine, 3)
    [saved] = first.state_dict()
    last_scored = [e for e in engine.events if e[0] == "score"][-1]
    assert saved["teacher"]["fields"]["teacher_logprobs"].tolist() == last_scored[2]  # batch 4's, scored in step 3
    engine.events.clear()
    resumed = pipeline(engine, 1, 5, recording_teacher(engine))
    resumed.sampler.load_state_dict(first.sampler.state_dict())
    file = io.BytesIO()  # through the checkpoint's serialisation
    torch.save([saved], file)
    file.seek(0)
    resumed.load_state_dict(torch.load(file, weights_only=False), 3)
    batches = [resumed.take(4), resumed.take(5)]
    assert [b.teacher.fields["teacher_logprobs"].tolist() for b in batches] == [
        [s.row.ground_truth for s in b.samples] for b in batches]
    # batch 5 only: batch 4 was not scored again
    assert [e[2] for e in engine.events if e[0] == "score"] == [[s.row.ground_truth for s in batches[1].samples]]


def test_negative_staleness_is_a_config_error():
    with pytest.raises(ConfigError, match="rollout.max_staleness must be >= 0"):
        load_config(None, ["rollout.max_staleness=-1"])


class LeaderEngine(GatedEngine):
    """As SGLangEngine under torchrun: every rank draws the samples' seeds, only rank 0 generates (on_leader)."""

    def generate(self, rows, generator):
        draws = torch.rand(len(rows), generator=generator).tolist()
        return on_leader(lambda: self._serve(rows, draws))

    def _serve(self, rows, draws):
        self.gate()
        self.generating.set()
        time.sleep(self.seconds)
        self.events.append(("generate", threading.current_thread().name, [r.ground_truth for r in rows], draws))
        self.generating.clear()
        return [Sample(row, i, [1], [len(self.events), i], [0.0], "stop", self.weight_version)
                for i, row in enumerate(rows)]


def _ranks_worker(rank: int, init_file: str, results, generation_seconds: float, update_seconds: float) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    engine, generator = LeaderEngine(seconds=generation_seconds), torch.Generator().manual_seed(0)
    teacher = recording_teacher(engine)
    pipe = pipeline(engine, 1, 4, lambda samples: on_leader(lambda: teacher(samples)), generator)
    taken, waits, saved = [], [], None
    for step in range(1, 5):
        batch = pipe.take(step)
        scores = batch.teacher.fields["teacher_logprobs"].tolist() if batch.teacher else None
        taken.append(([(s.row.ground_truth, s.response_ids) for s in batch.samples], scores))
        engine.updates[step].set()
        for _ in range(3):  # the update: collectives on the main thread while rank 0 generates on its own
            dist.all_reduce(torch.ones(1))
            time.sleep(update_seconds / 3)
        if rank == 0 and step < 4:  # batch step + 1 arrives within the update, before its last collective
            assert wait_until(lambda: generations(engine) == step + 1), f"batch {step + 1} not generated in update"
        dist.all_reduce(torch.ones(1))
        pipe.sync_weights(None)
        waits.append(pipe.step_end()[0]["perf/rollout_wait_seconds"])
        if step == 2:
            saved = [(b["rows"], [s["row"] for s in b["samples"]]) for b in pipe.state_dict()]
    pipe.close()
    results[rank] = {"taken": taken, "waits": waits, "saved": saved, "generator": generator.get_state().tolist(),
                     "threads": sorted({e[1] for e in engine.events if e[0] in ("generate", "score")}),
                     "overlapped": engine.overlapped}
    dist.destroy_process_group()


def test_under_torchrun_rank_0_generates_in_the_background_and_every_rank_trains_its_batches(tmp_path):
    """Two gloo ranks, K=1, a server-backed engine: rank 0 generates and scores on the pipeline's thread while the
    update runs collectives on the main thread; each batch reaches both ranks when collected. (Before, a torchrun
    trainer generated inline: step 2 on waited a whole generation, 0.5 s here.)"""
    generation, update = 0.5, 0.6
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_ranks_worker, args=(str(tmp_path / "init"), results, generation, update), nprocs=2)
        leader, other = results[0], results[1]
    assert leader["threads"] == ["rollouts_0"] and other["threads"] == []
    assert leader["taken"] == other["taken"] and len(leader["taken"]) == 4
    assert all(scores == [ground_truth for ground_truth, _ in samples] for samples, scores in leader["taken"])
    assert leader["saved"] == other["saved"] and len(leader["saved"]) == 1  # batch 3, rows found on each rank
    assert leader["generator"] == other["generator"]  # every rank drew the seeds of every generation
    # Batches 2-4 were generated on rank 0 during the previous step's update, each started only once it was under
    # way (GatedEngine); batch 1 had nothing to overlap with.
    assert leader["overlapped"] == [True, True, True] and other["overlapped"] == []
    assert leader["waits"][0] > 0.8 * generation and other["waits"][0] > 0.8 * generation
