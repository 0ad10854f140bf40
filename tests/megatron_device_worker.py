"""The megatron policy on the fake accelerator of tests/fake_device.py, and its logits workspace measured; run by
tests/test_megatron_device.py:

    torchrun --nproc-per-node 2 tests/megatron_device_worker.py ASSETS OUT [VOCABxSEQ ...]

Device discipline, for each layout (tp2, pp2): the policy is built on the CPU as usual, then everything megatron
built (weights, gradient buffers, the optimizer's views) is tagged as on the fake device, ``policy.device`` is set
to it, and megatron's own hard-coded ``device="cuda"`` factories are sent there (they are sent to the host
otherwise, see megaopd.models.megatron.cpu_rehearsal): what a GPU rank holds. Under the mode: the realised-token and
top-k logprobs (the student's and a megatron teacher's scoring path), one GRPO and one top-k OPD update, in
micro-batches with the chunked, recomputed vocabulary loss. Rank 0 writes OUT/device_<layout>.json.

Workspace, at tp2 for each VOCABxSEQ (a model ASSETS/models/v<VOCAB>): the peak bytes of live [.., V/tp] tensors
over one GRPO and one top-k OPD update of 4 rows of SEQ positions, one sequence per output-layer chunk;
OUT/workspace_<form>_<V>.json.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import types
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # megatron_cpu, megaopd
from megatron_cpu import redirect_cuda_to_cpu  # noqa: E402

redirect_cuda_to_cpu()

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as mpu  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from fake_device import FAKE, fake_device, put_on_device  # noqa: E402
from megaopd.data.batch import TokenBatch  # noqa: E402
from megaopd.config import GRPOConfig, MegatronConfig, ModelConfig, OPDConfig, OptimConfig  # noqa: E402
from megaopd.models.megatron import cpu_rehearsal  # noqa: E402
from megaopd.models.megatron.policy import MegatronPolicy  # noqa: E402
from megaopd.models.distributions import tail_logprob  # noqa: E402
from megaopd.objectives.losses import GRPO, OPD  # noqa: E402
from policy_contract import contract_batch  # noqa: E402
from vocab_bytes import VocabBytes  # noqa: E402

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}
MBS = 2  # 6 rows: 3 micro-batches per update
TOPK = 8
CHUNK = 14  # positions per output-layer chunk: one sequence of the contract batch, so every chunk is recomputed
OPTIM = OptimConfig(lr=1e-3, grad_clip=1.0)


def built_tensors(*roots) -> list[torch.Tensor]:
    """Every tensor reachable from the roots through objects' attributes and containers (not through classes,
    modules or functions): the weights, main_grad, gradient buffers and optimizer views megatron built."""
    seen, found, todo = set(), [], list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType, types.MethodType,
                                                types.BuiltinFunctionType, str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            main_grad = getattr(obj, "main_grad", None)  # megatron's fp32 gradient, an attribute of the parameter
            if main_grad is not None:
                todo.append(main_grad)
            continue
        todo.extend(gc.get_referents(obj))
    return found


def check_device(assets: Path, tp: int, pp: int) -> dict:
    cfg = ModelConfig(path=str(assets / "models" / "qwen3-tiny"), backend="megatron",
                      megatron=MegatronConfig(tp=tp, pp=pp, adam_eps=1e-4))
    policy = MegatronPolicy(cfg, OPTIM, logit_chunk_rows=CHUNK)
    batch = contract_batch(seed=1)  # the trainer's batches live on the host until the policy moves them
    teacher = AutoModelForCausalLM.from_pretrained(assets / "models" / "qwen3-tiny-seed1", dtype=torch.float32)
    with torch.no_grad():
        full = teacher(input_ids=batch.input_ids).logits[:, :-1].log_softmax(-1)
    batch.teacher_topk_logprobs, batch.teacher_topk_ids = full.topk(TOPK, dim=-1)
    batch.teacher_tail = tail_logprob(full, batch.teacher_topk_ids)
    batch.teacher_logprobs = full.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1) * batch.response_mask
    put_on_device(*built_tensors(policy.model_chunks, policy.optimizer))
    policy.device = FAKE
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_rehearsal, "_cpu_device", lambda device: FAKE if "cuda" in str(device) else device)
        patch.setattr(torch.cuda, "current_device", lambda: FAKE)
        with fake_device(patch) as seen:
            batch.old_logprobs = policy.logprobs(batch, MBS)
            view = policy.topk_logprobs(batch, TOPK, MBS)
            grpo = GRPO(GRPOConfig(), group_size=3)
            batch.advantages = torch.tensor([1.0, -0.5, -0.5, 0.3, 0.9, -1.2])[:, None] * batch.response_mask
            losses = [policy.train_minibatch(batch, grpo.token_loss, MBS)["loss"]]
            opd = OPD(OPDConfig(form="topk", topk=TOPK))
            opd.prepare(batch, [])
            losses.append(policy.train_minibatch(batch, opd.token_loss, MBS, opd.vocab_term)["loss"])
    host = [name for name, t in [("logprobs", batch.old_logprobs), *view.items()] if t.device != torch.device("cpu")]
    return {"violations": seen.violations, "syncs": dict(seen.syncs), "losses": losses, "not_on_host": host}


def measure_workspace(model_dir: Path, seq: int, form: str) -> dict:
    """The peak bytes of [.., V/tp] tensors over one GRPO or top-k OPD update of 4 rows x ``seq``, one sequence
    per chunk."""
    policy = MegatronPolicy(ModelConfig(path=str(model_dir), backend="megatron", megatron=MegatronConfig(tp=2)),
                            OPTIM, logit_chunk_rows=seq)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 250, (4, seq), generator=g)
    response = torch.zeros(4, seq - 1)
    response[:, 7:] = 1
    batch = TokenBatch(ids, torch.ones_like(ids), response, torch.zeros(4, seq - 1))
    batch.old_logprobs = policy.logprobs(batch, 4)
    if form == "topk":  # the student's own top-k as its teacher's: the same allocations as any teacher's
        objective = OPD(OPDConfig(form="topk", topk=TOPK))
        view = policy.topk_logprobs(batch, TOPK, 4)
        batch.teacher_logprobs, batch.teacher_topk_ids = view["realised"], view["topk_ids"]
        batch.teacher_topk_logprobs, batch.teacher_tail = view["topk"], view["tail"]
        objective.prepare(batch, [])
    else:
        objective = GRPO(GRPOConfig(), 4)
        batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * response
    width = policy.module.shared_embedding_or_output_weight().shape[0]  # this rank's share of the padded vocabulary
    with VocabBytes({width}) as seen:
        policy.train_minibatch(batch, objective.token_loss, 4, objective.vocab_term)
    return {"width": width, "peak": seen.peak}


def main() -> None:
    assets, out, *shapes = sys.argv[1:]
    assets, out = Path(assets), Path(out)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    results = {}
    for layout, (tp, pp) in LAYOUTS.items():
        mpu.destroy_model_parallel()
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        results[f"device_{layout}"] = check_device(assets, tp, pp)
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(tensor_model_parallel_size=2)
    for shape in shapes:
        vocab, seq = map(int, shape.split("x"))
        for form in ("grpo", "topk"):
            results[f"workspace_{form}_{vocab}"] = measure_workspace(assets / "models" / f"v{vocab}", seq, form)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, results)  # the last pipeline stage computes the loss, the first does not
    if dist.get_rank() == 0:
        for name, result in results.items():
            result["ranks"] = [r[name] for r in every]
            (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
