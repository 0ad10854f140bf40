"""Dockerfile.cpu's build steps, run without a Docker engine: its RUN lines, as written, in a fresh venv.

The Dockerfile is read here, not copied: FROM must name this interpreter's Python version, ENV is applied,
WORKDIR and COPY map into a scratch folder (`COPY . .` copies the tracked files, what a clone has), each RUN
line runs under /bin/sh, as Docker runs it, with the venv first on PATH (so `pip` is the venv's), and the CMD
must exit 0 at the end; the venv then holds exactly the lock's packages and megaopd. Measured on a loaded 2-core
machine: 11 min with a cold pip cache, 6 min with a warm one (the lock's install is I/O-bound).
Two ENV values are the image's own and are left out here: PyTorch's CPU index (CI reaches PyPI only; the file
of torch 2.13.0+cpu lies on the CI machine's disk, where pip's configuration finds it, as for `make setup`)
and PIP_NO_CACHE_DIR (CI reuses pip's cache between runs; an image has no use for one).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile.cpu"
IMAGE_ONLY_ENV = {"PIP_EXTRA_INDEX_URL", "PIP_NO_CACHE_DIR"}


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


def env_pairs(args: str) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in shlex.split(args))


def copy_context(source: str, workdir: Path, dest: str) -> None:
    """COPY SOURCE DEST: `.` is the tracked files (what a clone has); a DEST ending in / is a folder."""
    target = workdir / dest
    if source == ".":
        files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, text=True,
                               check=True, timeout=60).stdout.split("\0")
        for name in filter(None, files):
            if (ROOT / name).is_file():
                (target / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, target / name)
    else:
        if dest.endswith("/"):
            target = target / Path(source).name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / source, target)


def test_instructions_parse_the_dockerfile():
    steps = instructions(DOCKERFILE.read_text())
    kinds = [k for k, _ in steps]
    assert kinds[0] == "FROM" and kinds[-1] == "CMD" and kinds.count("RUN") >= 2
    assert "docker/requirements-cpu.lock" in " ".join(a for k, a in steps if k == "RUN")


@pytest.mark.slow
@pytest.mark.registry
@pytest.mark.timeout(1800)  # a fresh venv from the registry: 6-11 min measured on a loaded machine
def test_cpu_image_run_steps_build_a_working_environment(tmp_path):
    steps = instructions(DOCKERFILE.read_text())
    python = re.fullmatch(r"python:(\d+\.\d+)[-.\w]*", steps[0][1])
    assert python, f"{DOCKERFILE}: FROM {steps[0][1]} is not a python image"
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert python.group(1) == here, f"the image's Python is {python.group(1)}, this test runs on {here}"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}:{env['PATH']}", VIRTUAL_ENV=str(venv))
    root = tmp_path / "image"
    workdir = root
    timings = []
    for keyword, args in steps[1:]:
        if keyword == "ENV":
            env.update({k: v for k, v in env_pairs(args).items() if k not in IMAGE_ONLY_ENV})
        elif keyword == "WORKDIR":
            workdir = root / args.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif keyword == "COPY":
            *sources, dest = shlex.split(args)
            for source in sources:
                copy_context(source, workdir, dest)
        elif keyword == "RUN":
            start = time.monotonic()
            result = subprocess.run(["/bin/sh", "-c", args], cwd=workdir, env=env, capture_output=True, text=True,
                                    timeout=1500)
            timings.append((args, time.monotonic() - start))
            assert result.returncode == 0, f"RUN {args}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        elif keyword == "CMD":
            command = json.loads(args)  # the exec form: ["megaopd", "--help"]
            result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
            assert result.returncode == 0 and "usage: megaopd" in result.stdout, result.stderr[-3000:]
        else:
            raise AssertionError(f"{DOCKERFILE}: this test does not know how to run {keyword}")
    for command, seconds in timings:
        print(f"{seconds:6.1f} s  RUN {command}")
    # The installed megaopd is the copy's, and the set is exactly the lock's plus megaopd.
    listed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"], env=env,
                            capture_output=True, text=True, timeout=120, check=True).stdout
    installed = {re.sub(r"[-_.]+", "-", line.split("==")[0]).lower() for line in listed.split() if "==" in line}
    locked = {line.split("==")[0] for line in (ROOT / "docker/requirements-cpu.lock").read_text().split()
              if "==" in line}
    assert installed - {"pip", "megaopd"} == locked

