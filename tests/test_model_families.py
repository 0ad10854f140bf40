"""Checkpoints of other families and config variants than the embedded presets, built here from tiny configs (random
weights, the embedded tokenizer): each loads as a policy, and the rollout's logprobs (the fused decoder where it
claims the family, else the model's own forward), the policy's scoring and the model's own full-sequence forward
agree.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megaopd.config import ModelConfig
from megaopd.data.batch import collate
from megaopd.data.rows import load_rows
from megaopd.errors import ModelError
from megaopd.models.embedded import build_tokenizer
from megaopd.models.hf_policy import HFPolicy
from megaopd.rollout.local import LocalEngine

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            max_position_embeddings=512)


def tiny_checkpoint(out: Path, model_type: str, **config) -> Path:
    """A random ``model_type`` model directory of the TINY shape with the embedded tokenizer; norms and biases moved
    off their initial ones and zeros, so a skipped one shows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tokenizer()
    config = AutoConfig.for_model(model_type, **{**TINY, **config}, vocab_size=len(tokenizer), bos_token_id=None,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


FAMILIES = {
    "llama-head_dim-bias": ("llama", dict(head_dim=32, num_key_value_heads=1, attention_bias=True, mlp_bias=True)),
    "llama-yarn": ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                               "original_max_position_embeddings": 128})),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "phi3": ("phi3", {}),
    "olmo2": ("olmo2", {}),
    "gemma": ("gemma", dict(head_dim=16)),
    "mistral-window": ("mistral", dict(head_dim=16, sliding_window=8)),
    "gemma3-window": ("gemma3_text", dict(head_dim=16, sliding_window=8)),
    "qwen3-window": ("qwen3", dict(head_dim=16, sliding_window=8, use_sliding_window=True, max_window_layers=1)),
    # Soft-capped attention scores and logits: SDPA cannot soft-cap, and transformers refuses it for Gemma 2.
    "gemma2-softcap": ("gemma2", dict(head_dim=16, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
}


@pytest.mark.parametrize("variant", sorted(FAMILIES))
def test_rollout_scoring_and_the_model_forward_agree(assets, tmp_path, variant):
    model_type, config = FAMILIES[variant]
    policy = HFPolicy(ModelConfig(path=str(tiny_checkpoint(tmp_path, model_type, **config))))
    rows = load_rows(assets / "data" / "prog_trace" / "train.jsonl")[0][:2]
    samples = LocalEngine(policy).generate(rows, 2, 1.0, 1.0, 6, torch.Generator().manual_seed(0))
    batch = collate(samples, policy.pad_id)
    scored = policy.logprobs(batch)
    with torch.no_grad():
        logits = policy.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    forward = (logits.log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)) * batch.response_mask
    assert torch.allclose(scored, forward, atol=1e-5)
    assert torch.allclose(scored, batch.rollout_logprobs, atol=1e-5)


@pytest.mark.parametrize("model_type,config", [("granite", dict(logits_scaling=8.0)),
                                               ("cohere", dict(logit_scale=0.0625))])
def test_a_family_that_rescales_its_logits_after_the_output_layer_is_refused(tmp_path, model_type, config):
    """The policy projects the output layer's input itself: Granite's division by ``logits_scaling`` and Cohere's
    product with ``logit_scale`` happen after that layer, in the model's forward, and the policy scored unscaled
    logits (logprobs 0.3 from the model's own on a tiny one) with no error. It is refused at load, naming the model."""
    path = tiny_checkpoint(tmp_path, model_type, **config)
    with pytest.raises(ModelError, match=f"^{path}: its forward changes the logits after the output layer"):
        HFPolicy(ModelConfig(path=str(path)))


def test_a_window_named_by_sliding_window_alone_turns_shared_prompts_off():
    """Mistral names its window by ``sliding_window`` alone (no ``layer_types``, no ``use_sliding_window``): the
    shared-prompt check read only those two and let it through, and the run failed at its first shared forward."""
    from transformers import AutoConfig

    from megaopd.models.hf_shared_prompt import hf_attention_problem

    assert hf_attention_problem(AutoConfig.for_model("mistral", sliding_window=8)) == \
        "its attention has a sliding window (8 tokens)"
    assert hf_attention_problem(AutoConfig.for_model("mistral", sliding_window=None)) is None


@pytest.mark.parametrize("model_type,config", [("mistral", {}), ("gemma2", dict(head_dim=16))])
def test_the_plan_says_where_its_activations_are_a_lower_bound(assets, tmp_path, caplog, model_type, config):
    """The plan's activation figure is read off the Llama / Qwen forward: a Gemma 2 keeps 35-84% more for backward
    (eager attention, four norms a layer), and its plan said nothing of it. The plan says so, in its table and a
    warning; a Mistral's (a Llama's forward) stays as it was."""
    import logging

    from conftest import run_config
    from megaopd.run.plan import build_plan

    path = tiny_checkpoint(tmp_path / "model", model_type, **config)
    with caplog.at_level(logging.WARNING, logger="megaopd.run.plan"):
        table = build_plan(run_config(assets, tmp_path / "run", **{"model.path": path})).table()
    warned = model_type == "gemma2"
    assert ("a lower bound for gemma2" in table) == warned
    assert [r.getMessage() for r in caplog.records] == ([
        f"{path}: its activations are planned as a Llama's, a lower bound for a gemma2 model (it keeps more for "
        "backward); leave room, or set model.activation_checkpointing=true"] if warned else [])
