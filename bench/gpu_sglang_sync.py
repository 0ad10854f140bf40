"""GPU check of the SGLang weight-sync transports that CPU CI cannot run: CUDA IPC (colocated) and NCCL.

On one GPU machine with sglang importable in this environment (the GPU image):

    python bench/gpu_sglang_sync.py --model /path/to/hf-model [--methods tensor distributed disk]

For each transport it launches one SGLang server on the GPU, perturbs the policy (as an update would), syncs, and
lets the engine verify the served version and the logprob probe; it prints the sync time per transport. On a
machine without CUDA it stops at once with the reason. It has not run on a GPU yet (no device in the session that
wrote it): run it once when one is available and record its output in docs/serving.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

from megaopd.config import load_config
from megaopd.models.hf_policy import HFPolicy
from megaopd.rollout.serving.engine import SGLangEngine


def timed_sync(model: str, method: str, run_dir: str, dtype: str = "bfloat16", tolerance: float = 2e-2,
               mem_fraction: float = 0.4) -> tuple[float, int, float]:
    """Launch one server, perturb the policy (as an update would), sync by `method` and let the engine verify it.
    Returns (seconds of sync + verification, the served weight version, billions of parameters)."""
    cfg = load_config(None, [f"run_dir={run_dir}", f"model.path={model}", "model.device=cuda", f"model.dtype={dtype}",
                             "rollout.engine=sglang", f"rollout.sglang.sync={method}",
                             f"rollout.sglang.probe_tolerance={tolerance}",
                             f"rollout.sglang.server_args=[--mem-fraction-static, {mem_fraction}]"])
    policy = HFPolicy(cfg.model)
    engine = SGLangEngine(cfg.rollout, cfg.model, cfg.run_dir, policy)
    try:
        with torch.no_grad():
            for p in policy.model.parameters():
                p.mul_(1.01)
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.sync_weights(policy)  # raises StaleWeightsError unless the server serves the new weights
        seconds = time.perf_counter() - start
    finally:
        engine.close()
    return seconds, engine.weight_version, sum(p.numel() for p in policy.model.parameters()) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="HF model directory (bf16 or fp32)")
    parser.add_argument("--methods", nargs="+", default=["tensor", "distributed", "disk"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tolerance", type=float, default=2e-2, help="probe tolerance (bf16 kernels differ)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_sglang_sync: no CUDA device here; this script checks the GPU transports (CPU CI covers disk)")

    for method in args.methods:
        with tempfile.TemporaryDirectory() as run_dir:
            seconds, version, _ = timed_sync(args.model, method, run_dir, args.dtype, args.tolerance)
            print(f"{method:12s} sync + verify {seconds:7.2f} s  version {version}  OK", flush=True)


if __name__ == "__main__":
    main()
