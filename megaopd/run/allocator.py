"""glibc's allocator told to keep the heap a CPU training step reuses, instead of handing it back to the kernel.

A step on CPU allocates its activations afresh, op after op, and frees them by the end of the backward. glibc serves
a block above its mmap threshold with new pages from the kernel; its dynamic rule raises that threshold to the
largest block freed so far (up to 32 MiB), but also trims the heap's free top once it exceeds twice the threshold,
so the next step faults the same pages in again, zero-filled, inside the ops that write them (measured on the GRPO
bench's qwen3-tiny step: a [4784, 192] float multiply at 1.6 ms, its matmul beside it at 2.2 ms). Fixed values, a
32 MiB threshold and trimming only above 2 GiB, keep those blocks in the heap: the bench's step 0.185-0.190 ->
0.168-0.178 s on one thread, its peak RSS unchanged (docs/benchmarks.md). Freed memory stays with the process,
which holds its high-water mark anyway for the next step. Blocks above 32 MiB (a real model's weights) still come and go as their own mappings.

Only glibc has ``mallopt``: elsewhere (macOS, musl), and where another allocator is preloaded (it takes no notice),
nothing changes.

The setting is the process's, not a run's: ``keep_heap_for`` is called where a process that trains on the CPU
starts (``megaopd train``, a study's runner and its stage workers, the Megatron launcher, the bench drivers), never
by the trainer, which a library caller or a test builds in a process that is not its own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Iterable

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest: 4 MiB * sizeof(long) on 64-bit
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: trim only a free top above 2 GiB


def environment() -> dict[str, str]:
    """The same setting as glibc's environment variables, for a process started from here that does not call
    ``keep_heap`` itself (bench/common.py gives TRL's worker these, so the bench compares the frameworks, not the
    allocators)."""
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}


def keep_heap() -> bool:
    """Set the fixed threshold and trimming for this process (True where glibc took them)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # Setting either parameter ends the dynamic rule for both, so both are set.
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def keep_heap_for(devices: Iterable[str]) -> bool:
    """``keep_heap`` where a run of this process trains on the CPU (any of the runs' ``model.device``)."""
    return "cpu" in set(devices) and keep_heap()
