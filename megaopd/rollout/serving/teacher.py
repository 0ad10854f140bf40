"""A frozen teacher served by SGLang: the realised tokens' logprobs, and a top-k, by prefill (``max_new_tokens: 0``).

Only the response rows are scored: ``logprob_start_len`` is set at the prompt's end, so the server runs its LM head
and log-softmax over the R response positions instead of all P + R (what the FLOP ledger bills: ``flops.
teacher_passes``, one per sample). ``topk_logprobs`` asks for ``top_logprobs_num: K``; the tail bucket is the mass
the K leave.
A server cannot give the full distribution (opd.form=full_vocab needs a local teacher).

Indexing (SGLang 0.5.23, measured): with ``logprob_start_len = L`` the answer has one entry per token L..n-1 and the
first is null (the server does not project position L - 1), so L = prompt length - 1 and dropping the first entry
leaves exactly the R response tokens. Sampling settings: the server returns prompt (input) logprobs at temperature 1
whatever the request's temperature, and never cuts them to a top-p nucleus, so a teacher asked to score under other
settings (``opd.match_sampling`` with rollout.temperature != 1 or top_p < 1) refuses instead of returning numbers
for the wrong distribution (``run.resolve.check_temperature`` refuses such a run before any model loads). Its ``shape`` (for the ledger) and tokenizer come from the HF directory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megaopd.data.batch import TokenBatch
from megaopd.config import SGLangConfig
from megaopd.models.distributions import topk_tail
from megaopd.accounting.flops import ModelShape
from megaopd.rollout.serving.leader import on_leader
from megaopd.rollout.serving.pool import ServerPool


class SGLangTeacher:
    def __init__(self, path: str, urls: list[str], servers: SGLangConfig, dtype: str, run_dir: str | Path, name: str):
        from transformers import AutoConfig, AutoTokenizer

        self.path = path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(path))
        self.pool = None  # set on rank 0 only (see leader.py); a failed start stops every rank
        on_leader(lambda: self._start_servers(urls, servers, dtype, Path(run_dir) / "sglang", name))

    def _start_servers(self, urls: list[str], servers: SGLangConfig, dtype: str, log_dir: Path, name: str) -> None:
        self.pool = ServerPool.launch_or_attach(self.path, urls, servers, dtype, log_dir, name)

    def _score(self, batch: TokenBatch, top_k: int, temperature: float, top_p: float) -> list[dict]:
        """The server's answers for each row: response rows only (from the first response token on)."""
        if top_p < 1.0 or temperature != 1.0:
            raise ValueError(f"teacher {self.path} is served by SGLang, which scores prompt tokens at temperature 1 "
                             f"without a top-p cut; the rollout samples at temperature {temperature}, top-p {top_p}: "
                             "roll out at 1 / 1, set opd.match_sampling=false, or use a local teacher")
        lengths = batch.attention_mask.sum(-1).tolist()
        starts = [int(row.nonzero()[0]) + 1 if row.any() else n for row, n in zip(batch.response_mask, lengths)]
        sequences = [batch.input_ids[i, :n].tolist() for i, n in enumerate(lengths)]
        return on_leader(lambda: self.pool.prefill_logprobs(sequences, starts, top_k))

    @staticmethod
    def _place(batch: TokenBatch, i: int, values) -> slice:
        """The response columns of row i in the [B, S-1] grid, checked against what the server returned."""
        columns = batch.response_mask[i].nonzero().flatten()
        if len(values) != len(columns):
            raise RuntimeError(f"SGLang returned {len(values)} response logprobs for a {len(columns)}-token response")
        return slice(int(columns[0]), int(columns[0]) + len(columns)) if len(columns) else slice(0, 0)

    def logprobs(self, batch: TokenBatch, micro_batch_size: int = 64, temperature: float = 1.0,
                 top_p: float = 1.0) -> torch.Tensor:
        """Per-token logprob of each realised token, [B, S-1], masked to the response (as HFPolicy.logprobs)."""
        out = torch.zeros_like(batch.response_mask)
        for i, scored in enumerate(self._score(batch, 0, temperature, top_p)):
            out[i, self._place(batch, i, scored["logprobs"])] = torch.tensor(scored["logprobs"])
        return out

    def topk_logprobs(self, batch: TokenBatch, k: int, micro_batch_size: int = 64, temperature: float = 1.0,
                      top_p: float = 1.0) -> dict[str, torch.Tensor]:
        """As ``HFPolicy.topk_logprobs``; the tail is log(1 - the K's mass) (``distributions.topk_tail``)."""
        grid = batch.response_mask.shape
        out = {"realised": torch.zeros(grid), "topk_ids": torch.zeros((*grid, k), dtype=torch.long),
               "topk": torch.zeros((*grid, k)), "tail": torch.zeros(grid)}
        for i, scored in enumerate(self._score(batch, k, temperature, top_p)):
            columns = self._place(batch, i, scored["logprobs"])
            out["realised"][i, columns] = torch.tensor(scored["logprobs"])
            top = torch.tensor([[lp for lp, _ in row] for row in scored["top"]]).reshape(-1, k)
            out["topk"][i, columns] = top
            out["topk_ids"][i, columns] = torch.tensor([[tok for _, tok in row] for row in scored["top"]],
                                                       dtype=torch.long).reshape(-1, k)
            out["tail"][i, columns] = topk_tail(top)
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.stop()
