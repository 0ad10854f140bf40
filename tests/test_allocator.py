"""``megaopd.run.allocator.keep_heap``: a CPU trainer's freed activations stay in the process for the next step.

Each case runs in an interpreter of its own (the setting is process-wide). A 4 MiB block, above glibc's starting
mmap threshold, is its own mapping and goes back to the kernel when freed, so the process's resident memory falls;
with ``keep_heap`` it comes from the heap and stays resident, to be reused without faulting its pages in again.
The trainer's speed that buys is measured in bench/grpo_vs_trl.py (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")

PROBE = """
import json, sys, torch
from megaopd.run.allocator import keep_heap

def rss_kb():
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmRSS")).split()[1])

took = keep_heap() if sys.argv[1] == "keep" else None
before = rss_kb()
blocks = [torch.empty(1 << 20).fill_(1.0) for _ in range(4)]  # 4 x 4 MiB of float32, touched
held = rss_kb()
del blocks
print(json.dumps({"took": took, "held_kb": held - before, "after_free_kb": rss_kb() - before}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1], check=True)
    return json.loads(out.stdout.splitlines()[-1])


def test_freed_blocks_stay_resident_with_keep_heap():
    kept = _probe("keep")
    assert kept["took"] is True
    assert kept["held_kb"] >= 15 * 1024
    assert kept["after_free_kb"] >= 0.9 * kept["held_kb"], kept


def test_without_it_freed_blocks_go_back_to_the_kernel():
    """The negative control: glibc's default hands the same blocks back, which the next step faults in anew."""
    default = _probe("default")
    assert default["held_kb"] >= 15 * 1024
    assert default["after_free_kb"] <= 0.25 * default["held_kb"], default


def test_the_process_start_sets_it_and_the_trainer_never(assets, tmp_path, monkeypatch):
    """The setting is the process's: `megaopd train` takes it where its process starts, for a CPU run only; a Trainer
    built in a process that is not its own (a test, a library caller) leaves the process's allocator alone."""
    from megaopd import cli
    from megaopd.run import allocator
    from megaopd.run import trainer
    from tests.conftest import run_config, tiny_overrides

    calls = []
    monkeypatch.setattr(allocator, "keep_heap", lambda: calls.append("keep_heap") or True)
    trainer.Trainer(run_config(assets, tmp_path / "library")).close()
    assert calls == []
    monkeypatch.setattr(trainer, "train", lambda cfg: {"final": {}})  # the placement, not a run
    config = str(Path(__file__).resolve().parents[1] / "configs" / "embedded" / "grpo.yaml")
    for device, expected in (("cpu", ["keep_heap"]), ("cuda", [])):
        calls.clear()
        assert cli.main(["train", config, *tiny_overrides(assets, tmp_path / device), f"model.device={device}"]) == 0
        assert calls == expected, device
