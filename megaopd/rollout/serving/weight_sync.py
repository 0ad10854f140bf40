"""How new policy weights reach SGLang servers. One call, three transports (``rollout.sglang.sync``):

- ``disk``: export HF safetensors (atomically), then ``/update_weights_from_disk`` on every server. Works
  everywhere, CPU included; the cost is a write and a read of the model per step.
- ``tensor``: colocated on the trainer's GPUs: CUDA IPC handles to the live tensors through
  ``/update_weights_from_tensor`` (no copy through the host). Needs sglang importable in the trainer's environment.
- ``distributed``: servers on other nodes: one NCCL group (trainer rank 0 + every server rank) set up once by
  ``/init_weights_update_group``, then per bucket ``/update_weights_from_distributed`` while rank 0 broadcasts.

The last two need CUDA and fail at start-up without it. Whatever the transport, the engine then verifies the
servers (``SGLangEngine.verify``): a sync is never trusted on its own word. Only a disk sync leaves weights a
restarted server can load: after an in-memory sync it comes back on its last disk weights under their old version
number, so the engine refuses its rollouts (StaleWeightsError) instead of training on them.
"""

from __future__ import annotations

import shutil
import socket
import threading
import urllib.parse
from typing import Callable

import torch

from megaopd.config import WeightSync, choices
from megaopd.rollout.serving.leader import is_leader, on_leader
from megaopd.rollout.serving.server import ServerError, free_port

BUCKET_BYTES = 512 << 20  # tensors per /update_weights_from_distributed call: bounded memory, few round trips


def for_method(method: str) -> Callable:
    if method not in choices(WeightSync):
        *others, last = choices(WeightSync)
        raise ValueError(f"rollout.sglang.sync must be {', '.join(others)} or {last}, got {method!r}")
    if method != "disk" and not torch.cuda.is_available():
        raise RuntimeError(f"rollout.sglang.sync={method} moves weights between GPUs (CUDA IPC / NCCL) and this "
                           "machine has no CUDA device; use rollout.sglang.sync=disk")
    return {"disk": sync_from_disk, "tensor": sync_from_tensor}.get(method) or DistributedSync()


def _check(answers: list[dict], what: str, urls: list[str]) -> None:
    failed = [f"{url}: {a.get('message', a)}" for url, a in zip(urls, answers) if not a.get("success", False)]
    if failed:
        raise ServerError(f"{what} failed on " + "; ".join(failed))


def _flush(engine) -> None:
    """After the weights changed, the prefix cache still holds KV the old weights computed. The updates ask for no
    flush of their own (SGLang refuses it, failing the update, while a just-answered request is still listed);
    each server flushes here once idle."""
    for server in engine.pool.servers:
        server.flush_cache(engine.cfg.request_timeout_s)


def sync_from_disk(engine, policy, version: str) -> None:
    path = engine.weights_dir / f"v{version}"
    tmp = engine.weights_dir / f".tmp_v{version}"
    if is_leader():
        shutil.rmtree(tmp, ignore_errors=True)
    policy.save_hf(tmp)  # collective on a Megatron policy (rank 0 writes)
    on_leader(lambda: _load_from_disk(engine, tmp, path, version))


def _load_from_disk(engine, tmp, path, version: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)  # a server never reads a half-written directory
    answers = engine.pool.broadcast("/update_weights_from_disk",
                                    {"model_path": str(path), "weight_version": version, "flush_cache": False})
    _check(answers, f"/update_weights_from_disk {path}", engine.pool.urls)
    _flush(engine)
    for server in engine.pool.servers:  # a restarted server comes back on these weights
        server.model_path, server.weight_version = str(path), version
    for old in engine.weights_dir.glob("v*"):
        if old != path:
            shutil.rmtree(old, ignore_errors=True)


def sync_from_tensor(engine, policy, version: str) -> None:
    named = [(name, tensor.detach().contiguous()) for name, tensor in policy.hf_named_tensors()]  # collective
    on_leader(lambda: _load_from_tensors(engine, named, version))


def _load_from_tensors(engine, named, version: str) -> None:
    # The trainer's environment must hold sglang for this transport (the GPU image does).
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()  # CUDA IPC handles keyed by device UUID, valid in the server's processes
    # One serialized copy per server TP rank; each rank opens the CUDA IPC handles it needs.
    serialized = MultiprocessingSerializer.serialize(named, output_str=True)
    tp_size = int(engine.pool.servers[0].get("/get_server_info").get("tp_size", 1))
    answers = engine.pool.broadcast("/update_weights_from_tensor",
                                    {"serialized_named_tensors": [serialized] * tp_size, "flush_cache": False,
                                     "weight_version": version})
    _check(answers, "/update_weights_from_tensor", engine.pool.urls)
    _flush(engine)


class DistributedSync:
    """NCCL broadcast from trainer rank 0 to every server rank, in buckets."""

    group_name = "megaopd_weights"

    def __init__(self):
        self.group = None

    def _init_group(self, engine) -> None:
        from sglang.srt.utils import init_custom_process_group

        infos = [server.get("/get_server_info") for server in engine.pool.servers]
        ranks = [int(info.get("tp_size", 1)) * int(info.get("dp_size", 1)) for info in infos]
        world_size = 1 + sum(ranks)
        master = {"master_address": sync_address(engine.cfg.sync_address, engine.pool.urls),
                  "master_port": free_port(), "world_size": world_size, "group_name": self.group_name,
                  "backend": "nccl"}
        offsets = [1 + sum(ranks[:i]) for i in range(len(ranks))]
        answers: list = [None] * len(ranks)

        def init_server(i):
            answers[i] = engine.pool.servers[i].post("/init_weights_update_group", master | {"rank_offset": offsets[i]},
                                                     engine.cfg.request_timeout_s)

        threads = [threading.Thread(target=init_server, args=(i,)) for i in range(len(ranks))]
        for t in threads:
            t.start()
        self.group = init_custom_process_group(
            backend="nccl", init_method=f"tcp://{master['master_address']}:{master['master_port']}",
            world_size=world_size, rank=0, group_name=self.group_name)
        for t in threads:
            t.join()
        _check(answers, "/init_weights_update_group", engine.pool.urls)

    def __call__(self, engine, policy, version: str) -> None:
        named = [(name, tensor.detach().to("cuda").contiguous()) for name, tensor in policy.hf_named_tensors()]
        on_leader(lambda: self._broadcast(engine, named, version))  # the export above is collective

    def _broadcast(self, engine, named, version: str) -> None:
        if self.group is None:
            self._init_group(engine)
        buckets, current, size = [], [], 0
        for name, tensor in named:
            if current and size + tensor.numel() * tensor.element_size() > BUCKET_BYTES:
                buckets.append(current)
                current, size = [], 0
            current.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
        buckets.append(current)
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            payload = {"names": [n for n, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                       "shapes": [list(t.shape) for _, t in bucket], "group_name": self.group_name,
                       "flush_cache": False, **({"weight_version": version} if last else {})}
            answers: list = []
            request = threading.Thread(target=lambda: answers.extend(
                engine.pool.broadcast("/update_weights_from_distributed", payload)))
            request.start()  # the servers post their receives; rank 0 sends
            for _, tensor in bucket:
                torch.distributed.broadcast(tensor, src=0, group=self.group)
            request.join()
            _check(answers, "/update_weights_from_distributed", engine.pool.urls)
        _flush(engine)


def sync_address(configured: str, server_urls: list[str]) -> str:
    """Where the servers reach trainer rank 0 for the NCCL group: `configured` (rollout.sglang.sync_address: on a
    multi-node job the node's Slurm NodeAddr, as its batch script derives it), else this host's address on the route
    to the first server.

    Not ``gethostbyname(gethostname())``: on many nodes the hostname resolves to 127.0.1.1 or to a management
    network the servers cannot reach."""
    if configured:
        return configured
    server = urllib.parse.urlsplit(server_urls[0])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((server.hostname, server.port or 80))  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]
