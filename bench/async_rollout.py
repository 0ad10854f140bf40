"""Bounded-staleness rollouts: seconds per GRPO (or OPD) step at rollout.max_staleness = 0, 1, 2, on SGLang CPU servers.

    MEGAOPD_SGLANG_PYTHON=.venv-sglang/bin/python python bench/async_rollout.py   # launches one CPU server
    MEGAOPD_SGLANG_PYTHON=... python bench/async_rollout.py --lengths long-tail --ks 0,1,1i   # + in-flight updates
    python bench/async_rollout.py --url http://127.0.0.1:30000                    # or attach to one
    sudo MEGAOPD_SGLANG_PYTHON=... python bench/async_rollout.py --cluster --steps 12 --rounds 3   # separate nodes
    sudo MEGAOPD_SGLANG_PYTHON=... python bench/async_rollout.py --cluster --algorithm opd --ks 0,1   # + a teacher node

The same stage (the fixed-length benchmark model: every sample is exactly --max-new tokens, so each K does the
same work and books the same FLOPs) runs once per K and round against the same server, put back on the initial
weights at version 0 before each. Step 1 fills the pipeline (it waits for K+1 batches) and is left out of the
means. The wait share is the trainer's time blocked on rollouts (perf/rollout_wait_seconds) over its step time, the
sync share its time pushing and verifying weights (perf/weight_sync_seconds); staleness is per trained token. The
rounds alternate the order of the Ks and the ratio to K=0 is the median of the rounds' ratios: on a shared machine
the load drifts within a run. A K written `1i` is K=1 with in-flight weight updates (rollout.inflight_updates: the
sync aborts the requests running and continues each from its prefix under the new weights, docs/serving.md).

--lengths long-tail serves a model whose responses end by themselves, with long-tailed lengths instead of fixed ones
(bench/common.py long_tail_model: a median of 16 tokens, the longest of a step's several times that): a synchronous
step waits for its longest response, which is what in-flight updates are for. The table's header gives the
lengths the model samples (median, 90th percentile, longest of 64); the Ks no longer do exactly the same work, so
compare milliseconds per response token too.

OPD scores with a teacher server (the fixed-length qwen3-small, form sampled) that runs
beside the rollout server, or on its own node.

--cluster runs this same script as the trainer of a multi-node job on the local Slurm cluster of
.ci/slurm_multinode_up.sh (one network namespace per node): slurm/stage_multinode.sbatch starts the rollout server
(and OPD's teacher server) on nodes of their own and hands their URLs to the trainer node in MEGAOPD_ROLLOUT_URLS
(MEGAOPD_TEACHER_URLS), as a stage's job does. Those nodes are network namespaces of this machine: the network
between them is real (TCP over veth), the cores are not separate. So, with or without --cluster, the overlap shows
what the pipeline hides on the cores the machine has to spare, not what a rollout node of its own would give.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import DEFAULT_ASSETS, REPO, long_tail_model, machine, prepare_assets, train_files  # noqa: E402

from megaopd.run import allocator  # noqa: E402
from megaopd.config import SGLangConfig, load_config  # noqa: E402
from megaopd.run.environment import sglang_python, sglang_servers  # noqa: E402
from megaopd.objectives.methods import METHODS, method  # noqa: E402
from megaopd.accounting.metrics import read_metrics  # noqa: E402
from megaopd.rollout.serving.server import SGLangServer  # noqa: E402
from megaopd.rollout.serving.sglang_cpu import cpu_server_args, cpu_server_env  # noqa: E402
from megaopd.run.trainer import train  # noqa: E402

MAX_TOTAL_TOKENS = 16384  # each server's KV cache
TEACHER = "qwen3-small"  # OPD's teacher: a larger model of the student's family


def server_config(threads: int) -> SGLangConfig:
    return SGLangConfig(python=sglang_python(), max_total_tokens=MAX_TOTAL_TOKENS,
                        startup_timeout_s=600, server_args=cpu_server_args(0.5), env=cpu_server_env(threads),
                        request_timeout_s=300)


def student(assets: Path, a) -> Path:
    if a.lengths == "long-tail":
        return long_tail_model("qwen3-tiny", assets / "models" / "qwen3-tiny-long-tail")
    return assets / "models" / "qwen3-tiny"


def run_stage(server: SGLangServer, assets: Path, run_dir: Path, k: str, a) -> dict[str, float]:
    """One stage at K (`1i`: K=1 with in-flight updates)."""
    model = str(student(assets, a))
    server.load_weights(model, "0", 300)
    data = train_files(assets)
    # Without a teacher server handed over (MEGAOPD_TEACHER_URLS) the trainer launches its own for the stage.
    opd = (["opd.form=sampled", "opd.teacher_engine=sglang", f"opd.teachers.arith_add={assets / 'models' / TEACHER}"]
           if method(a.algorithm).teacher_term else [])
    cfg = load_config(None, [
        f"run_dir={run_dir}", f"model.path={model}", f"data.train=[{data[0]}]", f"data.eval=[{data[0]}]",
        f"train.algorithm={a.algorithm}", f"train.steps={a.steps}", f"train.prompts_per_step={a.prompts}",
        "train.micro_batch_size=64", f"rollout.samples_per_prompt={a.samples}", f"rollout.max_new_tokens={a.max_new}",
        f"rollout.max_staleness={k.rstrip('i')}", f"rollout.inflight_updates={k.endswith('i')}",
        "rollout.engine=sglang", f"eval.every={a.steps + 1}", "eval.prompts_per_domain=1",
        "eval.final_prompts_per_domain=1", "checkpoint.every=0", *opd])
    cfg.rollout.sglang = server_config(a.threads)
    cfg.rollout.sglang.urls = [server.url]
    allocator.keep_heap_for([cfg.model.device])  # as `megaopd train` does where its process starts
    summary = train(cfg)  # with the teacher server a multi-node job hands over (megaopd.run.environment)
    steps = [m for m in read_metrics(run_dir) if "perf/rollout_wait_seconds" in m][1:]  # step 1 fills the pipeline
    step_seconds = sum(m["perf/step_seconds"] for m in steps)
    return {"step_seconds": statistics.mean(m["perf/step_seconds"] for m in steps),
            "wait_share": sum(m["perf/rollout_wait_seconds"] for m in steps) / step_seconds,
            "sync_share": sum(m["perf/weight_sync_seconds"] for m in steps) / step_seconds,
            "staleness_mean": statistics.mean(m["rollout/staleness_mean"] for m in steps),
            "staleness_max": max(m["rollout/staleness_max"] for m in steps),
            "tokens": sum(m["rollout/response_length"] for m in steps) * a.prompts * a.samples,
            "flops": summary["ledger"]["totals"]["stage"]}


def measure(a) -> dict:
    """Every K against one rollout server (attached, handed over by a multi-node job, or launched here)."""
    torch.set_num_threads(a.threads)
    assets = prepare_assets(Path(a.assets), ("qwen3-tiny", TEACHER), rows=64 if a.smoke else 512)
    url = a.url or next(iter(sglang_servers(SGLangConfig()).urls), "")  # a multi-node job's server
    server = SGLangServer(url) if url else SGLangServer.launch(
        str(student(assets, a)), server_config(a.threads), "float32",
        Path(tempfile.mkdtemp()) / "server.log")
    load = [os.getloadavg()]
    rounds = []
    try:
        with tempfile.TemporaryDirectory() as root:
            for r in range(a.rounds):  # every other round in reverse: a load that drifts does not favour one K
                order = a.ks if r % 2 == 0 else a.ks[::-1]
                rounds.append({k: run_stage(server, assets, Path(root) / f"r{r}_k{k}", k, a) for k in order})
    finally:
        server.stop()
    load.append(os.getloadavg())
    lengths = student(assets, a) / "lengths.json"
    return {"rounds": rounds, "load": load, "server": "attached" if url else "launched",
            "lengths": json.loads(lengths.read_text()) if lengths.exists() else None}


def job_script(a, argv: list[str], assets: Path, out: Path, sglang: str) -> str:
    """slurm/stage_multinode.sbatch with this script as the trainer (torchrun -m bench.async_rollout, one process on
    one node, the same arguments less --cluster), a rollout node and, for OPD, a teacher node; it writes
    out/results.json."""
    from megaopd.launch.slurm import LaunchConfig, render_multinode
    from megaopd.run.study import StudyConfig

    launch = LaunchConfig(time="02:00:00", venv=sys.prefix, workdir=str(REPO), gpus_per_node=1, cpus_per_task=1,
                          trainer_module="bench.async_rollout", sglang_python=sglang, sglang_args=cpu_server_args(0.5),
                          sglang_env=cpu_server_env(a.threads), server_start_timeout_s=600)
    inner = [arg for arg in argv if arg != "--cluster"] + ["--results", str(out / "results.json")]
    teachers = [("arith_add", str(assets / "models" / TEACHER))] if method(a.algorithm).teacher_term else []
    return render_multinode(StudyConfig(out=str(out)), f"async-{a.algorithm}", launch, inner, 1,
                            str(student(assets, a)), teachers, "float32", MAX_TOTAL_TOKENS)


def on_cluster(a, argv: list[str]) -> dict:
    """Submits job_script to the local multi-node cluster, waits for it and returns its results and node layout."""
    from megaopd.launch.local_cluster import LocalCluster

    cluster = LocalCluster(4, Path(a.cluster_state), name="mns", subnet="10.77.0")
    needed = 3 if method(a.algorithm).teacher_term else 2
    idle = [node for node, state in cluster.node_states().items() if state.startswith("idle")]
    if len(idle) < needed:
        sys.exit(f"--cluster needs {needed} idle nodes of the local cluster at {a.cluster_state}, found {len(idle)}: "
                 "start it as root with `PY=.venv/bin/python .ci/slurm_multinode_up.sh`")
    sglang = sglang_python()
    if not sglang:
        sys.exit("--cluster: set MEGAOPD_SGLANG_PYTHON to the Python of SGLang's environment (.venv-sglang/bin/python)")
    assets = prepare_assets(Path(a.assets), ("qwen3-tiny", TEACHER), rows=64 if a.smoke else 512)
    out = Path(tempfile.mkdtemp(prefix="async_rollout_"))
    (out / "slurm" / "logs").mkdir(parents=True)
    script = out / "slurm" / "async_rollout.sbatch"
    script.write_text(job_script(a, argv, assets, out, sglang))
    submitted = cluster.client(["sbatch", "--parsable", str(script)],
                               env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    if submitted.returncode:
        sys.exit(f"sbatch {script} failed: {submitted.stderr.strip()}")
    job = submitted.stdout.strip().split(";")[0]
    print(f"job {job}: {script}, log under {out / 'slurm' / 'logs'}", flush=True)
    cluster.wait([job], a.timeout)
    log = "".join(p.read_text() for p in (out / "slurm" / "logs").glob(f"*-{job}.out"))
    if not (out / "results.json").exists():
        sys.exit(f"job {job} wrote no results; the end of its log:\n" + "\n".join(log.splitlines()[-40:]))
    layout = next(line for line in log.splitlines() if line.startswith(f"megaopd: job {job} "))
    return json.loads((out / "results.json").read_text()) | {"layout": layout.split(": ", 1)[1]}


def print_table(measured: dict, a) -> None:
    """Each K's mean over the rounds; the ratio to the first K is the median of the rounds' own ratios (min-max)."""
    rounds = measured["rounds"]
    first = a.ks[0]
    where = (f"multi-node job on the local Slurm cluster: {measured['layout']}" if "layout" in measured else
             f"one machine, server {measured['server']}")
    print(f"# {a.algorithm.upper()} with bounded-staleness rollouts on SGLang CPU servers\n\nmachine: {machine()}\n"
          f"load average (1, 5, 15 min) at start {measured['load'][0]}, at end {measured['load'][1]}\n")
    teacher = f", teacher {TEACHER}" if method(a.algorithm).teacher_term else ""
    lengths = (f"long-tailed lengths up to {a.max_new} tokens (the model's own sampled lengths: "
               f"{measured['lengths']})" if a.lengths == "long-tail" else f"{a.max_new} tokens (fixed length)")
    print(f"model qwen3-tiny{teacher}, {a.steps} steps of {a.prompts} x {a.samples} samples x {lengths}, "
          f"{a.threads} thread(s) trainer and each server, {len(rounds)} round(s) of every K; {where}\n")
    print("| rollout.max_staleness | s / step (steps 2..) | ms / response token | trainer wait share | weight sync "
          f"share | staleness mean / max | stage FLOPs | s / step vs K={first} (median of rounds, min-max) |")
    print("|---|---|---|---|---|---|---|---|")
    for k in a.ks:
        runs = [r[k] for r in rounds]
        ratios = sorted(r[k]["step_seconds"] / r[first]["step_seconds"] for r in rounds)
        flops = {r["flops"] for r in runs}  # equal by construction with fixed-length samples; shown if not
        per_token = statistics.mean(1000 * r["step_seconds"] * (a.steps - 1) / r["tokens"] for r in runs)
        print(f"| {k.replace('i', ', in-flight updates')} | {statistics.mean(r['step_seconds'] for r in runs):.3f} | "
              f"{per_token:.2f} | {statistics.mean(r['wait_share'] for r in runs):.0%} | "
              f"{statistics.mean(r['sync_share'] for r in runs):.0%} | "
              f"{statistics.mean(r['staleness_mean'] for r in runs):.2f} / {max(r['staleness_max'] for r in runs)} | "
              f"{' / '.join(f'{f:.4g}' for f in sorted(flops))} | "
              f"**{statistics.median(ratios):.2f}x** ({ratios[0]:.2f}-{ratios[-1]:.2f}) |")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--url", default="", help="attach to this server (serving the bench model) instead of launching; "
                                             "default: the first of $MEGAOPD_ROLLOUT_URLS (a multi-node job's)")
    p.add_argument("--cluster", action="store_true",
                   help="run the trainer and the servers on separate nodes of the local multi-node Slurm cluster")
    p.add_argument("--cluster-state", default="/tmp/megaopd-multinode",
                   help="--cluster: its state directory (.ci/slurm_multinode_up.sh's $MEGAOPD_MULTINODE_STATE)")
    p.add_argument("--algorithm", choices=[name for name, spec in METHODS.items() if spec.rollouts], default="grpo")
    p.add_argument("--ks", default="0,1,2", help="the rollout.max_staleness values, comma-separated; 1i: K=1 with "
                                                  "in-flight weight updates")
    p.add_argument("--lengths", choices=["fixed", "long-tail"], default="fixed")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=1, help="run every K this many times, alternating the order")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--assets", default=str(DEFAULT_ASSETS))
    p.add_argument("--timeout", type=float, default=3600, help="--cluster: seconds to wait for the job (then cancel)")
    p.add_argument("--results", default="", help="also write the measurements here (JSON)")
    a = p.parse_args(argv)
    a.ks = a.ks.split(",")
    if a.smoke:
        a.steps, a.prompts, a.samples, a.max_new = 3, 2, 2, 4
    return a


def main(argv: list[str]) -> None:
    a = parse(argv)
    measured = on_cluster(a, argv) if a.cluster else measure(a)
    if a.results:
        Path(a.results).write_text(json.dumps(measured))
    print_table(measured, a)


if __name__ == "__main__":
    main(sys.argv[1:])
