"""Test-only stand-in for the trainer entry point (launch setting ``trainer_module=placement_probe``): every
torchrun worker reports where it runs, over gloo, and rank 0 prints one ``placement {json}`` line for the test.

Each worker: its rank, local rank, host name, Slurm node, its torchrun agent (parent PID), whether it reached
the rollout servers of MEGAOPD_ROLLOUT_URLS, the network and CPU settings its step gave it and the address the
weight sync would give the servers (both as the trainer reads them: through megaopd.run.environment); plus an
all_reduce of the ranks, checked against its expected sum.
"""

import json
import os
import socket
import urllib.request

import torch
import torch.distributed as dist

from megaopd.config import SGLangConfig
from megaopd.run.environment import sglang_servers
from megaopd.rollout.serving.weight_sync import sync_address


def reaches(urls: list[str]) -> bool:
    try:
        for url in urls:
            urllib.request.urlopen(f"{url}/health", timeout=10)
        return True
    except OSError:
        return False


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    servers = sglang_servers(SGLangConfig())
    me = {"rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]), "host": socket.gethostname(),
          "node": os.environ.get("SLURMD_NODENAME", ""), "agent": os.getppid(),
          "servers_reached": reaches(servers.urls),
          "sync_address": sync_address(servers.sync_address, servers.urls),
          "hostname_address": socket.gethostbyname(socket.gethostname()),  # what the weight sync once used
          **{name: os.environ.get(name) for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA",
                                                     "OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK")}}
    everyone = [None] * world
    dist.all_gather_object(everyone, me)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    if rank == 0:
        print("placement " + json.dumps({"workers": everyone, "rank_sum": total.item(),
                                         "expected_sum": world * (world - 1) / 2}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
