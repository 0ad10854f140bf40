"""Torchrun worker (gloo, CPU) for tests/test_verifier_ranks.py: every rank holds the same rollouts, and their
verifier answers differently on each rank (as a wall-clock limit that fires on one rank only would). Each rank
writes the rewards and GRPO advantages it trained on, and what the verifier itself answered there, to OUT/rank*.json.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/verifier_ranks_worker.py OUT
        # score_samples and GRPO.prepare alone
    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/verifier_ranks_worker.py OUT CONFIG KEY=VALUE...
        # the trainer with model.backend=megatron (megaopd.megatron.cpu_launch)
"""

import json
import os
import sys
from pathlib import Path

from megaopd.batch import Sample, collate
from megaopd.config import GRPOConfig
from megaopd.data.rows import Row
from megaopd.objectives import GRPO
from megaopd.verifiers import register
import megaopd.verifiers.synthetic  # noqa: F401: registered first, so the rank-dependent verifier replaces it

RANK = int(os.environ["RANK"])
GROUP = 4
seen: dict[str, list] = {"own": [], "rewards": [], "advantages": []}


@register("test/rank_dependent", "arith_add", "prog_trace")
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


class Chars:
    """A tokenizer stand-in: token i decodes to i characters."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join("x" * i for i in ids)


def scoring_only() -> None:
    import torch.distributed as dist

    from megaopd.evaluate import score_samples

    dist.init_process_group("gloo")
    row = Row("test/rank_dependent", [{"role": "user", "content": "?"}], None)
    samples = [Sample(row, i // GROUP, [1, 2], [i], [0.0], "stop", 0) for i in range(2 * GROUP)]
    seen["alone"] = [rank_dependent("x" * i, None, {}) for i in range(len(samples))]  # this rank by itself
    score_samples(Chars(), samples)
    GRPO(GRPOConfig(), GROUP).prepare(collate(samples, pad_id=0), samples)
    dist.destroy_process_group()


if __name__ == "__main__":
    out = Path(sys.argv[1])
    if len(sys.argv) > 2:
        from megaopd.megatron.cpu_launch import main

        main(sys.argv[2:])
    else:
        scoring_only()
    (out / f"rank{RANK}.json").write_text(json.dumps(seen))
