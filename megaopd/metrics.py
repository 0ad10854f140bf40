"""Metrics: one ``metrics.jsonl`` line per logged step and the same scalars in TensorBoard.

Scalar names are grouped by prefix: ``train/``, ``rollout/``, ``eval/``, ``flops/``, ``perf/``. On resume, lines
and events after the checkpoint's step are dropped, so a resumed run's logs equal an uninterrupted run's.
"""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLogger:
    def __init__(self, run_dir: str | Path, resume_step: int = 0, tensorboard: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        if self.path.exists():
            # The final eval's line is written again when the run finishes (again).
            kept = [m for m in read_metrics(run_dir)
                    if m["step"] <= resume_step and not any(k.startswith("final/") for k in m)]
            self.path.write_text("".join(json.dumps(m) + "\n" for m in kept))
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=resume_step + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.writer is not None:
            for name, value in metrics.items():
                self.writer.add_scalar(name, value, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
