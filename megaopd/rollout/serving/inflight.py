"""In-flight weight updates on SGLang servers (``rollout.inflight_updates``), by abort and resume.

A weight sync no longer waits for the generation in flight: it aborts the requests running (``/abort_request``, all
of them, until the round's answers are back: ``drained``), pauses the servers (``/pause_generation``, mode abort),
loads and verifies the new weights, and lets them go on (``/continue_generation``). Each request running at the
abort comes back with finish reason "abort" and exactly the tokens and logprobs it had generated, under the
version that generated them (the server's reported ``weight_version``: it cannot change while a request holds the
server's update lock). The generation waits here until the sync has verified the new weights, then resubmits each
from its prompt plus its partial response for the tokens it has left: a response carries each token's version.

Why abort and not SGLang's in_place or retract pause: those keep the request inside the server and continue it after
the update, and its answer does not say how many tokens were sampled before the update, so the client cannot stamp
each token's version. An abort returns the partial response itself.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from megaopd.rollout.serving.server import ServerError


class Pauses:
    """The weight syncs that pause generation, as the generation threads see them: whether an abort is one a sync
    caused, and when the requests it aborted may go again."""

    def __init__(self):
        self._changed = threading.Condition()
        self._begun = 0  # syncs that paused generation so far
        self._open = False  # a sync is between its pause and its verified weights
        self._failed = False  # the last sync failed: the run stops, and no request goes to its unverified weights
        self._rounds = 0  # rounds of requests submitted whose answers are not back yet

    @contextmanager
    def pausing(self):
        """Around a sync: from before its pause until its weights are verified (or it failed)."""
        with self._changed:
            self._begun += 1
            self._open = True
        verified = False
        try:
            yield
            verified = True
        finally:
            with self._changed:
                self._open, self._failed = False, not verified
                self._changed.notify_all()

    @contextmanager
    def round(self, timeout_s: float) -> Iterator[int]:
        """Around one round of requests, from before it is submitted until its answers are back: it waits while a
        sync is between its pause and its verified weights, then yields how many syncs have paused generation so far
        (``caused`` tells whether a later abort was a sync's), and a sync's ``drained`` waits for it."""
        with self._changed:
            if not self._changed.wait_for(lambda: not self._open, timeout_s):
                raise ServerError(f"a weight sync that paused the rollout servers did not end within {timeout_s:g} s")
            if self._failed:
                raise ServerError("the weight sync that paused this generation failed (see its error)")
            self._rounds += 1
            begun = self._begun
        try:
            yield begun
        finally:
            with self._changed:
                self._rounds -= 1
                self._changed.notify_all()

    def drained(self, timeout_s: float) -> bool:
        """Whether every round's answers are back, waiting up to timeout_s."""
        with self._changed:
            return self._changed.wait_for(lambda: self._rounds == 0, timeout_s)

    def caused(self, settled: int) -> bool:
        """Whether a sync paused generation since ``round(...)`` yielded `settled`."""
        with self._changed:
            return self._begun > settled
