"""The fault suite (issue 55): each fault a long run meets on a shared cluster, injected for real (no mocks), with
the line megaopd prints and what a rerun of the same command does. docs/faults.md lists them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_config
from megaopd.checkpoint import Checkpointer, UnsafeCheckpoint, load_state
from megaopd.config import save_config
from megaopd.metrics import read_metrics


class _OpensAFile:
    """A pickle that creates a file when it is loaded: what a planted checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def _plant_pickle(path: Path, marker: Path) -> None:
    torch.save({"step": 4, "policy": _OpensAFile(marker)}, path)
    assert not marker.exists()


def test_a_planted_pickle_is_refused_and_runs_nothing(tmp_path):
    state = tmp_path / "checkpoints" / "step_0000004" / "state.pt"
    state.parent.mkdir(parents=True)
    marker = tmp_path / "created_on_load"
    _plant_pickle(state, marker)
    with pytest.raises(UnsafeCheckpoint, match=r"holds code \(io.open would run on load\)"):
        load_state(state)
    with pytest.raises(UnsafeCheckpoint):
        Checkpointer(tmp_path, every=2, keep=2).latest()
    assert not marker.exists()


def test_a_checkpoint_holds_data_only(assets, tmp_path):
    """A real checkpoint (model, optimizer, RNG states, rollouts ahead) loads under the allow-list."""
    from megaopd.trainer import train

    train(run_config(assets, tmp_path / "run", "grpo", **{"train.steps": 4, "rollout.max_staleness": 1}))
    state = load_state(tmp_path / "run" / "checkpoints" / "step_0000002" / "state.pt")
    assert state["step"] == 2 and len(state["rollouts"]) == 1
