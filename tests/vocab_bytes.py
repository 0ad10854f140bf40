"""The peak bytes of live tensors with a vocabulary-wide last dimension, over a block of code (forward and
backward): the logits / KL workspace that `megaopd plan` budgets, measured on CPU at the aten level."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class VocabBytes(TorchDispatchMode):
    """Counts each storage once while any tensor made on it by an op is alive; ``peak`` is the maximum of the sum."""

    def __init__(self, widths: set[int]):
        super().__init__()
        self.widths, self.live, self.refs, self.peak = widths, 0, {}, 0

    def _release(self, key: int, nbytes: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] in self.widths:
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if key not in self.refs:
                    self.refs[key] = 0
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                self.refs[key] += 1
                weakref.finalize(t, self._release, key, nbytes)
        return out
