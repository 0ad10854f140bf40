"""The ``RolloutEngine`` protocol: what every rollout engine implements (``rollout.LocalEngine``, the trainer's own
model; ``serving.engine.SGLangEngine``, SGLang servers with their own copy of the weights).

The trainer and the rollout pipeline talk to an engine only through these members, so a new engine is a class with
them; ``tests/engine_contract.py`` holds the cases every engine passes (``tests/test_rollout.py`` runs them on the
local engine, ``tests/test_sglang.py`` on a real SGLang server).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from megaopd.data.batch import Sample
from megaopd.data.rows import Row
from megaopd.models.policy_protocol import Policy


@runtime_checkable
class RolloutEngine(Protocol):
    # (The ledger bills a group's prompt prefilled once whatever the engine: docs/flops.md, "Shared work".)
    # Whether the engine samples from the trainer's own weights: then it cannot generate while the trainer updates
    # (the rollout pipeline generates inline); with its own copy it generates ahead on a thread.
    shares_policy_weights: bool
    weight_version: int  # the policy version it serves: every sample carries it (stale-weight bugs show up there)

    def generate(self, rows: list[Row], samples_per_prompt: int, temperature: float = 1.0, top_p: float = 1.0,
                 max_new_tokens: int = 64, generator: torch.Generator | None = None) -> list[Sample]:
        """``samples_per_prompt`` samples of each row, grouped consecutively (sample i answers ``rows[i // n]``):
        the chat-templated prompt ids, the response ids (with the EOS when the model stopped), each response
        token's logprob under the distribution the engine reports (``rollout.reported_sampling``), the finish
        reason and the weight version. Its random draws come from ``generator`` only."""

    def sync_weights(self, policy: Policy, version: int | None = None) -> None:
        """Serve ``policy``'s current weights as ``version`` (default: the next), verified where a copy is synced."""

    def take_resumed_prefills(self) -> list[int]:
        """The sequence lengths (prompt + partial response) the engine prefilled again since the last call, resuming
        requests an in-flight update interrupted: hardware work beyond the ledger's model FLOPs."""

    def close(self) -> None:
        """Stop what the engine launched."""
