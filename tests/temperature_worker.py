"""Megatron side of tests/test_temperature.py: one step of each saved config under torchrun (TP=2, CPU, gloo).

    torchrun --nproc-per-node 2 tests/temperature_worker.py DIR sampled topk

reads DIR/<form>.yaml, runs ``temperature_probe.step_gaps`` on its trainer with model.backend=megatron, and rank 0
writes DIR/<form>.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # temperature_probe, megaopd
from megaopd.megatron.cpu_rehearsal import redirect_cuda_to_cpu  # noqa: E402

redirect_cuda_to_cpu()

from megaopd.megatron.launch import rank_config  # noqa: E402
from megaopd.trainer import Trainer  # noqa: E402
from temperature_probe import step_gaps  # noqa: E402


def main() -> None:
    root, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    for form in sys.argv[2:]:
        cfg, _ = rank_config(str(root / f"{form}.yaml"), ["model.backend=megatron", "model.megatron.tp=2",
                                                          f"run_dir={root / 'megatron' / form}"], rank)
        gaps = step_gaps(Trainer(cfg))
        if rank == 0:
            (root / f"{form}.json").write_text(json.dumps(gaps))


if __name__ == "__main__":
    main()
