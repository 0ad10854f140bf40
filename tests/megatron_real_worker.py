"""Megatron (mbridge, tied embeddings) against HF on imported published weights, run by tests/test_real.py (SmolLM2,
Llama) and tests/test_real_qwen.py (Qwen2.5-Coder-0.5B, qwen2: q/k/v biases, 2 KV heads):

    torchrun --nproc-per-node 3 tests/megatron_real_worker.py MODEL_DIR BATCH.pt GROUPED.pt OUT_DIR tp3  # tp3.json
    torchrun --nproc-per-node 2 tests/megatron_real_worker.py MODEL_DIR BATCH.pt GROUPED.pt OUT_DIR tp2 pp2

(GROUPED.pt given as - skips the shared-prompt check.)

megatron splits query and KV heads over TP ranks only evenly (SmolLM2's 9 / 3 take TP=3, Qwen's 14 / 2 TP=2). Per
layout: token logprobs and logits of real text against HF before any step, one GRPO step, then the exported
checkpoint reloaded by transformers against the Megatron logits; each against HF at float64 too, beside HF's own
float32 result (float32's error on 24-30 real layers: ~1e-4 on these logits). The HF references are computed on
rank 0 only, on every core while the other ranks wait (the imported checkpoint's once a launch), the Megatron
model freed before the reload (a 0.5B model's float64 copy is 4 GB). The layouts of one launch (one world size) run
in turn, megatron's parallel state rebuilt for each.

Negative controls, at PP=2: the output layer lives on the last stage, apart from the embedding it is tied to, so one
breaks the tied mapping (the output layer read from ``lm_head.weight``, which a tied checkpoint does not have); on a
qwen2 model another merges the q/k/v biases without their per-KV-group interleave (the layout megatron's fused QKV
expects). With 2 KV heads that bug is invisible at TP=2 (each rank holds one group, where both layouts agree), so it
runs at PP=2 too, with both groups on each rank. On GROUPED.pt (samples sharing their prompts): shared-prompt
passes against unshared ones (logprobs, one GRPO step's gradients), with a response that sees another sample's
response as the negative control.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent)]
import megatron_worker as w  # noqa: E402  (redirects CUDA to CPU at import, like the tiny-model worker)
from machine_memory import every_core  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as mpu  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from megaopd.config import GRPOConfig, MegatronConfig, ModelConfig, OptimConfig  # noqa: E402
from megaopd.models.megatron import bridge as megaopd_bridge  # noqa: E402
from megaopd.models.megatron.policy import MegatronPolicy  # noqa: E402
from megaopd.objectives.losses import GRPO  # noqa: E402

LAYOUTS = {"tp3": (3, 1), "tp2": (2, 1), "pp2": (1, 2)}
OPTIM = OptimConfig(lr=1e-5, grad_clip=1.0)  # a fine-tuning step of a pretrained model (the tiny tests take 1e-3)


def cfg(model: str, tp: int, pp: int) -> ModelConfig:
    return ModelConfig(path=model, backend="megatron", megatron=MegatronConfig(tp=tp, pp=pp, adam_eps=w.EPS))


def hf_reference(model: str | Path, batch, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's logits and token logprobs on the response (zero elsewhere)."""
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    with torch.no_grad():
        logits = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    token = logits[:, :-1].log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    return logits, token * batch.response_mask


def broken_tie(bridge_class):
    """mbridge's Llama behaviour (megaopd.models.megatron.bridge fixes it): the output layer mapped to ``lm_head.weight``
    even when the checkpoint is tied."""
    class Broken(bridge_class):
        def _adjust_mapping_for_shared_weights(self):
            self._DIRECT_MAPPING = {**type(self)._DIRECT_MAPPING, "output_layer.weight": "lm_head.weight"}
    return Broken


def errors(megatron: torch.Tensor, hf: torch.Tensor, exact: torch.Tensor) -> dict:
    """Megatron's and HF's float32 results against HF's at float64 (float32's own error there), and each other."""
    return {"megatron": w.max_diff(megatron, exact), "hf_fp32": w.max_diff(hf, exact),
            "megatron_vs_hf": w.max_diff(megatron, hf)}


def broken_bias(bridge_class):
    """q/k/v biases merged one after another ([q; k; v]) instead of interleaved per KV group ([q0 k0 v0 q1 k1 v1])."""
    class Broken(bridge_class):
        def _weight_to_mcore_format(self, name, hf_weights):
            if name.endswith("self_attention.linear_qkv.bias"):
                return torch.cat(hf_weights)
            return super()._weight_to_mcore_format(name, hf_weights)
    return Broken


_KEPT: dict[str, dict] = {}  # checkpoint -> its references on this launch's one batch (rank 0)


def references(model: str | Path, batch, keep: bool = False) -> dict | None:
    """HF's logits and token logprobs at float32 and float64, on rank 0 (None elsewhere), while the other ranks
    wait holding nothing (a 0.5B model's float64 copy alone is 4 GB) and so leave their cores idle (gloo's wait
    sleeps). `keep`: computed once a launch (the imported checkpoint: every layout and control scores one batch)."""
    out = None
    if dist.get_rank() == 0:
        out = _KEPT.get(str(model))
        if out is None:
            with every_core():
                out = {"fp32": hf_reference(model, batch), "fp64": hf_reference(model, batch, torch.float64)}
        if keep:
            _KEPT[str(model)] = out
    dist.barrier()
    return out


def check(model: str, batch, tp: int, pp: int, out_dir: Path, tag: str) -> dict:
    real = batch.attention_mask.bool()
    before = references(model, batch, keep=True)
    policy = MegatronPolicy(cfg(model, tp, pp), OPTIM)
    logprobs, logits = policy.logprobs(batch, w.MBS), policy.logits(batch, w.MBS)
    # One GRPO step on the same text (advantages set, old logprobs the current ones): the export must carry it.
    batch.old_logprobs = logprobs
    batch.advantages = torch.linspace(-1, 1, batch.size)[:, None] * batch.response_mask
    objective = GRPO(GRPOConfig(), group_size=batch.size)
    step = policy.train_minibatch(batch, objective.token_loss, w.MBS, objective.vocab_term)
    policy.optimizer = None  # no more steps: Adam's state freed before the export gathers the model (2 GB a rank)
    gc.collect()
    export = out_dir / f"export_{tag}"
    policy.save_hf(export)
    trained = policy.logits(batch, w.MBS)
    del policy
    gc.collect()
    dist.barrier()
    after = references(export, batch)
    if before is None:
        return {}
    (ref_logits, ref_token), (exact_logits, exact_token) = before["fp32"], before["fp64"]
    (reloaded, _), (exact_reloaded, _) = after["fp32"], after["fp64"]
    return {"logprobs": errors(logprobs, ref_token, exact_token),
            "logits": errors(logits[real], ref_logits[real], exact_logits[real]),
            "grad_norm": step["grad_norm"],
            "export_reload_logits": errors(trained[real], reloaded[real], exact_reloaded[real]),
            "export_moved_logits": w.max_diff(reloaded[real], ref_logits[real])}


def broken_run(model: str, batch, tp: int, pp: int, breaks) -> dict:
    """The logprobs' distance from HF with the bridge broken by `breaks`, or the error it raises. Collective: when
    one stage alone fails to load (the last one, without lm_head.weight), the ranks agree on the failure before any
    of them runs a forward."""
    original = megaopd_bridge._bridge_class
    megaopd_bridge._bridge_class = lambda model_type: breaks(original(model_type))
    policy, error = None, ""
    try:
        policy = MegatronPolicy(cfg(model, tp, pp))
    except Exception as e:  # a loud failure is a detection too; say which
        error = f"{type(e).__name__}: {e}"[:300]
    finally:
        megaopd_bridge._bridge_class = original
    errors = [""] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    if any(errors):
        return {"error": next(e for e in errors if e)}
    logprobs = policy.logprobs(batch, w.MBS)
    del policy
    gc.collect()
    reference = references(model, batch, keep=True)
    return {"logprobs": w.max_diff(logprobs, reference["fp32"][1])} if reference else {}


def negative_controls(model: str, batch, tp: int, pp: int) -> dict:
    controls = {"broken_tie": broken_run(model, batch, tp, pp, broken_tie)}
    if megaopd_bridge._hf_config(model).model_type == "qwen2":
        controls["broken_qkv_bias"] = broken_run(model, batch, tp, pp, broken_bias)
    return controls


def check_shared(model: str, batch, tp: int, pp: int) -> dict:
    """Megatron with and without shared prompts on samples that share them: logprobs (beside HF float32's error
    against float64), and one GRPO step's gradients (each rank's own shard, unclipped: megatron's main_grad after
    the step), as max differences; the leaked control's logprobs too."""
    from megaopd.models.shared_prompt import PromptGroups

    optim = OptimConfig(lr=1e-5, grad_clip=0.0)
    plain, shared = (MegatronPolicy(cfg(model, tp, pp), optim, shared_prompt=on) for on in (False, True))
    _, ref_token = hf_reference(model, batch)
    _, exact_token = hf_reference(model, batch, torch.float64)
    expected = plain.logprobs(batch, w.MBS)
    result = {"logprobs": w.max_diff(shared.logprobs(batch, w.MBS), expected),
              "hf_fp32": w.max_diff(ref_token, exact_token)}
    batch.old_logprobs = expected
    batch.advantages = torch.linspace(-1, 1, batch.size)[:, None] * batch.response_mask
    objective = GRPO(GRPOConfig(), group_size=3)
    steps = [p.train_minibatch(batch, objective.token_loss, w.MBS) for p in (plain, shared)]
    grads = [[p.main_grad for p in policy.module.parameters()] for policy in (plain, shared)]
    local = torch.tensor([max(float((a - b).abs().max()) for a, b in zip(*grads)),
                          max(float(a.abs().max()) for a in grads[0])])
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    result |= {"grad_norm": steps[0]["grad_norm"], "grad_norm_shared": steps[1]["grad_norm"],
               "gradients": float(local[0]), "largest_gradient": float(local[1]),
               "saved_flops": shared.take_prompt_saving()}
    keys = PromptGroups.response_keys
    PromptGroups.response_keys = lambda self, prompt, own, batch_dim, seq_dim: keys(
        self, prompt, own.roll(1, batch_dim), batch_dim, seq_dim)
    try:
        result["leaked_logprobs"] = w.max_diff(shared.logprobs(batch, w.MBS), plain.logprobs(batch, w.MBS))
    finally:
        PromptGroups.response_keys = keys
    return result


def main() -> None:
    model, batch_file, grouped_file, out_dir, *layouts = sys.argv[1:]
    out_dir = Path(out_dir)
    batch = torch.load(batch_file, weights_only=False)
    # A rank that fails leaves the others at a collective: they give up after 5 minutes, not gloo's 30.
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    for layout in layouts:
        tp, pp = LAYOUTS[layout]
        mpu.destroy_model_parallel()
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        torch.manual_seed(0)
        t0 = time.perf_counter()
        result = check(model, batch.select(slice(0, batch.size)), tp, pp, out_dir, layout)
        if pp > 1:  # the output layer apart from the embedding: where a tied mapping can go wrong
            result["negative_control"] = negative_controls(model, batch, tp, pp)
        if grouped_file != "-":
            result["shared_prompt"] = check_shared(model, torch.load(grouped_file, weights_only=False), tp, pp)
        if dist.get_rank() == 0:
            (out_dir / f"{layout}.json").write_text(json.dumps(result | {"seconds": time.perf_counter() - t0},
                                                               indent=1))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
