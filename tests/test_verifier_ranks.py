"""One reward per sample for all ranks (issue 24): under torchrun the rollouts of a step are scored once, on rank 0,
and broadcast, so ranks whose verifiers would answer differently still train on identical rewards and advantages."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "verifier_ranks_worker.py"


def launch(out: Path, *args: str) -> tuple[dict, dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
           str(out), *args]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=560)
    if proc.returncode:
        errors = [line for line in proc.stderr.splitlines() if "Warning" not in line and "warn" not in line]
        pytest.fail("worker failed:\n" + "\n".join(errors[-60:]))
    return tuple(json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))


def assert_one_reward_per_sample(rank0: dict, rank1: dict) -> None:
    assert rank0["rewards"] and rank0["rewards"] == rank1["rewards"]
    assert rank0["advantages"] == rank1["advantages"]
    assert any(a != 0 for step in rank0["advantages"] for row in step for a in row)  # a real update


@pytest.mark.timeout(300)
def test_ranks_whose_verifiers_disagree_get_identical_rewards_and_advantages(tmp_path):
    rank0, rank1 = launch(tmp_path)
    assert rank0["alone"] != rank1["alone"]  # the verifier really answers differently on the two ranks
    assert_one_reward_per_sample(rank0, rank1)
    assert rank0["rewards"] == [rank0["alone"]]  # rank 0's verdicts, everywhere


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_megatron_trainer_at_tp2_trains_every_rank_on_rank_0s_rewards(assets, tmp_path):
    from conftest import run_config
    from megaopd.config import save_config

    config = tmp_path / "grpo.yaml"
    save_config(run_config(assets, tmp_path / "run", "grpo", **{
        "train.steps": 1, "eval.every": 100, "eval.sampled": False, "eval.prompts_per_domain": 1,
        "eval.final_prompts_per_domain": 1}), config)
    rank0, rank1 = launch(tmp_path, str(config), "model.backend=megatron", "model.megatron.tp=2")
    assert rank1["own"] == []  # only rank 0 ever ran the verifier
    assert_one_reward_per_sample(rank0, rank1)
