"""The ``Policy`` protocol: what every training backend implements (``HFPolicy``, ``MegatronPolicy``).

The trainer, the rollout engines, the weight sync and the teachers talk to a policy only through these calls, so a
new backend is a class with these members; ``tests/test_policy_contract.py`` runs the same cases on each. Every
grid is [B, S-1] over target positions (position t scores token t+1) and zero off the response.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Protocol, runtime_checkable

import torch

from megaopd.data.batch import TokenBatch
from megaopd.accounting.flops import ModelShape


@runtime_checkable
class Policy(Protocol):
    tokenizer: Any  # the HF tokenizer saved beside the weights (chat template, pad and eos)
    shape: ModelShape  # the architecture, for the FLOP ledger and the memory plan
    device: torch.device  # where rollouts on the local engine run

    @property
    def pad_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def model(self) -> torch.nn.Module:
        """An HF causal LM holding the current weights, for the local rollout engine."""

    def logprobs(self, batch: TokenBatch, micro_batch_size: int = 64, temperature: float = 1.0,
                 top_p: float = 1.0) -> torch.Tensor:
        """log p of each realised token, [B, S-1], under the given sampling settings (no grad)."""

    def logprobs_under(self, batch: TokenBatch, micro_batch_size: int, settings: list[tuple[float, float]],
                       with_entropy: bool = False) -> list[torch.Tensor]:
        """``logprobs`` under each (temperature, top_p) of ``settings`` from one forward (no grad): the trainer's
        old logprobs at the run's temperature and, beside them, its logprobs under the rollout's sampling
        distribution; ``with_entropy``: then each position's entropy at the first setting (no matmul more)."""

    def full_logprobs(self, batch: TokenBatch, micro_batch_size: int = 64) -> torch.Tensor:
        """The log-softmax over the vocabulary at every response position, [B, S-1, V] (small checks only)."""

    def topk_logprobs(self, batch: TokenBatch, k: int, micro_batch_size: int = 64, temperature: float = 1.0,
                      top_p: float = 1.0) -> dict[str, torch.Tensor]:
        """``realised`` [B, S-1], ``topk`` / ``topk_ids`` [B, S-1, K] and ``tail`` [B, S-1] (log mass outside)."""

    def train_minibatch(self, batch: TokenBatch, loss_fn, micro_batch_size: int,
                        vocab_term=None, temperature: float = 1.0) -> dict[str, float]:
        """One optimizer step on the token-mean of ``loss_fn`` (``policy.TokenLossFn``) over the batch's response
        tokens, whatever the micro-batching, its logprobs of softmax(logits / ``temperature``); returns the
        token-mean ``loss`` and metrics, ``grad_norm`` and ``lr``."""

    def take_prompt_saving(self, causal: bool = True) -> int:
        """The FLOPs its shared-prompt passes (``train.shared_prompt``) did not run since the last call: hardware work
        saved, beside the ledger (``megaopd.models.shared_prompt.saved_flops``); 0 without shared prompts."""

    def save_hf(self, out_dir: str | Path) -> None:
        """An HF directory (config, safetensors, tokenizer) that transformers loads to the same logprobs."""

    def hf_named_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of the current weights, for syncing rollout servers without the disk."""

    def state_dict(self) -> dict:
        """What the trainer's checkpoint holds to resume weights and optimizer exactly."""

    def load_state_dict(self, state: dict) -> None: ...


class TokenizerIds:
    """The pad and end ids every backend reads off its HF tokenizer (``Policy.pad_id``, ``Policy.eos_id``)."""

    tokenizer: Any

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id
