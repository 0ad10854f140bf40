"""`megaopd plan`'s logits / KL workspace against what the HF backend's update allocates on CPU, at two shapes
(vocabulary and chunk), GRPO's form: the planned bytes must match the measured peak of vocabulary-wide tensors
within TOLERANCE."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import run_config
from megaopd.embedded import build_model_config, build_tokenizer
from megaopd.batch import TokenBatch
from megaopd.objectives import GRPO
from megaopd.plan import build_plan
from megaopd.policy import HFPolicy
from vocab_bytes import VocabBytes

TOLERANCE = 0.25  # |planned / measured - 1| at most (measured: -0.20 at the small shape, +0.09 at the large)


def model_dir(tmp_path, vocab: int):
    tokenizer = build_tokenizer()
    config = build_model_config("qwen3-tiny", vocab, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / f"v{vocab}")
    tokenizer.save_pretrained(tmp_path / f"v{vocab}")
    return tmp_path / f"v{vocab}"


def planned_workspace(cfg) -> float:
    item = next(i for i in build_plan(cfg).items if i.component.startswith("logits/KL workspace"))
    return item.bytes


@pytest.mark.parametrize("vocab,chunk", [(4096, 32), (12288, 96)])
def test_planned_grpo_logits_workspace_covers_the_measured_one(assets, tmp_path, vocab, chunk):
    path = model_dir(tmp_path, vocab)
    cfg = run_config(assets, tmp_path / "run", "grpo", **{
        "model.path": path, "train.logit_chunk_rows": chunk, "train.micro_batch_size": 4,
        "train.prompts_per_step": 1, "rollout.samples_per_prompt": 4, "rollout.max_new_tokens": 4 * chunk,
        "plan.prompt_tokens": 8})
    policy = HFPolicy(cfg.model, cfg.optim, logit_chunk_rows=chunk)
    g = torch.Generator().manual_seed(0)
    seq = 8 + 4 * chunk  # 4 rows x 4 chunks of response positions

    ids = torch.randint(0, 250, (4, seq), generator=g)
    response = torch.zeros(4, seq - 1)
    response[:, 7:] = 1
    batch = TokenBatch(ids, torch.ones_like(ids), response, torch.zeros(4, seq - 1))
    batch.old_logprobs = policy.logprobs(batch, 4)
    objective = GRPO(cfg.grpo, 4)
    batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * response
    with VocabBytes({vocab}) as seen:
        policy.train_minibatch(batch, objective.token_loss, 4, objective.vocab_term)
    planned = planned_workspace(cfg) - chunk * 64 * 4  # the hidden chunk (H x b) is not vocabulary-wide
    print(f"vocab {vocab} chunk {chunk}: planned {planned / 2**20:.2f} MiB, measured {seen.peak / 2**20:.2f}")
    assert seen.peak > 0
    assert abs(planned / seen.peak - 1) <= TOLERANCE, (planned, seen.peak)
