"""Under torchrun every rank runs the loop, but only rank 0 talks to the servers: its answer (or error) reaches all."""

from __future__ import annotations

import torch.distributed as dist
import torch.multiprocessing as mp

from megaopd.rollout.serving.leader import is_leader, on_leader


def _worker(rank: int, init_file: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    calls = []
    value = on_leader(lambda: calls.append(rank) or f"answer from rank {rank}")
    try:
        on_leader(lambda: (_ for _ in ()).throw(RuntimeError(f"server down (seen by rank {rank})")))
        error = None
    except RuntimeError as e:
        error = str(e)
    results[rank] = (is_leader(), calls, value, error)
    dist.destroy_process_group()


def test_only_rank0_calls_and_every_rank_gets_its_answer_or_error(tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(str(tmp_path / "init"), results), nprocs=2)
        assert results[0] == (True, [0], "answer from rank 0", "server down (seen by rank 0)")
        assert results[1] == (False, [], "answer from rank 0", "server down (seen by rank 0)")


def test_without_a_process_group_it_is_a_plain_call():
    assert is_leader() and on_leader(lambda: 42) == 42
