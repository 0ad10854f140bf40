"""Atomic checkpoints: model, optimizer, RNG states, data position and ledger in one file per step.

Each checkpoint is written to a temporary directory and renamed into place, so ``checkpoints/step_*`` only ever
holds complete checkpoints: a run killed at any moment resumes from the last one.

A checkpoint is data, never code: it is read back with ``torch.load(weights_only=True)`` and an explicit allow-list
(``SAFE_GLOBALS``: the numpy RNG state's array type and nothing else), so a planted pickle that would run code on
load is refused before any of it runs (``load_state``).
"""

from __future__ import annotations

import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from megaopd.errors import UserError

STATE_FILE = "state.pt"
# What a checkpoint may hold besides tensors and Python's plain containers: numpy's RNG state (an ndarray of
# uint32). torch's weights_only unpickler refuses every other global, so nothing in the file can run code.
SAFE_GLOBALS = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), np.zeros(1).__reduce__()[0]]  # the last: _reconstruct


class UnsafeCheckpoint(UserError):
    """A checkpoint file that names a global outside ``SAFE_GLOBALS``: code, refused before it runs."""

    what = "checkpoint error"


def load_state(path: str | Path) -> dict:
    """A file megaopd wrote with ``torch.save``, read back as data only; ``UnsafeCheckpoint`` when it holds code."""
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        try:
            return torch.load(path, weights_only=True)
        except pickle.UnpicklingError as e:
            named = re.search(r"GLOBAL ([\w.]+)", str(e))
            code = named.group(1) if named else "a global"
            raise UnsafeCheckpoint(f"{path} holds code ({code} would run on load), refused: a checkpoint is data; "
                                   "move it aside to resume from the one before") from None


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
        return load_state(complete[-1] / STATE_FILE) if complete else None

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
