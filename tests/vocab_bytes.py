"""The peak bytes of live tensors with a vocabulary-wide last dimension, over a block of code (forward and
backward): the logits / KL workspace that `megaopd plan` budgets, measured on CPU at the aten level; and what the
tests that hold it against the plan share (tests/test_plan_workspace.py, tests/test_megatron_device.py)."""

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
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] in self.widths:
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if key not in self.refs:
                    if key in inputs:  # a view of a tensor made before the block (the head's weight .t()): not new
                        continue
                    self.refs[key] = 0
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                self.refs[key] += 1
                weakref.finalize(t, self._release, key, nbytes)
        return out


# |planned / measured - 1| at most, for every backend, form, dtype and shape measured: the plan's per-entry bytes are
# what these measure (the table is in the note of issue 25); the margin is for the allocations around the chunk.
TOLERANCE = 0.10


def model_dir(root, vocab: int):
    """The tiny Qwen3 (H = 64) at another vocabulary size, random weights: ``root/v<vocab>``."""
    from transformers import AutoModelForCausalLM

    from megaopd.models.embedded import build_model_config, build_tokenizer

    tokenizer = build_tokenizer()
    config = build_model_config("qwen3-tiny", vocab, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / f"v{vocab}")
    tokenizer.save_pretrained(root / f"v{vocab}")
    return root / f"v{vocab}"


def planned_vocab_bytes(cfg) -> float:
    """The plan's logits/KL workspace less its hidden-state chunk (rows x H, not vocabulary-wide)."""
    from megaopd.run.plan import BYTES, build_plan, resolve_arch

    item = next(i for i in build_plan(cfg).items if i.component.startswith("logits/KL workspace"))
    rows = int(item.component.split("(")[1].split()[0])
    return item.bytes - rows * resolve_arch(cfg.model.path).hidden * BYTES[cfg.model.dtype]
