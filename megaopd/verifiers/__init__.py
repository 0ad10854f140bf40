"""Rewards: one verifier per task, looked up by a row's ``data_source`` and then its ``ability``.

A verifier is a plain function ``(response_text, ground_truth, extra_info) -> float`` in [0, 1]. It costs no model
FLOPs (the ledger logs its wall time only). Implementations register themselves by name:

    @register("synthetic/add")
    def score_add(response, ground_truth, extra_info): ...
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any, Callable

from megaopd.data.rows import Row

Verifier = Callable[[str, Any, dict], float]

_REGISTRY: dict[str, Verifier] = {}
# Modules whose import registers verifiers; imported lazily so heavy ones (sandbox, math-verify) cost nothing
# until a row needs them.
_MODULES = ("megaopd.verifiers.synthetic", "megaopd.verifiers.math", "megaopd.verifiers.code",
            "megaopd.verifiers.science", "megaopd.verifiers.instruction")


def register(*names: str) -> Callable[[Verifier], Verifier]:
    def wrap(fn: Verifier) -> Verifier:
        for name in names:
            _REGISTRY[name] = fn
        return fn

    return wrap


def _load_all() -> None:
    for module in _MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:  # a missing dependency inside an existing module is a real error
                raise


def get_verifier(row: Row) -> Verifier:
    """The verifier for a row: by data_source first, then by ability; a clear error when neither is known."""
    for key in (row.data_source, row.ability):
        if key in _REGISTRY:
            return _REGISTRY[key]
    _load_all()
    for key in (row.data_source, row.ability):
        if key in _REGISTRY:
            return _REGISTRY[key]
    close = difflib.get_close_matches(row.data_source, list(_REGISTRY), n=1)
    hint = f" (closest: {close[0]!r})" if close else ""
    raise KeyError(f"no verifier for data_source={row.data_source!r} / ability={row.ability!r}{hint}; "
                   f"known: {sorted(_REGISTRY)}")


def score(row: Row, response: str) -> float:
    return float(get_verifier(row)(response, row.ground_truth, row.extra_info))
