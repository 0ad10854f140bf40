"""The ``Policy`` contract on both backends: the same cases (tests/policy_contract.py), the same bounds.

HF runs in-process; Megatron runs on CPU under gloo with TP=2 (two processes, so the vocabulary gathers over TP
are part of what is checked). Each backend is measured against transformers' own float32 forward of the same
weights, and the two backends' first training step against each other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from policy_contract import run_contract

TOL = 1e-5  # float32 forwards of the same weights
CONTRACT = Path(__file__).parent / "policy_contract.py"


def check(result: dict) -> None:
    assert result["is_policy"]
    pad, eos, tok_pad, tok_eos = result["ids"]
    assert (pad, eos) == (tok_pad, tok_eos) and pad != eos
    assert result["shape_matches"]
    for key in ("logprobs", "logprobs_t2", "full_logprobs", "topk", "topk_realised", "topk_tail"):
        assert result[key] < TOL, (key, result[key])
    assert result["logprobs_off_response"] == 0.0 and result["logprobs_under"] == 0.0
    assert result["topk_ids_agree"] == 1.0
    # the reported loss is the token-mean over the whole minibatch, and one step lowers it
    assert result["loss_reported"] == pytest.approx(result["loss_before"], abs=TOL)
    assert result["grad_norm"] > 0 and result["loss_after"] < result["loss_before"]
    assert result["second_step_moves"] > 1e-4 and result["state_restored"] < TOL and result["resumed_step"] < TOL
    assert result["save_hf"] < TOL and 0 <= result["named_tensors"] < TOL


@pytest.fixture(scope="module")
def hf_result(assets, tmp_path_factory) -> dict:
    from megaopd.config import ModelConfig, OptimConfig
    from megaopd.models.hf_policy import HFPolicy

    model_dir = assets / "models" / "qwen3-tiny"
    return run_contract(HFPolicy(ModelConfig(path=str(model_dir)), OptimConfig()), model_dir,
                        tmp_path_factory.mktemp("hf_contract"))


def test_hf_policy_meets_the_contract(hf_result):
    check(hf_result)


@pytest.mark.slow
def test_megatron_policy_meets_the_contract_and_steps_like_hf(assets, hf_result, tmp_path):
    pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install -e '.[megatron]')")
    pytest.importorskip("mbridge", reason="mbridge not installed (pip install -e '.[megatron]')")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(CONTRACT),
           str(assets / "models" / "qwen3-tiny"), str(tmp_path), "2"]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode:
        errors = [line for line in proc.stderr.splitlines() if "arn" not in line]
        pytest.fail("megatron contract run failed:\n" + "\n".join(errors[-60:]))
    result = json.loads((tmp_path / "contract.json").read_text())
    check(result)
    # the same Adam step from the same weights on the same batch
    assert result["loss_after"] == pytest.approx(hf_result["loss_after"], abs=1e-4)
    assert result["grad_norm"] == pytest.approx(hf_result["grad_norm"], rel=1e-4)
