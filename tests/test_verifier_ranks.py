"""One reward per sample for all ranks (issue 24): under torchrun the rollouts of a step are scored once, on rank 0,
and broadcast, so ranks whose verifiers would answer differently still train on identical rewards and advantages."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install -e '.[megatron]')")
pytest.importorskip("mbridge", reason="mbridge not installed (pip install -e '.[megatron]')")

WORKER = Path(__file__).parent / "verifier_ranks_worker.py"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_megatron_trainer_at_tp2_trains_every_rank_on_rank_0s_rewards(assets, tmp_path):
    from conftest import run_config
    from megaopd.config import save_config

    config = tmp_path / "grpo.yaml"
    save_config(run_config(assets, tmp_path / "run", "grpo", **{
        "train.steps": 1, "eval.every": 100, "eval.sampled": False, "eval.prompts_per_domain": 1,
        "eval.final_prompts_per_domain": 1}), config)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
           str(tmp_path), str(config), "model.backend=megatron", "model.megatron.tp=2"]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=560)
    if proc.returncode:
        errors = [line for line in proc.stderr.splitlines() if "Warning" not in line and "warn" not in line]
        pytest.fail("worker failed:\n" + "\n".join(errors[-60:]))
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # Rank 1's verifier flips every verdict of rank 0's; scored on each rank, the ranks' rewards would differ.
    assert rank0["rewards"] and rank0["rewards"] == rank1["rewards"]
    assert rank0["advantages"] == rank1["advantages"]
    assert any(a != 0 for step in rank0["advantages"] for row in step for a in row)  # a real update
    assert rank0["own"] and rank1["own"] == []  # only rank 0 ever ran the verifier
