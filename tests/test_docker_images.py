"""The images, built and run with podman on a local Debian base (no image registry is reachable from CI).

- `megaopd:cpu` is built from docker/Dockerfile.cpu as written, on the base docker/build_local_base.sh makes
  (BASE build argument), and then runs what docs/docker.md tells a user to run: `megaopd --help`, a study of one
  short GRPO stage writing to a mounted folder, `megaopd report` on it. The host then reads the run's files.
- The GPU image's Python layer: Dockerfile.gpu's instructions on the same base, less its system layer (apt-get on
  the CUDA base image) and Transformer Engine's torch extension (SKIPPED_TE says why), then the imports.

pip finds packages the way it does on this machine (its find-links, index and CA settings, the folders they name
mounted read-only): torch 2.13.0+cpu is the file on this disk, as for `make setup`, and the CUDA wheels come from
the local mirror or PyPI. The base is reused while its tag (a hash of its recipe) exists; podman reuses a build
layer only when its instruction and the files it copies are unchanged, so a changed Dockerfile or lock rebuilds.
Needs root and podman, debootstrap and runc (.ci/podman_up.sh installs them with apt); elsewhere it skips.
What it proves, what it cannot, and its costs: docs/docker.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]  # crun refuses this machine's cgroups
# The container's default open-files limit exceeds this machine's hard limit: runc's setrlimit fails without these.
LIMITS = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=4096:4096"]
CPU_TAG, GPU_TAG = "localhost/megaopd:cpu-ci", "localhost/megaopd:gpu-python-ci"
GPU_NEED_GB = 32  # the first GPU layer build's peak, 31 GB above its start (docs/docker.md), sampled each second
SKIPPED_TE = ("Transformer Engine's torch extension compiles against CUDA with nvcc (the CUDA base image's): "
              "no CUDA toolkit on the local base, so it is not built here")
# What megatron-core and mbridge import that cannot load on CI's machine: the import it breaks and the error, which
# each test run checks is still the reason before hiding the package (megatron-core then takes its path without it).
UNLOADABLE = {
    # megatron.core.tensor_parallel.random imports TE's torch extension under `except ModuleNotFoundError`; without
    # the extension (SKIPPED_TE), TE raises FileNotFoundError
    "transformer_engine": ("import megatron.core", "FileNotFoundError: Could not find shared object file for "
                                                   "Transformer Engine torch lib."),
    # mbridge imports megatron's GPT layer specs and so megatron.core.transformer.attention, which imports flash_mla
    # (sgl-flash-mla, pinned by SGLang) under `except ImportError`; flash_mla loads kernels linked against the GPU
    # driver, which the container runtime mounts on a GPU node, and fails with OSError without it
    "flash_mla": ("import mbridge", "OSError: libcuda.so.1: cannot open shared object file"),
}

pytestmark = [pytest.mark.slow, pytest.mark.registry, pytest.mark.podman]


def podman(*args: str, timeout: float, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout)
    if check:
        output = f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        assert result.returncode == 0, f"podman {' '.join(args[:3])} ...\n{output}"
    return result


@pytest.fixture(scope="module")
def base() -> str:
    missing = [t for t in ("podman", "debootstrap", "runc") if not shutil.which(t)]
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["bash", str(ROOT / ".ci/podman_up.sh")], check=True, timeout=900)
    elif missing or os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail(f"CI must build the images: needs root and {missing or 'podman'} (.ci/podman_up.sh)")
        pytest.skip(f"needs root and podman, debootstrap, runc (.ci/podman_up.sh installs them); missing {missing}")
    start = time.monotonic()
    result = subprocess.run(["bash", str(ROOT / "docker/build_local_base.sh")], capture_output=True, text=True,
                            timeout=1200)
    assert result.returncode == 0, result.stderr[-4000:]
    print(f"base: {time.monotonic() - start:.0f} s")
    return result.stdout.split()[-1]


def host_pip() -> tuple[list[str], list[str]]:
    """(--build-arg ..., --volume ...): this machine's pip settings for where packages come from."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            timeout=60).stdout
    settings = {m[1]: m[2] for m in re.finditer(r"^(?:global|install|:env:)\.([\w-]+)='(.*)'$", listed, re.M)}
    settings.update({k[4:].lower().replace("_", "-"): v for k, v in os.environ.items()
                     if k in ("PIP_CERT", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL")})
    args, paths = [], set()
    for key in ("cert", "find-links", "extra-index-url"):
        value = settings.get(key, "")
        args += ["--build-arg", f"PIP_{key.upper().replace('-', '_')}={value}"]
        for location in value.split():
            path = Path(location.removeprefix("file://"))
            if path.is_absolute() and path.exists():
                paths.add(path.parent if location.startswith("file://") else path)  # an index: its files too
    return args, [f"--volume={p}:{p}:ro" for p in sorted(paths)]


def build(containerfile: Path, tag: str, base: str, timeout: float) -> float:
    args, volumes = host_pip()
    start = time.monotonic()
    podman("build", "--network=host", *LIMITS, *volumes, *args, "--build-arg", f"BASE={base}", "-f",
           str(containerfile), "-t", tag, str(ROOT), timeout=timeout)
    seconds = time.monotonic() - start
    subprocess.run([*PODMAN, "image", "prune", "-f"], capture_output=True, timeout=300)  # earlier builds' layers
    return seconds


def run(image: str, *command: str, runs: Path | None = None, timeout: float = 600) -> str:
    """The command in the image; `runs` mounted where docs/docker.md mounts it, /opt/megaopd/runs."""
    mount = [f"--volume={runs}:/opt/megaopd/runs"] if runs else []
    return podman("run", "--rm", *LIMITS, "--env=OMP_NUM_THREADS=1", *mount, image, *command,
                  timeout=timeout).stdout


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, args = pending.strip().partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    return out


@pytest.fixture(scope="module")
def cpu_image(base: str) -> str:
    print(f"megaopd:cpu build: {build(ROOT / 'docker/Dockerfile.cpu', CPU_TAG, base, timeout=1800):.0f} s")
    return CPU_TAG


def assert_starts(image: str) -> None:
    """docs/docker.md's first command and the image's CMD print megaopd's help."""
    assert "usage: megaopd" in run(image, "megaopd", "--help")
    assert "usage: megaopd" in run(image), "the image's CMD is not `megaopd --help`"


# The negative control: a line of Dockerfile.cpu, the change that breaks the image, and what the checks then say.
BROKEN = {
    'CMD ["megaopd", "--help"]': ('CMD ["megaopd-cli", "--help"]', "megaopd-cli"),  # a wrong entry point
    "RUN pip install --no-deps -e .": ("RUN pip uninstall -y pyyaml && pip install --no-deps -e .",  # a package gone
                                       "requires pyyaml, which is not installed"),
}


@pytest.mark.timeout(900)  # podman reuses megaopd:cpu's layers up to the changed line: under a minute
@pytest.mark.parametrize("line", list(BROKEN))
def test_a_broken_dockerfile_fails(cpu_image, base, tmp_path, line):
    change, error = BROKEN[line]
    text = (ROOT / "docker/Dockerfile.cpu").read_text()
    assert text.count(line) == 1, f"Dockerfile.cpu no longer has {line!r}: update BROKEN"
    (tmp_path / "Dockerfile.broken").write_text(text.replace(line, change))
    tag = f"{CPU_TAG}-broken"
    try:
        with pytest.raises(AssertionError, match=error):
            build(tmp_path / "Dockerfile.broken", tag, base, timeout=900)
            assert_starts(tag)
    finally:
        podman("rmi", "--force", tag, timeout=300, check=False)


@pytest.mark.timeout(3600)  # from nothing: 5 min at load 6-10, 14 min once under heavier load
def test_cpu_image_runs_the_documented_commands(cpu_image, tmp_path):
    assert_starts(cpu_image)
    study = yaml.safe_load((ROOT / "configs/studies/self_teacher.yaml").read_text())
    grpo = next(s for s in study["stages"] if s["role"] == "grpo")
    grpo["overrides"] = ["model.path={out}/models/{student}", *grpo["overrides"][1:], "train.steps=3",
                         "train.prompts_per_step=4", "train.micro_batch_size=16", "rollout.max_new_tokens=12",
                         "rollout.samples_per_prompt=4", "eval.every=1", "eval.prompts_per_domain=6",
                         "eval.final_prompts_per_domain=12", "checkpoint.every=2"]
    study.update(out="runs/study", stages=[grpo])
    study["assets"].update(train_rows=120, heldout_rows=24)
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study))
    start = time.monotonic()
    printed = run(cpu_image, "megaopd", "study", "runs/study.yaml", runs=tmp_path)
    (tmp_path / "study" / "report").rename(tmp_path / "study_report")  # the report below must write its own
    reported = run(cpu_image, "megaopd", "report", "runs/study", runs=tmp_path)
    print(f"stage + report in the container: {time.monotonic() - start:.0f} s")

    # On the host: the run's numbers, the same in its ledger, its TensorBoard events, the report and the printout.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "study" / "grpo"
    ledger = json.loads((run_dir / "final" / "megaopd_ledger.json").read_text())
    flops = ledger["totals"]["stage"]
    assert flops > 0 and ledger["own"]["train"] > 0
    (events,) = (run_dir / "tensorboard").glob("events.out.tfevents.*")
    tensorboard = EventAccumulator(str(events)).Reload()
    steps = [e.step for e in tensorboard.Scalars("train/loss")]
    assert steps == [1, 2, 3]
    assert tensorboard.Scalars("flops/total_stage")[-1].value == pytest.approx(flops, rel=1e-6)
    report = json.loads((tmp_path / "study" / "report" / "report.json").read_text())
    assert report == json.loads((tmp_path / "study_report" / "report.json").read_text())
    assert f"{flops:.3e}" in printed and "report.md" in reported
    (stage,) = report["seeds"][0]["stages"].values()
    assert stage["steps"] == 3 and stage["totals"] == ledger["totals"]


def test_cpu_image_holds_exactly_the_lock(cpu_image):
    listed = run(cpu_image, "pip", "list", "--format=freeze", "--exclude", "pip")
    installed = {re.sub(r"[-_.]+", "-", line.split("==")[0]).lower(): line.split("==")[1]
                 for line in listed.split() if "==" in line}
    locked = dict(line.split("==") for line in (ROOT / "docker/requirements-cpu.lock").read_text().split()
                  if "==" in line)
    assert {k: v for k, v in installed.items() if k != "megaopd"} == locked


def gpu_python_layer(base: str) -> str:
    """Dockerfile.gpu on the local base: its system layer and TE's extension build left out, all else as written."""
    lines = [f"FROM {base}", "ARG PIP_CERT PIP_FIND_LINKS PIP_EXTRA_INDEX_URL"]  # this machine's pip, as for the CPU
    for keyword, args in instructions((ROOT / "docker/Dockerfile.gpu").read_text()):
        if keyword == "FROM" or (keyword == "RUN" and "apt-get" in args):
            continue  # the CUDA base image and its Python: the local base has bookworm's 3.11 in /opt/venv
        if keyword == "RUN" and "built from source" in args and "--no-build-isolation" in args:
            lines.append(f"RUN {json.dumps(['echo', 'skipped: ' + SKIPPED_TE])}")
            continue
        lines.append(f"{keyword} {args}")
    return "\n".join(lines) + "\n"


def gpu_layer_is_cached() -> bool:
    """The GPU layer image holds this lock: podman reuses its wheel layer (a build from there needs little disk)."""
    found = subprocess.run([*PODMAN, "run", "--rm", *LIMITS, GPU_TAG, "cat", "docker/requirements-gpu.lock"],
                           capture_output=True, text=True, timeout=300)
    return found.returncode == 0 and found.stdout == (ROOT / "docker/requirements-gpu.lock").read_text()


@pytest.mark.timeout(3600)  # from nothing: 15 min at load 6-10, 41 min once under heavier load; then cached
def test_gpu_lock_installs_and_imports(base, tmp_path):
    free_gb = shutil.disk_usage("/var/lib/containers").free / 2**30
    if free_gb < GPU_NEED_GB and not gpu_layer_is_cached():
        message = (f"{free_gb:.0f} GB free; the GPU layer's first build needs {GPU_NEED_GB} GB at its peak "
                   "(11 GB stay as podman's cache): free some disk")
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    containerfile = tmp_path / "Containerfile.gpu-python"
    containerfile.write_text(gpu_python_layer(base))
    print(f"GPU Python layer build: {build(containerfile, GPU_TAG, base, timeout=3000):.0f} s")
    assert_starts(GPU_TAG)  # nothing hidden: the CLI starts where no GPU is (a login node's `megaopd submit`)
    hidden: list[str] = []
    for name, (statement, reason) in UNLOADABLE.items():
        hide = f"import sys; sys.modules.update(dict.fromkeys({hidden})); "
        failed = podman("run", "--rm", *LIMITS, GPU_TAG, "python", "-c", hide + statement, timeout=300, check=False)
        assert failed.returncode != 0 and reason in failed.stderr, f"{statement}: {failed.stderr[-3000:]}"
        hidden.append(name)
    imports = (f"import sys; sys.modules.update(dict.fromkeys({hidden})); import torch, megatron.core, mbridge, "
               "sglang, megaopd.models.megatron.policy, megaopd.rollout.serving.engine; "
               "from mbridge.core.parallel_states import ParallelStates; "
               "from megaopd.models.megatron.bridge import _bridge_class; "
               "print(torch.__version__, megatron.core.__version__, mbridge.__version__, "
               "*(_bridge_class(t).__name__ for t in ('llama', 'qwen3')))")
    printed = run(GPU_TAG, "python", "-c", imports).splitlines()[-1].split()
    lock = (ROOT / "docker/requirements-gpu.lock").read_text()
    pins = dict(line.split("==") for line in lock.split() if "==" in line)
    assert [printed[0].split("+")[0], *printed[1:]] == [pins["torch"], pins["megatron-core"], pins["mbridge"],
                                                        "MegaopdLLaMABridge", "MegaopdQwen3Bridge"]
