"""Shared pieces of the megaopd-vs-TRL benchmarks: assets, the per-side workers and the A/B driver.

Each measurement runs in its own subprocess (``python bench/common.py worker ...``) so that the two sides never share
a process (no warm caches, no imported-library side effects, a clean RSS high-water mark), and the driver alternates
the sides A B A B ... so that slow drift of a shared machine hits both equally.

Equal work. The benchmark models are the embedded presets with one change: their EOS id points at an extra special
token that lies *outside* the model's vocabulary, so neither sampler can ever stop early and both sides generate
exactly ``max_new_tokens`` tokens for every sample. Both workers also count the tokens they actually generated and
trained on, and the driver prints those counts side by side (and fails if they differ by more than the prompt
tokenisation can explain).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megaopd.run import allocator  # noqa: E402
from megaopd.objectives.methods import method  # noqa: E402

DEFAULT_ASSETS = Path("/tmp/megaopd_bench_assets")  # each script's --assets moves them
DOMAINS = ["arith_add", "prog_trace"]
NEVER_EOS = "<|bench_never|>"


# ---------------------------------------------------------------------------------------------------------------
# assets
# ---------------------------------------------------------------------------------------------------------------

def fixed_length_model(preset: str, out_dir: Path, seed: int = 0) -> Path:
    """build_model, then point EOS at a token id >= vocab_size so that generation always runs to the limit."""
    from megaopd.models.embedded import build_model

    if (out_dir / "config.json").exists():
        return out_dir
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    build_model(preset, tmp, seed)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp)
    tok.add_special_tokens({"additional_special_tokens": [NEVER_EOS]})
    tok.eos_token = NEVER_EOS
    never = tok.convert_tokens_to_ids(NEVER_EOS)
    tok.save_pretrained(tmp)
    for name in ("config.json", "generation_config.json"):
        path = tmp / name
        if path.exists():
            cfg = json.loads(path.read_text())
            assert never >= cfg.get("vocab_size", 0) or name != "config.json", "never-EOS id inside the vocabulary"
            cfg["eos_token_id"] = never
            path.write_text(json.dumps(cfg, indent=1))
    tmp.rename(out_dir)
    return out_dir


def long_tail_model(preset: str, out_dir: Path, median: int = 16, seed: int = 0) -> Path:
    """build_model, with an end-of-turn probability that makes response lengths long-tailed (most near `median`
    tokens, a few many times longer: the tail that holds a synchronous step until its longest response ends).

    The residual stream's first channel is held at 1 (every token's embedding has 1 there, and no attention or MLP
    output writes to it), and the tied end-of-turn row reads it with a weight `a`: the end-of-turn logit rises by
    about a / rms(stream), which varies with the context, so lengths are a mixture of geometric ones. `a` is
    searched so that the median length of sampled responses (temperature 1) is `median`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megaopd.models.chat import chat_prompt_ids_batch
    from megaopd.models.embedded import build_model

    if (out_dir / "config.json").exists():
        return out_dir
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    build_model(preset, tmp, seed)
    model = AutoModelForCausalLM.from_pretrained(tmp)
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    assert model.config.tie_word_embeddings, f"{preset}: the end-of-turn row is the embedding's (a tied preset)"
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        embed[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
    prompts = chat_prompt_ids_batch(tokenizer, [[{"role": "user", "content": f"{i} + {i % 7} = ?"}]
                                                for i in range(16)])

    def sampled_lengths(a: float) -> list[int]:
        with torch.no_grad():
            embed[eos, 0] = a
        torch.manual_seed(seed)
        lengths = []
        for ids in prompts:
            out = model.generate(torch.tensor([ids] * 4), do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                 max_new_tokens=16 * median, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
            for row in out[:, len(ids):].tolist():
                lengths.append(row.index(eos) + 1 if eos in row else len(row))
        return sorted(lengths)

    low, high = 1.0, 64.0  # a higher `a`: an earlier end
    for _ in range(10):
        mid = (low * high) ** 0.5
        low, high = (mid, high) if statistics.median(sampled_lengths(mid)) > median else (low, mid)
    lengths = sampled_lengths((low * high) ** 0.5)
    (tmp / "lengths.json").write_text(json.dumps({"samples": len(lengths), "median": statistics.median(lengths),
                                                  "p90": lengths[len(lengths) * 9 // 10], "max": lengths[-1]}))
    model.save_pretrained(tmp)
    tmp.rename(out_dir)
    return out_dir


def prepare_assets(root: Path = DEFAULT_ASSETS, presets=("qwen3-tiny", "qwen3-small", "llama-tiny"),
                   rows: int = 512) -> Path:
    from megaopd.models.embedded import build_data

    root.mkdir(parents=True, exist_ok=True)
    for preset in presets:
        fixed_length_model(preset, root / "models" / preset, seed=0)
    if not (root / "data" / DOMAINS[-1] / "test.jsonl").exists():
        build_data(root / "data", DOMAINS, train_rows=rows, heldout_rows=16)
    return root


def train_files(assets: Path) -> list[str]:
    return [str(assets / "data" / d / "train.jsonl") for d in DOMAINS]


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def rss_now_kb() -> int:
    return _status_kb("VmRSS")


def peak_rss_kb() -> int:
    """This process's own resident high-water mark (VmHWM). Not getrusage's ru_maxrss: Linux carries the parent's
    over fork and exec, so a worker of a 500 MB driver read 506 MB with a 11 MB peak of its own."""
    return _status_kb("VmHWM")


def machine() -> str:
    import platform

    import torch

    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import transformers
        tv = transformers.__version__
    except ImportError:
        tv = "-"
    try:
        import trl
        trlv = trl.__version__
    except ImportError:
        trlv = "not installed"
    return (f"{cpu}, {os.cpu_count()} logical CPUs, Python {platform.python_version()}, torch {torch.__version__}, "
            f"transformers {tv}, trl {trlv}")


def have_trl() -> bool:
    try:
        import trl  # noqa: F401
        return True
    except Exception:  # noqa: BLE001 - any import failure means "skip the TRL side"
        return False


# ---------------------------------------------------------------------------------------------------------------
# workers: one side, one algorithm, N steps, timings + token counts + RSS as JSON
# ---------------------------------------------------------------------------------------------------------------

def _megaopd_worker(a) -> dict:
    from megaopd.config import load_config
    from megaopd.run.trainer import Trainer

    assets = Path(a.assets)
    student = assets / "models" / a.student
    overrides = [
        f"run_dir={a.run_dir}", f"model.path={student}", f"data.train={json.dumps(train_files(assets))}",
        f"train.algorithm={a.algo}", f"train.steps={a.warmup + a.steps}", f"train.prompts_per_step={a.prompts}",
        f"train.micro_batch_size={a.prompts * a.group}", f"train.recompute_old_logprobs={bool(a.recompute)}",
        f"train.shared_prompt={bool(a.shared_prompt)}",
        f"rollout.samples_per_prompt={a.group}", f"rollout.max_new_tokens={a.max_new}",
        "rollout.temperature=1.0", "rollout.top_p=1.0",
        f"optim.lr={a.lr}", "optim.betas=[0.9, 0.99]", "optim.weight_decay=0.0", "optim.grad_clip=1.0",
        "grpo.clip_low=0.2", "grpo.clip_high=0.2", "grpo.kl_coef=0.0", "grpo.scale_std=true",
        "checkpoint.every=1000000",
    ]
    if method(a.algo).teacher_term:
        overrides += [f"opd.teachers.*={assets / 'models' / a.teacher}", "opd.form=full_vocab"]
    cfg = load_config(None, overrides)
    allocator.keep_heap_for([cfg.model.device])  # as `megaopd train` does where its process starts
    trainer = Trainer(cfg)
    counts = {"gen": [], "prompt": []}
    generate = trainer.engine.generate

    def counting_generate(rows, n, *args, **kw):
        samples = generate(rows, n, *args, **kw)
        counts["gen"].append(sum(len(s.response_ids) for s in samples))
        counts["prompt"].append(sum(len(s.prompt_ids) for s in samples))
        return samples

    trainer.engine.generate = counting_generate
    for step in range(1, a.warmup + 1):
        trainer.rl_step(step)
    rss_before = rss_now_kb()
    prof = _start_profile(a)
    times, cpu_times, phases = [], [], []
    for step in range(a.warmup + 1, a.warmup + a.steps + 1):
        booked = dict(trainer.ledger.own)
        t0, c0 = time.perf_counter(), time.process_time()
        metrics = trainer.rl_step(step)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
        flops = {c: trainer.ledger.own[c] - booked[c] for c in booked}
        # The work executed beside the ledger's model FLOPs: the update less what shared prompts did not run, plus the
        # teachers' re-projections (they run inside the update).
        beyond = {"update": metrics.get("perf/teacher_recompute_flops", 0) - metrics["perf/shared_prompt_saved_flops"]}
        phases.append({phase: (metrics.get(f"perf/{phase}_seconds", 0.0), sum(flops[c] for c in components),
                               sum(flops[c] for c in components) + beyond.get(phase, 0))
                       for phase, components in PHASE_COMPONENTS.items()})
        assert sum(p[2] for p in phases[-1].values()) == metrics["perf/hardware_flops"]
    _stop_profile(a, prof)
    return {"times": times, "cpu_times": cpu_times, "gen_tokens": counts["gen"][a.warmup:], "seq_tokens":
            [g + p for g, p in zip(counts["gen"][a.warmup:], counts["prompt"][a.warmup:])], "rss_before_kb": rss_before,
            "flops": [sum(p[1] for p in step.values()) for step in phases],
            "executed": [sum(p[2] for p in step.values()) for step in phases], "phases": phases}


# megaopd's step phases (perf/<phase>_seconds) and the ledger components each one computes.
PHASE_COMPONENTS = {"rollout": ("rollout",), "teacher": ("teacher",), "update": ("old_logprob", "reference", "train")}


def matmul_peak(threads: int, n: int = 2048, reps: int = 7) -> float:
    """The machine's fp32 matmul peak as measured here, FLOP/s: the fastest of `reps` [n x n] @ [n x n] products
    on `threads` threads (the share-of-peak rows divide by it; the fastest, because another process on the machine
    can only slow a product down, so the shares are if anything understated)."""
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(n, n)
    a @ a  # warm-up: first-touch pages, the BLAS's own buffers
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ a
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / min(times)


def _trl_worker(a) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from megaopd.data.rows import load_rows
    from megaopd.verifiers import score

    assets = Path(a.assets)
    student = str(assets / "models" / a.student)
    rows = []
    for path in train_files(assets):
        rows += load_rows(path, False)[0]
    dataset = Dataset.from_list([{"prompt": r.prompt, "row_index": i} for i, r in enumerate(rows)])
    tokenizer = AutoTokenizer.from_pretrained(student, padding_side="left")

    def load(path):  # the same loading as megaopd's HFPolicy: float32, SDPA attention
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")

    common = dict(output_dir=a.run_dir, use_cpu=True, bf16=False, fp16=False, report_to="none", save_strategy="no",
                  logging_steps=10**6, max_steps=a.warmup + a.steps, per_device_train_batch_size=a.prompts * a.group,
                  gradient_accumulation_steps=1, learning_rate=a.lr, adam_beta1=0.9, adam_beta2=0.99,
                  weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0,
                  gradient_checkpointing=False,  # megaopd does not checkpoint activations: same work on both sides
                  max_completion_length=a.max_new, temperature=1.0, top_p=1.0, top_k=0, seed=0,
                  dataloader_num_workers=0, disable_tqdm=True)
    if method(a.algo).group_term:
        from trl import GRPOConfig, GRPOTrainer

        def reward(completions, row_index, **kw):  # megaopd's own verifier: same reward work on both sides
            return [score(rows[i], c[0]["content"] if isinstance(c, list) else c) for c, i in zip(completions, row_index)]

        args = GRPOConfig(**common, num_generations=a.group, beta=0.0, epsilon=0.2, num_iterations=1,
                          loss_type="dapo", scale_rewards="group", mask_truncated_completions=False)
        trainer = GRPOTrainer(model=load(student), reward_funcs=reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer)
    else:
        try:
            from trl import DistillationConfig, DistillationTrainer
        except ImportError:  # older TRL: the experimental namespace
            from trl.experimental.distillation import DistillationConfig, DistillationTrainer
        args = DistillationConfig(**common, beta=1.0)  # beta=1: reverse KL, full vocabulary
        assert a.group == 1, "TRL's DistillationTrainer samples one completion per prompt"
        trainer = DistillationTrainer(model=load(student), teacher_model=load(str(assets / "models" / a.teacher)),
                                      args=args, train_dataset=dataset, processing_class=tokenizer)

    counts = {"gen": [], "prompt": [], "gen_generated": []}
    inner = trainer._generate_and_score_completions

    def counting(inputs):
        out = inner(inputs)
        counts["gen"].append(int(out["completion_mask"].sum()))
        counts["gen_generated"].append(int(out["completion_ids"].numel()))
        counts["prompt"].append(int(out["prompt_mask"].sum()))
        return out

    trainer._generate_and_score_completions = counting
    marks = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            marks.setdefault("begin", []).append(time.perf_counter())
            marks.setdefault("cpu_begin", []).append(time.process_time())
            if len(marks["begin"]) == a.warmup + 1:
                marks["rss_before"] = rss_now_kb()
                marks["prof"] = _start_profile(a)

        def on_step_end(self, args, state, control, **kw):
            marks.setdefault("end", []).append(time.perf_counter())
            marks.setdefault("cpu_end", []).append(time.process_time())

    trainer.add_callback(Clock())
    trainer.train()
    _stop_profile(a, marks.get("prof"))
    ends = marks["end"]
    # step k = end(k) - end(k-1): includes fetching the batch, generation, reward, loss/update and the callbacks
    times = [ends[k] - ends[k - 1] for k in range(a.warmup, len(ends))] if a.warmup else \
        [ends[0] - marks["begin"][0]] + [ends[k] - ends[k - 1] for k in range(1, len(ends))]
    cpu = marks["cpu_end"]  # the same step boundaries, in CPU seconds of this process
    cpu_times = [cpu[k] - cpu[k - 1] for k in range(a.warmup, len(cpu))] if a.warmup else \
        [cpu[0] - marks["cpu_begin"][0]] + [cpu[k] - cpu[k - 1] for k in range(1, len(cpu))]
    gen, prompt = counts["gen"][a.warmup:], counts["prompt"][a.warmup:]
    return {"times": times, "cpu_times": cpu_times, "gen_tokens": gen, "seq_tokens": [g + p for g, p in zip(gen, prompt)],
            "generated_incl_pad": counts["gen_generated"][a.warmup:], "rss_before_kb": marks.get("rss_before", 0)}


PROFILE_KINDS = {"cprofile": "cProfile, top by cumulative time",
                 "ops": "torch.profiler, operators by their own CPU time",
                 "shapes": "torch.profiler with record_shapes, operators and input shapes (slowed: see the step time)"}


def _start_profile(a):
    """cProfile (where the Python time goes) or torch.profiler (which operators, by their own CPU time; "shapes": by
    input shapes too); one kind per run, so no profiler's overhead lands in another's numbers."""
    if not a.profile:
        return None
    if a.profile_kind in ("ops", "shapes"):
        from torch.profiler import ProfilerActivity, profile

        # record_shapes slows the big operators by far more than their own time (a qwen3-small forward: ~30 ms
        # alone, ~49 ms profiled, ~120 ms profiled with shapes), so the shares come from a run without it and
        # the shapes from a run of their own.
        prof = profile(activities=[ProfilerActivity.CPU], record_shapes=a.profile_kind == "shapes")
        prof.__enter__()
        return prof
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    return prof


def _stop_profile(a, prof) -> None:
    if prof is None:
        return
    if a.profile_kind in ("ops", "shapes"):
        prof.__exit__(None, None, None)
        averages = prof.key_averages(group_by_input_shape=a.profile_kind == "shapes")
        Path(a.profile).write_text(averages.table(sort_by="self_cpu_time_total", row_limit=a.profile_top))
        return
    import io
    import pstats

    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(a.profile_top)
    buf.write("\n---- by own time ----\n")
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(a.profile_top)
    Path(a.profile).write_text(buf.getvalue())


def worker_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--side", choices=["megaopd", "trl"], required=True)
    p.add_argument("--algo", choices=["grpo", "opd"], required=True)
    p.add_argument("--assets", default=str(DEFAULT_ASSETS))
    p.add_argument("--run-dir", required=True)
    p.add_argument("--student", default="qwen3-tiny")
    p.add_argument("--teacher", default="qwen3-small")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--recompute", type=int, default=0)
    p.add_argument("--shared-prompt", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", default="")
    p.add_argument("--profile-top", type=int, default=25)
    p.add_argument("--profile-kind", choices=list(PROFILE_KINDS), default="cprofile")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    import logging
    logging.disable(logging.WARNING)
    import warnings
    warnings.filterwarnings("ignore")
    result = (_megaopd_worker if a.side == "megaopd" else _trl_worker)(a)
    result["maxrss_kb"] = peak_rss_kb()
    Path(a.out).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------------------------

IN_PROCESS = False  # --smoke: run the workers in this process (saves the interpreter start-ups; times nothing)


def run_worker(side: str, algo: str, tmp: Path, tag: str, **kw) -> dict:
    out = tmp / f"{tag}.json"
    args = ["--side", side, "--algo", algo, "--run-dir", str(tmp / f"run_{tag}"), "--out", str(out)]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    if IN_PROCESS:
        worker_main(args)
        return json.loads(out.read_text())
    cmd = [sys.executable, str(Path(__file__).resolve()), "worker"] + args
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(kw.get("threads", 1)),
               PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               **allocator.environment())  # the megaopd worker sets the same itself: both sides keep their heap
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {side}/{algo} failed:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if values else "-"


def ab_compare(algo: str, rounds: int, tmp: Path, **kw) -> dict:
    """Alternate megaopd / TRL `rounds` times; each run reports its median step time over its timed steps."""
    runs = {"megaopd": [], "trl": []}
    for r in range(rounds):
        order = ("megaopd", "trl") if r % 2 == 0 else ("trl", "megaopd")  # A B B A ...: neither always goes first
        for side in order:
            res = run_worker(side, algo, tmp, f"{algo}_{side}_{r}", **kw)
            res["median_step_s"] = statistics.median(res["times"])
            res["median_cpu_s"] = statistics.median(res["cpu_times"]) if res.get("cpu_times") else float("nan")
            runs[side].append(res)
            print(f"  round {r + 1}/{rounds} {side:8s} median step {res['median_step_s']:.3f}s "
                  f"(steps {', '.join(f'{t:.3f}' for t in res['times'])}; CPU {res['median_cpu_s']:.3f}s)",
                  flush=True)
    return runs


def report_ab(title: str, runs: dict, peak: float) -> tuple[list[str], dict]:
    m, t = runs["megaopd"], runs["trl"]
    ratios = [b["median_step_s"] / a["median_step_s"] for a, b in zip(m, t)]
    # CPU seconds of the worker process per step: what a step costs, without the time a shared machine's other
    # processes took the core away (wall time includes that; both are reported).
    cpu_ratios = [b["median_cpu_s"] / a["median_cpu_s"] for a, b in zip(m, t)]

    def per_step(res, key):
        return statistics.median([v for r in res for v in r[key]])

    def tok_rate(res, key):
        return statistics.median([n / s for r in res for n, s in zip(r[key], r["times"])])

    gen_m, gen_t = per_step(m, "gen_tokens"), per_step(t, "gen_tokens")
    seq_m, seq_t = per_step(m, "seq_tokens"), per_step(t, "seq_tokens")
    def run_rate(r):
        return statistics.median([n / s for n, s in zip(r["seq_tokens"], r["times"])])

    tok_ratios = [run_rate(a) / run_rate(b) for a, b in zip(m, t)]
    # The ratio a free rollout would give: the bound on what any speed-up of generation alone can buy.
    ceiling = [b["median_step_s"] / (a["median_step_s"] - statistics.median(p["rollout"][0] for p in a["phases"]))
               for a, b in zip(m, t)]
    flops, executed = per_step(m, "flops"), per_step(m, "executed")
    step_m, step_t = (statistics.median(r["median_step_s"] for r in side) for side in (m, t))
    phases = {phase: tuple(statistics.median(p[phase][i] for r in m for p in r["phases"]) for i in (0, 1, 2))
              for phase in PHASE_COMPONENTS}
    lines = [
        f"### {title}",
        "",
        "| | megaopd | TRL | megaopd / TRL |",
        "|---|---|---|---|",
        f"| median step time (s) | {step_m:.3f} | {step_t:.3f} | |",
        f"| step throughput ratio (TRL time / megaopd time), median of {len(ratios)} A/B pairs | | | "
        f"**{statistics.median(ratios):.2f}x** (spread {spread(ratios)}) |",
        f"| median step CPU time (s) | {statistics.median(r['median_cpu_s'] for r in m):.3f} | "
        f"{statistics.median(r['median_cpu_s'] for r in t):.3f} | |",
        f"| step CPU-time ratio (TRL / megaopd), median of {len(cpu_ratios)} A/B pairs | | | "
        f"{statistics.median(cpu_ratios):.2f}x (spread {spread(cpu_ratios)}) |",
        f"| ratio with megaopd's rollout free (TRL time / megaopd's step less its rollout phase), median of "
        f"{len(ceiling)} A/B pairs: the most a faster generation could buy | | | "
        f"{statistics.median(ceiling):.2f}x (spread {spread(ceiling)}) |",
        f"| generated tokens per step | {gen_m:.0f} | {gen_t:.0f} | {gen_m / max(gen_t, 1):.3f} |",
        f"| trained tokens per step (prompt + response) | {seq_m:.0f} | {seq_t:.0f} | {seq_m / max(seq_t, 1):.3f} |",
        f"| trained tokens/s | {tok_rate(m, 'seq_tokens'):.0f} | {tok_rate(t, 'seq_tokens'):.0f} | "
        f"{statistics.median(tok_ratios):.2f}x (spread {spread(tok_ratios)}) |",
        f"| peak RSS of the worker (MiB) | {statistics.median(r['maxrss_kb'] for r in m) / 1024:.0f} | "
        f"{statistics.median(r['maxrss_kb'] for r in t) / 1024:.0f} | |",
        f"| model GFLOP per step (megaopd's ledger; the same work on both sides) | {flops / 1e9:.2f} | | |",
        f"| share of the fp32 matmul peak ({peak / 1e9:.1f} GFLOP/s, measured): model FLOP/s over it | "
        f"{flops / step_m / peak:.1%} | {flops / step_t / peak:.1%} | |",
        f"| executed GFLOP per step (megaopd: perf/hardware_flops, its shared prompts and recomputation; TRL runs "
        f"the unshared passes, the model FLOPs) | {executed / 1e9:.2f} | {flops / 1e9:.2f} | |",
        f"| share of the fp32 matmul peak: executed FLOP/s over it | {executed / step_m / peak:.1%} | "
        f"{flops / step_t / peak:.1%} | |",
        "",
        "megaopd's step by phase (wall time of the timed steps, medians; the ledger's model FLOPs of each, and the work "
        "executed):",
        "",
        "| phase | s per step | model GFLOP per step | share of the fp32 matmul peak | executed GFLOP per step | "
        "executed share of the peak |",
        "|---|---|---|---|---|---|",
        *(f"| {phase} | {s:.3f} | {f / 1e9:.2f} | {f / s / peak:.1%} | {x / 1e9:.2f} | {x / s / peak:.1%} |"
          for phase, (s, f, x) in phases.items() if s > 0),
        "",
    ]
    return lines, {"ratio_median": statistics.median(ratios), "ratios": ratios, "cpu_ratios": cpu_ratios, "gen": (gen_m, gen_t),
                   "seq": (seq_m, seq_t)}


def bench_main(algo: str, argv: list[str]) -> None:
    """Entry point of grpo_vs_trl.py / opd_vs_trl.py."""
    import tempfile

    p = argparse.ArgumentParser(description=f"{algo.upper()} step throughput: megaopd vs TRL, A/B alternated")
    p.add_argument("--smoke", action="store_true", help="one tiny round (CI): checks the script runs, times nothing")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (after --warmup)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--student", default="qwen3-tiny")
    p.add_argument("--teacher", default="qwen3-small")
    p.add_argument("--prompts", type=int, default=16 if method(algo).group_term else 32)
    p.add_argument("--group", type=int, default=8 if method(algo).group_term else 1)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--recompute", type=int, default=0,
                   help="megaopd train.recompute_old_logprobs (TRL skips that forward at num_iterations=1)")
    p.add_argument("--shared-prompt", type=int, default=1,
                   help="megaopd train.shared_prompt (off by itself at one sample per prompt; TRL has no such pass)")
    p.add_argument("--profile", action="store_true", help="also profile one run per side: cProfile and torch.profiler's operator table")
    p.add_argument("--assets", default=str(DEFAULT_ASSETS))
    a = p.parse_args(argv)
    if a.smoke:
        a.rounds, a.steps, a.warmup, a.prompts, a.max_new = 1, 1, 0, 2, 4
        a.group, a.teacher = min(a.group, 2), a.student
        global IN_PROCESS
        IN_PROCESS = True
    print(f"# {algo.upper()} step: megaopd vs TRL\n\nmachine: {machine()}\n", flush=True)
    if not have_trl():
        print(f"SKIPPED: trl is not importable (pip install 'trl>=1.16'); no {algo} comparison table.")
        return
    assets = prepare_assets(Path(a.assets), {a.student, a.teacher}, rows=64 if a.smoke else 512)
    kw = dict(assets=assets, student=a.student, teacher=a.teacher, prompts=a.prompts, group=a.group,
              max_new=a.max_new, threads=a.threads, recompute=a.recompute, shared_prompt=a.shared_prompt,
              steps=a.steps, warmup=a.warmup)
    with tempfile.TemporaryDirectory(prefix=f"bench_{algo}_") as tmp:
        tmp = Path(tmp)
        runs = ab_compare(algo, a.rounds, tmp, **kw)
        shape = (f"student {a.student}" + (f", teacher {a.teacher}" if method(algo).teacher_term else "") +
                 f", {a.prompts} prompts x {a.group} samples, {a.max_new} new tokens (fixed length), "
                 f"{a.threads} thread(s), megaopd recompute_old_logprobs={bool(a.recompute)} "
                 f"shared_prompt={bool(a.shared_prompt)}")
        lines, summary = report_ab(f"{algo.upper()} step, {shape}", runs, matmul_peak(a.threads))
        print("\n".join(lines))
        g_m, g_t = summary["gen"]
        if g_m != g_t:
            print(f"WARNING: unequal generated tokens per step (megaopd {g_m}, TRL {g_t})")
        if a.profile:
            for side in ("megaopd", "trl"):
                for kind, title in PROFILE_KINDS.items():
                    path = tmp / f"profile_{side}_{kind}.txt"
                    res = run_worker(side, algo, tmp, f"{algo}_{side}_{kind}", **kw, profile=path, profile_top=30,
                                     profile_kind=kind)
                    print(f"\n#### {title}, {side} ({a.steps} timed steps; median step "
                          f"{statistics.median(res['times']):.3f} s profiled, "
                          f"{statistics.median(r['median_step_s'] for r in runs[side]):.3f} s in the A/B runs)\n")
                    print("\n".join(path.read_text().splitlines()[:70]))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker_main(sys.argv[2:])
    else:
        print("usage: python bench/common.py worker ...  (run bench/grpo_vs_trl.py or bench/opd_vs_trl.py instead)")
