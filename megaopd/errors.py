"""The project's user-error types: a mistake in what was asked for (a config, a path, data, a model, a study), not a
bug. The ``megaopd`` command prints one as one line, ``megaopd: <what>: <why>; <what to do>``, and exits 2; the
traceback only with ``--debug``. Anything else that escapes is a bug and keeps its traceback.

A full disk is the cluster's fault, not a bug: ``NoSpace`` says which file could not be written and how much was
needed and free (``space_for`` turns whatever a writer raises for it, torch's "unexpected pos" included, into one).
So is a file that may not be written (a read-only filesystem, no permission): ``refused_line``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path


class UserError(ValueError):
    """Its message says why and what to do; ``what`` names the kind in the printed line."""

    what = "error"

    def line(self) -> str:
        return f"megaopd: {self.what}: {' '.join(str(self).split())}"


class DataError(UserError):
    what = "data error"


class ModelError(UserError):
    what = "model error"


class ModelImportError(ModelError):
    """A model that cannot be imported as asked (``megaopd import-model``: a packaged checkpoint or a GGUF file): the
    message says what is missing and the command that fixes it."""


class StudyError(UserError):
    what = "study error"


class RunDirError(UserError):
    """A file of a run directory (metrics.jsonl, summary.json) that megaopd cannot read back as it wrote it."""

    what = "run error"


def require_file(path, what: str, error: type[UserError]) -> None:
    """Refuse a path that is not an existing file, naming the setting it came from."""
    from pathlib import Path

    if not Path(path).is_file():
        problem = "is a directory, not a file" if Path(path).is_dir() else "does not exist"
        raise error(f"{what} {str(path)!r} {problem}; check the path (relative paths start at the current "
                    "directory)")


class NoSpace(UserError):
    """A write that failed for lack of space: ``megaopd: <path>: no space left (<needed> needed, <free> free); ..."""

    def __init__(self, path, needed: int | None, free: int):
        self.path, self.needed, self.free = str(path), needed, free
        super().__init__(f"{path}: no space left ({_size(needed)} needed, {_size(free)} free)")

    def line(self) -> str:
        return (f"megaopd: {self.path}: no space left ({_size(self.needed)} needed, {_size(self.free)} free); free "
                "space, lower checkpoint.keep or move run_dir")


def _size(n: int | None) -> str:
    if n is None:
        return "more"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _in_chain(error: BaseException | None, test) -> BaseException | None:
    """The first of `error` and the errors it was raised from or during that passes `test`, or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if test(error):
            return error
        error = error.__cause__ or error.__context__
    return None


def is_no_space(error: BaseException | None) -> bool:
    """Whether `error`, or one it was raised from or during, is a write refused for lack of space (torch's writer
    reports it as "unexpected pos" with the OSError as its context; safetensors as "os error 28")."""
    return _in_chain(error, lambda e: (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT))
                     or "No space left on device" in str(e) or "os error 28" in str(e)) is not None


def free_bytes(path) -> int:
    """Free bytes on the filesystem of `path` (or of its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


@contextlib.contextmanager
def space_for(path, needed: int | None = None, partial=()):
    """Turn a write under `path` that fails for lack of space into ``NoSpace``, after removing the `partial` files
    or directories it left (a partial temporary directory never stays behind)."""
    try:
        yield
    except BaseException as e:
        if isinstance(e, NoSpace) or not is_no_space(e):  # a NoSpace from an inner writer names its file already
            raise
        for leftover in partial:
            leftover = Path(leftover)
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            elif leftover.exists():
                os.unlink(leftover)
        path = _failed_file(e) or path
        raise NoSpace(path, needed, free_bytes(path)) from e


def _failed_file(error: BaseException | None) -> str | None:
    """The file an OSError in `error`'s chain names, if any."""
    named = _in_chain(error, lambda e: isinstance(e, OSError) and e.filename)
    return str(named.filename) if named else None


def no_space_line(error: BaseException) -> str:
    """The one line for a full disk that no writer turned into ``NoSpace`` (the report's, say)."""
    path = _failed_file(error) or os.getcwd()
    return NoSpace(path, None, free_bytes(path)).line()


def refused_line(error: BaseException) -> str | None:
    """The one line for a file megaopd may not write or read (a read-only filesystem, no permission), or None."""
    refused = _in_chain(error, lambda e: isinstance(e, OSError) and e.errno in (errno.EROFS, errno.EACCES,
                                                                                 errno.EPERM))
    if refused is None:
        return None
    return (f"megaopd: {refused.filename or os.getcwd()}: {refused.strerror.lower()}; make it writable, or write "
            "elsewhere (run_dir, the study's out, --out)")
