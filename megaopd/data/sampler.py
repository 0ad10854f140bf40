"""Deterministic prompt batches: a seeded permutation per epoch, resumable from (epoch, position)."""

from __future__ import annotations

import numpy as np

from megaopd.data.rows import Row


class PromptSampler:
    def __init__(self, rows: list[Row], batch_size: int, seed: int):
        if not rows:
            raise ValueError("no training rows: check data.train")
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.rows))

    def next_batch(self) -> list[Row]:
        batch = []
        while len(batch) < self.batch_size:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
            batch.append(self.rows[self._order[self.position]])
            self.position += 1
        return batch

    @property
    def drawn(self) -> int:
        """Prompts drawn so far, over every epoch."""
        return self.epoch * len(self.rows) + self.position

    def domains(self) -> set[str]:
        return {row.domain for row in self.rows}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation()
