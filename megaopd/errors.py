"""The project's user-error types: a mistake in what was asked for (a config, a path, data, a model, a study), not a
bug. The ``megaopd`` command prints one as one line, ``megaopd: <what>: <why>; <what to do>``, and exits 2; the
traceback only with ``--debug``. Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(ValueError):
    """Its message says why and what to do; ``what`` names the kind in the printed line."""

    what = "error"

    def line(self) -> str:
        return f"megaopd: {self.what}: {' '.join(str(self).split())}"


class DataError(UserError):
    what = "data error"


class ModelError(UserError):
    what = "model error"


class StudyError(UserError):
    what = "study error"


def require_file(path, what: str, error: type[UserError]) -> None:
    """Refuse a path that is not an existing file, naming the setting it came from."""
    from pathlib import Path

    if not Path(path).is_file():
        problem = "is a directory, not a file" if Path(path).is_dir() else "does not exist"
        raise error(f"{what} {str(path)!r} {problem}; check the path (relative paths start at the current "
                    "directory)")
