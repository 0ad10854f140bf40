"""The megatron policy on the fake accelerator (tests/fake_device.py), and its logits workspace against the plan.

One torchrun launch of two CPU processes (gloo) runs tests/megatron_device_worker.py: at TP=2 and at PP=2 it scores
(realised-token and top-k logprobs) and takes a GRPO and a top-k OPD update, in 3 micro-batches with the chunked,
recomputed vocabulary loss, on the fake device; then, at TP=2, it measures the peak of [.., V/tp] tensors over a
GRPO and a top-k OPD update (the megatron backend's vocabulary KL) at two vocabulary sizes, which `megaopd plan`
must match within TOLERANCE.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_config
from vocab_bytes import TOLERANCE, model_dir, planned_vocab_bytes

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install -e '.[megatron]')")
pytest.importorskip("mbridge", reason="mbridge not installed (pip install -e '.[megatron]')")

WORKER = Path(__file__).parent / "megatron_device_worker.py"
LAYOUTS = ("tp2", "pp2")
SHAPES = ((4096, 40), (12288, 104))  # (vocabulary, positions per sequence = per output-layer chunk)
UPDATE_PATH = ("megatron/", "objectives.py", "batch.py")


@pytest.fixture(scope="module")
def results(assets, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("megatron_device")
    (root / "models").mkdir()
    for name in ("qwen3-tiny", "qwen3-tiny-seed1"):
        (root / "models" / name).symlink_to(assets / "models" / name)
    for vocab, _ in SHAPES:
        model_dir(root / "models", vocab)
    out = root / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
           str(root), str(out), *(f"{vocab}x{seq}" for vocab, seq in SHAPES)]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=240)
    if proc.returncode:
        errors = [line for line in proc.stderr.splitlines() if "Warning" not in line and "warn" not in line]
        pytest.fail("megatron device worker failed:\n" + "\n".join(errors[-60:]))
    return {"root": root, **{p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_megatron_policy_keeps_every_tensor_on_its_device(results, layout):
    for rank, seen in enumerate(results[f"device_{layout}"]["ranks"]):
        assert seen["violations"] == [], f"rank {rank}:\n" + "\n".join(seen["violations"][:20])
        assert seen["not_on_host"] == [], f"rank {rank}: results left on the device: {seen['not_on_host']}"
        assert all(math.isfinite(loss) for loss in seen["losses"]), seen["losses"]
        # Two scoring calls and two updates of 3 micro-batches each: a host sync in megaopd's update path at most
        # once per call, not per micro-batch or metric.
        ours = {site: n for site, n in seen["syncs"].items() if site.startswith(UPDATE_PATH)}
        assert all(n <= 2 for n in ours.values()), f"rank {rank}: {ours}"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("form", ["grpo", "topk"])
@pytest.mark.parametrize("vocab,seq", SHAPES)
def test_planned_megatron_logits_workspace_covers_the_measured_one(results, assets, tmp_path, vocab, seq, form):
    opd = {"opd.form": form, "opd.topk": 8, "opd.teachers.*": results["root"] / "models" / f"v{vocab}"} \
        if form != "grpo" else {}
    cfg = run_config(assets, tmp_path, "opd" if opd else "grpo", **opd, **{
        "model.path": results["root"] / "models" / f"v{vocab}", "model.backend": "megatron", "model.megatron.tp": 2,
        "plan.nodes": 1, "plan.gpus_per_node": 2, "train.logit_chunk_rows": seq, "train.micro_batch_size": 4,
        "train.prompts_per_step": 1, "rollout.samples_per_prompt": 4, "plan.prompt_tokens": 8,
        "rollout.max_new_tokens": seq - 8})
    measured = max(rank["peak"] for rank in results[f"workspace_{form}_{vocab}"]["ranks"])
    planned = planned_vocab_bytes(cfg)
    print(f"megatron {form} tp2 vocab {vocab} chunk {seq}: planned {planned / 2**20:.2f} MiB, measured "
          f"{measured / 2**20:.2f} MiB, ratio {planned / measured:.3f}")
    assert measured > 0
    assert abs(planned / measured - 1) <= TOLERANCE, (planned, measured)
