"""A server node's process killed mid-stage, on the multi-node cluster (megaopd.launch.local_cluster): the trainer
stops with an error naming the dead server, the job fails, and submitting the study again through `megaopd submit`
resumes the stage from its last checkpoint with nothing lost (the ledger continues from the checkpoint's).
Also, without a cluster: the pool's error names every server it dropped and why."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from megaopd.config import SGLangConfig
from megaopd.rollout.serving.pool import ServerPool
from megaopd.rollout.serving.server import ServerError, SGLangServer
from megaopd.rollout.serving.sglang_cpu import cpu_server_args, cpu_server_env

from test_slurm_multinode import cluster  # noqa: F401  (the 4-node CI cluster)

ROOT = Path(__file__).resolve().parents[1]


def test_pool_error_names_each_dead_server():
    dead = ["http://127.0.0.1:9", "http://127.0.0.1:7"]  # nothing listens on the discard/echo ports here
    pool = ServerPool([SGLangServer(url) for url in dead], SGLangConfig(request_timeout_s=2, retries=0), "rollout")
    with pytest.raises(ServerError) as error:
        pool.map("/generate", [{"input_ids": [1, 2]}])
    message = str(error.value)
    assert message.startswith("rollout: every SGLang server failed: ")
    assert all(f"{url}: SGLang server {url}/generate failed" in message for url in dead), message
    assert pool.servers == []


def sglang_python() -> str:
    python = os.environ.get("MEGAOPD_SGLANG_PYTHON", "")
    if not python:
        pytest.skip("no SGLang environment: set MEGAOPD_SGLANG_PYTHON (make test builds .venv-sglang)")
    return python


def submit(cluster, study: Path, launch: list[str]) -> dict[str, str]:
    args = [a for setting in launch for a in ("--set", setting)]
    out = cluster.client([sys.executable, "-m", "megaopd.cli", "submit", str(study), *args], cwd=str(ROOT))
    assert out.returncode == 0, out.stderr
    return dict(line.split() for line in out.stdout.splitlines())


def job_state(cluster, job_id: str) -> str:
    return re.search(r"JobState=(\S+)", cluster.client(["scontrol", "show", "job", job_id]).stdout)[1]


def wait_ended(cluster, job_id: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_state(cluster, job_id)
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED"):
            return state
        time.sleep(2)
    cluster.client(["scancel", job_id])
    pytest.fail(f"job {job_id} still {state} after {timeout} s")


def kill_server(cluster, node: int) -> int:
    """SIGKILL the SGLang server (and its scheduler children) running in node ``node``'s namespace."""
    pids = subprocess.run(["ip", "netns", "pids", cluster.node_ns(node)], capture_output=True, text=True).stdout.split()
    killed = 0
    for pid in map(int, pids):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "sglang" in cmdline:
            os.kill(pid, signal.SIGKILL)
            killed += 1
    return killed


@pytest.mark.slow
@pytest.mark.timeout(1800)  # its own waits: 900 s to reach step 2, 600 s to fail, then the resubmission
def test_killed_rollout_server_stops_the_stage_naming_it_and_a_resubmission_resumes(cluster, tmp_path):
    steps = 6
    out = tmp_path / "out"
    study = tmp_path / "study.yaml"
    study.write_text(yaml.safe_dump({
        "out": str(out),
        "assets": {"presets": ["qwen3-tiny"], "domains": ["arith_add"], "train_rows": 100, "heldout_rows": 20},
        "stages": [{"name": "grpo", "config": str(ROOT / "configs/embedded/grpo.yaml"), "overrides": [
            "model.path={out}/models/qwen3-tiny", "data.train=[{out}/data/arith_add/train.jsonl]",
            "data.eval=[{out}/data/arith_add/test.jsonl]", f"train.steps={steps}", "checkpoint.every=1",
            f"eval.every={steps}", "eval.prompts_per_domain=2", "eval.final_prompts_per_domain=2",
            "train.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8",
            "rollout.sglang.max_total_tokens=2048", "rollout.sglang.retries=1"]}]}))
    # One trainer node (Megatron on CPU) and one rollout node (an SGLang CPU server): a 2-node job.
    launch = [f"venv={sys.prefix}", f"workdir={ROOT}", "nodes=1", "gpus_per_node=1", "rollout_nodes=1",
              "trainer_module=megaopd.models.megatron.cpu_launch", f"sglang_python={sglang_python()}", "sglang_tp=1",
              f"sglang_args={json.dumps(cpu_server_args())}", f"sglang_env={json.dumps(cpu_server_env())}",
              "overrides=[model.backend=megatron, model.device=cpu, model.dtype=float32]"]
    ids = submit(cluster, study, launch)
    metrics = out / "grpo" / "metrics.jsonl"
    deadline = time.monotonic() + 900
    while not (metrics.exists() and '"step": 2,' in metrics.read_text()):  # mid-stage: checkpoints 1 and 2
        assert time.monotonic() < deadline and job_state(cluster, ids["grpo"]) in ("PENDING", "RUNNING"), \
            "the stage did not reach step 2"
        time.sleep(1)
    assert kill_server(cluster, 2) >= 1
    assert wait_ended(cluster, ids["grpo"], 600) == "FAILED"
    cluster.client(["scancel", ids["report"]])  # it waits on the failed stage forever (afterok)
    log = next((out / "slurm" / "logs").glob(f"*-grpo-{ids['grpo']}.out")).read_text()
    url = re.search(r"SGLang rollout server on node2 at (\S+):", log)[1]
    # Dead in a rollout: "rollout: every SGLang server failed: <url>: ..."; in a weight sync: "SGLang server <url>/...".
    assert re.search(rf"ServerError: .*{re.escape(url)}", log), log[-3000:]
    before = [json.loads(line) for line in metrics.read_text().splitlines()]
    checkpointed = max(int(p.name.split("_")[1]) for p in (out / "grpo" / "checkpoints").glob("step_*"))
    assert 2 <= checkpointed < steps

    again = submit(cluster, study, launch)  # the path users take after fixing the cause
    assert "grpo" in again and wait_ended(cluster, again["grpo"], 900) == "COMPLETED"
    resumed = next((out / "slurm" / "logs").glob(f"*-grpo-{again['grpo']}.out")).read_text()
    assert f"from step {checkpointed}" in resumed
    assert f"weights v{checkpointed} verified" in resumed  # the new server was given the checkpoint's weights
    after = [json.loads(line) for line in metrics.read_text().splitlines()]
    logged = [m["step"] for m in after if not any(k.startswith("final/") for k in m)]
    assert logged == list(range(steps + 1))  # step 0 (start), then every step once: none lost, none twice
    # The ledger continues from the checkpoint's: the lines up to it are the first job's, unchanged.
    assert after[:checkpointed + 1] == before[:checkpointed + 1]
    totals = [m["flops/total_stage"] for m in after[:steps + 1]]
    assert all(b > a for a, b in zip(totals, totals[1:]))
    summary = json.loads((out / "grpo" / "summary.json").read_text())
    assert summary["steps"] == steps and summary["ledger"]["totals"]["stage"] == after[-1]["flops/total_stage"]
