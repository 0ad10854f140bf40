"""Atomic checkpoints: model, optimizer, RNG states, data position and ledger in one file per step.

Each checkpoint is written to a temporary directory and renamed into place, so ``checkpoints/step_*`` only ever
holds complete checkpoints: a run killed at any moment resumes from the last one.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import torch

STATE_FILE = "state.pt"


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


class Checkpointer:
    def __init__(self, run_dir: str | Path, every: int, keep: int):
        self.dir = Path(run_dir) / "checkpoints"
        self.every, self.keep = every, keep

    def _complete(self) -> list[Path]:
        return sorted(p for p in self.dir.glob("step_*") if (p / STATE_FILE).exists())

    def latest(self) -> dict | None:
        complete = self._complete()
        return torch.load(complete[-1] / STATE_FILE, weights_only=False) if complete else None

    def maybe_save(self, step: int, state_fn, force: bool = False) -> bool:
        if not force and (self.every <= 0 or step % self.every):
            return False
        self.save(step, state_fn())
        return True

    def save(self, step: int, state: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.dir / f"step_{step:07d}"
        tmp = self.dir / f".tmp_step_{step:07d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        torch.save(state, tmp / STATE_FILE)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in self._complete()[: -self.keep] if self.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
