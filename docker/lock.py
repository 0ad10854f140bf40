"""The images' locked requirement sets: pip's resolver writes them, the tests and the docs read them back.

    python docker/lock.py [cpu] [gpu]      # resolve, write docker/requirements-<image>.lock; `make lock` also
                                           # regenerates the versions table in docs/docker.md (docker/versions.py)

Each image installs one closed set of name==version pins (everything but megaopd itself, which the image
installs from its checkout with --no-deps). The set comes from `pip install --dry-run --ignore-installed --report`
on megaopd's own requirements (pyproject.toml: the dependencies and the image's extras) plus the image's own
top-level requirements (IMAGES below), run on the interpreter the images use (CPython 3.11, linux x86_64).
The lock's header records a hash of those inputs: a pin changed in pyproject.toml without running this script
again makes the lock stale, and tests/test_docker_lock.py says so.
"""

from __future__ import annotations

import hashlib
import json
import platform
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = "make lock"


@dataclass(frozen=True)
class Image:
    name: str
    extras: tuple[str, ...]  # megaopd's extras the image installs
    requirements: tuple[str, ...]  # the image's own top-level requirements, beside megaopd's


IMAGES = {
    # The embedded default on CPU: torch's CPU build (the file on this disk in CI, PyTorch's CPU index in the image).
    "cpu": Image("cpu", ("verifiers",), ("torch==2.13.0",)),
    # Trainer and servers in one environment, built around the torch that SGLang pins. Transformer Engine from
    # PyPI: its CUDA core is a wheel, its torch extension a source package built in the image against that torch
    # (with --no-build-isolation, so its setup.py's imports must be in the set: wheel).
    "gpu": Image("gpu", ("verifiers", "megatron"), ("sglang==0.5.23", "transformer-engine[pytorch]", "wheel")),
}


def lock_path(image: str) -> Path:
    return ROOT / "docker" / f"requirements-{image}.lock"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def inputs(image: Image, pyproject: Path = ROOT / "pyproject.toml") -> dict:
    """Everything the resolution depends on that lives in this repository, in a stable order."""
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project.get("optional-dependencies", {})
    missing = [e for e in image.extras if e not in extras]
    if missing:
        raise KeyError(f"{pyproject}: no extra {missing} in [project.optional-dependencies] (has {sorted(extras)})")
    return {"python": project.get("requires-python"), "dependencies": project["dependencies"],
            "extras": {e: extras[e] for e in image.extras}, "image": list(image.requirements)}


def inputs_sha256(image: Image, pyproject: Path = ROOT / "pyproject.toml") -> str:
    return hashlib.sha256(json.dumps(inputs(image, pyproject), sort_keys=True).encode()).hexdigest()


@dataclass
class Pin:
    version: str
    # A package pip builds from source in the image: what its metadata required at resolution time (its
    # metadata comes from running its setup.py, which for Transformer Engine's torch extension needs a CUDA torch:
    # the tests check these against the lock without building it again).
    requires: list[str] | None = None


@dataclass
class Lock:
    header: dict[str, str]  # "key: value" comment lines at the top
    pins: dict[str, str]  # canonical name -> version
    from_source: dict[str, list[str]]  # canonical name -> its recorded requirements

    @property
    def inputs_sha256(self) -> str:
        return self.header.get("inputs-sha256", "")


def read_lock(path: Path) -> Lock:
    header, pins, from_source = {}, {}, {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split(" #", 1)[0].strip()
        if raw.startswith("# ") and ": " in raw and not pins:
            key, value = raw[2:].split(": ", 1)
            header[key.strip()] = value.strip()
        if raw.startswith("#   requires: ") and pins:
            from_source[list(pins)[-1]].append(raw.split(": ", 1)[1])
        if raw.endswith("# built from source"):
            from_source[canonical(line.partition("==")[0])] = []
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        if not sep or not version:
            raise ValueError(f"{path}:{number}: expected name==version, got {raw!r}")
        pins[canonical(name)] = version
    return Lock(header, pins, from_source)


def resolve(image: Image, python: str = sys.executable) -> tuple[dict[str, Pin], str]:
    """pip's resolution of megaopd[extras] + the image's requirements, and pip's version."""
    target = f"{ROOT}[{','.join(image.extras)}]"
    command = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", "-",
               target, *image.requirements]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"pip could not resolve the {image.name} image's set:\n{result.stderr[-4000:]}")
    report = json.loads(result.stdout)
    pins = {}
    for item in report["install"]:
        name = canonical(item["metadata"]["name"])
        if name == "megaopd":
            continue
        metadata = item["metadata"]
        requires = [r for r in metadata.get("requires_dist", [])  # those of the package itself, not of its extras
                    if not (m := Requirement(r).marker) or m.evaluate({"extra": ""})]
        from_source = not item["download_info"]["url"].endswith(".whl")
        pins[name] = Pin(metadata["version"], requires if from_source else None)
    return dict(sorted(pins.items())), report["pip_version"]


def write_lock(image: Image, pins: dict[str, Pin], pip_version: str) -> Path:
    python = f"CPython {platform.python_version()} {sys.platform} {platform.machine()}"
    lines = [f"# The {image.name} image's requirement set, pinned by pip's resolver; do not edit by hand.",
             f"# regenerate: {REGENERATE}   (python docker/lock.py {image.name})",
             f"# resolved-for: {python}, pip {pip_version}",
             f"# inputs: megaopd[{','.join(image.extras)}] {' '.join(image.requirements)}",
             f"# inputs-sha256: {inputs_sha256(image)}",
             f"# packages: {len(pins)}"]
    for name, pin in pins.items():
        if pin.requires is None:
            lines.append(f"{name}=={pin.version}")
        else:
            lines += [f"{name}=={pin.version}  # built from source", *(f"#   requires: {r}" for r in pin.requires)]
    path = lock_path(image.name)
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str]) -> int:
    names = argv or list(IMAGES)
    unknown = [n for n in names if n not in IMAGES]
    if unknown:
        print(f"unknown image {unknown}: choose from {list(IMAGES)}", file=sys.stderr)
        return 2
    for name in names:
        pins, pip_version = resolve(IMAGES[name])
        print(f"{write_lock(IMAGES[name], pins, pip_version).relative_to(ROOT)}: {len(pins)} packages")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
