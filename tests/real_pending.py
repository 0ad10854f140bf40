"""The rest of the real tier (issue 26), not collected by CI yet: each test here is written against the imported
SmolLM2-135M-Instruct but was never seen to pass. The machine it was written on ran 15-25 processes per core and
every one of these timed out (20 minutes for the local engine's greedy decode alone). Run it on a quiet machine,

    OMP_NUM_THREADS=1 MEGAOPD_SGLANG_PYTHON=.venv-sglang/bin/python pytest tests/real_pending.py

and move the tests that pass into tests/test_real.py (then CI runs them). What each one checks: the local engine
stops at <|im_end|> and the verifier reads real answers (with a negative control: <|endoftext|> as EOS runs past
the end of the turn); an HF GRPO step, self-teacher OPD steps (top-k, full-vocab) and the exact FLOP audit; Megatron
at TP=3 / PP=2 against HF and its export (tests/megatron_real_worker.py; a broken tied mapping at PP=2); an SGLang
CPU server: stop token, logprob mismatch against the trainer, verified disk sync after a real update.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megaopd.batch import collate
from megaopd.config import ModelConfig
from megaopd.data.word_problems import word_split
from megaopd.metrics import read_metrics
from megaopd.model_import import set_stop_tokens
from megaopd.policy import HFPolicy
from megaopd.rollout import LocalEngine
from megaopd.trainer import Trainer
from megaopd.verifiers import score
from conftest import run_config
from megaopd.data.word_problems import build_word_problems
from test_real import END, QUESTION, collect, worded  # noqa: F401  (collect: an autouse fixture)

pytestmark = pytest.mark.timeout(1200)
TOL = 1e-4  # Megatron vs HF; measured at TP=3: logprobs 3.1e-5, logits 7.4e-5 (the tiny tier's 1e-5 does not hold)
PROBE_TOLERANCE = 5e-2


@pytest.fixture(scope="module")
def words(tmp_path_factory) -> Path:
    return build_word_problems(tmp_path_factory.mktemp("words"), train_rows=64, heldout_rows=16)


def real_run(assets, run_dir, model: Path, words: Path, algorithm: str = "grpo", **overrides):
    return run_config(assets, run_dir, algorithm, **{
        "model.path": model, "data.train": f"[{words / 'train.jsonl'}]", "data.eval": f"[{words / 'heldout.jsonl'}]",
        "train.steps": 1, "train.prompts_per_step": 2, "rollout.samples_per_prompt": 2, "rollout.max_new_tokens": 16,
        "train.micro_batch_size": 4, "optim.lr": 1e-5, "eval.every": 100, "eval.prompts_per_domain": 1,
        "eval.final_prompts_per_domain": 1, "eval.max_new_tokens": 8, "eval.sampled": False,
        "checkpoint.every": 1000, **overrides})


@pytest.mark.real
def test_local_engine_stops_at_end_of_turn_and_the_verifier_reads_real_answers(smollm2):
    policy = HFPolicy(ModelConfig(path=str(smollm2)))
    engine, end = LocalEngine(policy), policy.tokenizer.convert_tokens_to_ids(END)
    [answer] = engine.generate([dataclasses.replace(word_split("heldout", 1)[0], prompt=QUESTION)], 1,
                               temperature=0.0, max_new_tokens=48, generator=torch.Generator().manual_seed(0))
    text = policy.tokenizer.decode(answer.response_ids)
    assert answer.finish_reason == "stop" and text.endswith(END) and text.count(END) == 1, text
    assert len(answer.response_ids) < 24, text  # a one-line answer, not a run past the end of the turn
    # Negative control: with <|endoftext|> as EOS (what a checkpoint whose EOS is not the template's end of turn
    # would give without set_stop_tokens) the same greedy answer runs past <|im_end|>, and the checks above fail.
    policy.tokenizer.eos_token = "<|endoftext|>"
    [runaway] = engine.generate([dataclasses.replace(word_split("heldout", 1)[0], prompt=QUESTION)], 1,
                                temperature=0.0, max_new_tokens=48, generator=torch.Generator().manual_seed(0))
    assert runaway.response_ids[:len(answer.response_ids)] == answer.response_ids
    assert len(runaway.response_ids) > len(answer.response_ids), "generation went on past <|im_end|>"
    assert set_stop_tokens(policy.tokenizer) == [end, 0] and policy.eos_id == end  # the importer's repair

    rows = word_split("heldout", 8)
    samples = engine.generate(rows, 1, temperature=0.0, max_new_tokens=64, generator=torch.Generator().manual_seed(0))
    texts = [policy.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    print("\n".join(f"{s.row.ground_truth} {s.finish_reason}: {t!r}" for s, t in zip(samples, texts)))
    stopped = [s for s in samples if s.finish_reason == "stop"]
    assert len(stopped) >= 3, [s.finish_reason for s in samples]  # others ramble on past 64 tokens
    assert all(s.response_ids[-1] == end and s.response_ids.count(end) == 1 for s in stopped)
    rewards = [score(s.row, t) for s, t in zip(samples, texts)]
    assert any(rewards), texts  # the model answers some right, in its own words ...
    for sample, text, reward in zip(samples, texts, rewards):  # ... and the same text against another answer is 0
        if reward:
            wrong = dataclasses.replace(sample.row, ground_truth=str(int(sample.row.ground_truth) + 1))
            assert score(wrong, text) == 0.0


# ----------------------------------------------------------------------------------------------------- HF backend

def one_step(cfg) -> dict:
    summary = Trainer(cfg).fit()
    assert summary["steps"] == 1
    (step,) = [m for m in read_metrics(cfg.run_dir) if m.get("step") == 1 and "train/loss" in m]
    assert torch.isfinite(torch.tensor(step["train/loss"])) and 0 < step["train/grad_norm"] < float("inf"), step
    assert step["flops/total_stage"] > 0
    return step


@pytest.fixture(scope="module")
def grpo_checkpoint(assets, smollm2, words, tmp_path_factory) -> Path:
    """One GRPO step of the real model on word problems. Its 16-token rollouts rarely reach an answer, and equal
    rewards give GRPO nothing to follow, so the rewards alternate within each group (the shape tier's way); the
    verifier reading real answers is tested above on full-length ones."""
    from test_shapes import alternating_rewards

    run_dir = tmp_path_factory.mktemp("real_grpo") / "grpo"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("megaopd.trainer.score_samples", alternating_rewards)
        step = one_step(real_run(assets, run_dir, smollm2, words, **{"rollout.samples_per_prompt": 4}))
    print("GRPO step:", {k: v for k, v in step.items() if k.startswith(("train/", "rollout/reward"))})
    return run_dir / "final"


@pytest.mark.real
def test_grpo_step_on_real_text_moves_the_weights(grpo_checkpoint, smollm2):
    from safetensors import safe_open

    name = "model.layers.0.mlp.down_proj.weight"
    with safe_open(str(grpo_checkpoint / "model.safetensors"), "pt") as a, \
            safe_open(str(smollm2 / "model.safetensors"), "pt") as b:
        assert not torch.equal(a.get_tensor(name), b.get_tensor(name))


@pytest.mark.real
@pytest.mark.parametrize("form", ["topk", "full_vocab"])
def test_self_teacher_opd_step_from_the_grpo_checkpoint(assets, smollm2, words, grpo_checkpoint, tmp_path, form):
    """OPD from the imported model with its own GRPO checkpoint as the teacher (E3's setting)."""
    step = one_step(real_run(assets, tmp_path / form, smollm2, words, "opd", **{
        "opd.teachers.*": grpo_checkpoint, "opd.form": form, "opd.topk": 16}))
    assert step["train/reverse_kl"] >= 0 and "train/teacher/*/reverse_kl_k1" in step


@pytest.mark.real
@pytest.mark.parametrize("algorithm", ["grpo", "opd"])
def test_flop_audit_is_exact_on_the_real_model(assets, smollm2, words, grpo_checkpoint, tmp_path, algorithm):
    from megaopd.flop_audit import audit_step

    extra = {} if algorithm == "grpo" else {"opd.teachers.*": grpo_checkpoint, "opd.form": "full_vocab"}
    audit = audit_step(real_run(assets, tmp_path / "run", smollm2, words, algorithm, **{
        "train.prompts_per_step": 1, "rollout.max_new_tokens": 8, **extra}))
    idle = {"grpo": "teacher", "opd": "reference"}[algorithm]
    assert audit[idle].measured == audit[idle].booked == 0
    for component, row in audit.items():
        assert row.booked == row.ledger_form, component
        if component != idle:
            assert row.measured == row.executed_form + row.recomputed, (component, row)


# ------------------------------------------------------------------------------------------- Megatron via mbridge
# TP=3 rather than 2: megatron splits the 9 query heads and 3 KV heads evenly over the TP ranks, so TP=2 cannot run
# this model (megatron-core: "num_attention_heads (9) must be a multiple of tensor_model_parallel_size (2)").

@pytest.fixture(scope="module")
def megatron_real(smollm2, tmp_path_factory) -> dict:
    pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install -e '.[megatron]')")
    pytest.importorskip("mbridge", reason="mbridge not installed (pip install -e '.[megatron]')")
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("megatron_real")
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    torch.save(collate(worded(tokenizer, word_split("heldout", 4)), tokenizer.pad_token_id), out / "batch.pt")
    worker = Path(__file__).parent / "megatron_real_worker.py"
    for layout, ranks in (("tp3", 3), ("pp2", 2)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               str(worker), str(smollm2), str(out / "batch.pt"), str(out), layout]
        proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                              timeout=540)
        if proc.returncode:
            errors = [line for line in proc.stderr.splitlines() if "Warning" not in line and "warn" not in line]
            pytest.fail(f"megatron real worker ({layout}) failed:\n" + "\n".join(errors[-60:]))
    result = {layout: json.loads((out / f"{layout}.json").read_text()) for layout in ("tp3", "pp2")}
    print(json.dumps(result, indent=1))
    return result


@pytest.mark.real
@pytest.mark.parametrize("layout", ["tp3", "pp2"])
def test_megatron_matches_hf_on_real_weights_and_its_export_reloads(megatron_real, layout):
    result = megatron_real[layout]
    assert result["logprobs"] < TOL, result
    assert result["grad_norm"] > 1e-3  # the step before the export was a real one
    assert result["export_reload_logits"] < TOL, result
    assert result["export_moved_logits"] > 1e2 * TOL  # ... and the export carries it


@pytest.mark.real
def test_a_broken_tied_embedding_mapping_is_detected(megatron_real):
    """Negative control at PP=2 (the output layer on the last stage, apart from the embedding): mbridge's own Llama
    mapping reads the output layer from lm_head.weight, which a tied checkpoint does not have."""
    control = megatron_real["pp2"]["negative_control"]
    assert "broken_tie_error" in control or control["broken_tie_logprobs"] > 1e3 * TOL, control


# ------------------------------------------------------------------------------------------ an SGLang CPU server

@pytest.fixture(scope="module")
def real_server(smollm2, tmp_path_factory):
    from test_sglang import server_config

    from megaopd.serving.server import SGLangServer

    server = SGLangServer.launch(str(smollm2), server_config(), "float32",
                                 tmp_path_factory.mktemp("sglang_real") / "server.log")
    try:
        yield server
    finally:
        server.stop()


def attached(assets, run_dir, smollm2, words, server):
    from test_sglang import server_config

    cfg = real_run(assets, run_dir, smollm2, words, **{"rollout.engine": "sglang"})
    cfg.rollout.sglang = server_config()
    cfg.rollout.sglang.urls = [server.url]
    # The probe compares the server with the trainer on a fixed response: real kernels differ by up to ~1e-2 here
    # (measured below), so the tiny tier's 1e-4 would refuse the right weights; an update moves it far more.
    cfg.rollout.sglang.probe_tolerance = PROBE_TOLERANCE
    return cfg


@pytest.mark.real
@pytest.mark.sglang
def test_sglang_server_stops_at_end_of_turn_and_scores_like_the_trainer(assets, smollm2, words, real_server,
                                                                          tmp_path):
    """The train-inference mismatch on a real model: the server's logprobs of its own sampled responses against
    the trainer's recomputation on the same tokens (fp32 both; different kernels)."""
    from megaopd.serving.engine import SGLangEngine

    cfg = attached(assets, tmp_path, smollm2, words, real_server)
    policy = HFPolicy(cfg.model)
    engine = SGLangEngine(cfg.rollout, cfg.model, cfg.run_dir, policy)
    end = policy.tokenizer.convert_tokens_to_ids(END)
    rows = word_split("heldout", 4)
    greedy = engine.generate(rows, 1, temperature=0.0, max_new_tokens=96, generator=torch.Generator().manual_seed(0))
    assert sum(s.finish_reason == "stop" for s in greedy) >= 3, [s.finish_reason for s in greedy]
    assert all(s.response_ids[-1] == end and s.response_ids.count(end) == 1 for s in greedy if s.finish_reason == "stop")
    sampled = engine.generate(rows, 4, temperature=1.0, max_new_tokens=48, generator=torch.Generator().manual_seed(1))
    batch = collate(sampled, policy.pad_id)
    gap = (policy.logprobs(batch) - batch.rollout_logprobs).abs()[batch.response_mask.bool()]
    print(f"SGLang vs trainer logprobs over {gap.numel()} sampled tokens: max {gap.max():.3g}, mean {gap.mean():.3g}")
    assert gap.max() < 5e-2 and gap.mean() < 5e-3, (gap.max(), gap.mean())


@pytest.mark.real
@pytest.mark.sglang
def test_each_weight_sync_method_after_a_real_update(assets, smollm2, words, real_server, tmp_path):
    """A GRPO update on real text, then the disk sync, verified by the server's version and the logprob probe.
    The in-memory methods (tensor, distributed) move weights between GPUs: on a CPU they stop with the reason."""
    from megaopd.objectives import GRPO
    from megaopd.config import GRPOConfig
    from megaopd.serving import weight_sync
    from megaopd.serving.engine import SGLangEngine

    cfg = attached(assets, tmp_path, smollm2, words, real_server)
    cfg.optim.lr = 1e-4  # one step that moves the probe's logprobs well past the tolerance
    policy = HFPolicy(cfg.model, cfg.optim)
    engine = SGLangEngine(cfg.rollout, cfg.model, cfg.run_dir, policy)  # verifies the served starting weights first
    batch = collate(worded(policy.tokenizer, word_split("train", 4)), policy.pad_id)
    batch.old_logprobs = policy.logprobs(batch)
    batch.advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None] * batch.response_mask
    objective = GRPO(GRPOConfig(), group_size=4)
    probe = policy.logprobs(engine.probe)
    update = policy.train_minibatch(batch, objective.token_loss, 4, objective.vocab_term)
    moved = (policy.logprobs(engine.probe) - probe).abs().max()
    print(f"the update moved the probe's logprobs by up to {moved:.3g}")
    assert update["grad_norm"] > 0 and moved > 4 * PROBE_TOLERANCE  # a stale server would fail the probe
    engine.sync_weights(policy)  # disk; raises StaleWeightsError unless the server serves the updated weights
    assert engine.weight_version == 1 and real_server.get("/model_info")["weight_version"] == "1"
    if not torch.cuda.is_available():
        for method in ("tensor", "distributed"):
            with pytest.raises(RuntimeError, match=f"sync={method} moves weights between GPUs"):
                weight_sync.for_method(method)
    engine.close()
