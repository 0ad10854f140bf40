"""In-flight weight updates (issue 56): per-token weight versions through the local engine and the rollout pipeline,
and the staleness bound counted per token when a batch trains. Each property has a negative control: the same check
with the fix taken away, which must fail (tests/test_stale_opd.py: OPD's correction on stale samples)."""

import pytest
import torch

from megaopd.config import ConfigError, ModelConfig, TrainConfig, load_config
from megaopd.data.batch import Sample, collate
from megaopd.data.rows import Row, load_rows
from megaopd.models.hf_policy import HFPolicy
from megaopd.objectives.losses import is_correction
from megaopd.rollout import pipeline as pipeline_module
from megaopd.rollout.decode import FusedDecoder
from megaopd.rollout.local import LocalEngine, resume, run_to_end
from megaopd.rollout.pipeline import RolloutPipeline
from megaopd.rollout.serving.inflight import Pauses
from megaopd.rollout.serving.server import ServerError
from megaopd.rollout.staleness import StaleRollouts, fresh_tokens, masked_loss
from megaopd.data.sampler import PromptSampler
from conftest import run_config

CHUNK = 4  # decode steps between the pauses where an update may land


# ---- a response spanning an update (the local engine) ----
def span_an_update(assets, monkeypatch=None):
    """Two prompts x 2 samples of 12 tokens, paused after the first CHUNK decode steps while a weight update lands
    (the last layer's MLP gate moved: the KV cache, which that layer's MLP never feeds, is the same under both versions,
    so every token's logprob is exactly its version's teacher-forced one). Returns the samples, their batch, and the
    teacher-forced logprobs of the sampled tokens under the old and the new weights. `monkeypatch`: the negative
    control's, which makes ``FusedDecoder.pack`` a no-op at the update."""
    policy = HFPolicy(ModelConfig(path=str(assets / "models" / "qwen3-tiny")))
    engine = LocalEngine(policy)
    assert FusedDecoder.supports(policy.model)  # the path whose packed weights an update leaves behind
    rows = load_rows(assets / "data" / "arith_add" / "train.jsonl")[0][:2]
    generation = engine.generation(rows, 2, 1.0, 1.0, 12, torch.Generator().manual_seed(0), chunk=CHUNK)
    assert resume(generation) is None  # paused after the first chunk
    if monkeypatch is not None:
        monkeypatch.setattr(FusedDecoder, "pack", lambda self, model: None)
    gate = policy.model.model.layers[-1].mlp.gate_proj.weight  # packed into the decoder's w_gate_up
    old = gate.detach().clone()
    with torch.no_grad():
        gate.add_(torch.randn(gate.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    engine.sync_weights(policy)  # version 1
    samples = run_to_end(generation)
    batch = collate(samples, policy.pad_id)
    new_logprobs = policy.logprobs(batch)
    with torch.no_grad():
        gate.copy_(old)
    return samples, batch, policy.logprobs(batch), new_logprobs


def test_a_response_spanning_an_update_carries_both_versions_and_its_weights_use_them(assets):
    """Every response's first CHUNK tokens are version 0's, the rest version 1's, token by token (Sample, then the
    batch); each token's rollout logprob is its own version's, so the IS weights p_trainer / p_rollout at the new
    weights are 1 on the new version's tokens and p_new / p_old on the old version's. Negative control:
    ``test_without_the_repack_the_later_tokens_are_not_the_new_versions`` (the decoder's packed weights not
    refreshed at the update) breaks the second property."""
    samples, batch, old, new = span_an_update(assets)
    for s in samples:
        assert len(s.response_ids) > CHUNK  # no EOS this early: every response spans the update
        assert s.versions() == [0] * CHUNK + [1] * (len(s.response_ids) - CHUNK) and s.weight_version == 0
    response = batch.response_mask.bool()
    assert batch.token_versions[response].tolist() == [v for s in samples for v in s.versions()]
    weights = is_correction(new, batch.rollout_logprobs, batch.response_mask,
                            TrainConfig(tis="token", tis_cap=1e9)).weights
    first = response & (batch.token_versions == 0)
    later = response & (batch.token_versions == 1)
    assert torch.allclose(batch.rollout_logprobs[first], old[first], atol=1e-5)
    assert torch.allclose(weights[first], (new - old).exp()[first], rtol=1e-4)
    assert (weights[first] - 1).abs().max() > 0.05  # the update moved them: the weights see which version sampled
    assert torch.allclose(weights[later], torch.ones(int(later.sum())), atol=1e-4)


def test_without_the_repack_the_later_tokens_are_not_the_new_versions(assets, monkeypatch):
    """Negative control of the test above: with ``FusedDecoder.pack`` a no-op at the update, the tokens stamped
    version 1 were decoded by the old MLP, and their IS weights are not 1."""
    samples, batch, old, new = span_an_update(assets, monkeypatch)
    later = batch.response_mask.bool() & (batch.token_versions == 1)
    weights = is_correction(new, batch.rollout_logprobs, batch.response_mask, TrainConfig(tis="token", tis_cap=1e9))
    assert (weights.weights[later] - 1).abs().max() > 0.05


# ---- the in-flight pipeline and the bound at training time ----
class PausingEngine:
    """Shares the trainer's weights; each response is 3 chunks of 2 tokens, each stamped with the version current
    when its chunk is decoded, paused between chunks (as ``LocalEngine.generation``)."""

    shares_policy_weights = True

    def __init__(self):
        self.weight_version = 0

    def generation(self, rows):
        versions = []
        for chunk in range(3):
            if chunk:
                yield
            versions += [self.weight_version] * 2
        return [Sample(row, i, [1], [2] * 6, [0.0] * 6, "length", versions[0], token_versions=versions)
                for i, row in enumerate(rows)]

    def generate(self, rows):
        return run_to_end(self.generation(rows))

    def sync_weights(self, policy) -> None:
        self.weight_version += 1


def rows():
    return [Row("src", [{"role": "user", "content": str(i)}], i) for i in range(7)]


def pausing_pipeline(engine, k, steps, stale_tokens="refuse", inflight=True):
    return RolloutPipeline(engine, PromptSampler(rows(), 2, seed=0), engine.generate, k, steps,
                           generation=engine.generation if inflight else None, stale_tokens=stale_tokens)


def test_inflight_batches_span_updates_within_the_bound():
    """At K=2 the batches generated ahead advance a chunk per step and the updates land between chunks: a batch
    trained at step k >= 3 carries versions k-3, k-2, k-1 (staleness 2, 1, 0 at training time); a checkpoint runs
    the paused generations to their end, and they come back in step order."""
    engine = PausingEngine()
    pipe = pausing_pipeline(engine, 2, 6)
    seen = []
    for step in range(1, 5):
        batch = pipe.take(step)
        seen.append(batch.samples[0].versions())
        pipe.sync_weights(None)
        metrics, _ = pipe.step_end()
    assert seen == [[0] * 6, [0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 2, 2], [1, 1, 2, 2, 3, 3]]
    assert metrics["rollout/staleness_max"] == 2 and metrics["rollout/staleness_mean"] == 1
    state = pipe.state_dict()
    assert [b["samples"][0]["token_versions"] for b in state] == [[2, 2, 3, 3, 4, 4], [3, 3, 4, 4, 4, 4]]
    assert [len(b.samples) for b in pipe.drain_generated()] == [2, 2]  # billed by the trainer at the checkpoint


def queued_batch(stale_tokens, inflight=False):
    """K=1: batch 2 is generated in step 1 by version 0 (in-flight: its first chunk only), then waits while the
    trainer moves two versions on (a queue, e.g. a slow step): at training time its version-0 tokens are 2 old,
    though none was behind the weights that generated it."""
    engine = PausingEngine()
    pipe = pausing_pipeline(engine, 1, 4, stale_tokens, inflight)
    pipe.take(1)
    pipe.sync_weights(None)
    pipe.step_end()
    engine.sync_weights(None)  # a version the batch waited through
    return pipe, engine


def test_the_bound_is_counted_per_token_when_the_batch_trains():
    """refuse stops at the stale tokens; mask trains the batch with the version-0 tokens' loss zeroed and logs
    their share. Negative control: ``test_a_bound_counted_at_generation_time_misses_the_queue``."""
    pipe, engine = queued_batch("refuse")
    with pytest.raises(StaleRollouts, match=r"step 2: 12 of 12 response tokens are up to 2 weight versions old .*"
                                            r"rollout\.max_staleness=1; set rollout\.stale_tokens=mask"):
        pipe.take(2)
    pipe, engine = queued_batch("mask", inflight=True)
    batch = pipe.take(2)
    assert [s.versions() for s in batch.samples] == [[0, 0, 2, 2, 2, 2]] * 2
    metrics, _ = pipe.step_end()
    assert metrics["rollout/staleness_masked_share"] == pytest.approx(1 / 3)
    assert metrics["rollout/staleness_max"] == 2
    tokens = collate(batch.samples, 0)
    tokens.fresh_mask = fresh_tokens(tokens, engine.weight_version, 1)
    loss = masked_loss(lambda logp, vocab, mb: (torch.ones_like(mb.response_mask), {}))(None, None, tokens)[0]
    assert loss[tokens.response_mask.bool()].tolist() == [0, 0, 1, 1, 1, 1] * 2


def test_a_bound_counted_at_generation_time_misses_the_queue(monkeypatch):
    """Negative control of the test above: counted against the version that ended each response's generation
    (the queue ignored), the stale tokens pass unrefused."""
    monkeypatch.setattr(pipeline_module, "token_staleness",
                        lambda samples, version: [max(s.versions()) - v for s in samples for v in s.versions()])
    pipe, _ = queued_batch("refuse")
    assert pipe.take(2).samples[0].versions() == [0] * 6  # 2 versions old when it trains, and not refused


def test_sglang_resubmits_only_after_its_sync_verified_the_weights():
    """What a generation on SGLang servers sees of the syncs (serving.inflight.Pauses; the real-server tests are
    tests/test_sglang_inflight.py): an abort with no sync since its round was submitted is not one of megaopd's; a
    sync waits for a round's answers; a round waits while a sync runs; after a failed sync (its probe found other
    weights) nothing is resubmitted."""
    pauses = Pauses()
    with pauses.round(1) as settled:
        assert not pauses.drained(0.01)  # a sync waits for the round's answers
    assert pauses.drained(0) and not pauses.caused(settled)
    with pytest.raises(RuntimeError, match="the probe"):
        with pauses.pausing():
            assert pauses.caused(settled)
            with pytest.raises(ServerError, match="did not end within 0.1 s"), pauses.round(0.1):
                pass
            raise RuntimeError("the probe found other weights")
    with pytest.raises(ServerError, match="the weight sync that paused this generation failed"), pauses.round(1):
        pass
    with pauses.pausing():
        pass
    with pauses.round(1) as settled:
        assert settled == 2


@pytest.mark.parametrize("overrides,message", [
    (["rollout.inflight_updates=true"], r"rollout\.max_staleness=0 generates none: set rollout\.max_staleness=1"),
    (["rollout.inflight_updates=true", "rollout.max_staleness=1", "rollout.partial_rollouts=requeue"],
     r"^rollout\.partial_rollouts=requeue would train a GRPO group split across batches \(cut "
     r"responses continued in a later one\): use rollout\.partial_rollouts=continue$"),
    (["rollout.inflight_chunk=0"], r"^rollout\.inflight_chunk must be >= 1"),
])
def test_inflight_settings_that_cannot_run_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.timeout(300)
def test_the_trainer_runs_inflight_updates_and_checkpoints_the_versions(assets, tmp_path):
    """The embedded GRPO config at K=2 with in-flight updates every 3 decode steps: step k's batch was started by
    version k-3 (from step 3 on) and finished by k-1, so its staleness at training time reaches K and averages
    below it (one response, several versions); a checkpoint holds the batches ahead with their tokens' versions."""
    from megaopd.accounting.metrics import read_metrics
    from megaopd.models.checkpoint import load_state
    from megaopd.run.trainer import train

    train(run_config(assets, tmp_path / "run", "grpo", **{"rollout.max_staleness": 2, "rollout.inflight_updates": True,
                                                          "rollout.inflight_chunk": 3}))
    steps = [m for m in read_metrics(tmp_path / "run") if "rollout/staleness_max" in m]
    assert [m["rollout/staleness_max"] for m in steps] == [0, 1, 2, 2]
    assert all(0 < m["rollout/staleness_mean"] < m["rollout/staleness_max"] for m in steps[1:])
    assert all(m["rollout/staleness_masked_share"] == 0 for m in steps)
    ahead = load_state(tmp_path / "run" / "checkpoints" / "step_0000002" / "state.pt")["rollouts"]
    assert [{v for s in b["samples"] for v in s["token_versions"] or [s["weight_version"]]} for b in ahead] == \
        [{0, 1, 2}, {1, 2}]


# ---- the ledger at a stage's end ----
def generated_and_billed(assets, tmp_path, **overrides) -> tuple[int, int, float, float, dict]:
    """The embedded GRPO config at K=2 (20-step cap) trained with every rollout generation counted: returns how many
    generations started and ran to their end, the rollout FLOPs of every token those generated (the ledger's own
    formula, ``Method.step_flops``), the ledger's rollout FLOPs, and the summary."""
    from conftest import validation
    from megaopd.run.trainer import Trainer

    cfg = run_config(assets, tmp_path / "run", "grpo", **validation(assets), **{
        "train.steps": 20, "eval.every": 2, "checkpoint.every": 100, "rollout.max_staleness": 2,
        "rollout.inflight_chunk": 3} | overrides)
    trainer = Trainer(cfg)
    pipe, started, ended = trainer.rollouts, [], []
    generation, generate = pipe.generation, pipe.generate

    def end(rows, samples):
        ended.append((rows, samples))
        return samples

    def counted(rows):
        started.append(rows)
        return end(rows, (yield from generation(rows)))
    pipe.generate = lambda rows: started.append(rows) or end(rows, generate(rows))
    pipe.generation = counted if generation else None
    summary = trainer.fit()
    n = cfg.rollout.samples_per_prompt
    generated = sum(trainer.method.step_flops(cfg.train, cfg.rollout, cfg.grpo, trainer.policy.shape, None,
                                              [len(samples[i * n].prompt_ids) for i in range(len(rows))],
                                              [len(s.response_ids) for s in samples])["rollout"]
                    for rows, samples in ended)
    return len(started), len(ended), generated, summary["ledger"]["own"]["rollout"], summary


# overrides, and the reason the stage ends at step 4
STOPS = {"plateau": ({"train.stop.rule": "plateau", "train.stop.metric": "arith_add", "train.stop.window": 2,
                      "train.stop.min_delta": 1.0}, "plateau"),  # no eval can improve by a whole accuracy
         "cap": ({"train.steps": 4}, "max_steps")}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stop,inflight", [("plateau", True), ("plateau", False), ("cap", True)])
def test_a_stage_bills_every_token_it_generated(assets, tmp_path, stop, inflight):
    """At a plateau stop the batches generated ahead (up to K, partly generated with in-flight updates) were never
    trained: the stop's checkpoint runs the paused generations to their end and bills them, so every generation
    started has ended and the ledger's rollout FLOPs are those of every token generated. At the cap nothing is
    generated ahead. Negative control: ``test_a_stop_without_its_checkpoint_leaves_generations_unbilled``."""
    overrides, reason = STOPS[stop]
    started, ended, generated, billed, summary = generated_and_billed(
        assets, tmp_path, **overrides, **{"rollout.inflight_updates": inflight})
    assert summary["steps"] == 4 and summary["stop"]["reason"] == reason
    assert started == ended == (6 if stop == "plateau" else 4)  # K = 2 batches generated past the stop
    assert billed == generated > 0


def test_a_stop_without_its_checkpoint_leaves_generations_unbilled(assets, tmp_path, monkeypatch):
    """Negative control of the test above: without the checkpoint a stop forces, the two in-flight generations ahead
    are dropped part-generated, their tokens in no ledger."""
    from megaopd.models.checkpoint import Checkpointer

    monkeypatch.setattr(Checkpointer, "maybe_save", lambda self, step, state, force=False: False)
    started, ended, generated, billed, _ = generated_and_billed(
        assets, tmp_path, **STOPS["plateau"][0], **{"rollout.inflight_updates": True})
    assert (started, ended) == (6, 4) and billed == generated
