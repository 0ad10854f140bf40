"""A fake accelerator for CPU tests: the device discipline a CUDA run needs, checked without a GPU.

Inside ``fake_device()``, ``FAKE`` (``cpu:0``, a device no real CPU tensor reports) plays the GPU. Tensors are
tagged as on it when made there: moved with ``.to(FAKE)``, made by a factory given ``device=FAKE``, or computed
from a tagged tensor; the rest are host tensors. A tagged tensor's ``.device`` reads ``FAKE``, so code that builds
on ``x.device`` follows it there, and code that forgets the device makes a host tensor; any other tensor reads its
own device (a meta one stays meta: transformers builds a model there). A ``TorchFunctionMode``
then records, as CUDA would refuse them (or as they would cost a GPU run):

* an op mixing device and host tensors (a host 0-dim scalar is allowed, as on CUDA; so is a host index or a copy);
* a random draw whose generator is not on the device of the tensor it fills (``torch.Generator`` is swapped for a
  subclass that remembers the device it was asked for);
* ``.numpy()`` of a device tensor, and float64 on the device (no fast float64 on GPUs, none at all on some);
* host syncs (``.item()``, ``.tolist()``, ``bool`` / ``float`` / ``int`` of a device tensor, ``.cpu()``), counted
  by call site in megaopd, so a test can bound them per step.

It cannot see what runs below the Python dispatcher: tensors made inside C++ kernels or autograd (gradients are
tagged when read through ``.grad``), collectives (``torch.distributed``), CUDA-only kernels, streams and memory;
nor code paths only a real GPU takes (``if torch.cuda.is_available()``).
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter

import torch
import torch.utils.checkpoint as checkpoint
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

FAKE = torch.device("cpu", 0)
_TAG = "_on_fake_device"
_SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
          torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.cpu}
_MIXING_ALLOWED = {torch._has_compatible_shallow_copy_type, torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.copy_, torch.Tensor.to,
                   torch.Tensor.cpu, torch.Tensor.index_select, torch.Tensor.share_memory_}


def on_device(t: torch.Tensor) -> bool:
    return getattr(t, _TAG, False)


def put_on_device(*tensors: torch.Tensor) -> None:
    """Tag tensors made outside the mode as the device's (a model a backend built in place, as megatron does)."""
    for t in tensors:
        setattr(t, _TAG, True)


class FakeGenerator(torch.Generator):
    """A torch.Generator that remembers whether it was made for the fake device (a CPU generator forgets the index)."""

    def __new__(cls, device="cpu"):
        generator = super().__new__(cls, "cpu")
        generator.on_fake = torch.device(device) == FAKE
        return generator


def _target(func, args, kwargs):
    """The device an op asks for explicitly (a factory's ``device=``, ``.to(device)``, ``.cpu()``), else None."""
    if func is torch.Tensor.cpu:
        return torch.device("cpu")
    device = kwargs.get("device")
    if device is None and func is torch.Tensor.to:
        device = next((a for a in args[1:] if isinstance(a, (str, torch.device))), None)
    return None if device is None else torch.device(device)


def _where(innermost: bool = False) -> str:
    """The innermost megaopd frame of the caller; with ``innermost``, "library" unless the op's own caller is in
    megaopd (a sync inside transformers or megatron is theirs)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    while frame is not None:
        name = frame.f_code.co_filename
        if "/megaopd/" in name and "/site-packages/" not in name:
            return f"{name.split('/megaopd/', 1)[1]}:{frame.f_lineno}"
        if innermost and "/torch/" not in name:
            return "library"
        frame = frame.f_back
    return "outside megaopd"


class DeviceDiscipline(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.violations: list[str] = []
        self.syncs: Counter[str] = Counter()

    def _violation(self, what: str) -> None:
        self.violations.append(f"{_where()}: {what}")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == torch.Tensor.device.__get__:
            return FAKE if on_device(args[0]) else func(*args, **kwargs)
        if func == torch.Tensor.data.__set__:  # Module.to moves a parameter so: its data to the new tensor's place
            setattr(args[0], _TAG, on_device(args[1]))
            return func(*args, **kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        dev = [t for t in tensors if on_device(t)]
        if dev and func in _SYNCS:
            self.syncs[f"{_where(innermost=True)} {func.__name__}"] += 1
        if dev and func is torch.Tensor.numpy:
            self._violation("numpy() of a device tensor (CUDA refuses it)")
        host = [t for t in tensors if not on_device(t) and t.dim() > 0]
        if dev and host and func not in _MIXING_ALLOWED:
            self._violation(f"{getattr(func, '__name__', func)} mixes device tensors with host tensors of shape "
                            f"{[tuple(t.shape) for t in host][:3]}")
        target = _target(func, args, kwargs)
        tag = (target == FAKE) if target is not None else bool(dev)
        generator = kwargs.get("generator")
        if generator is not None and getattr(generator, "on_fake", False) != tag:
            self._violation(f"{func.__name__} draws on the {'device' if tag else 'host'} with a generator made for "
                            f"the {'device' if getattr(generator, 'on_fake', False) else 'host'}")
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        in_place = (name.endswith("_") and not name.startswith("__")) or (name.startswith("__i") and name not in
                                                                          ("__index__", "__int__", "__invert__"))
        if in_place or "out" in kwargs or func is torch.Tensor.__setitem__:
            return out  # in place: the tensor keeps its place
        inputs = {id(t) for t in tensors}

        def tagged(t):
            if not isinstance(t, torch.Tensor):
                return t
            if id(t) in inputs and on_device(t) != tag:
                t = t.view_as(t)  # .cpu() / .to() returned its input: a new view takes the new place
            if tag:
                if t.dtype == torch.float64:
                    self._violation(f"{name} makes a float64 tensor on the device")
                setattr(t, _TAG, True)
            elif on_device(t):
                delattr(t, _TAG)
            return t
        return tree_map(tagged, out)


@contextlib.contextmanager
def fake_device(monkeypatch):
    """Run the block with FAKE as the accelerator; yields the DeviceDiscipline that records what it saw."""
    monkeypatch.setattr(torch, "Generator", FakeGenerator)
    # A backward runs outside the mode (autograd.backward is itself one of its ops), so a chunk that
    # torch.utils.checkpoint recomputes there reads as a host tensor: compare its shape and dtype only.
    monkeypatch.setitem(checkpoint._allowed_determinism_checks_to_fns, "default",
                        lambda x: {"shape": x.shape, "dtype": x.dtype})
    mode = DeviceDiscipline()
    with mode:
        yield mode
