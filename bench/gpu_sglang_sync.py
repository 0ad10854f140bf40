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
from megaopd.policy import HFPolicy
from megaopd.serving.engine import SGLangEngine


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
            cfg = load_config(None, [f"run_dir={run_dir}", f"model.path={args.model}", "model.device=cuda",
                                     f"model.dtype={args.dtype}", "rollout.engine=sglang", f"rollout.sglang.sync={method}",
                                     f"rollout.sglang.probe_tolerance={args.tolerance}",
                                     "rollout.sglang.server_args=[--mem-fraction-static, 0.4]"])
            policy = HFPolicy(cfg.model, cfg.optim)
            engine = SGLangEngine(cfg, policy)
            try:
                with torch.no_grad():
                    for p in policy.model.parameters():
                        p.mul_(1.01)
                torch.cuda.synchronize()
                start = time.perf_counter()
                engine.sync_weights(policy)  # raises StaleWeightsError unless the server serves the new weights
                seconds = time.perf_counter() - start
                print(f"{method:12s} sync + verify {seconds:7.2f} s  version {engine.weight_version}  OK", flush=True)
            finally:
                engine.close()


if __name__ == "__main__":
    main()
