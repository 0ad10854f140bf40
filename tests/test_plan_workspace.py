"""`megaopd plan`'s logits / KL workspace against what the HF backend's update allocates on CPU, at two shapes
(vocabulary and chunk), in GRPO's form (with and without shared prompts: the same response rows) and both OPD forms
with a vocabulary KL (full, and top-k with its tail):
the planned bytes must match the measured peak of vocabulary-wide tensors within TOLERANCE. The Megatron backend's
are in tests/test_megatron_device.py."""

import pytest
import torch

from conftest import run_config
from megaopd.data.batch import TokenBatch
from megaopd.models.hf_policy import HFPolicy
from megaopd.objectives.losses import GRPO, OPD
from vocab_bytes import TOLERANCE, VocabBytes, model_dir, planned_vocab_bytes


@pytest.mark.parametrize("form", ["grpo", "grpo_shared", "full_vocab", "topk"])
@pytest.mark.parametrize("vocab,chunk,dtype", [(4096, 32, "float32"), (12288, 96, "float32"), (4096, 32, "bfloat16")])
def test_planned_logits_workspace_covers_the_measured_one(assets, tmp_path, form, vocab, chunk, dtype):
    path = model_dir(tmp_path, vocab)
    opd = {"opd.form": form, "opd.topk": 8, "opd.teachers.*": path} if not form.startswith("grpo") else {}
    cfg = run_config(assets, tmp_path / "run", "opd" if opd else "grpo", **{
        "model.path": path, "model.dtype": dtype, "train.logit_chunk_rows": chunk, "train.micro_batch_size": 4,
        "train.prompts_per_step": 1, "rollout.samples_per_prompt": 4, "rollout.max_new_tokens": chunk,
        "plan.prompt_tokens": 8, "train.shared_prompt": form == "grpo_shared", **opd})
    policy = HFPolicy(cfg.model, cfg.optim, logit_chunk_rows=chunk, shared_prompt=cfg.train.shared_prompt)
    g = torch.Generator().manual_seed(0)
    seq = 8 + chunk  # 4 rows x a chunk of response positions: 4 chunks in the micro-batch (what the
    # full-vocabulary form once held one of per chunk in its backward)

    ids = torch.randint(0, 250, (4, seq), generator=g)
    ids[:, :8] = ids[0, :8]  # one prompt, four samples
    response = torch.zeros(4, seq - 1)
    response[:, 7:] = 1
    batch = TokenBatch(ids, torch.ones_like(ids), response, torch.zeros(4, seq - 1))
    batch.old_logprobs = policy.logprobs(batch, 4)
    if opd:  # the student's own weights as its teacher: the same allocations as any teacher of this vocabulary
        teacher = HFPolicy(cfg.model, logit_chunk_rows=chunk)
        objective = OPD(cfg.opd, teacher)
        view = teacher.topk_logprobs(batch, 8, 4)
        batch.teacher_logprobs, batch.teacher_topk_ids = view["realised"], view["topk_ids"]
        batch.teacher_topk_logprobs, batch.teacher_tail = view["topk"], view["tail"]
        objective.prepare(batch, [])
    else:
        objective = GRPO(cfg.grpo, 4)
        batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * response
    with VocabBytes({vocab}) as seen:
        policy.train_minibatch(batch, objective.token_loss, 4, objective.vocab_term)
    planned = planned_vocab_bytes(cfg)
    print(f"hf {form} {dtype} vocab {vocab} chunk {chunk}: planned {planned / 2**20:.2f} MiB, measured "
          f"{seen.peak / 2**20:.2f} MiB, ratio {planned / seen.peak:.3f}")
    assert seen.peak > 0
    assert abs(planned / seen.peak - 1) <= TOLERANCE, (planned, seen.peak)
