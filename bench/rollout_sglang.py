"""Rollout throughput: a real SGLang server on CPU vs megaopd's LocalEngine, same model, prompts and lengths.

    MEGAOPD_SGLANG_PYTHON=.venv-sglang/bin/python python bench/rollout_sglang.py   # launches one CPU server
    python bench/rollout_sglang.py --url http://127.0.0.1:30000                    # or attach to one
    python bench/rollout_sglang.py --smoke --url ...                               # CI (tests/test_sglang.py)

Both sides go through megaopd's engine interface (``SGLangEngine.generate`` over HTTP, ``LocalEngine.generate``
in-process) at temperature 1 on the fixed-length benchmark model (its EOS id lies outside the vocabulary, so every
sample is exactly --max-new tokens), alternating call by call. The server runs float32, torch_native attention,
one OpenMP thread, like the trainer side. Tokens/s counts generated tokens only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import DEFAULT_ASSETS, machine, prepare_assets, spread, train_files  # noqa: E402

from megaopd.config import load_config  # noqa: E402
from megaopd.data.rows import load_rows  # noqa: E402
from megaopd.run.environment import sglang_python  # noqa: E402
from megaopd.models.hf_policy import HFPolicy  # noqa: E402
from megaopd.rollout.local import LocalEngine  # noqa: E402
from megaopd.rollout.serving.engine import SGLangEngine  # noqa: E402
from megaopd.rollout.serving.sglang_cpu import cpu_server_args, cpu_server_env  # noqa: E402


def tokens_per_second(engine, rows, n: int, max_new: int, seed: int) -> tuple[float, int]:
    start = time.perf_counter()
    samples = engine.generate(rows, n, 1.0, 1.0, max_new, torch.Generator().manual_seed(seed))
    tokens = sum(len(s.response_ids) for s in samples)
    return tokens / (time.perf_counter() - start), tokens


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--url", default="", help="attach to this server instead of launching one")
    p.add_argument("--model", default="", help="HF dir the attached server serves (default: the bench model)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--assets", default=str(DEFAULT_ASSETS))
    a = p.parse_args(argv)
    settings = [(16, 8), (64, 1)]  # (prompts, samples per prompt)
    if a.smoke:
        a.rounds, a.max_new, settings = 1, 4, [(2, 2)]
    torch.set_num_threads(a.threads)
    assets = prepare_assets(Path(a.assets), ("qwen3-tiny",), rows=64 if a.smoke else 512)
    model = a.model or str(assets / "models" / "qwen3-tiny")
    rows = load_rows(train_files(assets)[0], False)[0]

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(None, [f"run_dir={run_dir}", f"model.path={model}", "rollout.engine=sglang",
                                 "rollout.sglang.max_total_tokens=16384"])
        cfg.rollout.sglang.server_args = cpu_server_args(0.05)
        cfg.rollout.sglang.env = cpu_server_env(a.threads)
        cfg.rollout.sglang.urls = [a.url] if a.url else []
        cfg.rollout.sglang.python = sglang_python()  # $MEGAOPD_SGLANG_PYTHON, else this python
        policy = HFPolicy(cfg.model)
        policy.model.eval()
        engines = {"local": LocalEngine(policy), "sglang": SGLangEngine(cfg.rollout, cfg.model, cfg.run_dir, policy)}
        try:
            print(f"# Rollout throughput: SGLang server (CPU) vs LocalEngine\n\nmachine: {machine()}\n")
            print(f"model {Path(model).name}, {a.max_new} new tokens per sample, {a.threads} thread(s) each side, "
                  f"{a.rounds} alternating rounds, server {'attached' if a.url else 'launched'} "
                  f"({cfg.rollout.sglang.python or 'this python'})\n")
            print("| prompts x samples | tokens per call | SGLang tok/s | LocalEngine tok/s | "
                  "ratio SGLang/local (median, spread) |")
            print("|---|---|---|---|---|")
            for prompts, n in settings:
                batch = rows[:prompts]
                for engine in engines.values():  # warm-up
                    tokens_per_second(engine, batch, n, 2, 0)
                rates: dict[str, list[float]] = {"sglang": [], "local": []}
                counts = set()
                for r in range(a.rounds):
                    for side in (("sglang", "local") if r % 2 == 0 else ("local", "sglang")):
                        rate, tokens = tokens_per_second(engines[side], batch, n, a.max_new, r)
                        rates[side].append(rate)
                        counts.add(tokens)
                ratios = [s / loc for s, loc in zip(rates["sglang"], rates["local"])]
                print(f"| {prompts} x {n} | {'/'.join(map(str, sorted(counts)))} | "
                      f"{statistics.median(rates['sglang']):.0f} | {statistics.median(rates['local']):.0f} | "
                      f"**{statistics.median(ratios):.2f}x** ({spread(ratios)}) |")
        finally:
            engines["sglang"].close()


if __name__ == "__main__":
    main(sys.argv[1:])
