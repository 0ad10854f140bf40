"""Bounded-staleness rollouts on one SGLang CPU server: seconds per GRPO step at rollout.max_staleness = 0, 1, 2.

    MEGAOPD_SGLANG_PYTHON=.venv-sglang/bin/python python bench/async_rollout.py   # launches one CPU server
    python bench/async_rollout.py --url http://127.0.0.1:30000                    # or attach to one

The same GRPO stage (the fixed-length benchmark model: every sample is exactly --max-new tokens, so each K does the
same work and books the same FLOPs) runs once per K against the same server, put back on the initial weights at
version 0 before each. Step 1 fills the pipeline (it waits for K+1 batches) and is left out of the means. The wait
share is the trainer's time blocked on rollouts (perf/rollout_wait_seconds) over its step time. On one machine the
server and the trainer share the cores, so the overlap shows what the pipeline hides, not what a separate rollout
node would give (the multi-node bench is not written yet: docs/serving.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import DEFAULT_ASSETS, machine, prepare_assets, train_files  # noqa: E402

from megaopd.config import SGLangConfig, load_config  # noqa: E402
from megaopd.metrics import read_metrics  # noqa: E402
from megaopd.serving.server import SGLangServer  # noqa: E402
from megaopd.serving.sglang_cpu import cpu_server_args, cpu_server_env  # noqa: E402
from megaopd.trainer import Trainer  # noqa: E402


def server_config(threads: int) -> SGLangConfig:
    return SGLangConfig(python=os.environ.get("MEGAOPD_SGLANG_PYTHON", ""), max_total_tokens=16384,
                        startup_timeout_s=600, server_args=cpu_server_args(0.5), env=cpu_server_env(threads),
                        request_timeout_s=300)


def run_stage(server: SGLangServer, model: str, assets: Path, run_dir: Path, k: int, a) -> dict[str, float]:
    answer = server.post("/update_weights_from_disk", {"model_path": model, "weight_version": "0"}, 300)
    assert answer["success"], answer
    data = train_files(assets)
    cfg = load_config(None, [
        f"run_dir={run_dir}", f"model.path={model}", f"data.train=[{data[0]}]", f"data.eval=[{data[0]}]",
        "train.algorithm=grpo", f"train.steps={a.steps}", f"train.prompts_per_step={a.prompts}",
        "train.micro_batch_size=64", f"rollout.samples_per_prompt={a.samples}", f"rollout.max_new_tokens={a.max_new}",
        f"rollout.max_staleness={k}", "rollout.engine=sglang", f"eval.every={a.steps + 1}", "eval.prompts_per_domain=1",
        "eval.final_prompts_per_domain=1", "checkpoint.every=0"])
    cfg.rollout.sglang = server_config(a.threads)
    cfg.rollout.sglang.urls = [server.url]
    summary = Trainer(cfg).fit()
    steps = [m for m in read_metrics(run_dir) if "perf/rollout_wait_seconds" in m][1:]  # step 1 fills the pipeline
    step_seconds = sum(m["perf/step_seconds"] for m in steps)
    return {"step_seconds": statistics.mean(m["perf/step_seconds"] for m in steps),
            "wait_share": sum(m["perf/rollout_wait_seconds"] for m in steps) / step_seconds,
            "staleness_max": max(m["rollout/staleness_max"] for m in steps),
            "flops": summary["ledger"]["totals"]["stage"]}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--url", default="", help="attach to this server (serving the bench model) instead of launching")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--assets", default=str(DEFAULT_ASSETS))
    a = p.parse_args(argv)
    if a.smoke:
        a.steps, a.prompts, a.samples, a.max_new = 3, 2, 2, 4
    torch.set_num_threads(a.threads)
    assets = prepare_assets(Path(a.assets), ("qwen3-tiny",), rows=64 if a.smoke else 512)
    model = str(assets / "models" / "qwen3-tiny")
    server = SGLangServer(a.url) if a.url else SGLangServer.launch(
        model, server_config(a.threads), "float32", Path(tempfile.mkdtemp()) / "server.log")
    try:
        with tempfile.TemporaryDirectory() as root:
            results = {k: run_stage(server, model, assets, Path(root) / f"k{k}", k, a) for k in (0, 1, 2)}
    finally:
        server.stop()
    print(f"# GRPO with bounded-staleness rollouts on one SGLang CPU server\n\nmachine: {machine()}\n")
    print(f"model qwen3-tiny (fixed length), {a.steps} steps of {a.prompts} x {a.samples} samples x {a.max_new} "
          f"tokens, {a.threads} thread(s) trainer and server, server {'attached' if a.url else 'launched'}\n")
    print("| rollout.max_staleness | s / step (steps 2..) | trainer wait share | staleness max | stage FLOPs | "
          "s / step vs K=0 |")
    print("|---|---|---|---|---|---|")
    for k, r in results.items():
        print(f"| {k} | {r['step_seconds']:.3f} | {r['wait_share']:.0%} | {r['staleness_max']} | {r['flops']:.4g} | "
              f"**{r['step_seconds'] / results[0]['step_seconds']:.2f}x** |")


if __name__ == "__main__":
    main(sys.argv[1:])
