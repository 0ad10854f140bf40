"""A frozen teacher served by SGLang: the realised tokens' logprobs by prefill (``max_new_tokens: 0``).

Only the sampled-token OPD form can use it: a server returns the logprob of each given token (and at most a top-k),
never the full distribution the full-vocabulary form needs. Its ``shape`` (for the FLOP ledger) and tokenizer come
from the HF directory, without loading the weights into the trainer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megaopd.batch import TokenBatch
from megaopd.config import RunConfig
from megaopd.flops import ModelShape
from megaopd.serving.leader import on_leader
from megaopd.serving.pool import ServerPool


class SGLangTeacher:
    def __init__(self, path: str, urls: list[str], cfg: RunConfig, name: str):
        from transformers import AutoConfig, AutoTokenizer

        self.path = path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(path))
        self.pool = None  # set on rank 0 only (see leader.py); a failed start stops every rank
        on_leader(lambda: self._start_servers(urls, cfg, name))

    def _start_servers(self, urls: list[str], cfg: RunConfig, name: str) -> None:
        self.pool = ServerPool.launch_or_attach(self.path, urls, cfg.rollout.sglang, cfg.model.dtype,
                                                Path(cfg.run_dir) / "sglang", name)

    def logprobs(self, batch: TokenBatch, micro_batch_size: int = 64) -> torch.Tensor:
        """Per-token logprob of each realised token, [B, S-1], masked to the response (as HFPolicy.logprobs)."""
        lengths = batch.attention_mask.sum(-1).tolist()
        sequences = [batch.input_ids[i, :n].tolist() for i, n in enumerate(lengths)]
        out = torch.zeros_like(batch.response_mask)
        for i, (logprobs, _) in enumerate(on_leader(lambda: self.pool.prefill_logprobs(sequences))):
            out[i, :len(logprobs)] = torch.tensor(logprobs)
        return out * batch.response_mask

    def full_logprobs(self, batch: TokenBatch, micro_batch_size: int = 64) -> torch.Tensor:
        raise ValueError(f"teacher {self.path} is served by SGLang, which returns sampled-token logprobs only: "
                         "use opd.form=sampled, or opd.teacher_engine=local for the full-vocabulary form")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.stop()
