"""The ``sglang`` rollout engine: the local engine's interface, served by SGLang over HTTP, with verified syncs.

    generate(rows, n, ...)   one batched /generate per server: token ids, per-token logprobs, finish reasons,
                             and the weight version each sample was produced by (checked against the trainer's)
    sync_weights(policy)     push the new weights (disk everywhere; CUDA IPC or NCCL on GPUs), then prove the
                             servers serve them: the reported version, and a logprob probe against the trainer

Silently stale weights are the most reported bug of RL stacks with separate rollout servers; here a server that
serves anything but the trainer's current weights stops the run with an error naming it.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from megaopd.data.batch import Sample, collate
from megaopd.models.chat import chat_prompt_ids, chat_prompt_ids_batch
from megaopd.config import ModelConfig, RolloutConfig
from megaopd.data.rows import Row
from megaopd.rollout.serving import weight_sync
from megaopd.rollout.serving.leader import on_leader
from megaopd.rollout.serving.pool import ServerPool, split_evenly
from megaopd.rollout.serving.server import ServerError

log = logging.getLogger(__name__)
PROBE_PROMPT = [{"role": "user", "content": "weight probe: 12 + 34 = ?"}]
PROBE_RESPONSE = "46, because 12 + 34 = 46."


class StaleWeightsError(RuntimeError):
    """A server serves weights other than the trainer's current ones."""


class SGLangEngine:
    shares_policy_weights = False  # its own copy: it can generate while the trainer updates (rollout_pipeline)

    def __init__(self, rollout: RolloutConfig, model: ModelConfig, run_dir: str | Path, policy):
        self.cfg = rollout.sglang
        self.tokenizer, self.eos_id = policy.tokenizer, policy.eos_id
        self.weight_version = 0
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
        sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                    "stop_token_ids": [self.eos_id]}
        # Whole groups per server, so that a group's prompt is prefilled once in that server's radix cache.
        chunks = split_evenly(list(range(len(rows))), len(self.pool.servers))
        payloads = [{"input_ids": [prompts[g] for g in chunk for _ in range(n)],
                     "sampling_params": [sampling | {"sampling_seed": seeds[g * n + k]} for g in chunk
                                         for k in range(n)],
                     "return_logprob": True} for chunk in chunks]
        answers = [a for chunk_answers in self.pool.map("/generate", payloads) for a in chunk_answers]

        samples = []
        for i, answer in enumerate(answers):
            meta = answer["meta_info"]
            served = meta["weight_version"]
            if served != str(self.weight_version):
                raise StaleWeightsError(f"a rollout server served weight version {served!r} but the trainer is at "
                                        f"{self.weight_version} (servers: {', '.join(self.pool.urls)})")
            finish = meta["finish_reason"]["type"]
            if finish == "abort":
                raise ServerError(f"SGLang aborted a rollout request: {meta['finish_reason']}")
            samples.append(Sample(
                row=rows[i // n], group=i // n, prompt_ids=prompts[i // n], response_ids=list(answer["output_ids"]),
                rollout_logprobs=[lp for lp, _, _ in meta["output_token_logprobs"]], finish_reason=finish,
                weight_version=self.weight_version))
        return samples

    # ---- weight sync ----
    def sync_weights(self, policy, version: int | None = None) -> None:
        """Push the policy's weights as `version` (default: the next one), then verify every server serves them."""
        version = self.weight_version + 1 if version is None else version
        self.sync(self, policy, str(version))
        self.weight_version = version
        self.verify(policy, version)

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
