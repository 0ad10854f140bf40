"""megatron-core on CPU under gloo, for CPU rehearsals and CI only: never imported on a GPU cluster.

megatron-core hard-codes CUDA in a few places (each redirect below says which call and why it exists; every one
was shown necessary by leaving it out). ``redirect_cuda_to_cpu()`` sends those calls to
the CPU. Two users: the test processes (tests/megatron_cpu.py) and ``python -m megaopd.models.megatron.cpu_launch``, the
trainer entry point of a cluster rehearsal on CPU nodes (launch setting ``trainer_module``). The GPU path,
``megaopd.models.megatron.launch``, never imports this module: there the real calls run.

It must run before the first megatron import that binds one of these names (``tensor_parallel/layers.py`` binds the
RNG tracker at import, which is why models are built with ``use_cpu_initialization=True``).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types

import torch

# Tensor factories that some megatron modules call with a hard-coded device="cuda".
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like")


def _cpu_device(device):
    if device is None:
        return None
    text = str(device) if not isinstance(device, int) else "cuda"
    return "cpu" if text.startswith("cuda") else device


class _CpuTorch(types.ModuleType):
    """A per-module stand-in for ``torch`` whose factories map cuda -> cpu; everything else is torch itself.

    Only the modules that hard-code device="cuda" get it: wrapping ``torch.zeros`` globally breaks the identity
    checks torch uses under ``with torch.device("meta")`` (transformers' from_pretrained then builds garbage RoPE).
    """

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name in _FACTORIES:
            def factory(*args, device=None, _f=value, **kwargs):
                return _f(*args, device=_cpu_device(device), **kwargs)
            return factory
        return value


class _NullRNGTracker:
    """Megatron's CUDA RNG tracker forks CUDA generators for dropout; on CPU with dropout 0 there is nothing to fork."""

    def fork(self, name: str = "model-parallel-rng"):
        return contextlib.nullcontext()

    def add(self, name, seed):
        pass

    def reset(self):
        pass

    def get_states(self):
        return {}

    def set_states(self, states):
        pass

    def is_initialized(self):
        return True


_TRACKER = _NullRNGTracker()
_CUDA_TYPES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
               "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}
_done = False


def redirect_cuda_to_cpu() -> None:
    global _done
    if _done:
        return
    _done = True
    # SGLang's flash_mla raises OSError (not ImportError) without libcuda; make megatron's import guard see None.
    sys.modules.setdefault("flash_mla", None)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.Tensor.cuda = lambda self, *a, **k: self
    # The optimizers dispatch on CUDA type names (DistributedOptimizer, Float16 optimizer, grad clipping).
    original_type = torch.Tensor.type

    def tensor_type(self, *args, **kwargs):
        name = original_type(self, *args, **kwargs)
        return _CUDA_TYPES.get(name, name) if not args and not kwargs else name

    torch.Tensor.type = tensor_type

    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as tp_random

    tp_random.get_cuda_rng_tracker = lambda *a, **k: _TRACKER
    tensor_parallel.get_cuda_rng_tracker = tp_random.get_cuda_rng_tracker
    for name in ("megatron.core.transformer.utils", "megatron.core.pipeline_parallel.schedules",
                 "megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads",
                 "megatron.core.utils", "megatron.core.distributed.param_and_grad_buffer"):
        importlib.import_module(name).torch = _CpuTorch()
    # Without apex/TE, torch Adam keeps a per-parameter 'step' tensor. Megatron's checkpoint load restores it from
    # the param groups as ONE tensor shared by every parameter (torch Adam then adds 1 per parameter per step),
    # and its fully_reshardable format does not store it per parameter. FusedAdam on GPU keeps 'step' in the
    # param groups, so neither arises there. Give each parameter its own copy of the restored step.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states_without_step(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        if "step" in state:
            state["step"] = state["step"].clone()
            tensors = {"step": state["step"], **tensors}
        return set_states(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states_without_step
    # Modules that did `from ... import get_cuda_rng_tracker` at import time.
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("megatron.") and hasattr(module, "get_cuda_rng_tracker"):
            module.get_cuda_rng_tracker = tp_random.get_cuda_rng_tracker
