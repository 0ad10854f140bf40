"""Megatron backend throughput on one GPU: a Qwen3-1.7B-shaped model built from a config (random weights, no
download), bf16 training steps and, when Transformer Engine is installed, FP8 steps; prints step time, tokens/s
and MFU. Run through ``bench/gpu_megatron.sh`` (torchrun, one process per GPU).

    torchrun --nproc-per-node 1 bench/gpu_megatron.py --steps 6 --seq 2048 --batch 16 --micro-batch 4

The weights go HF -> Megatron through mbridge like any run's, so the timing includes nothing the trainer skips;
the loss is the token-mean NLL over every position (a training pass of the same FLOPs as a GRPO/OPD update).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaopd.config import FP8Recipe, choices  # noqa: E402

# Qwen3-1.7B's shape (hidden 2048, 28 layers, 16 query / 8 KV heads of 128, SwiGLU 6144, vocab 151936, tied).
QWEN3_1P7B = dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=8192,
                  rms_norm_eps=1e-6, rope_theta=1e6)


def build_hf_dir(out: Path, layers: int) -> Path:
    """A random bf16 Qwen3 checkpoint of that shape, built on the GPU, with the embedded tokenizer beside it."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from megaopd.models.embedded import build_tokenizer

    config = Qwen3Config(**{**QWEN3_1P7B, "num_hidden_layers": layers}, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return out


def run(path: Path, fp8: str, args) -> dict:
    from megaopd.data.batch import TokenBatch
    from megaopd.config import MegatronConfig, ModelConfig, OptimConfig
    from megaopd.accounting.flops import train_flops
    from megaopd.models.megatron.policy import MegatronPolicy
    from megaopd.accounting.metrics import step_perf

    cfg = ModelConfig(path=str(path), backend="megatron", dtype="bfloat16", device="cuda",
                      megatron=MegatronConfig(fp8=fp8))
    policy = MegatronPolicy(cfg, OptimConfig(lr=1e-5))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, QWEN3_1P7B["vocab_size"], (args.batch, args.seq), generator=g)
    batch = TokenBatch(ids, torch.ones_like(ids), torch.ones(args.batch, args.seq - 1),
                       torch.zeros(args.batch, args.seq - 1))
    times, metrics = [], {}
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        metrics = policy.train_minibatch(batch, lambda logp, full, mb: (-logp, {}), args.micro_batch)
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        print(f"  [{fp8}] step {step}: {time.perf_counter() - t0:.3f} s, loss {metrics['loss']:.3f}, "
              f"MFU {metrics.get('mfu', float('nan')):.3f}", flush=True)
    seconds = statistics.median(times)
    perf = step_perf(args.batch * train_flops(policy.shape, args.seq), seconds, devices=1)  # the median step
    result = {"precision": "bf16" if fp8 == "none" else f"fp8-{fp8}", "step_s": seconds,
              "tokens_per_s": args.batch * args.seq / seconds, "tflops_per_device": perf["tflops_per_device"],
              "mfu": perf.get("mfu"), "loss": metrics["loss"], "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
              "params": sum(p.numel() for p in policy.module.parameters())}
    del policy
    torch.cuda.empty_cache()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=QWEN3_1P7B["num_hidden_layers"])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16, help="sequences per optimizer step")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--fp8", default="hybrid", choices=choices(FP8Recipe),
                   help="FP8 recipe for the second run when TE is present ('none': skip)")
    p.add_argument("--out", default="", help="write the results as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_megatron.py needs a CUDA GPU (megatron-core and Transformer Engine run on GPUs only); "
              "none is visible here. The CPU checks of the backend are tests/test_megatron.py.", file=sys.stderr)
        return 2
    from megaopd.models.megatron import require

    require()
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; transformer_engine "
          f"{'present' if importlib.util.find_spec('transformer_engine') else 'absent (bf16 only)'}", flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = build_hf_dir(Path(tmp) / "qwen3-1.7b-shape", args.layers)
        print(f"built the HF checkpoint in {time.perf_counter() - t0:.1f} s", flush=True)
        results = [run(path, "none", args)]
        if args.fp8 != "none" and importlib.util.find_spec("transformer_engine"):
            results.append(run(path, args.fp8, args))
    print(f"\n{'precision':<12}{'params':>10}{'step s':>9}{'tokens/s':>11}{'TFLOP/s':>9}{'MFU':>7}{'mem GiB':>9}")
    for r in results:
        mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "n/a"
        print(f"{r['precision']:<12}{r['params'] / 1e9:>9.2f}B{r['step_s']:>9.3f}{r['tokens_per_s']:>11.0f}"
              f"{r['tflops_per_device']:>9.1f}{mfu:>7}{r['max_memory_gib']:>9.1f}")
    print(f"total {time.perf_counter() - t0:.0f} s (MFU: model FLOPs of megaopd.accounting.flops over the bf16 dense peak)")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
