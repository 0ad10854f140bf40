"""Torchrun worker (gloo, CPU) for tests/test_verifier_ranks.py: the trainer with model.backend=megatron
(``megaopd.models.megatron.cpu_launch``), whose verifier answers differently on each rank (as a wall-clock limit that fires
on one rank only would). Each rank writes the verdicts its own verifier gave and the rewards and GRPO advantages it
trained on to OUT/rank*.json.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/verifier_ranks_worker.py OUT CONFIG KEY=VALUE...
"""

import json
import os
import sys
from pathlib import Path

import megaopd.verifiers.synthetic  # noqa: F401: registered first, so the rank-dependent verifier replaces it
from megaopd.models.megatron.cpu_launch import main
from megaopd.objectives.losses import GRPO
from megaopd.verifiers import register

RANK = int(os.environ["RANK"])
seen: dict[str, list] = {"own": [], "rewards": [], "advantages": []}


@register("arith_add", "prog_trace")
def rank_dependent(response: str, ground_truth, extra_info: dict) -> float:
    verdict = float((len(response) + RANK) % 2)
    seen["own"].append(verdict)
    return verdict


prepare = GRPO.prepare


def recording_prepare(self, batch, samples):
    metrics = prepare(self, batch, samples)
    seen["rewards"].append([s.reward for s in samples])
    seen["advantages"].append(batch.advantages.tolist())
    return metrics


GRPO.prepare = recording_prepare

if __name__ == "__main__":
    main(sys.argv[2:])
    (Path(sys.argv[1]) / f"rank{RANK}.json").write_text(json.dumps(seen))
