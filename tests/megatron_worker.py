"""Multi-process checks of the megatron backend against the HF backend, run by tests/test_megatron.py:

    torchrun --nproc-per-node 2 tests/megatron_worker.py ASSETS OUT tp2 pp2 dp2

One launch runs several layouts in turn (the ~5 s import is paid once): for each, megatron's parallel state is
rebuilt and every check compares with HF float32 computed in the same process. Rank 0 writes OUT/<layout>.json
with the measured numbers; the pytest side asserts on them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # megatron_cpu, megaopd
from megatron_cpu import redirect_cuda_to_cpu  # noqa: E402

redirect_cuda_to_cpu()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as mpu  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from megaopd.data.batch import TokenBatch  # noqa: E402
from megaopd.config import GRPOConfig, MegatronConfig, ModelConfig, OPDConfig, OptimConfig, FixedAdvantageConfig  # noqa: E402
from megaopd.models.distributions import tail_logprob  # noqa: E402
from megaopd.models.hf_policy import HFPolicy  # noqa: E402
from megaopd.models.megatron.policy import MegatronPolicy, megatron_teachers  # noqa: E402
from megaopd.objectives.losses import GRPO, OPD, FixedAdvantage  # noqa: E402
from megaopd.teachers.router import TeacherRouter  # noqa: E402

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1), "tp1": (1, 1)}
PARITY_MODELS = ("qwen3-tiny", "qwen3-tiny-untied", "llama-tiny", "llama-tiny-tied")
OPTIM = OptimConfig(lr=1e-3, grad_clip=1.0)
EPS = 1e-4  # Adam eps: 1e-8 amplifies fp32 rounding in near-zero second moments (reference note)
MBS = 2
TOPK = 16  # the top-k OPD form with its tail bucket (the megatron backend's vocabulary KL)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())  # double: a float64 reference keeps its digits


def make_batch(vocab: int, seed: int) -> TokenBatch:
    """Six right-padded sequences of different lengths, responses after a 4-token prompt."""
    g = torch.Generator().manual_seed(seed)
    lengths = [14, 9, 12, 7, 14, 10]
    width = max(lengths)
    ids = torch.full((len(lengths), width), 256, dtype=torch.long)
    attention = torch.zeros_like(ids)
    response = torch.zeros((len(lengths), width - 1))
    for i, n in enumerate(lengths):
        # Byte tokens only: HF never trains the pad token's embedding row (nn.Embedding padding_idx), Megatron does.
        ids[i, :n] = torch.randint(0, 256, (n,), generator=g)
        attention[i, :n] = 1
        response[i, 3: n - 1] = 1
    return TokenBatch(ids, attention, response, torch.zeros_like(response))


def policy_cfg(assets: Path, name: str, tp: int, pp: int, **megatron) -> ModelConfig:
    return ModelConfig(path=str(assets / "models" / name), backend="megatron",
                       megatron=MegatronConfig(tp=tp, pp=pp, adam_eps=EPS, **megatron))


def hf_reference(assets: Path, name: str) -> HFPolicy:
    hf = HFPolicy(ModelConfig(path=str(assets / "models" / name)), OPTIM)
    hf.optimizer = torch.optim.AdamW(hf.model.parameters(), lr=OPTIM.lr, betas=OPTIM.betas, eps=EPS,
                                     weight_decay=OPTIM.weight_decay)
    hf.scheduler = torch.optim.lr_scheduler.LambdaLR(hf.optimizer, lambda step: 1.0)
    return hf


def check_parity(assets: Path, tp: int, pp: int) -> dict:
    """Logits, full log-softmax and token logprobs of frozen Megatron models vs HF, both families, tied/untied."""
    out = {}
    batch = make_batch(259, seed=1)
    for name in PARITY_MODELS:
        policy = MegatronPolicy(policy_cfg(assets, name, tp, pp))
        hf = AutoModelForCausalLM.from_pretrained(assets / "models" / name, dtype=torch.float32)
        with torch.no_grad():
            ref = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        real = batch.attention_mask.bool()
        full_ref = ref[:, :-1].log_softmax(-1)
        token_ref = full_ref.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1) * batch.response_mask
        out[name] = {"logits": max_diff(policy.logits(batch, MBS)[real], ref[real]),
                     "full_logprobs": max_diff(policy.full_logprobs(batch, MBS)[real[:, 1:]], full_ref[real[:, 1:]]),
                     "logprobs": max_diff(policy.logprobs(batch, MBS), token_ref)}
        policy.seq_multiple = 16  # what sequence parallelism / FP8 ask for on GPU: padded positions change nothing
        out[name]["logprobs_seq_padded"] = max_diff(policy.logprobs(batch, MBS), token_ref)
    return out


def negative_control(assets: Path, tp: int, pp: int) -> dict:
    """A gate/up split bug in the loaded MLP weights (a classic mapping error) must show in the logits."""
    policy = MegatronPolicy(policy_cfg(assets, "llama-tiny", tp, pp))
    batch = make_batch(259, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(assets / "models" / "llama-tiny", dtype=torch.float32)
    with torch.no_grad():
        ref = hf(input_ids=batch.input_ids).logits
        for name, param in policy.module.named_parameters():
            if "linear_fc1.weight" in name:
                gate, up = param.chunk(2)
                param.copy_(torch.cat([up, gate]))
    real = batch.attention_mask.bool()
    return {"swapped_gate_up_logits": max_diff(policy.logits(batch, MBS)[real], ref[real])}


def set_teacher_targets(batch, teacher, topk: int) -> None:
    """The teacher's top-k logprobs, tail bucket and sampled-token logprobs on `batch`, from its full forward."""
    with torch.no_grad():
        teacher_full = teacher(input_ids=batch.input_ids).logits[:, :-1].log_softmax(-1)
    batch.teacher_topk_logprobs, batch.teacher_topk_ids = teacher_full.topk(topk, dim=-1)
    batch.teacher_tail = tail_logprob(teacher_full, batch.teacher_topk_ids)
    batch.teacher_logprobs = teacher_full.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1) * batch.response_mask


def check_steps(assets: Path, tp: int, pp: int, out_dir: Path, tag: str) -> dict:
    """GRPO, OPD (top-16 + tail for Qwen3, sampled-token for Llama), then the fixed-advantage control on both
    backends from the same state."""
    results = {}
    teacher = AutoModelForCausalLM.from_pretrained(assets / "models" / "qwen3-tiny-seed1", dtype=torch.float32)
    for name, form in (("qwen3-tiny", "topk"), ("llama-tiny", "sampled")):
        # One sequence per output-layer chunk (14 positions): the chunked, recomputed vocabulary loss is what is compared.
        megatron = MegatronPolicy(policy_cfg(assets, name, tp, pp), OPTIM, logit_chunk_rows=14)
        hf = hf_reference(assets, name)
        steps = []
        objectives = {"grpo": GRPO(GRPOConfig(), group_size=3), form: OPD(OPDConfig(form=form, topk=TOPK)),
                      "fixed_advantage": FixedAdvantage(FixedAdvantageConfig())}
        for step, (label, objective) in enumerate(objectives.items()):
            batch = make_batch(259, seed=10 + step)
            old = hf.logprobs(batch, MBS)
            noise = torch.randn(old.shape, generator=torch.Generator().manual_seed(step)) * 0.3
            batch.old_logprobs = (old + noise) * batch.response_mask  # ratios away from 1: clipping is exercised
            set_teacher_targets(batch, teacher, TOPK)
            if isinstance(objective, GRPO):
                batch.advantages = torch.tensor([1.0, -0.5, -0.5, 0.3, 0.9, -1.2])[:, None] * batch.response_mask
            else:
                objective.prepare(batch, [])
            m = megatron.train_minibatch(batch, objective.token_loss, MBS, objective.vocab_term)
            h = hf.train_minibatch(batch, objective.token_loss, MBS, objective.vocab_term)
            steps.append({"algorithm": type(objective).__name__, "form": label,
                          "loss_megatron": m["loss"], "loss_hf": h["loss"],
                          "loss": abs(m["loss"] - h["loss"]), "grad_norm": abs(m["grad_norm"] - h["grad_norm"]),
                          "grad_norm_hf": h["grad_norm"],
                          "metrics": {k: abs(m[k] - h[k]) for k in h if k not in ("loss", "grad_norm")}})
        exported = megatron.export_hf_state()
        hf_state = hf.model.state_dict()
        weights = max(max_diff(exported[k], hf_state[k]) for k in exported)
        moved = max(max_diff(v, hf_state[k]) for k, v in
                    AutoModelForCausalLM.from_pretrained(assets / "models" / name).state_dict().items())
        # Export after the steps, reload with transformers, compare with the Megatron logits.
        export_dir = out_dir / f"export_{tag}_{name}"
        megatron.save_hf(export_dir)
        batch = make_batch(259, seed=1)
        reloaded = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
        with torch.no_grad():
            ref = reloaded(input_ids=batch.input_ids).logits
        real = batch.attention_mask.bool()
        optimizers = getattr(megatron.optimizer, "chained_optimizers", [megatron.optimizer])
        results[name] = {"steps": steps, "weights": weights, "weights_moved": moved,
                         "optimizer": [type(o).__name__ for o in optimizers],
                         "export_reload_logits": max_diff(megatron.logits(batch, MBS)[real], ref[real])}
        if name == "qwen3-tiny":
            # Checkpoint, then one more step here: a resume at another layout must reproduce that step exactly
            # (same loss and grad norm, and the same weights after it, which needs the Adam moments and step).
            ckpt = out_dir / f"dist_ckpt_{tag}"
            megatron.save_checkpoint(ckpt)
            after = megatron.train_minibatch(make_batch(259, seed=5), nll, MBS)
            if dist.get_rank() == 0:
                torch.save(megatron.export_hf_state(), out_dir / f"continued_{tag}.pt")
            else:
                megatron.export_hf_state()
            results["checkpoint"] = {"dir": str(ckpt), "export": str(export_dir), "continued_loss": after["loss"],
                                     "continued_grad_norm": after["grad_norm"],
                                     "continued_weights": str(out_dir / f"continued_{tag}.pt")}
    return results


def make_group_batch(seed: int) -> TokenBatch:
    """Three prompts of different lengths, three samples each: responses of different lengths (one of a single
    token), right-padded; byte tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in (5, 3, 7)]
    responses = [torch.randint(0, 256, (n,), generator=g) for n in (4, 1, 6, 3, 3, 5, 2, 6, 1)]
    width = max(len(prompts[i // 3]) + len(r) for i, r in enumerate(responses))
    ids = torch.full((len(responses), width), 256, dtype=torch.long)
    attention, response = torch.zeros_like(ids), torch.zeros((len(responses), width - 1))
    for i, r in enumerate(responses):
        p = prompts[i // 3]
        ids[i, :len(p) + len(r)] = torch.cat([p, r])
        attention[i, :len(p) + len(r)] = 1
        response[i, len(p) - 1:len(p) - 1 + len(r)] = 1
    return TokenBatch(ids, attention, response, torch.zeros_like(response))


def check_shared_prompt(assets: Path, tp: int, pp: int) -> dict:
    """Shared-prompt passes against the unshared ones on this layout, from the same weights: logprobs and one GRPO
    step (loss, grad norm, weights after it), micro-batches of 2 rows cutting the groups; a negative control lets
    each response see another sample's response instead of its own."""
    from megaopd.models.shared_prompt import PromptGroups

    policies = [MegatronPolicy(policy_cfg(assets, "qwen3-tiny", tp, pp), OPTIM, shared_prompt=shared)
                for shared in (False, True)]
    batch = make_group_batch(seed=7)
    plain, shared = (p.logprobs(batch, MBS) for p in policies)
    result = {"logprobs": max_diff(shared, plain), "saved_flops": policies[1].take_prompt_saving()}
    batch.old_logprobs = (plain + torch.randn(plain.shape, generator=torch.Generator().manual_seed(3)) * 0.3) \
        * batch.response_mask
    batch.advantages = torch.linspace(-1, 1, batch.size)[:, None] * batch.response_mask
    objective = GRPO(GRPOConfig(), group_size=3)
    steps = [p.train_minibatch(batch, objective.token_loss, MBS) for p in policies]
    result |= {"grad_norm_plain": steps[0]["grad_norm"], "loss": abs(steps[1]["loss"] - steps[0]["loss"]),
               "grad_norm": abs(steps[1]["grad_norm"] - steps[0]["grad_norm"])}
    exported = [p.export_hf_state() for p in policies]
    result["weights"] = max(max_diff(exported[1][k], exported[0][k]) for k in exported[0])
    keys = PromptGroups.response_keys
    PromptGroups.response_keys = lambda self, prompt, own, batch_dim, *rest: keys(
        self, prompt, own.roll(1, batch_dim), batch_dim, *rest)
    try:
        result["leaked_logprobs"] = max_diff(policies[1].logprobs(batch, MBS), policies[0].logprobs(batch, MBS))
    finally:
        PromptGroups.response_keys = keys
    return result


def nll(logp, full, mb):
    return -logp, {}


def check_resume(assets: Path, tp: int, pp: int, checkpoint: dict) -> dict:
    """Load a distributed checkpoint written at another layout, check the weights, then take the next step."""
    policy = MegatronPolicy(policy_cfg(assets, "qwen3-tiny", tp, pp), OPTIM)
    policy.load_checkpoint(checkpoint["dir"])
    batch = make_batch(259, seed=1)
    ref_model = AutoModelForCausalLM.from_pretrained(checkpoint["export"], dtype=torch.float32)
    with torch.no_grad():
        ref = ref_model(input_ids=batch.input_ids).logits
    real = batch.attention_mask.bool()
    logits = max_diff(policy.logits(batch, MBS)[real], ref[real])
    step = policy.train_minibatch(make_batch(259, seed=5), nll, MBS)
    exported = policy.export_hf_state()
    continued = torch.load(checkpoint["continued_weights"])
    return {"logits": logits, "steps": policy.steps, "loss": abs(step["loss"] - checkpoint["continued_loss"]),
            "grad_norm": abs(step["grad_norm"] - checkpoint["continued_grad_norm"]),
            "weights_after_next_step": max(max_diff(exported[k], continued[k]) for k in continued)}


def check_teacher(assets: Path, teacher_tp: int) -> dict:
    """A frozen teacher at its own TP scoring beside the student's layout (the student's parallel state is live)."""
    name = "qwen3-tiny-seed1"
    teacher = MegatronPolicy(policy_cfg(assets, name, mpu.get_tensor_model_parallel_world_size(),
                                        mpu.get_pipeline_model_parallel_world_size()), tp=teacher_tp)
    batch = make_batch(259, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(assets / "models" / name, dtype=torch.float32)
    with torch.no_grad():
        full_ref = hf(input_ids=batch.input_ids).logits[:, :-1].log_softmax(-1)
    real = batch.attention_mask.bool()[:, 1:]
    token_ref = full_ref.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1) * batch.response_mask
    result = {"teacher_tp": teacher.layout.tp, "student_tp": mpu.get_tensor_model_parallel_world_size(),
              "full_logprobs": max_diff(teacher.full_logprobs(batch, MBS)[real], full_ref[real]),
              "logprobs": max_diff(teacher.logprobs(batch, MBS), token_ref)}
    # The same through the trainer's TeacherRouter with the megatron loader (model.megatron.teacher_tp).
    cfg = policy_cfg(assets, name, mpu.get_tensor_model_parallel_world_size(),
                     mpu.get_pipeline_model_parallel_world_size(), teacher_tp=teacher_tp)
    router = TeacherRouter({"*": cfg.path}, megatron_teachers(cfg), AutoTokenizer.from_pretrained(cfg.path))
    samples = [SimpleNamespace(row=SimpleNamespace(domain="any"))] * batch.size
    router.score(batch, samples, "topk", MBS, topk=TOPK)
    mask = batch.response_mask.bool()
    top_ref = full_ref.topk(TOPK, dim=-1).values
    result["router_topk_logprobs"] = max(max_diff(batch.teacher_topk_logprobs[mask], top_ref[mask]),
                                         max_diff(full_ref.gather(-1, batch.teacher_topk_ids)[mask], top_ref[mask]))
    result["router_logprobs"] = max_diff(batch.teacher_logprobs, token_ref)
    result["router_teacher_tp"] = router.teachers["*"].layout.tp
    return result


def main() -> None:
    assets, out_dir, *layouts = sys.argv[1:]
    assets, out_dir = Path(assets), Path(out_dir)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    resume_from = None
    for layout in layouts:
        tp, pp = LAYOUTS[layout]
        t0 = time.perf_counter()
        mpu.destroy_model_parallel()
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        result = {"layout": layout, "tp": tp, "pp": pp, "dp": mpu.get_data_parallel_world_size(),
                  "parity": check_parity(assets, tp, pp)}
        if layout == "tp2":
            result["negative_control"] = negative_control(assets, tp, pp)
        result["train"] = check_steps(assets, tp, pp, out_dir, layout)
        result["shared_prompt"] = check_shared_prompt(assets, tp, pp)
        if resume_from is not None:
            result["resume"] = {"from": resume_from[0], **check_resume(assets, tp, pp, resume_from[1])}
        resume_from = (layout, result["train"]["checkpoint"])
        if layout == "dp2":
            result["teacher"] = check_teacher(assets, teacher_tp=2)
        result["seconds"] = time.perf_counter() - t0
        if dist.get_rank() == 0:
            (out_dir / f"{layout}.json").write_text(json.dumps(result, indent=1))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
