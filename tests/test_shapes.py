"""The shape tier: real architectures at full width and full vocabulary with one or two layers (issue 14).

Tiny models (64 wide, 259 tokens, head_dim = hidden / heads) cannot show bugs that only real shapes have: a
151,936-column vocabulary padded for TP, Qwen3's head_dim (128) that is not hidden / heads (64), a [rows x V] tensor
that only hurts at V = 151,936. Here, at Qwen3-0.6B's width and vocabulary: one GRPO step (bf16 compute, fp32
masters) and one full-vocabulary OPD step through the trainer, the FLOP audit, the Megatron backend at TP=2 against
HF, and a real SGLang CPU server loading the shape and taking a verified weight sync. A negative control shows that
a head_dim bug passes at tiny shapes and is caught here.

    pytest -m shapes tests/test_shapes.py      # CI runs it (marked slow as well)

Peak RSS ~4 GB for the trainer tests (a 0.19B-parameter policy with Adam, a teacher), ~7 GB for the Megatron pair.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import run_config
from machine_memory import alone
from megaopd.accounting import flops
from megaopd.models.embedded import build_model
from megaopd.run.flop_audit import audit_step
from megaopd.accounting.metrics import read_metrics
from megaopd.run.trainer import Trainer

pytestmark = [pytest.mark.shapes, pytest.mark.slow]
SHAPE = "qwen3-0.6b"
PROBE = "model.layers.0.mlp.down_proj.weight"



@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shapes")
    return {"student": build_model(f"{SHAPE}:layers=2", root / "student", seed=0),
            "teacher": build_model(f"{SHAPE}:layers=2", root / "teacher", seed=1),
            "one_layer": build_model(f"{SHAPE}:layers=1", root / "one_layer", seed=0)}


def shape_run(assets, run_dir, model: Path, algorithm: str = "grpo", **overrides):
    return run_config(assets, run_dir, algorithm, **{
        "model.path": model, "train.steps": 1, "train.prompts_per_step": 2, "rollout.samples_per_prompt": 2,
        "rollout.max_new_tokens": 8, "train.micro_batch_size": 2, "eval.every": 100, "eval.prompts_per_domain": 1,
        "eval.final_prompts_per_domain": 1, "eval.sampled": False, "checkpoint.every": 1000, **overrides})


def probe_weight(model_dir: Path) -> torch.Tensor:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return f.get_tensor(PROBE).float()


def one_step(cfg) -> dict:
    summary = Trainer(cfg).fit()
    assert summary["steps"] == 1
    (step,) = [m for m in read_metrics(cfg.run_dir) if m.get("step") == 1 and "train/loss" in m]
    assert torch.isfinite(torch.tensor(step["train/loss"])) and 0 < step["train/grad_norm"] < float("inf")
    assert step["flops/total_stage"] > 0
    return step


def alternating_rewards(tokenizer, samples) -> tuple[float, int]:
    """A random 152k-way model never answers right, and GRPO with equal rewards has nothing to follow: the test
    sets the rewards (alternating within each group) so the update is a real one."""
    for i, sample in enumerate(samples):
        sample.reward = float(i % 2)
    return 0.0, 0


def test_grpo_step_bf16_over_fp32_masters_at_full_vocab(assets, shapes, tmp_path, monkeypatch):
    monkeypatch.setattr("megaopd.run.trainer.score_samples", alternating_rewards)
    # One group of 2: bf16 matmuls are emulated on a CPU without AVX-512 BF16, and the shape tier's longest test
    # is this step's 152k-way projections; the alternating rewards still give the group a real update.
    cfg = shape_run(assets, tmp_path / "grpo", shapes["student"], **{
        "model.dtype": "bfloat16", "model.master_dtype": "float32", "optim.lr": 1e-3, "train.prompts_per_step": 1})
    one_step(cfg)
    assert not torch.equal(probe_weight(tmp_path / "grpo" / "final"), probe_weight(shapes["student"]))


def test_full_vocab_opd_step_at_full_vocab(assets, shapes, tmp_path):
    cfg = shape_run(assets, tmp_path / "opd", shapes["student"], "opd", **{
        "opd.teachers.*": shapes["teacher"], "opd.form": "full_vocab", "rollout.samples_per_prompt": 1})
    step = one_step(cfg)
    assert step["train/teacher/*/reverse_kl_k1"] > 0  # two random 152k-way models disagree
    assert not torch.equal(probe_weight(tmp_path / "opd" / "final"), probe_weight(shapes["student"]))


def audit(assets, tmp_path, model: Path) -> dict:
    cfg = shape_run(assets, tmp_path, model, **{"train.prompts_per_step": 1, "rollout.samples_per_prompt": 2})
    return audit_step(cfg)


def audit_gaps(rows: dict) -> dict[str, float]:
    return {c: abs(r.measured / r.executed_form - 1) for c, r in rows.items() if r.executed_form}


def test_flop_audit_at_full_width_and_vocab(assets, shapes, tmp_path):
    rows = audit(assets, tmp_path / "run", shapes["one_layer"])
    assert {c for c, r in rows.items() if r.executed_form} == {"rollout", "old_logprob", "train"}
    for component, row in rows.items():
        assert row.booked == row.ledger_form, component
    assert max(audit_gaps(rows).values()) < 0.02, audit_gaps(rows)


def test_negative_control_a_head_dim_bug_passes_tiny_and_fails_here(assets, shapes, tmp_path, monkeypatch):
    """A broken copy of ModelShape.from_hf_config that assumes head_dim = hidden / heads (true of every tiny
    preset, false for Qwen3: 128 vs 1024 / 16 = 64): the tiny audit still agrees, the real-shape audit does not."""
    original = flops.ModelShape.from_hf_config.__func__

    def broken(cls, cfg, gated_mlp=True):
        shape = original(cls, cfg, gated_mlp)
        return flops.ModelShape(shape.n_layers, shape.d_model, shape.n_heads, shape.n_kv_heads,
                                shape.d_model // shape.n_heads, shape.d_ff, shape.vocab_size, gated_mlp)
    monkeypatch.setattr(flops.ModelShape, "from_hf_config", classmethod(broken))
    tiny = audit_gaps(audit(assets, tmp_path / "tiny", assets / "models" / "qwen3-tiny"))
    real = audit_gaps(audit(assets, tmp_path / "real", shapes["one_layer"]))
    print("head_dim bug: relative audit gap tiny", tiny, "real", real)
    assert max(tiny.values()) < 0.02  # the tiny tier cannot see it
    assert max(real.values()) > 0.05  # the shape tier does


@pytest.fixture(scope="module")
def megatron_tp2(shapes, tmp_path_factory) -> dict:
    """One torchrun launch of tests/megatron_shapes_worker.py: Megatron TP=2 and HF on the one-layer shape."""
    pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install -e '.[megatron]')")
    pytest.importorskip("mbridge", reason="mbridge not installed (pip install -e '.[megatron]')")
    out = tmp_path_factory.mktemp("megatron") / "tp2.json"
    worker = Path(__file__).parent / "megatron_shapes_worker.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(worker),
           str(shapes["one_layer"]), str(shapes["teacher"]), str(out)]
    with alone("megatron tp2 at Qwen3-0.6B width"):  # 11.4 GB above idle
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                              timeout=900)
    if proc.returncode:
        pytest.fail("megatron shapes worker failed:\n" + "\n".join(proc.stderr.splitlines()[-60:]))
    result = json.loads(out.read_text())
    print(json.dumps(result, indent=1))
    return result


TP_TOLERANCE = 1e-4  # fp32 on both sides; reductions over 1024-wide rows and 152k columns


def test_megatron_tp2_matches_hf_at_full_vocab(megatron_tp2):
    result = megatron_tp2
    assert result["vocab"] == 151936 and result["padded_vocab"] == 152064  # a multiple of 128 * tp
    assert result["parity"]["logits_columns"] == 151936  # the padded columns never reach a caller
    for what in ("logits", "full_logprobs", "logprobs"):
        assert result["parity"][what] < TP_TOLERANCE, (what, result["parity"])
    assert [s["objective"] for s in result["steps"]] == ["GRPO", "OPD"]
    for step in result["steps"]:
        assert step["loss"] < TP_TOLERANCE * max(1.0, abs(step["loss_hf"])), step
    for step in result["steps"]:  # GRPO, then top-K + tail OPD over the vocab-parallel logits
        assert step["grad_norm"] < 1e-3 * step["grad_norm_hf"], step
    assert result["weights_after_steps"] < TP_TOLERANCE  # both steps moved the weights the same way


@pytest.mark.sglang
def test_sglang_cpu_server_loads_the_shape_and_takes_a_verified_sync(assets, shapes, tmp_path):
    from test_sglang import TOLERANCE, server_config

    from megaopd.data.batch import collate
    from megaopd.data.rows import load_rows
    from megaopd.models.hf_policy import HFPolicy
    from megaopd.rollout.serving.engine import SGLangEngine
    from megaopd.rollout.serving.server import SGLangServer

    model = shapes["one_layer"]
    sglang = server_config()
    # On CPU the share is of the machine's free memory, and the 0.7 GB of fp32 weights need more than the tiny
    # model's 5%; max_total_tokens still caps the KV cache.
    fraction = sglang.server_args.index("--mem-fraction-static") + 1
    sglang.server_args = [*sglang.server_args[:fraction], "0.5", *sglang.server_args[fraction + 1:]]
    server = SGLangServer.launch(str(model), sglang, "float32", tmp_path / "server.log")
    try:
        cfg = shape_run(assets, tmp_path / "run", model, **{"rollout.engine": "sglang"})
        cfg.rollout.sglang = sglang
        cfg.rollout.sglang.urls = [server.url]
        policy = HFPolicy(cfg.model)
        engine = SGLangEngine(cfg.rollout, cfg.model, cfg.run_dir, policy)
        rows, _ = load_rows(str(assets / "data" / "arith_add" / "train.jsonl"))
        samples = engine.generate(rows[:2], 2, temperature=1.0, max_new_tokens=8,
                                  generator=torch.Generator().manual_seed(0))
        batch = collate(samples, policy.pad_id)
        gap = float(((policy.logprobs(batch) - batch.rollout_logprobs).abs() * batch.response_mask).max())
        assert gap < TOLERANCE, f"server vs trainer logprobs at V=151,936 differ by {gap:.2e}"
        with torch.no_grad():  # an update the server has not seen: the sync must carry all 0.17B parameters
            for p in policy.model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        engine.sync_weights(policy)  # disk sync, then the logprob probe: raises if the server serves other weights
        assert engine.weight_version == 1 and server.get("/model_info")["weight_version"] == "1"
        engine.close()
    finally:
        server.stop()
