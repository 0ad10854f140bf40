"""The ``sglang`` rollout engine: the local engine's interface, served by SGLang over HTTP, with verified syncs.

    generate(rows, n, ...)   one batched /generate per server: token ids, per-token logprobs, finish reasons,
                             and the weight version each token was produced by (checked against the trainer's)
    sync_weights(policy)     push the new weights (disk everywhere; CUDA IPC or NCCL on GPUs), then prove the
                             servers serve them: the reported version, and a logprob probe against the trainer;
                             with rollout.inflight_updates, while a generation runs (``serving.inflight``)

Silently stale weights are the most reported bug of RL stacks with separate rollout servers; here a server that
serves anything but the trainer's current weights stops the run with an error naming it.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megaopd.data.batch import Sample, collate
from megaopd.models.chat import chat_prompt_ids, chat_prompt_ids_batch
from megaopd.config import ModelConfig, RolloutConfig
from megaopd.data.rows import Row
from megaopd.rollout.serving import weight_sync
from megaopd.rollout.serving.inflight import Pauses
from megaopd.rollout.serving.leader import on_leader
from megaopd.rollout.serving.pool import ServerPool, split_evenly
from megaopd.rollout.serving.server import ServerError

log = logging.getLogger(__name__)
PROBE_PROMPT = [{"role": "user", "content": "weight probe: 12 + 34 = ?"}]
PROBE_RESPONSE = "46, because 12 + 34 = 46."


class StaleWeightsError(RuntimeError):
    """A server serves weights other than the trainer's current ones."""


@dataclass
class _Request:
    """One sample's request, over the rounds in-flight updates split it into (each resumes the previous one's)."""

    group: int
    seed: int
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the weight version of each response token
    served: int = 0  # the version of the last answer's server (a response of no tokens has only this one)
    finish: str = ""


class SGLangEngine:
    shares_policy_weights = False  # its own copy: it can generate while the trainer updates (rollout_pipeline)

    def __init__(self, rollout: RolloutConfig, model: ModelConfig, run_dir: str | Path, policy):
        self.cfg = rollout.sglang
        self.tokenizer, self.eos_id = policy.tokenizer, policy.eos_id
        self.weight_version = 0
        # True: a sync lands while a generation runs (it pauses the servers, the generation resumes what it aborted)
        self.updates_in_flight = rollout.inflight_updates
        self.pauses = Pauses()
        self._resumed: list[int] = []  # prompt + partial response lengths prefilled again (take_resumed_prefills)
        self._resumed_lock = threading.Lock()  # appended on the generation thread, taken on the trainer's
        self.sync = weight_sync.for_method(self.cfg.sync)
        self.weights_dir = Path(run_dir) / "rollout_weights"
        self.pool = None  # set on rank 0 only (see leader.py); a failed start stops every rank
        on_leader(lambda: self._start_servers(model, Path(run_dir) / "sglang", self.cfg.urls))
        probe_prompt = chat_prompt_ids(self.tokenizer, PROBE_PROMPT)
        probe_response = self.tokenizer.encode(PROBE_RESPONSE, add_special_tokens=False)
        self.probe = collate([Sample(None, 0, probe_prompt, probe_response, [0.0] * len(probe_response), "stop", 0)],
                             policy.pad_id)
        # Attached servers must serve the trainer's starting weights too (a wrong --model-path is common).
        self.verify(policy, version=0)

    def _start_servers(self, model: ModelConfig, log_dir: Path, urls: list[str]) -> None:
        self.pool = ServerPool.launch_or_attach(model.path, urls, self.cfg, model.dtype, log_dir, "rollout")
        log.info("SGLang rollout servers: %s", ", ".join(self.pool.urls))

    # ---- rollouts ----
    def generate(self, rows: list[Row], samples_per_prompt: int, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 64, generator: torch.Generator | None = None) -> list[Sample]:
        # One seed per sample from the trainer's generator (on every rank, so that their generators stay equal).
        seeds = torch.randint(0, 2**31 - 1, (len(rows) * samples_per_prompt,), generator=generator,
                              device=generator.device if generator is not None else None).tolist()
        return on_leader(lambda: self._generate(rows, samples_per_prompt, temperature, top_p, max_new_tokens, seeds))

    def _generate(self, rows, n, temperature, top_p, max_new_tokens, seeds) -> list[Sample]:
        prompts = chat_prompt_ids_batch(self.tokenizer, [row.prompt for row in rows])
        sampling = {"temperature": temperature, "top_p": top_p, "stop_token_ids": [self.eos_id]}
        requests = [_Request(i // n, seed) for i, seed in enumerate(seeds)]
        pending = requests
        while pending:  # one round, and one more after each in-flight update that aborted some
            with self.pauses.round(self.cfg.request_timeout_s) as settled:
                submitted = self.weight_version
                answers = self._submit(pending, prompts, sampling, max_new_tokens)
            for request, answer in answers:
                self._record(request, answer["meta_info"], answer["output_ids"], submitted)
            pending = [r for r in pending if r.finish == "abort"]
            if pending and not self.pauses.caused(settled):
                raise ServerError(f"SGLang server(s) {', '.join(self.pool.urls)} aborted {len(pending)} rollout "
                                  "request(s) while no weight sync had paused them")
            with self._resumed_lock:  # the weight update flushed their KV cache: resuming prefills them again
                self._resumed += [len(prompts[r.group]) + len(r.response) for r in pending]
        return [Sample(row=rows[r.group], group=r.group, prompt_ids=prompts[r.group], response_ids=r.response,
                       rollout_logprobs=r.logprobs, finish_reason=r.finish,
                       weight_version=r.versions[0] if r.versions else r.served,
                       token_versions=r.versions if len(set(r.versions)) > 1 else None) for r in requests]

    def _submit(self, requests: list[_Request], prompts, sampling: dict, max_new_tokens: int):
        """(request, answer) pairs of one /generate per server. Whole groups per server, so that a group's prompt is
        prefilled once in that server's radix cache. A resumed request goes on from its partial response for the
        tokens it has left, with its own seed: a server with --enable-deterministic-inference draws each token from
        a hash of the seed and the token's position, so the continuation draws the noise the uninterrupted request
        would have (without it SGLang ignores the seed: CPU servers, whose attention it cannot make deterministic)."""
        groups: dict[int, list[_Request]] = {}
        for request in requests:
            groups.setdefault(request.group, []).append(request)
        chunks = [[r for g in part for r in groups[g]] for part in split_evenly(list(groups), len(self.pool.servers))]
        payloads = [{"input_ids": [prompts[r.group] + r.response for r in chunk],
                     "sampling_params": [sampling | {"max_new_tokens": max_new_tokens - len(r.response),
                                                     "sampling_seed": r.seed} for r in chunk],
                     "return_logprob": True} for chunk in chunks]
        answers = [a for chunk_answers in self.pool.map("/generate", payloads) for a in chunk_answers]
        return zip([r for chunk in chunks for r in chunk], answers)

    def _record(self, request: _Request, meta: dict, output_ids: list[int], submitted: int) -> None:
        """Appends one answer's tokens to its request, each stamped with the version the server generated it by:
        the one it reports (a weight update waits for the requests running; a pause aborts them first)."""
        served = meta["weight_version"]
        if served not in {str(v) for v in range(submitted, self.weight_version + 1)}:
            raise StaleWeightsError(f"a rollout server served weight version {served!r} but the trainer is at "
                                    f"{self.weight_version} (servers: {', '.join(self.pool.urls)})")
        request.response += output_ids
        request.logprobs += [lp for lp, _, _ in meta["output_token_logprobs"]]
        request.served = int(served)
        request.versions += [request.served] * len(output_ids)
        request.finish = meta["finish_reason"]["type"]

    def take_resumed_prefills(self) -> list[int]:
        with self._resumed_lock:
            resumed, self._resumed = self._resumed, []
        return resumed

    # ---- weight sync ----
    def sync_weights(self, policy, version: int | None = None) -> None:
        """Push the policy's weights as `version` (default: the next one), then verify every server serves them."""
        version = self.weight_version + 1 if version is None else version
        with self.pauses.pausing() if self.updates_in_flight else nullcontext():
            self._abort_running()
            self._generation_control("/pause_generation", {"mode": "abort"})  # nothing runs until it continues
            self.sync(self, policy, str(version))
            self.weight_version = version
            self._generation_control("/continue_generation", {})  # a paused server would hold the probe's /generate
            self.verify(policy, version)

    def _abort_running(self) -> None:
        """In-flight updates: abort the requests running and wait for their partial answers. SGLang's abort-mode
        pause aborts them too, but then polls for them once a second: longer than a whole step on CPU."""
        if self.updates_in_flight:
            on_leader(self._abort_until_drained)

    def _abort_until_drained(self) -> None:
        deadline = time.monotonic() + self.cfg.request_timeout_s
        while True:  # again every 50 ms: a round's requests may reach a server just after an abort
            self.pool.broadcast("/abort_request", {"abort_all": True})
            if self.pauses.drained(0.05):
                return
            if time.monotonic() > deadline:
                raise ServerError(f"rollout requests aborted for a weight sync did not return within "
                                  f"{self.cfg.request_timeout_s:g} s (servers: {', '.join(self.pool.urls)})")

    def _generation_control(self, path: str, payload: dict) -> None:
        """Pause or continue the servers' generation around an in-flight update (without, a sync waits for it)."""
        if self.updates_in_flight:
            on_leader(lambda: self.pool.broadcast(path, payload))

    def verify(self, policy, version: int) -> None:
        """Every server reports `version` and scores the probe like the trainer does, or the run stops."""
        response = self.probe.response_mask[0].bool()
        trainer = policy.logprobs(self.probe)[0][response]  # collective on a Megatron policy: every rank
        on_leader(lambda: self._verify_servers(trainer, response, version))

    def _verify_servers(self, trainer: torch.Tensor, response: torch.Tensor, version: int) -> None:
        for server in list(self.pool.servers):
            single = ServerPool([server], self.cfg, self.pool.name)
            [scored] = single.prefill_logprobs([self.probe.input_ids[0].tolist()])
            served, served_version = scored["logprobs"], scored["weight_version"]
            if served_version != str(version):
                raise StaleWeightsError(f"SGLang server {server.url} reports weight version {served_version!r}, "
                                        f"expected {version} (a server megaopd attaches to starts with "
                                        "--weight-version 0 on the trainer's model.path)")
            gap = float((torch.tensor(served)[response] - trainer).abs().max())
            if gap > self.cfg.probe_tolerance:
                raise StaleWeightsError(
                    f"SGLang server {server.url} (weight version {served_version!r}) does not serve the trainer's "
                    f"weights: probe logprobs differ by up to {gap:.2e} > rollout.sglang.probe_tolerance="
                    f"{self.cfg.probe_tolerance:g}")
        log.info("weights v%s verified on %d server(s)", version, len(self.pool.servers))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.stop()
            shutil.rmtree(self.weights_dir, ignore_errors=True)
