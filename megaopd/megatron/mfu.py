"""Model FLOP utilisation: achieved model FLOP/s (``megaopd.flops`` conventions: matmuls only, 3x forward for a
training pass, real tokens) over the devices' dense peak.

MFU is always quoted against the bf16 dense peak, also for FP8 steps (the usual convention: FP8 then shows as
MFU above what bf16 could reach, not as a different denominator). Unknown devices get TFLOP/s but no MFU.
"""

from __future__ import annotations

import torch

# Dense (no sparsity) bf16 tensor-core peak per device, FLOP/s, from the vendors' data sheets (SXM parts).
BF16_PEAK = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "B200": 2250e12,
             "GB200": 2500e12, "L40S": 362e12}


def device_peak_flops() -> float | None:
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
