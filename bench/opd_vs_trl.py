"""OPD step throughput, megaopd vs TRL, on the same tiny HF model, prompts, group size, generation length and optimizer.

    python bench/opd_vs_trl.py            # 5 A/B rounds, 1 warm-up + 3 timed steps per run, 1 thread
    python bench/opd_vs_trl.py --rounds 11  # more A/B rounds (the quiet-machine measurement)
    python bench/opd_vs_trl.py --profile  # also cProfile one run per side (where the time goes)
    python bench/opd_vs_trl.py --smoke    # CI: one tiny round, checks that the script still runs

Both sides generate exactly --max-new tokens per sample (the benchmark model's EOS id lies outside its vocabulary)
and the table shows the generated / trained token counts of both sides, so the ratio compares equal work.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import bench_main  # noqa: E402

if __name__ == "__main__":
    bench_main("opd", sys.argv[1:])
