"""Stop signals handled off the signal handler.

A Python signal handler runs in the main thread between two bytecodes, and a second signal
can run it again inside the first: the kernel sends a parent-death signal each time a thread
of the dead launcher exits, so a server gets SIGTERM several times at once. A handler that
takes a lock (``threading.Event.set()`` does) then waits on itself forever: seen, a server
whose launcher was SIGKILLed stuck in ``Event.set()`` called from ``Event.set()``. Here the
handler only counts the signal and puts it on a ``queue.SimpleQueue`` (whose ``put`` is
reentrant); a thread of its own calls the real handler, where locks are safe.
"""

from __future__ import annotations

import queue
import signal
import threading
from collections.abc import Callable, Iterable
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# From a launcher to its training process: checkpoint now, then exit for a fresh start on
# a new cluster (psctl scale; training/loop.py).
RESIZE_SIGNAL = signal.SIGUSR1
# A training process's parent-death signal (its launcher killed: SIGKILL, OOM): a stop. Not
# SIGTERM: the kernel sends it again at each reparenting (to another launcher thread, then
# to init), and a second SIGTERM aborts with no final checkpoint (measured: steps lost).
LAUNCHER_GONE = signal.SIGUSR2


class SignalRelay:
    """``handler(signum)`` on the relay thread for each of ``signals``; with
    ``abort_on_second``, a second signal raises KeyboardInterrupt in the main thread."""

    def __init__(
        self,
        handler: Callable[[int], None],
        signals: Iterable[int] = STOP_SIGNALS,
        *,
        abort_on_second: bool = False,
    ) -> None:
        self.handler = handler
        self.abort_on_second = abort_on_second
        self.received = 0  # only the handler writes it; an int needs no lock
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._relay, name="psctl-signals", daemon=True)
        self._thread.start()
        self._old = {sig: signal.signal(sig, self._on_signal) for sig in signals}

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.received += 1
        if self.abort_on_second and self.received > 1:
            raise KeyboardInterrupt
        self._queue.put(signum)

    def _relay(self) -> None:
        while (signum := self._queue.get()) is not None:
            self.handler(signum)

    def restore(self) -> None:
        """The handlers from before, and the relay thread ended."""
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._queue.put(None)
        self._thread.join(timeout=5.0)


class EarlyStops:
    """Stop signals that come while a process starts, before it can act on one (importing
    TensorFlow, waiting for its servers): counted, for ``SignalRelay`` to take over. The
    default action would kill it there, with no checkpoint or summary: seen, ``psctl stop``
    while a training process started after a resize ended ``psctl local`` with 130. A
    second one does what the default would (a second Ctrl-C aborts)."""

    def __init__(self, signals: Iterable[int] = STOP_SIGNALS) -> None:
        self.received = 0
        self.signum = 0
        for sig in signals:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.received += 1
        self.signum = signum
        if self.received > 1:
            self.die()

    def die(self) -> None:
        """End as the default action would, if a stop came: where there is nothing to
        save yet (still waiting for the servers)."""
        if self.signum:
            signal.signal(self.signum, signal.SIG_DFL)
            signal.raise_signal(self.signum)
