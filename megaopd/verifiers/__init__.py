"""Rewards: one verifier per task, looked up by a row's ``data_source`` and then its ``ability``.

A verifier is a plain function ``(response_text, ground_truth, extra_info) -> float`` in [0, 1]. It costs no model
FLOPs (the ledger logs its wall time only). :func:`score`, the call training makes, never raises for a response:
a verifier that fails scores 0 and the failure is counted by reason (:func:`verifier_errors`, logged by the trainer
as ``rollout/verifier_errors``). Only set-up errors raise: no verifier for the row, or a machine that cannot
sandbox code. Implementations register themselves by name:

    @register("synthetic/add")
    def score_add(response, ground_truth, extra_info): ...
"""

from __future__ import annotations

import collections
import difflib
import importlib
import logging
import threading
from typing import Any, Callable

from megaopd.config import SandboxConfig
from megaopd.data.rows import Row
from megaopd.errors import DataError
from megaopd.verifiers.sandbox import SandboxUnavailable

log = logging.getLogger(__name__)

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
    raise DataError(f"no verifier for data_source={row.data_source!r} / ability={row.ability!r}{hint}; fix the rows' "
                    f"data_source, or register a verifier for it (megaopd.verifiers.register); known: "
                    f"{sorted(_REGISTRY)}")


def check_ready(rows: list[Row], settings: SandboxConfig | None = None) -> None:
    """Start-up check of the rows a run will score, so that it fails now rather than at its first such row: each
    has a verifier (a ``DataError`` names the one that has none), the sandbox takes the run's `settings`
    (``verifier.sandbox``), and if any row's verifier runs programs this machine must be able to sandbox them in
    the namespaces mode, or in the fallback mode when ``settings.allow_fallback`` (SandboxUnavailable names what is
    missing)."""
    from megaopd.verifiers import sandbox

    sandbox.configure(settings or SandboxConfig())
    found = [get_verifier(row) for row in {(r.data_source, r.ability): r for r in rows}.values()]
    if any(getattr(verifier, "needs_sandbox", False) for verifier in found):
        log.info("code sandbox: %s", sandbox.describe())


_errors: collections.Counter[str] = collections.Counter()
_errors_lock = threading.Lock()
_last_error = ""  # "verifier (reason): message" of the latest failure, for the message that stops a run


class VerifierBroken(RuntimeError):
    """Too many samples in a row scored 0 because their verifier failed: training on them would teach nothing."""


class ErrorWatch:
    """Stops a run whose verifier is broken: ``check`` raises VerifierBroken once the share of a step's samples
    whose verifier failed is above ``max_share`` for ``steps`` consecutive steps."""

    def __init__(self, max_share: float, steps: int):  # in range: VerifierConfig
        self.max_share, self.steps, self.bad = max_share, steps, 0

    def check(self, errors: int, samples: int) -> None:
        share = errors / max(samples, 1)
        self.bad = self.bad + 1 if share > self.max_share else 0
        if self.bad >= self.steps:
            raise VerifierBroken(f"the verifier failed on {share:.0%} of this step's samples, above "
                                 f"verifier.max_error_share={self.max_share} for {self.bad} steps in a row; "
                                 f"last error: {_last_error}")


def verifier_errors() -> dict[str, int]:
    """Failures of the verifiers themselves since start, by reason (a running count: callers take differences)."""
    with _errors_lock:
        return dict(_errors)


def score(row: Row, response: str) -> float:
    """The row's reward for ``response`` in [0, 1]; a verifier failure is 0, logged and counted, never raised."""
    return guarded(get_verifier(row), response, row.ground_truth, row.extra_info, row.data_source)


def guarded(verifier: Verifier, response: str, ground_truth: Any, extra_info: dict, source: str = "") -> float:
    """``verifier``'s score, or 0 (logged and counted by reason) when it fails; SandboxUnavailable still raises."""
    try:
        value = float(verifier(response, ground_truth, extra_info))
        if not 0.0 <= value <= 1.0:  # NaN too
            raise ValueError(f"score {value} outside [0, 1]")
        return value
    except SandboxUnavailable:
        raise
    except Exception as e:  # noqa: BLE001: any failure of the harness is a 0 with its reason, not a dead run
        global _last_error
        reason = getattr(e, "reason", type(e).__name__)
        name = getattr(verifier, "__name__", verifier)
        with _errors_lock:
            _errors[reason] += 1
            _last_error = f"{name} on a {source} row ({reason}): {str(e)[:300]}"
        log.warning("verifier %s failed on a %s row (%s): %s", name, source, reason, str(e)[:300])
        return 0.0
