"""One reward per sample for all ranks: under torchrun the rollouts of a step are scored once and broadcast, so
ranks whose verifiers would answer differently still train on identical rewards and advantages (issue 24)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "verifier_ranks_worker.py"


@pytest.mark.timeout(300)
def test_ranks_whose_verifiers_disagree_get_identical_rewards_and_advantages(tmp_path):
    out = tmp_path / "ranks.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
           str(out)]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = json.loads(out.read_text())
    assert rank0["own"] != rank1["own"]  # the verifier really answers differently on the two ranks
    assert rank0["rewards"] == rank1["rewards"] == rank0["own"]  # rank 0's verdicts, everywhere
    assert rank0["advantages"] == rank1["advantages"]
    assert any(a != 0 for row in rank0["advantages"] for a in row)
