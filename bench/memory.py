"""Peak memory of one GRPO step and one OPD step, megaopd vs TRL.

    python bench/memory.py          # 3 alternating rounds per algorithm
    python bench/memory.py --smoke  # CI: one tiny round

Method: every measurement is its own subprocess (bench/common.py worker) that sets up the trainer, records its
resident set (VmRSS) just before the step, runs exactly one step (no warm-up), and reports its own RSS high-water
mark (VmHWM; getrusage's ru_maxrss would carry the driver's over). "Peak RSS" is the whole process (Python, torch,
the libraries each side imports, models, optimizer state, activations); "step increment" = peak - RSS before the step, i.e. what the
step itself added on top of the set-up process (0 when the peak was reached while loading). tracemalloc is not used:
it does not see torch's allocations.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import DEFAULT_ASSETS, have_trl, machine, prepare_assets, run_worker  # noqa: E402


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--student", default="qwen3-tiny")
    p.add_argument("--teacher", default="qwen3-small")
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--assets", default=str(DEFAULT_ASSETS))
    a = p.parse_args(argv)
    shapes = {"grpo": (16, 8), "opd": (32, 1)}
    if a.smoke:
        a.rounds, a.max_new, a.teacher, shapes = 1, 4, a.student, {"grpo": (2, 2)}  # seconds, not minutes: one algorithm
        common.IN_PROCESS = True  # smoke only: the RSS figures are then not per-side
    print(f"# Peak memory of one step (RSS high-water mark, one subprocess per measurement)\n\nmachine: {machine()}\n")
    if not have_trl():
        print("SKIPPED: trl is not importable (pip install 'trl>=1.16'); no memory comparison table.")
        return
    assets = prepare_assets(Path(a.assets), {a.student, a.teacher}, rows=64 if a.smoke else 512)
    print(f"student {a.student}, OPD teacher {a.teacher}, {a.max_new} new tokens, {a.rounds} alternating rounds\n")
    print("| step | side | peak RSS (MiB) | RSS before step (MiB) | step increment (MiB) |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="bench_mem_") as tmp:
        for algo, (prompts, group) in shapes.items():
            res = {"megaopd": [], "trl": []}
            for r in range(a.rounds):
                for side in (("megaopd", "trl") if r % 2 == 0 else ("trl", "megaopd")):
                    res[side].append(run_worker(side, algo, Path(tmp), f"mem_{algo}_{side}_{r}", assets=assets,
                                                student=a.student, teacher=a.teacher, prompts=prompts, group=group,
                                                max_new=a.max_new, steps=1, warmup=0, threads=1))
            for side, runs in res.items():
                peak = statistics.median(x["maxrss_kb"] for x in runs) / 1024
                before = statistics.median(x["rss_before_kb"] for x in runs) / 1024
                inc = statistics.median(max(0, x["maxrss_kb"] - x["rss_before_kb"]) for x in runs) / 1024
                print(f"| {algo.upper()} {prompts}x{group} | {side} | {peak:.0f} | {before:.0f} | {inc:.0f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
