"""The scalars a run logs: computed from a step's samples and timings, then written as one ``metrics.jsonl`` line
per logged step and the same scalars in TensorBoard.

Scalar names are grouped by prefix: ``train/``, ``rollout/``, ``eval/`` (the test split), ``valid/`` (the
validation split, which stop rules read), ``flops/``, ``perf/``; the end's evals ``final/`` and ``final_valid/``.
On resume, lines and events after the checkpoint's step are dropped, so a resumed run's logs equal an
uninterrupted run's.

MFU (model FLOP utilisation) is achieved model FLOP/s (``megaopd.accounting.flops`` conventions: matmuls only, 3x forward for a
training pass, real tokens) over the devices' dense peak. It is always quoted against the bf16 dense peak, also for
FP8 steps (the usual convention: FP8 then shows as MFU above what bf16 could reach, not as a different
denominator). Unknown devices get TFLOP/s but no MFU. torch is imported only where a device is asked, so the report
reads metrics without it.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from megaopd.errors import RunDirError, space_for

if TYPE_CHECKING:
    from megaopd.data.batch import Sample, TokenBatch
    from megaopd.objectives.losses import ISCorrection

log = logging.getLogger(__name__)


def per_domain_means(samples: list[Sample], value: Callable[[Sample], float]) -> dict[str, float]:
    """Mean of `value` over the samples of each domain, domains sorted by name."""
    sums: dict[str, list[float]] = defaultdict(list)
    for s in samples:
        sums[s.row.domain].append(value(s))
    return {domain: sum(v) / len(v) for domain, v in sorted(sums.items())}


def rollout_metrics(samples: list[Sample], batch: TokenBatch, routes: dict,
                    correction: ISCorrection | None = None) -> dict[str, float]:
    """One RL step's ``rollout/`` scalars, and per teacher route its KL and token share (``train/teacher/``).

    The mismatch scalars compare the engine's logprobs with the trainer's under the same distribution
    (``batch.sampling_logprobs``: the rollout's temperature / top-p as the engine reports them), so a rollout at
    T != 1 measures the trainer/engine mismatch, not the temperature."""
    metrics = {
        "rollout/reward": sum(s.reward for s in samples) / len(samples),
        "rollout/response_length": sum(len(s.response_ids) for s in samples) / len(samples),
        "rollout/truncated_share": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "rollout/weight_version": max(s.weight_version for s in samples),  # which weights sampled this step
    }
    # Train/rollout mismatch: |trainer - engine| logprob of the sampled tokens (0 when not recomputed).
    response = batch.response_mask.bool()
    tokens = batch.response_mask.sum().clamp(min=1)
    gap = (batch.sampling_logprobs - batch.rollout_logprobs).abs() * batch.response_mask
    metrics["rollout/logprob_gap"] = float(gap.sum() / tokens)
    metrics["rollout/logprob_gap_max"] = float(gap.max())
    # KL(behaviour || trainer) over the response tokens, k3 with samples from the behaviour (the engine): r - 1 -
    # log r, r = p_trainer / p_engine; unbiased, and >= 0 token by token unlike k1. In float64: at a mismatch of
    # 1e-3 the float32 cancellation in r - 1 - log r alone is ~20% of each token's value.
    from megaopd.objectives.losses import k3_kl  # here: the report reads metrics without torch

    k3 = k3_kl(batch.rollout_logprobs.double(), batch.sampling_logprobs.double()) * batch.response_mask
    metrics["rollout/behaviour_kl"] = float(k3.sum() / tokens)
    if correction is not None:
        metrics["rollout/tis_weight_mean"] = float(correction.weights[response].mean())
        if correction.truncated is not None:
            metrics["rollout/tis_truncated_share"] = float(correction.truncated[response].float().mean())
        if correction.masked is not None:
            metrics["rollout/is_masked_share"] = float(correction.masked[response].float().mean())
    for domain, reward in per_domain_means(samples, lambda s: s.reward).items():
        metrics[f"rollout/{domain}/reward"] = reward
    total_tokens = float(batch.response_mask.sum().clamp(min=1))
    for route, indices in routes.items():
        mask = batch.response_mask[indices]
        k1 = ((batch.old_logprobs[indices] - batch.teacher_logprobs[indices]) * mask).sum()
        metrics[f"train/teacher/{route}/reverse_kl_k1"] = float(k1 / mask.sum().clamp(min=1))
        metrics[f"train/teacher/{route}/token_share"] = float(mask.sum()) / total_tokens
        if batch.teacher_exact is not None:  # a teacher of another tokenizer: how much credit needed no split
            exact = (batch.teacher_exact[indices] * mask).sum()
            metrics[f"train/teacher/{route}/exact_credit_share"] = float(exact / mask.sum().clamp(min=1))
    return metrics


# Dense (no sparsity) bf16 tensor-core peak per device, FLOP/s, from the vendors' data sheets (SXM parts).
BF16_PEAK = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "B200": 2250e12,
             "GB200": 2500e12, "L40S": 362e12}


def device_clock() -> float:
    """``time.perf_counter`` once the GPU's queued work is done, so that an interval times that work."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def device_peak_flops() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().upper()
    for key in sorted(BF16_PEAK, key=len, reverse=True):  # "GB200" before "B200"
        if key in name:
            return BF16_PEAK[key]
    return None


def step_perf(model_flops: int, seconds: float, devices: int) -> dict[str, float]:
    """TFLOP/s per device and, where the device's peak is known, MFU."""
    per_device = model_flops / max(seconds, 1e-9) / devices
    out = {"tflops_per_device": per_device / 1e12}
    peak = device_peak_flops()
    if peak:
        out["mfu"] = per_device / peak
    return out


class MetricsLogger:
    def __init__(self, run_dir: str | Path, resume_step: int = 0, tensorboard: bool = True):
        """`resume_step`: the step of the checkpoint the run resumed from; 0 when it starts over (none, or none
        intact), and then it logs its step-0 eval again."""
        self.path = Path(run_dir) / "metrics.jsonl"
        kept_up_to = resume_step if resume_step > 0 else -1
        if self.path.exists():
            # The final eval's line is written again when the run finishes (again).
            kept = [m for m in read_metrics(run_dir)
                    if m["step"] <= kept_up_to and not any(k.startswith("final/") for k in m)]
            self.path.write_text("".join(json.dumps(m) + "\n" for m in kept))
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=kept_up_to + 1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        line = json.dumps({"step": step, **metrics}) + "\n"
        with space_for(self.path, len(line)), self.path.open("a") as f:
            f.write(line)
        if self.writer is not None:
            for name, value in metrics.items():
                self.writer.add_scalar(name, value, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of a run's metrics.jsonl. A last line cut short (no newline: a kill or a full disk mid-write) is left
    out with a warning, as its step is after the run's last checkpoint and a resumed run writes it again; any other
    line that is not JSON was changed after megaopd wrote it, and is an error naming it."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines) and not text.endswith("\n"):
                log.warning("%s:%d: the last line was cut short (a write interrupted); left out", path, number)
                break
            raise RunDirError(f"{path}:{number}: not a JSON line (changed after megaopd wrote it); restore the file "
                              "or delete that line") from None
    return rows
