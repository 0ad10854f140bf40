"""The Python half of bench/gpu_acceptance.sh: SGLang rollouts and weight syncs, 20-step GRPO and OPD runs, and the
one JSON. Each part runs inside its own try, so that a failing part is recorded with its error and the others still
run; ``passed`` is true only when every part ran and met its check.

    python bench/gpu_acceptance.py --work DIR --megatron DIR/megatron.json --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megaopd.config import load_config  # noqa: E402
from megaopd.data.rows import load_rows  # noqa: E402
from megaopd.embedded import build_data, build_model  # noqa: E402
from megaopd.methods import method  # noqa: E402
from megaopd.metrics import read_metrics  # noqa: E402

SHAPE = "qwen3-0.6b"  # full 28 layers, width and vocabulary, random-initialised


def sglang_rollout(model: Path, data: Path, work: Path) -> dict:
    """Tokens/s of one SGLang GPU server: 64 prompts x 8 samples x 256 new tokens (EOS never ends a random model
    early, so every sample runs to the limit)."""
    from megaopd.policy import HFPolicy
    from megaopd.serving.engine import SGLangEngine

    cfg = load_config(None, [f"run_dir={work / 'rollout'}", f"model.path={model}", "model.device=cuda",
                             "model.dtype=bfloat16", "rollout.engine=sglang", "rollout.sglang.probe_tolerance=5e-2",
                             "rollout.sglang.server_args=[--mem-fraction-static, 0.5]"])
    policy = HFPolicy(cfg.model)
    engine = SGLangEngine(cfg, policy)
    rows = load_rows(str(data / "arith_add" / "train.jsonl"))[0][:64]
    try:
        engine.generate(rows[:8], 2, max_new_tokens=16, generator=torch.Generator().manual_seed(0))  # warm-up
        start = time.perf_counter()
        samples = engine.generate(rows, 8, max_new_tokens=256, generator=torch.Generator().manual_seed(1))
        seconds = time.perf_counter() - start
    finally:
        engine.close()
    tokens = sum(len(s.response_ids) for s in samples)
    return {"samples": len(samples), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def weight_sync(model: Path, work: Path, method: str) -> dict:
    """One perturbed update pushed to a fresh server by `method` and verified (version and logprob probe)."""
    from gpu_sglang_sync import timed_sync  # bench/ is this script's directory

    seconds, version, billions = timed_sync(str(model), method, str(work / f"sync_{method}"), tolerance=5e-2,
                                            mem_fraction=0.3)
    return {"verified": version == 1, "seconds": seconds, "seconds_per_billion": seconds / billions}


def train_run(model: Path, data: Path, work: Path, algorithm: str, steps: int = 20, teacher: Path | None = None,
              lr: float = 1e-5) -> dict:
    """`steps` steps on the HF backend, bf16 compute over fp32 masters; the loss must move."""
    from megaopd.trainer import Trainer

    train, heldout = data / "arith_add" / "train.jsonl", data / "arith_add" / "heldout.jsonl"
    overrides = [f"run_dir={work / algorithm}", f"model.path={model}", "model.device=cuda", "model.dtype=bfloat16",
                 "model.master_dtype=float32", f"train.algorithm={algorithm}", f"train.steps={steps}",
                 "train.prompts_per_step=16", "train.micro_batch_size=16", "rollout.max_new_tokens=32",
                 f"rollout.samples_per_prompt={8 if method(algorithm).group_term else 1}", f"optim.lr={lr}",
                 f"data.train=[{train}]", f"data.eval=[{heldout}]",
                 "eval.every=1000", "eval.prompts_per_domain=16", "eval.final_prompts_per_domain=16",
                 "checkpoint.every=1000"]
    if method(algorithm).teacher_term:
        overrides += [f"opd.teachers.*={teacher}", "opd.form=full_vocab"]
    start = time.perf_counter()
    summary = Trainer(load_config(None, overrides)).fit()
    metrics = [m for m in read_metrics(work / algorithm) if "train/loss" in m]
    losses = [m["train/loss"] for m in metrics]
    return {"steps": len(losses), "seconds": time.perf_counter() - start, "loss_first": losses[0],
            "loss_last": losses[-1], "loss_moved": max(losses) - min(losses) > 1e-6 * max(1.0, abs(losses[0])),
            "reward_mean": sum(m.get("rollout/reward", 0.0) for m in metrics) / len(metrics),
            "final_accuracy": summary["final"].get("final/mean/accuracy_greedy")}


def part(results: dict, name: str, fn, *args) -> None:
    start = time.perf_counter()
    try:
        results[name] = {**fn(*args), "ok": True}
    except Exception as e:  # recorded, and the next part runs
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    results[name]["wall_s"] = time.perf_counter() - start
    print(name, json.dumps({k: v for k, v in results[name].items() if k != "trace"}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True)
    p.add_argument("--megatron", required=True, help="bench/gpu_megatron.py's JSON")
    p.add_argument("--megatron-log", default="")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_acceptance.py: no CUDA GPU here; nothing ran")
    work, start = Path(a.work), time.perf_counter()
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    megatron = Path(a.megatron)
    results["megatron"] = ({"ok": True, "runs": json.loads(megatron.read_text())} if megatron.exists() else
                           {"ok": False, "error": Path(a.megatron_log).read_text()[-3000:] if a.megatron_log else ""})
    model = build_model(SHAPE, work / "models" / SHAPE, seed=0)
    data = work / "data"
    build_data(data, ["arith_add"], train_rows=2000, heldout_rows=64)
    part(results, "sglang_rollout", sglang_rollout, model, data, work)
    for method in ("disk", "tensor", "distributed"):
        part(results, f"sync_{method}", weight_sync, model, work, method)
    # A random 0.6B model never answers right, and GRPO's loss is 0 when every reward is: a short SFT cold start
    # gives it rewards to move on; it is also the OPD teacher of the random-init student.
    part(results, "sft_cold_start", train_run, model, data, work, "sft", 100, None, 3e-4)
    cold = work / "sft" / "final"
    part(results, "grpo_20_steps", train_run, cold, data, work, "grpo")
    part(results, "opd_20_steps", train_run, model, data, work, "opd", 20, cold, 1e-4)
    checks = [results["megatron"]["ok"], *(results[k]["ok"] for k in results if isinstance(results[k], dict)
                                           and "ok" in results[k] and k != "megatron")]
    checks += [results[k].get("verified", False) for k in results if k.startswith("sync_")]
    checks += [results[k].get("loss_moved", False) for k in ("sft_cold_start", "grpo_20_steps", "opd_20_steps")]
    results["passed"] = all(checks)
    results["total_s"] = time.perf_counter() - start
    Path(a.out).write_text(json.dumps(results, indent=1))
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
