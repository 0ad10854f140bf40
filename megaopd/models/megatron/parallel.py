"""Process groups: megatron's global parallel state for the student, and separate groups for a teacher whose TP
differs from the student's (an 8B teacher at TP=4 beside a 1.7B student at TP=1, on the same ranks).

Every rank of ``torchrun`` runs the same program; ranks are laid out tp-fastest, then dp, then pp (megatron's
default order), so world_size = tp * dp * pp.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


def init_distributed() -> None:
    """One process group for the whole job: NCCL on GPUs, gloo on CPU (tests and the CPU demo)."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        raise RuntimeError("model.backend=megatron runs under torchrun (e.g. `torchrun --nproc-per-node 2 -m "
                           "megaopd.models.megatron.launch CONFIG model.backend=megatron ...`); RANK/WORLD_SIZE are not set")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        try:  # megatron-core calls CUDA directly; only the CPU rehearsal entry point redirects those calls
            torch.cuda.current_device()
        except (AssertionError, RuntimeError):
            raise RuntimeError("model.backend=megatron needs CUDA GPUs (megatron-core calls CUDA directly); on CPU "
                               "it runs only under the rehearsal entry point, which redirects those calls "
                               "(torchrun ... -m megaopd.models.megatron.cpu_launch). Use model.backend=hf on CPU.") from None
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def model_device(requested: str) -> torch.device:
    """Where megatron puts this rank's model: cuda:LOCAL_RANK on GPUs (``init_distributed``), else the CPU.

    ``model.device`` does not move a megatron model; it must name that place (``cuda`` or ``cuda:<LOCAL_RANK>``
    on GPUs, ``cpu`` without), or the run stops here instead of quietly training somewhere else.
    """
    actual = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        asked = torch.device(requested)
    except RuntimeError:
        raise ValueError(f"model.device={requested!r} is not a torch device; megatron runs this rank on "
                         f"{actual}") from None
    if asked.type != actual.type or asked.index not in (None, actual.index):
        local = f" (LOCAL_RANK {os.environ.get('LOCAL_RANK', 0)})" if actual.type == "cuda" else ""
        raise ValueError(f"model.device={requested} but megatron places this rank's model on {actual}{local}: "
                         f"set model.device={actual.type}, and choose GPUs with CUDA_VISIBLE_DEVICES / torchrun")
    return actual


def init_model_parallel(tp: int, pp: int, seed: int = 0) -> None:
    """megatron's global parallel state for the student; a second call must ask for the same layout."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    init_distributed()
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not a multiple of tp*pp = {tp}*{pp}")
    if mpu.model_parallel_is_initialized():
        have = (mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise ValueError(f"megatron parallel state is already (tp, pp) = {have}, asked for {(tp, pp)}")
        return
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


@dataclass
class Layout:
    """What a model needs to know about its place in the job (mbridge's ParallelStates carries the same)."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: object
    pp_group: object
    dp_group: object
    pg_collection: object = None  # megatron ProcessGroupCollection for a model off the global state

    def parallel_states(self):
        from mbridge.core.parallel_states import ParallelStates

        return ParallelStates(tp_size=self.tp, tp_rank=self.tp_rank, pp_size=self.pp, pp_rank=self.pp_rank,
                              vpp_size=None, tp_group=self.tp_group, pp_group=self.pp_group,
                              cp_group=self.pg_collection.cp if self.pg_collection else None)


def student_layout() -> Layout:
    from megatron.core import parallel_state as mpu

    return Layout(tp=mpu.get_tensor_model_parallel_world_size(), pp=mpu.get_pipeline_model_parallel_world_size(),
                  dp=mpu.get_data_parallel_world_size(), tp_rank=mpu.get_tensor_model_parallel_rank(),
                  pp_rank=mpu.get_pipeline_model_parallel_rank(), dp_rank=mpu.get_data_parallel_rank(),
                  tp_group=mpu.get_tensor_model_parallel_group(), pp_group=mpu.get_pipeline_model_parallel_group(),
                  dp_group=mpu.get_data_parallel_group())


_TEACHER_LAYOUTS: dict[int, Layout] = {}


def teacher_layout(tp: int) -> Layout:
    """Groups for a forward-only model at TP=`tp`, PP=1 on all ranks (dp = world / tp); built once per tp.

    Creating groups is collective: every rank must ask for the same teacher layouts in the same order.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    if tp in _TEACHER_LAYOUTS:
        return _TEACHER_LAYOUTS[tp]
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp:
        raise ValueError(f"teacher tp={tp} does not divide the world size {world}")
    tp_group = dp_group = pp_group = None
    for start in range(0, world, tp):  # tp-fastest, like the student
        group = dist.new_group(list(range(start, start + tp)))
        if start <= rank < start + tp:
            tp_group = group
    for offset in range(tp):
        group = dist.new_group(list(range(offset, world, tp)))
        if rank % tp == offset:
            dp_group = group
    for r in range(world):
        group = dist.new_group([r])
        if r == rank:
            pp_group = group
    pgs = ProcessGroupCollection(tp=tp_group, pp=pp_group, cp=pp_group, dp=dp_group, dp_cp=dp_group,
                                 embd=None, pos_embd=None, tp_cp=tp_group, mp=tp_group)
    layout = Layout(tp=tp, pp=1, dp=world // tp, tp_rank=rank % tp, pp_rank=0, dp_rank=rank // tp,
                    tp_group=tp_group, pp_group=pp_group, dp_group=dp_group, pg_collection=pgs)
    _TEACHER_LAYOUTS[tp] = layout
    return layout
