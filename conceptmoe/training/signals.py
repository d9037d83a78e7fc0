"""Stop a training run cleanly on SIGINT / SIGTERM (what a cluster scheduler sends before a kill).

``with StopOnSignal() as stop:`` replaces the two handlers for the block: a signal only sets
``stop.signum``; the train loop finishes the step it is in, writes a checkpoint atomically and
raises ``Interrupted`` (exit code 128 + signal: 130 for SIGINT, 143 for SIGTERM). A second
SIGINT while the checkpoint is written is ignored (the write is atomic either way). Outside the
main thread (where Python cannot install handlers) the block runs without them.
"""

from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopOnSignal:
    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()
