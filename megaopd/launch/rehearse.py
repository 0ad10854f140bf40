"""``megaopd rehearse STUDY --launch L.yaml``: your cluster study, rehearsed on this machine before a GPU hour.

    sudo megaopd rehearse configs/studies/cluster/two_domain_qwen3.yaml --launch configs/cluster/launch_2node.yaml

First the real layout is checked without running anything: every stage's script renders (config keys, backends,
node counts), tensor x pipeline parallel divides each stage's GPUs, and where a model's config.json is readable
here its heads and layers split over TP and PP. Then a local Slurm cluster (``local_cluster``: one network
namespace per node) with as many nodes as the largest stage is brought up, and the study runs on it through
`megaopd submit`, the path a real submission takes, with the same node layout: trainer nodes running torchrun
of megatron-core (TP/PP as in the launch file, gloo on CPU via ``megaopd.models.megatron.cpu_launch``), SGLang CPU
servers on the rollout and teacher nodes. What differs, and why:
- models: the embedded tiny ones (``megaopd.models.embedded``) stand in for each model outside the study (the student
  and external teachers; same family), built by the study's assets job; synthetic data stands in for the data
  files, one synthetic domain per data directory;
- a few steps per stage (``--steps``), small batches, float32 on CPU, no FP8;
- GPUs per node: at most ``--gpus-per-node`` (default 2) stand-in GPUs, more only where TP x PP needs them, so
  DP shrinks and TP/PP stay; each SGLang server runs at TP 1;
- site settings (partition, account, QoS, container, setup lines, extra sbatch options) are the local cluster's;
  they are listed as not rehearsed.
Per stage it prints nodes, ranks per node, servers, steps and the weight versions verified on the servers, then
tears the cluster down. Needs root (namespaces); without it, it says what to run instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import sys
import time
from pathlib import Path

from megaopd.run import environment
from megaopd.config import ConfigError, flag_in_range, load_config, save_config
from megaopd.data.rows import write_rows
from megaopd.data.synthetic import DOMAINS, make_splits
from megaopd.errors import UserError
from megaopd.accounting.flops import attention_heads, read_hf_config
from megaopd.launch.local_cluster import LocalCluster, check_name_and_subnet
from megaopd.launch.slurm import (Job, LaunchConfig, absolute_study, add_study_arguments, for_stage, plan,
                                  study_and_launch)
from megaopd.objectives.methods import method
from megaopd.rollout.serving.sglang_cpu import cpu_server_args, cpu_server_env
from megaopd.accounting.shapes import REAL_SHAPES, RealShape
from megaopd.run.finished import SUMMARY
from megaopd.run.study import AssetsConfig, StudyConfig, stage_overrides

ROOT = Path(__file__).resolve().parents[2]
# Launch fields that belong to the real site: replaced by the local cluster's, and reported as not rehearsed.
SITE_FIELDS = ("partition", "account", "qos", "container_image", "container_mounts", "venv", "setup", "sbatch",
               "mem", "cpus_per_task", "sglang_python", "sglang_args", "sglang_env", "sglang_tp", "socket_ifname",
               "ib_hca", "cpu_bind")
ON_CPU = ["model.device=cpu", "model.dtype=float32", "model.megatron.fp8=none",
          "model.megatron.transformer_engine=false"]


def small(steps: int) -> list[str]:
    """A few short steps per stage, with a checkpoint and an evaluation on the way."""
    return [f"train.steps={steps}", "checkpoint.every=1", f"eval.every={steps}", "eval.prompts_per_domain=2",
            "eval.final_prompts_per_domain=2", "train.prompts_per_step=2", "train.micro_batch_size=2",
            "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8", "rollout.sglang.max_total_tokens=2048",
            "rollout.sglang.request_timeout_s=300", "sft.stop_at_accuracy=0", "optim.warmup_steps=0"]


# ---- 1. the real layout, checked without running anything ----
def layout_problems(study: StudyConfig, launch: LaunchConfig) -> list[str]:
    """Mistakes in the real study and launch file: a script that does not render, a parallel layout that does
    not fit the GPUs, heads or layers that do not split (where the model's config.json is readable here)."""
    try:
        plan(study, launch)
    except (ConfigError, ValueError, KeyError) as e:
        return [f"the study does not render: {e}"]
    problems = []
    for stage in study.stages:
        sl = for_stage(launch, stage.name)
        cfg = load_config(stage.config, stage_overrides(study, stage) + sl.overrides)
        if cfg.model.backend != "megatron":
            continue
        tp, pp = cfg.model.megatron.tp, cfg.model.megatron.pp
        world = sl.nodes * max(sl.gpus_per_node, 1)
        where = f"stage {stage.name} ({sl.nodes} node(s) x {sl.gpus_per_node} GPU(s))"
        if world % (tp * pp):
            problems.append(f"{where}: tp={tp} x pp={pp} does not divide the {world} GPUs")
        models = {"model.path": cfg.model.path}
        models |= {f"opd.teachers.{r}": p for r, p in method(cfg.train.algorithm).local_teachers(cfg.opd).items()}
        for key, path in models.items():
            problems += [f"{where}: {key}={path}: {p}" for p in shape_problems(path, tp, pp)]
    return problems


def shape_problems(model: str, tp: int, pp: int) -> list[str]:
    """Heads and layers that do not split over TP and PP, from the model's config.json or, where that is not
    readable here (the cluster's /models), the published shape its directory is named after (none if neither)."""
    try:
        config = read_hf_config(model)
        (heads, kv_heads), layers = attention_heads(config), config.get("num_hidden_layers", 0)
    except (OSError, ValueError):
        shape = published_shape(model)
        if shape is None:
            return []
        heads, kv_heads, layers = shape.heads, shape.kv_heads, shape.layers
    out = []
    if heads % tp or kv_heads % tp:
        out.append(f"{heads} attention heads / {kv_heads} KV heads do not split over tp={tp}")
    if layers % pp:
        out.append(f"{layers} layers do not split over pp={pp}")
    return out


def published_shape(model: str) -> RealShape | None:
    """The REAL_SHAPES entry a model directory is named after: /models/Qwen3-8B or Qwen3-8B-Base -> qwen3-8b."""
    name = Path(model).name.lower()
    matches = [key for key in REAL_SHAPES if name == key or name.startswith(key + "-")]
    return REAL_SHAPES[max(matches, key=len)] if matches else None


# ---- 2. the rehearsal study and launch file ----
def stand_ins(study: StudyConfig) -> tuple[dict[str, str], dict[str, tuple[str, str, str]]]:
    """External model path -> embedded preset (first the student's family tiny, then small, base), and data file
    -> (its directory's name, synthetic domain, split), one synthetic domain per data directory."""
    models, data = {}, {}
    sizes = {"qwen3": ["qwen3-tiny", "qwen3-small", "qwen3-base"], "llama": ["llama-tiny", "llama-small"]}
    dirs: list[str] = []
    domains: dict[str, str] = {}  # data directory -> synthetic domain
    for stage in study.stages:
        cfg = load_config(stage.config, stage_overrides(study, stage))
        paths = [cfg.model.path] + list(method(cfg.train.algorithm).teachers(cfg.opd).values())
        for path in paths:
            if not path.startswith(study.out + "/") and path not in models:
                family = "llama" if "llama" in path.lower() else "qwen3"
                used = sum(p.startswith(family) for p in models.values())
                models[path] = sizes[family][min(used, len(sizes[family]) - 1)]
        for files, split in ((cfg.data.train, "train"), (cfg.data.validation, "validation"), (cfg.data.eval, "test")):
            for file in files:
                parent = str(Path(file).parent)
                if parent not in dirs:
                    dirs.append(parent)
                    domains[parent] = synthetic_domain(Path(parent).name, set(domains.values()))
                data[file] = (Path(parent).name, domains[parent], split)
    return models, data


def synthetic_domain(directory: str, used: set[str]) -> str:
    """A synthetic domain for a data directory: one whose ability names it (math -> arithmetic, code -> code),
    else the first unused one."""
    free = [d for d in DOMAINS if d not in used] or list(DOMAINS)
    name = directory.lower()
    return next((d for d in free if name and (name in DOMAINS[d].ability or DOMAINS[d].ability in name)), free[0])


def rehearsal_study(study: StudyConfig, out: Path, steps: int, stages: list[str] | None) -> StudyConfig:
    """The study on stand-in models and data under ``out``: each stage's own overrides, then the stand-ins."""
    models, data = stand_ins(study)
    rehearsal = []
    for stage in study.stages:
        if stages is not None and stage.name not in stages:
            continue
        cfg = load_config(stage.config, stage_overrides(study, stage))
        extra = []
        if cfg.model.path in models:
            extra.append(f"model.path={{out}}/models/{models[cfg.model.path]}")
        extra += [f"opd.teachers.{route}={{out}}/models/{models[path]}"
                  for route, path in method(cfg.train.algorithm).teachers(cfg.opd).items() if path in models]
        for key, files in (("data.train", cfg.data.train), ("data.validation", cfg.data.validation),
                           ("data.eval", cfg.data.eval)):
            if files:
                extra.append(f"{key}=[" + ", ".join(f"{{out}}/standin/{data[f][0]}/{data[f][2]}.jsonl"
                                                    for f in files) + "]")
        # Stand-ins are untrained: an external teacher's check runs (its code path is rehearsed) but cannot refuse.
        rehearsal.append(dataclasses.replace(stage, overrides=[*stage.overrides, *extra, *small(steps)],
                                             allow_weaker_teacher=True))
    domains = sorted({domain for _, domain, _ in data.values()})
    assets = AssetsConfig(presets=sorted(set(models.values())), domains=domains, train_rows=20, heldout_rows=20,
                          validation_rows=20)
    # One seed: the layout and the scripts are the same for every seed.
    return dataclasses.replace(study, out=str(out), assets=assets, stages=rehearsal, seeds=[])


def write_standin_data(study: StudyConfig, out: Path, rows: int = 200) -> None:
    """{out}/standin/<data directory's name>/{train,validation,test}.jsonl (those the study reads): synthetic rows
    whose domain (the key of the verifier's data_source stays) is the directory's name, so that multi-teacher routes
    named after the data directories (opd.teachers.math, .code) find their rows as they would the real ones."""
    splits: dict[tuple[str, str], set[str]] = {}
    for name, domain, split in stand_ins(study)[1].values():
        splits.setdefault((name, domain), set()).add(split)
    heldout = max(rows // 10, 8)
    for (name, domain), wanted in splits.items():
        # the test rows are drawn whenever validation is: validation is cut after them, disjoint
        counts = {"train": rows, "test": heldout} | ({"validation": heldout} if "validation" in wanted else {})
        for split, made in make_splits(domain, counts).items():
            if split not in wanted:
                continue
            for row in made:
                row.extra_info["domain"] = name
            write_rows(out / "standin" / name / f"{split}.jsonl", made)


def rehearsal_gpus(nodes: int, gpus: int, tp: int, pp: int, cap: int) -> int:
    """The fewest stand-in GPUs per node, from min(gpus, cap) up, on which TP x PP fits the trainer nodes."""
    for g in range(max(min(gpus, cap), 1), max(gpus, 1) + 1):
        if (nodes * g) % (tp * pp) == 0:
            return g
    return max(gpus, 1)  # the real layout does not fit either: layout_problems said so


def rehearsal_launch(study: StudyConfig, launch: LaunchConfig, cap: int, sglang_python: str) -> LaunchConfig:
    # One CPU per task: every local node advertises all of this machine's cores, so a step's share of them would
    # oversubscribe it as many times over as there are nodes.
    local = dict(partition="", account="", qos="", container_image="", container_mounts=[], venv=sys.prefix,
                 workdir=str(ROOT), setup=[], sbatch=[], mem="", cpus_per_task=1, socket_ifname="", ib_hca="",
                 cpu_bind="", sglang_tp=1,
                 trainer_module="megaopd.models.megatron.cpu_launch", sglang_python=sglang_python,
                 sglang_args=cpu_server_args(), server_start_timeout_s=900,
                 sglang_env=cpu_server_env())
    base = dataclasses.replace(launch, **local, gpus_per_node=min(launch.gpus_per_node, cap),
                               overrides=[*launch.overrides, *ON_CPU], stages={})
    stages = {}
    for stage in study.stages:
        sl = for_stage(launch, stage.name)
        cfg = load_config(stage.config, stage_overrides(study, stage) + sl.overrides)
        own = {k: v for k, v in launch.stages.get(stage.name, {}).items() if k not in SITE_FIELDS}
        gpus = sl.gpus_per_node
        if cfg.model.backend == "megatron" or sl.nodes > 1 or gpus > 1:
            gpus = rehearsal_gpus(sl.nodes, gpus, cfg.model.megatron.tp, cfg.model.megatron.pp, cap)
        own["gpus_per_node"] = gpus
        if "overrides" in own:
            own["overrides"] = [*own["overrides"], *ON_CPU]
        stages[stage.name] = own
    return dataclasses.replace(base, stages=stages)


def not_rehearsed(launch: LaunchConfig) -> list[str]:
    fields = [dataclasses.asdict(launch)] + list(launch.stages.values())
    return sorted({f"{k}={v}" for f in fields for k, v in f.items() if k in SITE_FIELDS and v})


# ---- 3. run it on a local cluster and read back what happened ----
def cluster_nodes(jobs: list[Job]) -> int:
    """The nodes of the largest job (its ``#SBATCH --nodes`` line)."""
    return max(int(re.search(r"^#SBATCH --nodes=(\d+)$", job.script, re.M)[1]) for job in jobs)


def run_on_cluster(cluster: LocalCluster, study_path: Path, launch_path: Path, timeout_s: float) -> dict[str, str]:
    """Submit through `megaopd submit` inside the cluster and wait; job name -> Slurm job id."""
    result = cluster.client([sys.executable, "-m", "megaopd.cli", "submit", str(study_path), "--launch",
                             str(launch_path)], cwd=str(ROOT))
    if result.returncode:
        raise RuntimeError(f"megaopd submit failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    ids = dict(line.split() for line in result.stdout.splitlines() if len(line.split()) == 2)
    try:
        cluster.wait(list(ids.values()), timeout_s)
    except TimeoutError as e:
        raise TimeoutError(f"the rehearsal did not finish: {e} (raise --timeout)") from None
    return ids


def job_state(cluster: LocalCluster, job_id: str) -> str:
    out = cluster.client(["scontrol", "show", "job", job_id]).stdout
    found = re.search(r"JobState=(\S+)", out)
    return found[1] if found else "UNKNOWN"


def stage_report(log: str, run_dir: Path) -> dict:
    """What the stage's own output says: nodes, ranks per node, servers, steps, verified weight versions."""
    nodes = re.search(r"train on (.*?) \(", log) or re.search(r"on (\S+): ", log)
    ranks: dict[str, int] = {}
    for host in re.findall(r"megaopd: rank \d+ of \d+ \(local \d+\) on (\S+)", log):
        ranks[host] = ranks.get(host, 0) + 1
    # "SGLang rollout server on node3 at URL: MODEL", "SGLang teacher <route> server on node4 at URL: MODEL"
    servers = [(role.replace(" ", ":"), host, model) for role, host, model in
               re.findall(r"SGLang (rollout|teacher \S+) server on (\S+) at \S+: (\S+)", log)]
    versions = sorted({int(v) for v in re.findall(r"weights v(\d+) verified", log)})
    summary = run_dir / SUMMARY
    steps = json.loads(summary.read_text())["steps"] if summary.exists() else None
    return {"nodes": nodes[1] if nodes else "?", "ranks": ranks, "servers": servers, "steps": steps,
            "versions": versions}


def short(model: str) -> str:
    """A model directory by its name, or <stage>/final for a stage's output."""
    path = Path(model)
    return f"{path.parent.name}/{path.name}" if path.name == "final" else path.name


def format_row(name: str, state: str, report: dict) -> str:
    ranks = " ".join(f"{h}:{n}" for h, n in sorted(report["ranks"].items())) or "-"
    servers = " ".join(f"{role}:{host}({short(model)})" for role, host, model in report["servers"]) or "-"
    versions = ",".join(map(str, report["versions"])) or "-"
    return (f"{name:24} {state:10} nodes: {report['nodes']:14} ranks/node: {ranks:16} servers: {servers:50} "
            f"steps: {report['steps'] if report['steps'] is not None else '-'}  verified weights: {versions}")


def rehearse(study: StudyConfig, launch: LaunchConfig, args: argparse.Namespace) -> int:
    problems = layout_problems(study, launch)
    if problems:
        print("megaopd rehearse: the real layout has problems (nothing was run):", *problems, sep="\n  ")
        return 1
    state = Path(args.state).resolve()
    if (state / "out").exists():  # a rehearsal's own output: a rerun starts afresh, not from its finished stages
        shutil.rmtree(state / "out")
    rehearsal = absolute_study(rehearsal_study(study, state / "out", args.steps, args.stages))
    write_standin_data(study, Path(rehearsal.out))
    sglang_python = args.sglang_python or environment.sglang_python()
    if not sglang_python:
        print("megaopd rehearse: no SGLang environment for the CPU servers: give --sglang-python or set "
              "MEGAOPD_SGLANG_PYTHON (make setup builds .venv-sglang)", file=sys.stderr)
        return 2
    local = rehearsal_launch(rehearsal, launch, args.gpus_per_node, sglang_python)
    jobs = plan(rehearsal, local)
    nodes = cluster_nodes(jobs)
    gpus = max([1, *(s["gpus_per_node"] for s in local.stages.values())])
    skipped = not_rehearsed(launch)
    print(f"megaopd rehearse: {len(rehearsal.stages)} stage(s) on a local cluster of {nodes} node(s) x {gpus} "
          f"stand-in GPU(s); stand-ins: {', '.join(f'{k} -> {v}' for k, v in stand_ins(study)[0].items())}")
    if skipped:
        print(f"not rehearsed (site settings): {', '.join(skipped)}")
    study_path, launch_path = state / "study.yaml", state / "launch.yaml"
    state.mkdir(parents=True, exist_ok=True)
    save_config(rehearsal, study_path)
    save_config(local, launch_path)
    start = time.monotonic()
    cluster = LocalCluster(nodes, state / "cluster", args.name, args.subnet, gpus)
    try:
        cluster.up()
        ids = run_on_cluster(cluster, study_path, launch_path, args.timeout)
        states = {name: job_state(cluster, job_id) for name, job_id in ids.items()}
    except (PermissionError, FileNotFoundError, RuntimeError, TimeoutError) as e:
        print(f"megaopd rehearse: {e}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            cluster.down()
    logs = Path(rehearsal.out) / "slurm" / "logs"
    for name, job_id in ids.items():
        log = "".join(p.read_text(errors="replace") for p in logs.glob(f"*-{name}-{job_id}.out"))
        if name in ("assets", "report"):
            print(f"{name:24} {states[name]}")
        else:
            print(format_row(name, states[name], stage_report(log, Path(rehearsal.out) / name)))
        if states[name] != "COMPLETED" and log:
            print(f"  {name}: last lines of its log ({logs}):\n    " + "\n    ".join(log.splitlines()[-15:]))
    ok = all(s == "COMPLETED" for s in states.values())
    print(f"megaopd rehearse: {'passed' if ok else 'FAILED'} in {time.monotonic() - start:.0f} s")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megaopd rehearse", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_study_arguments(parser)  # as for megaopd submit
    parser.add_argument("--stages", nargs="*", help="only these stages (their upstream stages must be listed too)")
    parser.add_argument("--steps", type=flag_in_range(1), default=2, help="training steps per stage")
    parser.add_argument("--gpus-per-node", type=flag_in_range(1), default=2, help="stand-in GPUs per node, at most")
    parser.add_argument("--sglang-python", default="", help="SGLang's environment (default $MEGAOPD_SGLANG_PYTHON)")
    parser.add_argument("--state", default="/tmp/megaopd-rehearse", help="cluster state, run directories, logs")
    parser.add_argument("--name", default="rehearse", help="the local cluster's name (namespaces)")
    parser.add_argument("--subnet", default="10.78.0", help="the local cluster's /24")
    parser.add_argument("--timeout", type=flag_in_range(0, kind=float, low_open=True), default=3600,
                        help="seconds for the whole rehearsal")
    parser.add_argument("--keep", action="store_true", help="leave the cluster up (down: local_cluster down)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        command = shlex.join(["megaopd", "rehearse", *(argv if argv is not None else sys.argv[1:])])
        print("megaopd rehearse needs root: it builds a Slurm cluster in network namespaces on this machine. Run\n"
              f"  sudo -E env PATH=\"$PATH\" {command}\nor, without root, check the scripts only:\n"
              f"  megaopd submit {args.config} --launch {args.launch or 'L.yaml'} --dry-run", file=sys.stderr)
        return 2
    try:
        check_name_and_subnet(args.name, args.subnet)
        study, launch = study_and_launch(args)
    except UserError as e:
        print(e.line(), file=sys.stderr)
        return 2
    return rehearse(study, launch, args)


if __name__ == "__main__":
    sys.exit(main())
