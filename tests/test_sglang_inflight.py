"""In-flight weight updates on a real SGLang 0.5.23 CPU server (issue 56): a sync aborts the requests running, and
the generation resumes each from its partial response under the new weights (megaopd.rollout.serving.inflight).

The server is slowed (/slow_down) so that a sync lands while the requests run. Each property has a negative
control: the same check with the fix taken away, which must fail. The server and its helpers are tests/test_sglang.py's.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from megaopd.accounting import flops
from megaopd.accounting.metrics import read_metrics
from megaopd.config import TrainConfig
from megaopd.data.batch import collate
from megaopd.models.hf_policy import HFPolicy
from megaopd.objectives.losses import is_correction
from megaopd.rollout.serving.engine import SGLangEngine
from megaopd.rollout.serving.server import ServerError
from megaopd.run.trainer import Trainer
from test_sglang import TOLERANCE, attached, fresh, rows  # noqa: F401 (fixtures)

pytestmark = pytest.mark.sglang
TOKENS = 16
SLOW_S = 0.15  # per forward pass: a generation of TOKENS tokens takes ~2.5 s, and a sync lands in it


@contextmanager
def slowed(sglang, seconds: float = SLOW_S):
    sglang.post("/slow_down", {"forward_sleep_time": seconds}, 60)
    try:
        yield
    finally:
        sglang.post("/slow_down", {"forward_sleep_time": None}, 60)


class Recorded:
    """An engine's rounds of requests (one per generation, plus one per resubmission), the tokens the server says
    it generated (completion_tokens, summed over every answer), and its broadcasts (pause, continue, updates)."""

    def __init__(self, engine: SGLangEngine):
        self.generations = self.rounds = self.generated = 0
        self.broadcasts = []
        self.resumed = []  # prompt + partial response length of each request resubmitted
        generate, submit, record, broadcast = engine._generate, engine._submit, engine._record, engine.pool.broadcast

        def generating(*args):
            self.generations += 1
            return generate(*args)

        def submitting(requests, prompts, *args):
            self.rounds += 1
            self.resumed += [len(prompts[r.group]) + len(r.response) for r in requests if r.response]
            return submit(requests, prompts, *args)

        def recording(request, meta, *args):
            self.generated += meta["completion_tokens"]
            return record(request, meta, *args)
        engine._generate, engine._submit, engine._record = generating, submitting, recording
        engine.pool.broadcast = lambda path, payload: self.broadcasts.append(path) or broadcast(path, payload)

    @property
    def resubmissions(self) -> int:
        return self.rounds - self.generations


def inflight_engine(sglang, assets, tmp_path, inflight: bool = True):
    cfg = attached(assets, tmp_path, sglang, **{"rollout.max_staleness": 1, "rollout.inflight_updates": inflight})
    policy = HFPolicy(cfg.model, cfg.optim)
    return SGLangEngine(cfg.rollout, cfg.model, cfg.run_dir, policy), policy


def generate(engine, assets, temperature: float = 1.0):
    return engine.generate(rows(assets, 2), 2, temperature, max_new_tokens=TOKENS,
                           generator=torch.Generator().manual_seed(0))


def generate_across_syncs(engine, policy, assets, syncs: int = 1, during_sync=None, temperature: float = 1.0):
    """The samples of one generation during which `syncs` weight syncs land (each `during_sync()` called while its
    sync has the servers paused), and what it raised."""
    result = {}

    def run():
        try:
            result["samples"] = generate(engine, assets, temperature)
        except Exception as error:
            result["error"] = error
    thread = threading.Thread(target=run)
    thread.start()
    sync = engine.sync
    if during_sync:
        engine.sync = lambda *args: (during_sync(), sync(*args))
    for _ in range(syncs):
        time.sleep(0.8)
        assert thread.is_alive(), "the generation ended before the sync: the checks below would check nothing"
        engine.sync_weights(policy)
    engine.sync = sync
    thread.join(120)
    assert not thread.is_alive()
    return result.get("samples"), result.get("error")


def check_every_token_kept(samples, reference, policy, recorded: Recorded, syncs: int) -> None:
    """Property (a), greedy and with unchanged weights: the responses the syncs split are the uninterrupted ones
    token by token, each with the finish reason of its end (EOS or the token limit) and its tokens' logprobs the
    trainer's; every token the server generated, summed over the rounds, is in a response (none thrown away)."""
    assert [s.response_ids for s in samples] == [s.response_ids for s in reference]
    assert all(s.finish_reason == ("stop" if s.response_ids[-1] == policy.eos_id else "length") for s in samples)
    assert all(len(s.response_ids) == TOKENS for s in samples if s.finish_reason == "length")
    batch = collate(samples, policy.pad_id)
    assert ((policy.logprobs(batch) - batch.rollout_logprobs).abs() * batch.response_mask).max() < TOLERANCE
    assert recorded.generated == sum(len(s.response_ids) for s in samples)
    spanning = [s for s in samples if s.token_versions]
    assert spanning and all(s.versions() == sorted(s.versions()) for s in spanning)  # the syncs landed inside
    assert max(v for s in samples for v in s.versions()) == syncs


@pytest.mark.parametrize("syncs", [1, 2])
def test_no_aborted_token_is_lost_or_taken_for_a_stop(fresh, assets, tmp_path, syncs):
    engine, policy = inflight_engine(fresh, assets, tmp_path)
    with slowed(fresh):
        reference = generate(engine, assets, temperature=0)
        recorded = Recorded(engine)
        samples, error = generate_across_syncs(engine, policy, assets, syncs, temperature=0)
    assert error is None
    assert recorded.generations == 1 and recorded.resubmissions == syncs  # resubmitted after each sync
    assert recorded.broadcasts.count("/pause_generation") == syncs
    check_every_token_kept(samples, reference, policy, recorded, syncs)


@pytest.mark.parametrize("broken", ["restarted", "stopped"])
def test_without_the_resume_aborted_tokens_are_lost_or_stop(fresh, assets, tmp_path, monkeypatch, broken):
    """Negative control of the test above: an aborted request restarted from its prompt (its tokens thrown away,
    miles #2589) or taken as a normal stop fails its check."""
    record = SGLangEngine._record

    def broken_record(self, request, meta, output_ids, submitted):
        record(self, request, meta, output_ids, submitted)
        if request.finish == "abort" and broken == "restarted":
            request.response, request.logprobs, request.versions = [], [], []
        elif request.finish == "abort":
            request.finish = "stop"
    monkeypatch.setattr(SGLangEngine, "_record", broken_record)
    engine, policy = inflight_engine(fresh, assets, tmp_path)
    with slowed(fresh):
        reference = generate(engine, assets, temperature=0)
        recorded = Recorded(engine)
        samples, error = generate_across_syncs(engine, policy, assets, temperature=0)
    assert error is None
    with pytest.raises(AssertionError):
        check_every_token_kept(samples, reference, policy, recorded, 1)


def spanning_a_real_update(fresh, assets, tmp_path, monkeypatch=None):
    """One generation across a sync of changed weights: its samples, their batch, and the sampled tokens'
    teacher-forced logprobs under the old and the new weights."""
    engine, policy = inflight_engine(fresh, assets, tmp_path)
    old = {name: p.detach().clone() for name, p in policy.model.named_parameters()}
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    with slowed(fresh):
        samples, error = generate_across_syncs(engine, policy, assets)
    assert error is None
    batch = collate(samples, policy.pad_id)
    new_logprobs = policy.logprobs(batch)
    policy.model.load_state_dict(old, strict=False)
    return samples, batch, policy.logprobs(batch), new_logprobs


def check_versions_and_weights(samples, batch, old, new) -> None:
    """Property (b): each token's rollout logprob is the one of the version it is stamped with, so the IS weights
    p_new / p_rollout at the new weights are 1 on the new version's tokens and p_new / p_old on the old's."""
    response = batch.response_mask.bool()
    assert batch.token_versions[response].tolist() == [v for s in samples for v in s.versions()]
    first, later = response & (batch.token_versions == 0), response & (batch.token_versions == 1)
    assert first.any() and later.any()
    weights = is_correction(new, batch.rollout_logprobs, batch.response_mask,
                            TrainConfig(tis="token", tis_cap=1e9)).weights
    assert (batch.rollout_logprobs[first] - old[first]).abs().max() < TOLERANCE
    assert (batch.rollout_logprobs[later] - new[later]).abs().max() < TOLERANCE
    assert torch.allclose(weights[first], (new - old).exp()[first], rtol=1e-3)
    assert (weights[first] - 1).abs().max() > 0.05  # the update moved them: the weights see which version sampled
    assert (weights[later] - 1).abs().max() < 1e-3


def test_a_response_spanning_an_update_carries_both_versions_and_its_weights_use_them(fresh, assets, tmp_path):
    check_versions_and_weights(*spanning_a_real_update(fresh, assets, tmp_path))


def test_with_one_version_per_sample_the_check_fails(fresh, assets, tmp_path, monkeypatch):
    """Negative control of the test above: every token stamped with the version its response began with (what the
    engine did before in-flight updates): the new version's tokens pass for the old's."""
    record = SGLangEngine._record

    def one_version(self, request, meta, output_ids, submitted):
        record(self, request, meta, output_ids, submitted)
        request.versions = [request.versions[0]] * len(request.versions)
    monkeypatch.setattr(SGLangEngine, "_record", one_version)
    with pytest.raises(AssertionError):
        check_versions_and_weights(*spanning_a_real_update(fresh, assets, tmp_path))


def aborts_during_the_pause(sglang):
    """A second pause and an abort of every request, while the sync has the server paused (prime-rl #2841)."""
    sglang.post("/pause_generation", {"mode": "abort"}, 60)
    abort_every_request(sglang)


def abort_every_request(sglang):
    sglang._send("/abort_request", b'{"abort_all": true}', 60)  # its answer is empty, not JSON


def test_an_abort_during_the_pause_does_not_crash_the_engine(fresh, assets, tmp_path):
    engine, policy = inflight_engine(fresh, assets, tmp_path)
    with slowed(fresh):
        reference = generate(engine, assets, temperature=0)
        recorded = Recorded(engine)
        samples, error = generate_across_syncs(engine, policy, assets, during_sync=lambda: aborts_during_the_pause(
            fresh), temperature=0)
    assert error is None
    check_every_token_kept(samples, reference, policy, recorded, 1)
    assert fresh.healthy() and generate(engine, assets)  # and the server still serves


def test_an_abort_no_sync_caused_is_an_error_naming_the_server(fresh, assets, tmp_path):
    """Negative control of the test above (an abort reaches the generation's requests), and the rule: an abort
    megaopd did not pause for is an error naming the server, never a normal stop."""
    engine, policy = inflight_engine(fresh, assets, tmp_path, inflight=False)
    with slowed(fresh):
        samples, error = generate_across_syncs(engine, policy, assets, during_sync=lambda: abort_every_request(fresh))
    assert samples is None and isinstance(error, ServerError)
    assert f"SGLang server(s) {fresh.url} aborted" in str(error) and "no weight sync had paused them" in str(error)


@pytest.mark.parametrize("inflight", [False, True])
def test_only_inflight_updates_resubmit(fresh, assets, tmp_path, inflight):
    """Property (d), in the trainer at rollout.max_staleness=1: with in-flight updates off, no request is
    resubmitted and no sync pauses a server (the sync waits for the generation); on (its negative control), the
    syncs land in the batches generated ahead: resubmissions, and a batch trained with tokens of two versions."""
    cfg = attached(assets, tmp_path / "run", fresh, **{"train.steps": 3, "eval.every": 3, "rollout.max_staleness": 1,
                                                        "rollout.inflight_updates": inflight})
    trainer = Trainer(cfg)
    recorded = Recorded(trainer.engine)
    with slowed(fresh):
        trainer.fit()
    steps = [m for m in read_metrics(tmp_path / "run") if "rollout/staleness_max" in m]
    if inflight:
        assert recorded.resubmissions > 0 and recorded.broadcasts.count("/pause_generation") == 3
        assert any(0 < m["rollout/staleness_mean"] < 1 for m in steps)
        # The resumed requests' prefills are billed as hardware work, each whole
        resumed = sum(flops.prefill_flops(trainer.policy.shape, n) for n in recorded.resumed)
        assert resumed > 0 and sum(m["perf/resume_prefill_flops"] for m in steps) == resumed
    else:
        assert recorded.resubmissions == 0 and "/pause_generation" not in recorded.broadcasts
        assert [m["rollout/staleness_mean"] for m in steps] == [0, 1, 1]
        assert recorded.resumed == [] and all(m["perf/resume_prefill_flops"] == 0 for m in steps)
    assert fresh.get("/model_info")["weight_version"] == "3"


# A checkpoint that does not wait for the generation in flight (the negative control of the kill -9 test)
NOT_WAITING = """
from megaopd.rollout.pipeline import RolloutPipeline
state_dict = RolloutPipeline.state_dict

def not_waiting(self):
    in_flight, self._in_flight = self._in_flight, None
    try:
        return state_dict(self)
    finally:
        self._in_flight = in_flight
RolloutPipeline.state_dict = not_waiting
"""


def killed_mid_generation(fresh, assets, tmp_path, patch: str = ""):
    """A 4-step run at K=1 with in-flight updates, its CLI killed (kill -9) once its step-2 checkpoint is written and
    step 3's sync has interrupted batch 4; the server left on the base weights at version 0, as a requeued job's
    fresh servers. `patch`: Python run in the trainer's process before the CLI. Returns the config, the checkpoint."""
    from megaopd.config import save_config
    from test_sglang import reset

    cfg = attached(assets, tmp_path / "run", fresh, **{"train.steps": 4, "eval.every": 4, "checkpoint.every": 2,
                                                        "rollout.max_staleness": 1, "rollout.inflight_updates": True})
    save_config(cfg, tmp_path / "run.yaml")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_0000002" / "state.pt"
    command = [sys.executable, "-c", f"{patch}\nimport sys\nfrom megaopd.cli import main\n"
                                     f"sys.exit(main(['train', {str(tmp_path / 'run.yaml')!r}]))"]
    with slowed(fresh, 0.3):
        run = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while not (checkpoint.exists() and fresh.get("/model_info")["weight_version"] == "3"):
            assert run.poll() is None and time.time() < deadline, "the run ended before batch 4 was interrupted"
            time.sleep(0.05)
        run.send_signal(signal.SIGKILL)
        run.wait()
    fresh.post("/continue_generation", {}, 60)  # in case the kill came between a sync's pause and its continue
    reset(fresh, assets)
    return cfg, checkpoint


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill_9_mid_generation_resumes_with_the_checkpointed_versions_and_ledger(fresh, assets, tmp_path):
    """Property (e): a checkpoint collects the generation in flight first, so it holds batch 3 whole, its tokens of
    versions 1 and 2 (step 2's sync landed in it), and its ledger bills every one of them (a batch generated across
    a sync is billed where it is collected: here the checkpoint). kill -9 once step 3's sync has interrupted batch
    4 (partial responses held in memory only), then the run resumes on fresh servers (the base weights at version
    0, as a requeued job's launched ones): it trains batch 3 with the checkpointed versions, from the checkpointed
    ledger (batch 3 neither billed again nor lost)."""
    from megaopd.models.checkpoint import load_state

    cfg, checkpoint = killed_mid_generation(fresh, assets, tmp_path)
    [ahead] = load_state(checkpoint)["rollouts"]
    versions = [v for s in ahead["samples"] for v in s["token_versions"] or [s["weight_version"]] * len(
        s["response_ids"])]
    assert set(versions) == {1, 2}
    trainer = Trainer(cfg)
    with slowed(fresh, 0.3):
        trainer.fit()
    steps = [m for m in read_metrics(tmp_path / "run") if "rollout/staleness_max" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert steps[2]["rollout/staleness_mean"] == pytest.approx(sum(2 - v for v in versions) / len(versions))
    n = cfg.rollout.samples_per_prompt
    batch_3 = trainer.method.step_flops(cfg.train, cfg.rollout, cfg.grpo, trainer.policy.shape, None,
                                        [len(ahead["samples"][i * n]["prompt_ids"]) for i in range(len(ahead["rows"]))],
                                        [len(s["response_ids"]) for s in ahead["samples"]])["rollout"]
    saved = load_state(checkpoint)["ledger"]["own"]["rollout"]
    assert saved - steps[1]["flops/rollout"] == pytest.approx(batch_3)  # billed at the checkpoint, every token
    assert steps[2]["flops/rollout"] == saved  # step 3 collects nothing: batch 4 is collected by step 4
    assert fresh.get("/model_info")["weight_version"] == "4"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_checkpoint_that_does_not_wait_loses_the_batch_in_flight(fresh, assets, tmp_path):
    """Negative control of the test above: a checkpoint that does not collect the generation in flight holds no
    batch 3, whose prompts the sampler had drawn: the resumed run would never train them."""
    from megaopd.models.checkpoint import load_state

    _, checkpoint = killed_mid_generation(fresh, assets, tmp_path, NOT_WAITING)
    assert load_state(checkpoint)["rollouts"] == []
