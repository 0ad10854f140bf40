"""Megatron side of tests/test_temperature.py and tests/test_fixed_advantage.py: one step of each saved config under
torchrun (TP=2, CPU, gloo).

    torchrun --nproc-per-node 2 tests/step_worker.py DIR sampled topk

reads DIR/<name>.yaml, runs ``step_probe.step_gaps`` on its trainer with model.backend=megatron, and rank 0 writes
DIR/<name>.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # step_probe, megaopd
from megaopd.models.megatron.cpu_rehearsal import redirect_cuda_to_cpu  # noqa: E402

redirect_cuda_to_cpu()

from megaopd.models.megatron.launch import rank_config  # noqa: E402
from megaopd.run.trainer import Trainer  # noqa: E402
from step_probe import step_gaps  # noqa: E402


def main() -> None:
    root, rank = Path(sys.argv[1]), int(os.environ["RANK"])
    for name in sys.argv[2:]:
        cfg, _ = rank_config(str(root / f"{name}.yaml"), ["model.backend=megatron", "model.megatron.tp=2",
                                                          f"run_dir={root / 'megatron' / name}"], rank)
        gaps = step_gaps(Trainer(cfg))
        if rank == 0:
            (root / f"{name}.json").write_text(json.dumps(gaps))


if __name__ == "__main__":
    main()
