"""How an SGLang server runs on a plain CPU (CI, rehearsals, CPU benchmarks): its flags and its environment.

Never the GPU path. ``sglang_cpu_stubs/`` holds an import-only vllm stub that SGLang's RoPE layer imports (and never
calls) on a plain CPU platform; it is put on the server's PYTHONPATH, not megaopd's.
"""

from __future__ import annotations

from pathlib import Path

STUBS = Path(__file__).with_name("sglang_cpu_stubs")


def cpu_server_args(mem_fraction: float = 0.8) -> list[str]:
    """Flags of sglang.launch_server on CPU. SGLang budgets weights + KV cache as a fraction of the memory free at
    start-up, counting other processes: a small fraction fails on a busy machine; --max-total-tokens (the stage's
    rollout.sglang.max_total_tokens) caps the KV cache anyway. --sleep-on-idle: without it the idle scheduler
    polls its sockets in a busy loop, a whole core (measured: 0.98 cores over 30 idle s, 0.02 with it, the same
    request latency), taken from the trainer that shares the CPU while the server waits for its next batch."""
    return ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph", "--skip-server-warmup",
            "--sleep-on-idle", "--mem-fraction-static", str(mem_fraction)]


def cpu_server_env(threads: int = 1) -> dict[str, str]:
    """The server's extra environment: the vllm stub, and its thread count (torch would take every core)."""
    return {"PYTHONPATH": str(STUBS), "OMP_NUM_THREADS": str(threads)}
