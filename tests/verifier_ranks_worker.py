"""Torchrun worker (gloo, CPU) for tests/test_verifier_ranks.py: every rank holds the same rollouts, and their
verifier answers differently on each rank (as a wall-clock limit that fires on one rank only would). Each rank
scores the step the trainer's way (``score_samples``) and computes GRPO advantages; rank 0 writes what every rank
saw, and what the verifier itself answered there, to OUT.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/verifier_ranks_worker.py OUT
"""

import json
import sys

import torch.distributed as dist

from megaopd.batch import Sample, collate
from megaopd.config import GRPOConfig
from megaopd.data.rows import Row
from megaopd.evaluate import score_samples
from megaopd.objectives import GRPO
from megaopd.verifiers import register

GROUP = 4


@register("test/rank_dependent")
def rank_dependent(response: str, ground_truth, extra_info: dict) -> float:
    return float((int(response) + dist.get_rank()) % 2)


class Digits:
    """A tokenizer stand-in: a response is its one token id, decoded as its digits."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i) for i in ids)


def main(out: str) -> None:
    dist.init_process_group("gloo")
    row = Row("test/rank_dependent", [{"role": "user", "content": "?"}], None)
    samples = [Sample(row, i // GROUP, [1, 2], [i], [0.0], "stop", 0) for i in range(2 * GROUP)]
    own = [rank_dependent(str(i), None, {}) for i in range(len(samples))]  # what this rank alone would score
    score_samples(Digits(), samples)
    batch = collate(samples, pad_id=0)
    GRPO(GRPOConfig(), GROUP).prepare(batch, samples)
    mine = {"own": own, "rewards": [s.reward for s in samples], "advantages": batch.advantages.tolist()}
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(seen, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
