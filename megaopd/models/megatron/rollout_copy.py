"""The HF copy of a Megatron policy's weights that the local rollout engine samples from, rebuilt lazily.

Every rank holds one and samples the same rollouts from the same seed; at scale rollouts come from SGLang servers
synced from ``MegatronPolicy.export_hf_state`` instead, and this copy is never built.
"""

from __future__ import annotations

from typing import Callable

import torch

from megaopd.models.megatron import bridge as hf_bridge


class RolloutCopy:
    """An HF model built from the first export and refreshed in place whenever the policy's weights changed."""

    def __init__(self, bridge, dtype: torch.dtype, device: torch.device):
        self.bridge, self.dtype, self.device = bridge, dtype, device
        self.model = None
        self.version = -1  # the policy weight version the copy holds; -1: not built yet

    def current(self, version: int, export: Callable[[], dict[str, torch.Tensor]]) -> torch.nn.Module:
        """The copy at weight `version`; `export` (collective, so every rank calls this) only when it is stale."""
        if self.version != version:
            state = export()
            if self.model is None:
                self.model = hf_bridge.hf_model_from_state(self.bridge, state, self.dtype).to(self.device)
            else:
                hf_bridge.load_exact(self.bridge, self.model, state)
            self.model.eval().requires_grad_(False)
            self.version = version
        return self.model
