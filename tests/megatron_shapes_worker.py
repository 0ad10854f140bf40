"""Megatron at TP=2 against HF at a real shape (full width and vocabulary), run by tests/test_shapes.py:

    torchrun --nproc-per-node 2 tests/megatron_shapes_worker.py STUDENT_DIR TEACHER_DIR OUT.json

The vocabulary (151,936 for Qwen3) is padded to a multiple of 128 * tp = 256 (152,064) and split over the two
ranks; the log-softmax and the top-K + tail KL run on each rank's 76,032 columns. HF runs on rank 0 only (its
AdamW copy of a 0.19B-parameter model is the largest thing here), on every core while rank 1 waits; rank 0 writes
what it measured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent)]
import megatron_worker as w  # noqa: E402  (redirects CUDA to CPU at import, like the tiny-model worker)
from machine_memory import every_core  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as mpu  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from megaopd.config import GRPOConfig, MegatronConfig, ModelConfig, OPDConfig  # noqa: E402
from megaopd.models.hf_policy import HFPolicy  # noqa: E402
from megaopd.models.megatron.policy import MegatronPolicy  # noqa: E402
from megaopd.objectives.losses import GRPO, OPD  # noqa: E402

TOPK = 64  # teacher entries per position; the rest of the vocabulary is the tail bucket


def main() -> None:
    student, teacher_dir, out = sys.argv[1:]
    dist.init_process_group("gloo")
    mpu.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    rank0 = dist.get_rank() == 0
    torch.manual_seed(0)
    cfg = ModelConfig(path=student, backend="megatron", megatron=MegatronConfig(tp=2, adam_eps=w.EPS))
    megatron = MegatronPolicy(cfg, w.OPTIM)
    result = {"vocab": megatron.vocab_size, "padded_vocab": megatron.bridge.padded_vocab_size}
    hf = None
    if rank0:
        hf = HFPolicy(ModelConfig(path=student), w.OPTIM)
        hf.optimizer = torch.optim.AdamW(hf.model.parameters(), lr=w.OPTIM.lr, betas=w.OPTIM.betas, eps=w.EPS,
                                         weight_decay=w.OPTIM.weight_decay)
        hf.scheduler = torch.optim.lr_scheduler.LambdaLR(hf.optimizer, lambda step: 1.0)
    batch = w.make_batch(259, seed=1)
    real = batch.attention_mask.bool()
    logits, full, token = (megatron.logits(batch, w.MBS), megatron.full_logprobs(batch, w.MBS),
                           megatron.logprobs(batch, w.MBS))
    if rank0:
        with torch.no_grad(), every_core():
            ref = hf.model(input_ids=batch.input_ids).logits
        full_ref = ref[:, :-1].log_softmax(-1)
        token_ref = full_ref.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1) * batch.response_mask
        result["parity"] = {"logits": w.max_diff(logits[real], ref[real]),
                            "full_logprobs": w.max_diff(full[real[:, 1:]], full_ref[real[:, 1:]]),
                            "logprobs": w.max_diff(token, token_ref), "logits_columns": logits.shape[-1]}

    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    steps = []
    # OPD as the megatron backend runs it at this vocabulary: the teacher's top-K plus the tail bucket, whose KL over
    # the vocab-parallel student logits needs the all-reduces across both ranks' 76,032 columns.
    for step, objective in enumerate((GRPO(GRPOConfig(), group_size=3), OPD(OPDConfig(form="topk", topk=TOPK)))):
        batch = w.make_batch(259, seed=10 + step)
        batch.old_logprobs = megatron.logprobs(batch, w.MBS)
        w.set_teacher_targets(batch, teacher, TOPK)
        if isinstance(objective, GRPO):
            batch.advantages = torch.tensor([1.0, -0.5, -0.5, 0.3, 0.9, -1.2])[:, None] * batch.response_mask
        else:
            objective.prepare(batch, [])
        m = megatron.train_minibatch(batch, objective.token_loss, w.MBS, objective.vocab_term)
        if rank0:
            with every_core():
                h = hf.train_minibatch(batch, objective.token_loss, w.MBS, objective.vocab_term)
            steps.append({"objective": type(objective).__name__, "loss_hf": h["loss"],
                          "loss": abs(m["loss"] - h["loss"]), "grad_norm_hf": h["grad_norm"],
                          "grad_norm": abs(m["grad_norm"] - h["grad_norm"])})
    exported = megatron.export_hf_state()
    if rank0:
        state = hf.model.state_dict()
        result["steps"] = steps
        result["weights_after_steps"] = max(w.max_diff(exported[k], state[k]) for k in exported)
        Path(out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
