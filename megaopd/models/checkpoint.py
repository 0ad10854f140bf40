"""Atomic checkpoints: model, optimizer, RNG states, data position and ledger in one file per step.

Each checkpoint is written to a temporary directory and renamed into place, so ``checkpoints/step_*`` only ever
holds complete checkpoints: a run killed at any moment resumes from the last one.

A checkpoint is data, never code: it is read back with ``torch.load(weights_only=True)`` and an explicit allow-list
(``SAFE_GLOBALS``: the numpy RNG state's array type and nothing else), so a planted pickle that would run code on
load is refused before any of it runs (``load_state``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from megaopd.errors import UserError, space_for

log = logging.getLogger(__name__)

STATE_FILE = "state.pt"
MANIFEST = "manifest.json"  # written last: sizes and sha256 of the checkpoint's files
DAMAGED_DIR = "damaged"  # where a checkpoint that does not verify is moved, never deleted
# What a checkpoint may hold besides tensors and Python's plain containers: numpy's RNG state (an ndarray of
# uint32). torch's weights_only unpickler refuses every other global, so nothing in the file can run code.
SAFE_GLOBALS = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), np.zeros(1).__reduce__()[0]]  # the last: _reconstruct


class UnsafeCheckpoint(UserError):
    """A checkpoint file that names a global outside ``SAFE_GLOBALS``: code, refused before it runs."""

    what = "checkpoint error"

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def load_state(path: str | Path) -> dict:
    """A file megaopd wrote with ``torch.save``, read back as data only; ``UnsafeCheckpoint`` when it holds code."""
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        try:
            return torch.load(path, weights_only=True)
        except pickle.UnpicklingError as e:
            named = re.search(r"GLOBAL ([\w.]+)", str(e))
            code = named.group(1) if named else "a global"
            raise UnsafeCheckpoint(code, f"{path} holds code ({code} would run on load), refused: a checkpoint is "
                                         "data; move it aside to resume from the one before") from None


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def fsync(path: str | Path) -> None:
    """Flush a file's or a directory's contents (a directory: its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path: Path) -> dict:
    """A file's size and sha256, as a manifest records them."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def _referenced(state: dict) -> list[Path]:
    """Files a checkpoint's state points to outside its directory: a Megatron policy's distributed checkpoint
    (every rank's shard), which must verify with it."""
    policy = state.get("policy")
    where = policy.get("dist_checkpoint") if isinstance(policy, dict) else None
    return sorted(p for p in Path(where).rglob("*") if p.is_file()) if where else []


def state_bytes(state) -> int:
    """About how many bytes ``torch.save`` writes for `state`: its tensors' storage (the rest is small)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 64


def write_manifest(directory: Path, referenced: list[Path] = ()) -> None:
    """Every file of `directory` (and the `referenced` ones, by absolute path) with its size and checksum, read back
    from disk, written last and flushed."""
    files = {p.name: file_digest(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    files |= {str(p.resolve()): file_digest(p) for p in referenced}
    (directory / MANIFEST).write_text(json.dumps({"format": 1, "files": files}, indent=1))
    fsync(directory / MANIFEST)


def verify(directory: Path) -> str | None:
    """Why the checkpoint in `directory` does not verify against its manifest, or None when it does."""
    try:
        files = json.loads((directory / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        return "no manifest"
    except (ValueError, KeyError, TypeError, OSError) as e:
        return f"unreadable manifest ({e.__class__.__name__})"
    for name, expected in files.items():
        path = Path(name) if os.path.isabs(name) else directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["size"]:
            return f"{name} has {path.stat().st_size} bytes, not {expected['size']}"
        if file_digest(path)["sha256"] != expected["sha256"]:
            return f"{name} fails its checksum"
    return None


class Checkpointer:
    """``checkpoints/step_*`` of one run. A checkpoint is written to ``.tmp_step_*``, each file flushed, its manifest
    (sizes and sha256 of every file, read back from disk) written last, the directory flushed, then renamed into
    place and the parent flushed. On resume the newest checkpoint whose manifest verifies is loaded; a damaged one
    (a file missing, cut short or changed, an unreadable manifest, or a file that does not load as data) is moved
    to ``checkpoints/damaged/`` (never deleted) with one warning naming it and the step resumed from.

    A checkpoint without a manifest was written before manifests (issue 55): it is loaded when it reads completely
    as data (weights_only, the allow-list) and moved aside like a damaged one when it does not."""

    def __init__(self, run_dir: str | Path, every: int, keep: int):
        self.dir = Path(run_dir) / "checkpoints"
        self.every, self.keep = every, keep

    def _complete(self) -> list[Path]:
        return sorted(p for p in self.dir.glob("step_*") if p.is_dir())

    def latest(self) -> dict | None:
        """The newest checkpoint that verifies and loads, or None; damaged ones on the way are moved aside."""
        for partial in self.dir.glob(".tmp_step_*"):  # a save cut short (a kill, a full disk): never complete
            shutil.rmtree(partial, ignore_errors=True)
        damaged = []
        for directory in reversed(self._complete()):
            problem = verify(directory)
            state = None
            if problem in (None, "no manifest"):
                try:
                    state = load_state(directory / STATE_FILE)
                except UnsafeCheckpoint as e:
                    problem = f"{STATE_FILE} holds code ({e.code} would run on load)"
                except Exception as e:  # noqa: BLE001: whatever a damaged file raises, it is damaged
                    problem = f"{STATE_FILE} does not load ({' '.join(str(e).split())[:120]})"
            if state is not None:
                if problem == "no manifest":
                    log.warning("checkpoint %s has no manifest (written before manifests): loaded unverified",
                                directory)
                self._report(damaged, f"step {state['step']}")
                return state
            damaged.append((directory, self._move_aside(directory), problem))
        self._report(damaged, "the start (no checkpoint verifies)")
        return None

    @staticmethod
    def _report(damaged: list, resumed_from: str) -> None:
        for directory, moved, problem in damaged:
            log.warning("checkpoint %s is damaged (%s): moved to %s; resuming from %s", directory, problem, moved,
                        resumed_from)

    def _move_aside(self, directory: Path) -> Path:
        aside = self.dir / DAMAGED_DIR
        aside.mkdir(exist_ok=True)
        target, n = aside / directory.name, 1
        while target.exists():
            target, n = aside / f"{directory.name}.{n}", n + 1
        directory.rename(target)
        fsync(self.dir)
        return target

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
        with space_for(final, state_bytes(state), partial=[tmp]):  # a full disk: one line, no .tmp_step_* left
            tmp.mkdir()
            with open(tmp / STATE_FILE, "wb") as f:  # a Python file: a failed write raises its OSError
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            write_manifest(tmp, _referenced(state))
            fsync(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        fsync(self.dir)
        for old in self._complete()[: -self.keep] if self.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
