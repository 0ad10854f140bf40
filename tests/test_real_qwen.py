"""The real tier's second family (issue 41): Qwen2.5-Coder-0.5B-Instruct and -1.5B-Instruct, imported from their
pinned PyPI chunk packages by ``megaopd import-model`` (the ``qwen05`` / ``qwen15`` fixtures), through every backend
on CPU, and a real strong-to-weak OPD step: the 1.5B teaching the 0.5B.

What this family adds to SmolLM2's tier (tests/test_real.py): q/k/v biases, 2 KV heads (7 query heads each), a
151,936-row tied embedding that the GGUF stores twice (re-tied on import), a ChatML template with a default system
message, a pad token (<|endoftext|>) that is not the end of turn (<|im_end|>), and a teacher three times the student
on one tokenizer. Both models' weights are bfloat16 on disk (megaopd/models/packaged_models.py says why); the student
trains in float32, the teacher runs in bfloat16 (opd.teacher_dtype) where the memory plan (24 GiB) says so.

    pytest -m real tests/test_real_qwen.py      # CI runs it (make setup installs the packages; ~1.7 GB of wheels)

One file, so that one pytest-xdist worker runs it start to end: each step holds a 0.5B student with its Adam state
(8 GB), the strong-to-weak steps a 1.5B teacher beside it, and two of those at once would not fit a 24 GB machine.
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

from megaopd.config import ModelConfig
from megaopd.data.word_problems import build_word_problems, word_split
from megaopd.models.model_import import end_of_turn_token, set_stop_tokens
from megaopd.models.hf_policy import HFPolicy
from megaopd.rollout.local import LocalEngine
from megaopd.verifiers import score
from machine_memory import alone
from test_real import (assert_detected, assert_megatron_matches_hf, chat_prompt_round_trips, megatron_against_hf,
                       one_step, padding_changes_nothing, real_run, served_rollouts, serving,
                       weight_sync_after_a_real_update)

pytestmark = [pytest.mark.slow, pytest.mark.real, pytest.mark.timeout(2400)]
END, PAD = "<|im_end|>", "<|endoftext|>"
QUESTION = [{"role": "user", "content": "What is 7 + 5?"}]
# The published architectures (Qwen's model cards): parameters with the embedding counted once.
PUBLISHED = {"qwen05": dict(layers=24, hidden=896, heads=14, kv_heads=2, parameters=494_032_768),
             "qwen15": dict(layers=28, hidden=1536, heads=12, kv_heads=2, parameters=1_543_714_304)}



@pytest.fixture(scope="module", autouse=True)
def machine():
    """One turn alone for the whole file, not one per job: almost all of its time is jobs alone (the pair's steps,
    Megatron, the 0.5B's server), and each turn waits for the other worker's test in progress (up to minutes),
    whose worker may start another long one between two jobs. The few light tests run on every core meanwhile."""
    with alone("tests/test_real_qwen.py"):
        yield


@pytest.fixture(scope="module")
def words(tmp_path_factory) -> Path:
    return build_word_problems(tmp_path_factory.mktemp("words"), train_rows=16, heldout_rows=4)


# ------------------------------------------------------------------------------------------ the imported directories

def test_imports_have_the_published_architecture_one_tokenizer_and_the_end_of_turn_stop(qwen05, qwen15):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizers = {}
    for name, model in (("qwen05", qwen05), ("qwen15", qwen15)):
        facts, config = PUBLISHED[name], json.loads((model / "config.json").read_text())
        assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"],
                config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == \
            ("qwen2", facts["layers"], facts["hidden"], facts["heads"], facts["kv_heads"], 151936), name
        assert config["tie_word_embeddings"] is True and "quantization_config" not in config, name
        with safe_open(str(model / "model.safetensors"), "pt") as f:
            shapes = {key: f.get_slice(key).get_shape() for key in f.keys()}
            dtypes = {f.get_slice(key).get_dtype() for key in f.keys()}
        assert "lm_head.weight" not in shapes and dtypes == {"BF16"}, (name, dtypes)  # tied: one copy, bfloat16
        assert sum(torch.Size(s).numel() for s in shapes.values()) == facts["parameters"], name
        assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.k_proj.bias"} <= set(shapes)
        tokenizer = tokenizers[name] = AutoTokenizer.from_pretrained(model)
        end, pad = tokenizer.convert_tokens_to_ids([END, PAD])
        assert end_of_turn_token(tokenizer) == tokenizer.eos_token == END and tokenizer.pad_token == PAD, name
        assert json.loads((model / "generation_config.json").read_text())["eos_token_id"] == [end], name
        assert (end, pad, len(tokenizer)) == (151645, 151643, 151936), name  # GGUF lists the padded rows too
    assert tokenizers["qwen05"].get_vocab() == tokenizers["qwen15"].get_vocab()  # one tokenizer: OPD compares ids
    model = AutoModelForCausalLM.from_pretrained(qwen05, dtype=torch.bfloat16)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED["qwen05"]["parameters"]


# --------------------------------------------------------------------------- chat template, stop tokens, padding

def test_chat_prompt_padding_and_the_end_of_turn_stop_on_real_text(qwen05):
    policy = HFPolicy(ModelConfig(path=str(qwen05)))
    tokenizer = policy.tokenizer
    text = chat_prompt_round_trips(tokenizer, QUESTION)
    assert "You are Qwen, created by Alibaba Cloud." in text  # the template's default system turn
    # pad (<|endoftext|>) is not EOS here: a row's own final <|im_end|> is a response token, the padding is not.
    assert policy.pad_id != policy.eos_id
    padding_changes_nothing(policy, 2)

    engine, end = LocalEngine(policy), policy.tokenizer.convert_tokens_to_ids(END)

    def greedy(max_new_tokens):
        row = dataclasses.replace(word_split("test", 1)[0], prompt=QUESTION, ground_truth="12")
        [sample] = engine.generate([row], 1, temperature=0.0, max_new_tokens=max_new_tokens,
                                   generator=torch.Generator().manual_seed(0))
        return sample, tokenizer.decode(sample.response_ids)

    answer, text = greedy(24)
    print(f"greedy: {text!r}")
    assert answer.finish_reason == "stop" and text.endswith(END) and text.count(END) == 1, text
    assert score(answer.row, tokenizer.decode(answer.response_ids, skip_special_tokens=True)) == 1.0, text
    # Negative control: <|endoftext|> as EOS (a wrong stop token) lets the same greedy answer run past <|im_end|>.
    tokenizer.eos_token = PAD
    runaway, runaway_text = greedy(24)
    print(f"with EOS {PAD}: {runaway_text!r}")
    assert runaway.response_ids[:len(answer.response_ids)] == answer.response_ids
    assert len(runaway.response_ids) > len(answer.response_ids), runaway_text
    assert set_stop_tokens(tokenizer) == [end, policy.pad_id] and policy.eos_id == end  # the importer's repair


# ------------------------------------------------------------------------------------------------- HF backend

def test_grpo_step_on_real_text_moves_the_weights(assets, qwen05, words, tmp_path, monkeypatch):
    """One GRPO step of the 0.5B on word problems. Its short rollouts never reach an answer, so the rewards alternate
    within the group (the shape tier's way); 24 tokens, because the instruct model's first 8 often coincide
    ("To find the total number of marbles"), and two equal responses with opposite advantages cancel."""
    from safetensors import safe_open

    from test_shapes import alternating_rewards

    responses = []

    def rewards(tokenizer, samples):
        responses.extend(tokenizer.decode(s.response_ids) for s in samples)
        return alternating_rewards(tokenizer, samples)
    monkeypatch.setattr("megaopd.run.trainer.score_samples", rewards)
    step = one_step(real_run(assets, tmp_path / "grpo", qwen05, words, **{"rollout.max_new_tokens": 24}),
                    export=tmp_path / "final")
    print("GRPO step:", responses, {k: v for k, v in step.items() if k.startswith(("train/", "rollout/reward"))})
    assert len(set(responses)) == 2 and step["train/grad_norm"] > 1e-3, (responses, step["train/grad_norm"])
    name = "model.layers.0.self_attn.k_proj.bias"  # a Qwen2 bias: trained like every weight
    with safe_open(str(tmp_path / "final" / "model.safetensors"), "pt") as a, \
            safe_open(str(qwen05 / "model.safetensors"), "pt") as b:
        assert not torch.equal(a.get_tensor(name).float(), b.get_tensor(name).float())


# ---------------------------------------------------------------------- strong-to-weak: the 1.5B teaches the 0.5B
BUDGET_GIB = 24  # the machine the plan is made for


def strong_to_weak(assets, qwen05, qwen15, words, tmp_path, mode: str, form: str) -> dict:
    """One OPD step of the 0.5B from the 1.5B in its own process (tests/strong_to_weak_worker.py), planned for a
    24 GiB machine (plan.memory_gib: the trainer refuses a run that does not fit), the teacher in bfloat16."""
    from conftest import tiny_overrides

    overrides = tiny_overrides(assets, tmp_path / "run", "opd", **{
        "model.path": qwen05, "data.train": f"[{words / 'train.jsonl'}]", "data.eval": f"[{words / 'test.jsonl'}]",
        "train.steps": 1, "train.prompts_per_step": 1, "rollout.samples_per_prompt": 2, "rollout.max_new_tokens": 8,
        "train.micro_batch_size": 2, "optim.lr": 1e-5, "opd.teachers.*": qwen15, "opd.teacher_dtype": "bfloat16",
        "opd.form": form, "opd.topk": 16, "plan.memory_gib": BUDGET_GIB,
        **({"opd.teacher_engine": "sglang"} if mode == "sglang" else {})})
    out = tmp_path / "result.json"
    with alone(f"strong-to-weak {mode} {form}") as cores:  # the 1.5B teacher and the 0.5B student: 11.5 GB
        proc = subprocess.run([sys.executable, str(Path(__file__).parent / "strong_to_weak_worker.py"), str(out),
                               mode, *map(str, overrides)], capture_output=True, text=True, timeout=2000,
                              env={**os.environ, "OMP_NUM_THREADS": str(cores)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    print(f"strong-to-weak {mode} {form}:\n{result['plan']['table']}\npeak RSS {result['peak_rss'] / 2**30:.2f} GiB "
          f"(before loading: {result['baseline_rss'] / 2**30:.2f})\n"
          + json.dumps({k: v for k, v in result.items() if k not in ("plan",)}, indent=1))
    return result


def assert_obeys_its_plan(result: dict) -> None:
    """The plan fits the budget, and the run's peak RSS stays inside the budget it was planned for."""
    from megaopd.config import PlanConfig

    plan = result["plan"]
    assert plan["table"].splitlines()[-1] == "fits" and plan["budget"] == BUDGET_GIB * 2**30 * PlanConfig().usable
    assert result["peak_rss"] <= plan["budget"], (result["peak_rss"], plan["budget"])
    assert "teacher * (1.54B) bfloat16" in plan["table"]


def assert_teacher_three_times_the_student(result: dict) -> None:
    per_token = result["forward_flops_per_token"]
    ratio = per_token["teacher"] / per_token["student"]
    print(f"teacher/student forward FLOPs per token: {ratio:.3f}")
    assert 3.1 < ratio < 3.2, ratio  # 1.54B vs 0.49B multiplying parameters (the tied head counted in both)


@pytest.mark.pair
@pytest.mark.parametrize("form", ["full_vocab", "topk"])
def test_strong_to_weak_opd_step_in_memory_with_the_flop_audit_exact(assets, qwen05, qwen15, words, tmp_path, form):
    """Each local OPD form: one step, every phase's FLOPs counted (FlopCounterMode) against the ledger's formula,
    on both shapes at once (q/k/v biases run as addmm, whose bias the ledger leaves out like the counter; 2 KV heads;
    the tied head counted at every projected position)."""
    result = strong_to_weak(assets, qwen05, qwen15, words, tmp_path, "audit", form)
    assert_obeys_its_plan(result)
    assert_teacher_three_times_the_student(result)
    audit = result["audit"]
    assert audit["reference"]["measured"] == audit["reference"]["booked"] == 0
    assert audit["teacher"]["booked"] > 0
    for component, row in audit.items():
        assert row["booked"] == row["ledger_form"], component
        if component != "reference":
            assert row["measured"] == row["executed_form"] + row["recomputed"], (component, row)
    # The teacher's and the student's forward over the same sequences, as the counter saw them (the teacher's
    # re-projections of its kept rows aside): between the multiplying-parameter ratio (3.13, the head at every
    # position) and the layers' alone (3.66, no head): these rows project 8 of their ~260 positions.
    step = (audit["teacher"]["measured"] - audit["teacher"]["recomputed"]) / audit["old_logprob"]["measured"]
    print(f"teacher/student forward FLOPs on this step (counted): {step:.3f}")
    assert 3.1 < step < 3.7, step


@pytest.mark.pair
@pytest.mark.sglang
def test_strong_to_weak_topk_step_from_an_sglang_teacher_server(assets, qwen05, qwen15, words, tmp_path):
    from test_sglang import sglang_python

    sglang_python()  # skips (or fails in CI) without the SGLang environment
    result = strong_to_weak(assets, qwen05, qwen15, words, tmp_path, "sglang", "topk")
    assert "teacher *" not in result["plan"]["table"]  # the teacher is on its server, not in the trainer
    assert result["peak_rss"] <= result["plan"]["budget"]
    step = result["step"]
    assert step["train/reverse_kl"] > 0 and "train/teacher/*/reverse_kl_k1" in step, step
    # The served teacher scores what the local one scores on the same batches (the worker's gap_to_local_teacher).
    # Both run bfloat16 through different kernels and round the logits to bfloat16 (0.125 apart at |logit| 16-32,
    # where the top tokens' lie): gaps of a few tenths on one token are rounding; a mis-indexed response (scores one
    # position off), rows crossed between samples or top-k lists on the wrong positions move them by nats.
    gap = result["teacher_gap"]
    assert gap["tokens"] >= 2, gap
    assert gap["realised_max"] < 1.0 and gap["realised_mean"] < 0.1 and gap["topk_mean"] < 0.15, gap


# ------------------------------------------------------------------------------------------- Megatron via mbridge

@pytest.fixture(scope="module")
def megatron_qwen(qwen05, tmp_path_factory) -> dict:
    """TP=2 (the 14 query and 2 KV heads split evenly) and PP=2 on the 0.5B's real weights; two worked solutions
    (each rank holds ~5 GB at the step: weights, gradients and Adam in float32)."""
    return megatron_against_hf(qwen05, {"tp2": 2, "pp2": 2}, tmp_path_factory.mktemp("megatron_qwen"), rows=2)


@pytest.mark.pair  # 12.8 GB above idle: alone (tests/machine_memory.py)
@pytest.mark.parametrize("check", ["tp2", "pp2", "broken_tie", "broken_qkv_bias"])
def test_megatron_matches_hf_on_the_qwen_weights_and_catches_a_broken_tie_or_bias(megatron_qwen, check):
    """TP=2 and PP=2 against HF, the export reloading; then the negative controls at PP=2: the output layer read
    from lm_head.weight (absent: tied), and the q/k/v biases merged without their per-KV-group interleave
    (megatron_real_worker.broken_bias)."""
    if check in ("tp2", "pp2"):
        assert_megatron_matches_hf(megatron_qwen[check])
    else:
        assert_detected(megatron_qwen["pp2"], check, "lm_head.weight" if check == "broken_tie" else None)


# ------------------------------------------------------------------------------------------ an SGLang CPU server

@pytest.fixture(scope="module")
def qwen_server(qwen05, tmp_path_factory):
    with alone("the 0.5B's SGLang server"):  # 6.5 GB, beside this worker's 0.5B policy
        yield from serving(qwen05, tmp_path_factory, "sglang_qwen")


@pytest.mark.sglang
def test_sglang_rollouts_stop_at_end_of_turn_and_score_like_the_trainer(assets, qwen05, words, qwen_server,
                                                                        tmp_path):
    row = dataclasses.replace(word_split("test", 1)[0], prompt=QUESTION, ground_truth="12")
    gap = served_rollouts(assets, qwen05, words, qwen_server, tmp_path, [row], word_split("test", 2), 24, 32)
    assert gap.max() < 1e-3 and gap.mean() < 1e-4, (gap.max(), gap.mean())


@pytest.mark.sglang
def test_each_weight_sync_method_after_a_real_update(assets, qwen05, words, qwen_server, tmp_path):
    weight_sync_after_a_real_update(assets, qwen05, words, qwen_server, tmp_path)
