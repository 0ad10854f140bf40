"""The images' locks (docker/requirements-*.lock) against pyproject.toml, pip's resolver and the docs.

Offline: a lock matches pyproject.toml when its recorded inputs hash is the one pyproject.toml gives now (any
change to the dependencies, the image's extras or the image's own requirements makes it stale: `make lock`)
and when every one of those requirements is satisfied by the lock's pins; Dockerfile.gpu's CUDA is the CUDA of
the locked torch; the versions table in docs/docker.md is the one the locks give. With PyPI (`-m registry`,
CI runs it): pip's resolver accepts each locked set as it stands and adds nothing to it. And the build context: what
git ignores, the images' `COPY . .` leaves out.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docker"))
import lock  # noqa: E402
import versions  # noqa: E402

IMAGES = sorted(lock.IMAGES)


def unsatisfied(image: lock.Image, pins: dict[str, str], pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The requirements of megaopd[extras] and of the image that the pins do not satisfy (markers evaluated here)."""
    spec = lock.inputs(image, pyproject)
    wanted = [*spec["dependencies"], *(r for group in spec["extras"].values() for r in group), *spec["image"]]
    problems = []
    for text in wanted:
        requirement = Requirement(text)
        if not satisfied(requirement, pins):
            version = pins.get(lock.canonical(requirement.name))
            problems.append(f"{text}: " + ("not in the lock" if version is None else f"the lock has {version}"))
    return problems


def satisfied(requirement: Requirement, pins: dict[str, str]) -> bool:
    if requirement.marker and not requirement.marker.evaluate({**default_environment(), "extra": ""}):
        return True
    version = pins.get(lock.canonical(requirement.name))
    return version is not None and requirement.specifier.contains(version, prereleases=True)


@pytest.mark.parametrize("image", IMAGES)
def test_lock_matches_pyproject(image):
    spec, found = lock.IMAGES[image], lock.read_lock(lock.lock_path(image))
    assert found.inputs_sha256 == lock.inputs_sha256(spec), (
        f"{lock.lock_path(image).name} was resolved from other requirements than pyproject.toml and "
        f"docker/lock.py hold now: run `{lock.REGENERATE}` and commit the lock")
    assert unsatisfied(spec, found.pins) == []
    assert "megaopd" not in found.pins
    for name, requires in found.from_source.items():  # what pip's check in the image will ask of them
        assert [r for r in requires if not satisfied(Requirement(r), found.pins)] == [], name
    assert found.header["packages"] == str(len(found.pins))


def test_changing_a_pin_in_pyproject_makes_the_lock_stale(tmp_path):
    original = (ROOT / "pyproject.toml").read_text()
    (pin,) = re.findall(r'"megatron-core==([^"]+)"', original)
    changed = tmp_path / "pyproject.toml"
    changed.write_text(original.replace(f'"megatron-core=={pin}"', '"megatron-core==0.0.1"'))
    gpu, pins = lock.IMAGES["gpu"], lock.read_lock(lock.lock_path("gpu")).pins
    assert lock.inputs_sha256(gpu, changed) != lock.inputs_sha256(gpu)
    assert unsatisfied(gpu, pins, changed) == [f"megatron-core==0.0.1: the lock has {pins['megatron-core']}"]
    # An extra the CPU image does not install leaves its lock as it is.
    assert lock.inputs_sha256(lock.IMAGES["cpu"], changed) == lock.inputs_sha256(lock.IMAGES["cpu"])


def test_lock_lines_are_pins(tmp_path):
    bad = tmp_path / "bad.lock"
    bad.write_text("# inputs-sha256: x\ntorch>=2.13\n")
    with pytest.raises(ValueError, match=r"bad.lock:2: expected name==version, got 'torch>=2.13'"):
        lock.read_lock(bad)


def test_each_dockerfile_installs_its_own_lock_and_checks_it():
    for image in IMAGES:
        text = (ROOT / "docker" / f"Dockerfile.{image}").read_text()
        assert f"docker/requirements-{image}.lock" in text, image
        assert "pip check" in text, image
        assert re.search(r"pip install[^\n]*--no-deps[^\n]*-e \.", text), f"{image}: megaopd over the lock"


def test_gpu_base_image_cuda_is_the_locked_torchs():
    pins = lock.read_lock(lock.lock_path("gpu")).pins
    runtime = versions.torch_cuda(pins)
    toolkit = versions.base_cuda(versions.base_image("gpu"))
    assert runtime.split(".")[:2] == toolkit.split(".")[:2], (
        f"Dockerfile.gpu's CUDA {toolkit} (nvcc builds TE's torch extension with it) is not torch's {runtime}")


def test_gpu_image_python_is_the_one_the_lock_was_resolved_for():
    resolved = lock.read_lock(lock.lock_path("gpu")).header["resolved-for"]
    python = re.search(r"CPython (\d+\.\d+)", resolved).group(1)
    assert f"python{python}" in (ROOT / "docker" / "Dockerfile.gpu").read_text()
    assert f"python:{python}-" in versions.base_image("cpu")


def test_versions_table_in_the_doc_is_generated_from_the_locks():
    assert versions.table_in_doc() == versions.table(), "run `python docker/versions.py` (or `make lock`)"


@pytest.mark.slow
@pytest.mark.registry
@pytest.mark.timeout(1500)  # the GPU set: 5.5 min measured on a loaded machine
@pytest.mark.parametrize("image", IMAGES)
def test_pip_resolves_the_locked_set_as_it_stands(image, tmp_path):
    """pip's resolver, asked for the locked pins, answers with exactly those pins.

    A package built from source in the image stands here as the requirements its metadata had at `make lock`
    (recorded under its pin): its metadata comes from running its setup.py against a CUDA torch, minutes and
    gigabytes of build environment that `make lock` pays once. Everything else resolves from metadata alone.
    """
    found = lock.read_lock(lock.lock_path(image))
    here = f"CPython {sys.version_info.major}.{sys.version_info.minor}."
    assert found.header["resolved-for"].startswith(here), f"the lock was resolved for {found.header['resolved-for']}"
    wheels = {name: version for name, version in found.pins.items() if name not in found.from_source}
    asked = tmp_path / "asked.txt"
    asked.write_text("\n".join([f"{n}=={v}" for n, v in wheels.items()]
                               + [r for requires in found.from_source.values() for r in requires]) + "\n")
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                             "--report", "-", "-r", str(asked)], capture_output=True, text=True, timeout=1200)
    print(f"{image}: pip resolved {len(wheels)} pins in {time.monotonic() - start:.0f} s")
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout)
    resolved = {lock.canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in report["install"]}
    assert resolved == wheels, "pip's resolution of the lock differs from the lock: run `make lock`"
    assert [item["metadata"]["name"] for item in report["install"]
            if not item["download_info"]["url"].endswith(".whl")] == [], "newly built from source: run `make lock`"


def test_the_build_context_leaves_out_what_git_ignores():
    """A checkout's environments, runs and imported checkpoints stay out of the images (a pattern missing from
    .dockerignore once put make test's 4.4 GB of checkpoints into megaopd:cpu, 1.7 GB otherwise)."""
    def patterns(name: str) -> set[str]:
        lines = (line.strip() for line in (ROOT / name).read_text().splitlines())
        return {line.removeprefix("**/") for line in lines if line and not line.startswith("#")}

    assert patterns(".gitignore") <= patterns(".dockerignore"), patterns(".gitignore") - patterns(".dockerignore")
