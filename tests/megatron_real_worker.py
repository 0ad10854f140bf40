"""Megatron (mbridge, Llama, tied embeddings) against HF on the imported SmolLM2 weights, run by tests/test_real.py:

    torchrun --nproc-per-node 3 tests/megatron_real_worker.py MODEL_DIR BATCH.pt OUT_DIR tp3    # OUT_DIR/tp3.json
    torchrun --nproc-per-node 2 tests/megatron_real_worker.py MODEL_DIR BATCH.pt OUT_DIR pp2

TP=3, not 2: SmolLM2-135M has 9 query and 3 KV heads, which megatron splits over TP ranks only evenly. Per layout:
token logprobs and logits of real text against HF before any step, one GRPO step, then the exported checkpoint
reloaded by transformers against the Megatron logits; each against HF at float64 too, beside HF's own float32 result
(float32's error on 30 real layers: ~1e-4 on these logits). At PP=2 the output layer lives on the last stage, apart
from the embedding it is tied to, so a negative control there breaks the tied mapping (the output layer read from
``lm_head.weight``, which a tied checkpoint does not have) and measures the logprobs again.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent)]
import megatron_worker as w  # noqa: E402  (redirects CUDA to CPU at import, like the tiny-model worker)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as mpu  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from megaopd.config import GRPOConfig, MegatronConfig, ModelConfig, OptimConfig  # noqa: E402
from megaopd.megatron import bridge as megaopd_bridge  # noqa: E402
from megaopd.megatron.policy import MegatronPolicy  # noqa: E402
from megaopd.objectives import GRPO  # noqa: E402

LAYOUTS = {"tp3": (3, 1), "pp2": (1, 2)}
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
    """mbridge's Llama behaviour (megaopd.megatron.bridge fixes it): the output layer mapped to ``lm_head.weight``
    even when the checkpoint is tied."""
    class Broken(bridge_class):
        def _adjust_mapping_for_shared_weights(self):
            self._DIRECT_MAPPING = {**type(self)._DIRECT_MAPPING, "output_layer.weight": "lm_head.weight"}
    return Broken


def errors(megatron: torch.Tensor, hf: torch.Tensor, exact: torch.Tensor) -> dict:
    """Megatron's and HF's float32 results against HF's at float64 (float32's own error there), and each other."""
    return {"megatron": w.max_diff(megatron, exact), "hf_fp32": w.max_diff(hf, exact),
            "megatron_vs_hf": w.max_diff(megatron, hf)}


def check(model: str, batch, tp: int, pp: int, out_dir: Path, tag: str) -> dict:
    real = batch.attention_mask.bool()
    ref_logits, ref_token = hf_reference(model, batch)
    exact_logits, exact_token = hf_reference(model, batch, torch.float64)
    policy = MegatronPolicy(cfg(model, tp, pp), OPTIM)
    result = {"logprobs": errors(policy.logprobs(batch, w.MBS), ref_token, exact_token),
              "logits": errors(policy.logits(batch, w.MBS)[real], ref_logits[real], exact_logits[real])}
    # One GRPO step on the same text (advantages set, old logprobs the current ones): the export must carry it.
    batch.old_logprobs = policy.logprobs(batch, w.MBS)
    batch.advantages = torch.linspace(-1, 1, batch.size)[:, None] * batch.response_mask
    objective = GRPO(GRPOConfig(), group_size=batch.size)
    step = policy.train_minibatch(batch, objective.token_loss, w.MBS, objective.vocab_term)
    export = out_dir / f"export_{tag}"
    policy.save_hf(export)
    dist.barrier()
    reloaded, _ = hf_reference(export, batch)
    exact_reloaded, _ = hf_reference(export, batch, torch.float64)
    trained = policy.logits(batch, w.MBS)
    result |= {"grad_norm": step["grad_norm"],
               "export_reload_logits": errors(trained[real], reloaded[real], exact_reloaded[real]),
               "export_moved_logits": w.max_diff(reloaded[real], ref_logits[real])}
    return result


def negative_control(model: str, batch, tp: int, pp: int) -> dict:
    """The logprobs with the tied mapping broken, or the error it raises. Collective: the last stage alone fails to
    load (no lm_head.weight), so the ranks agree on a failure before any of them runs a forward."""
    original = megaopd_bridge._bridge_class
    megaopd_bridge._bridge_class = lambda model_type: broken_tie(original(model_type))
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
        return {"broken_tie_error": next(e for e in errors if e)}
    _, ref_token = hf_reference(model, batch)
    return {"broken_tie_logprobs": w.max_diff(policy.logprobs(batch, w.MBS), ref_token)}


def main() -> None:
    model, batch_file, out_dir, layout = sys.argv[1:]
    out_dir, (tp, pp) = Path(out_dir), LAYOUTS[layout]
    batch = torch.load(batch_file, weights_only=False)
    # A rank that fails leaves the others at a collective: they give up after 5 minutes, not gloo's 30.
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    result = check(model, batch.select(slice(0, batch.size)), tp, pp, out_dir, layout)
    if pp > 1:  # the output layer apart from the embedding: where a tied mapping can go wrong
        result["negative_control"] = negative_control(model, batch, tp, pp)
    if dist.get_rank() == 0:
        (out_dir / f"{layout}.json").write_text(json.dumps(result | {"seconds": time.perf_counter() - t0}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
