"""Train one stage with the megatron backend: every torchrun rank runs the same trainer loop.

    torchrun --nproc-per-node 2 -m megaopd.models.megatron.launch CONFIG model.backend=megatron model.megatron.tp=2 ...

Each rank holds the full (small) step batch: rollouts, rewards and teacher scores are computed identically on every
rank from the same seed (the local engine samples from an HF copy of the Megatron weights, refreshed after each
update), and the policy calls inside the step are collective (``MegatronPolicy`` splits the batch over DP and
shards the model over TP/PP). Rank 0 writes the run directory; the other ranks write their identical copies under
``<run_dir>/ranks/<rank>``, and all ranks share one distributed checkpoint directory
(``model.megatron.checkpoint_dir``, default ``<run_dir>/megatron_checkpoints``).

At cluster scale the same holds with SGLang rollouts (``rollout.engine=sglang``): weights are synced from
``MegatronPolicy.hf_named_tensors()``.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path

from megaopd.config import RunConfig, load_config
from megaopd.models.megatron import require


def rank_config(config: str | None, overrides: list[str], rank: int) -> tuple[RunConfig, str]:
    """The run config as rank `rank` sees it (its own run directory unless rank 0, the shared checkpoints), and the
    stage's run directory (rank 0's)."""
    cfg = load_config(config, overrides)
    if cfg.model.backend != "megatron":
        raise ValueError("megaopd.models.megatron.launch trains with model.backend=megatron (add it to the overrides)")
    if not cfg.model.megatron.checkpoint_dir:
        cfg.model.megatron.checkpoint_dir = str(Path(cfg.run_dir) / "megatron_checkpoints")
    stage_dir = cfg.run_dir
    if rank:
        cfg.run_dir = str(Path(cfg.run_dir) / "ranks" / str(rank))
    return cfg, stage_dir


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__)
        return 2
    require()
    rank = int(os.environ.get("RANK", 0))
    # Every rank says where it runs: the placement of a multi-node job, read back from its own log. One write with
    # its newline (print writes the end separately): the ranks share the log, and a line split there was seen.
    sys.stdout.write(f"megaopd: rank {rank} of {os.environ.get('WORLD_SIZE', 1)} "
                     f"(local {os.environ.get('LOCAL_RANK', 0)}) on {socket.gethostname()}\n")
    sys.stdout.flush()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s")
    from megaopd.run import allocator
    from megaopd.run.trainer import train

    cfg, stage_dir = rank_config(argv[0], argv[1:], rank)
    allocator.keep_heap_for([cfg.model.device])  # a CPU rehearsal's rank (cpu_launch): its allocator (allocator.py)
    summary = train(cfg, stage_dir)
    if rank == 0:
        print(f"{summary['run_dir']}: {summary['steps']} steps, final {summary['final']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
