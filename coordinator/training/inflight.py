"""Scheduled calls in flight, the stall watchdog that watches them, and ``--epochs``'s
watch on the workers still draining their data.

Pure Python over a small protocol (anything with ``steps``, ``scheduled_at`` and a
non-blocking done check), so that both are unit-tested with fakes; the controller feeds
them ClusterCoordinator's RemoteValues.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


def remote_done(remote: Any) -> bool:
    """Whether a scheduled call has finished (value or error), without blocking.

    RemoteValue has no public non-blocking check; its status event is what fetch() waits
    on (TF 2.21). Without it, report done so that fetch() decides (blocking).
    """
    event = getattr(remote, "_status_available_event", None)
    return bool(event.is_set()) if event is not None else True


def wait_remote(remote: Any, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for one call to finish."""
    event = getattr(remote, "_status_available_event", None)
    if event is not None:
        event.wait(timeout)


@dataclass
class InFlight:
    remote: Any  # the RemoteValue of one scheduled call
    steps: int
    scheduled_at: float
    # When a call scheduled after this one finished: ClusterCoordinator's queue is FIFO, so
    # from then on this one is surely running on a worker, not waiting in the queue.
    overtaken_at: float | None = None


@dataclass
class CallTracker:
    """The calls scheduled and not yet retired, oldest first."""

    is_done: Callable[[Any], bool] = remote_done
    wait: Callable[[Any, float], None] = wait_remote
    clock: Callable[[], float] = time.monotonic
    calls: collections.deque[InFlight] = field(default_factory=collections.deque)

    def __len__(self) -> int:
        return len(self.calls)

    def __iter__(self) -> Iterator[InFlight]:
        return iter(self.calls)

    def add(self, remote: Any, steps: int) -> InFlight:
        entry = InFlight(remote, steps, self.clock())
        self.calls.append(entry)
        return entry

    def take_finished(self) -> list[InFlight]:
        """Remove and return the calls that finished; the calls scheduled before the newest
        of them and still running are marked overtaken."""
        done = [entry for entry in self.calls if self.is_done(entry.remote)]
        if done:
            newest = max(entry.scheduled_at for entry in done)
            now = self.clock()
            for entry in self.calls:
                if entry.overtaken_at is None and entry.scheduled_at < newest:
                    entry.overtaken_at = now
        for entry in done:
            self.calls.remove(entry)
        return done

    def give_up(self, entries: list[InFlight]) -> None:
        for entry in entries:
            self.calls.remove(entry)

    def wait_for_oldest(self, timeout: float) -> None:
        if self.calls:
            self.wait(self.calls[0].remote, timeout)


@dataclass(frozen=True)
class Stall:
    """What one look of the watchdog found."""

    stuck: list[InFlight]  # overtaken calls unfinished for the timeout: give them up
    started: bool  # no call finished for the timeout: the job just became stalled
    idle_seconds: float


@dataclass
class StallWatchdog:
    """``--stall-timeout``: a call still running that long after later calls finished sits
    on a frozen or cut-off worker (give it up, its steps are scheduled again); no call at
    all finishing that long means the whole job is stalled, until steps finish again."""

    timeout: float
    clock: Callable[[], float] = time.monotonic
    stalled: bool = False
    stalls: int = 0
    last_progress: float = field(default=0.0)  # moved on by each stall report too
    last_finished: float = field(default=0.0)  # when a call last finished
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout!r}")
        self.last_progress = self.last_finished = self.clock()

    def progress(self) -> bool:
        """A call finished; True when that ends a stall."""
        with self._lock:
            self.last_progress = self.last_finished = self.clock()
            ended = self.stalled
            self.stalled = False
            return ended

    def check_idle(self, in_flight: int) -> float | None:
        """From a thread beside the loop: the idle seconds when a stall starts now (no call
        finished for the timeout with calls in flight), else None. It reports a stall even
        while the loop itself waits on a blocked ps (a status read, for one)."""
        with self._lock:
            idle = self.clock() - self.last_progress
            if in_flight <= 0 or idle < self.timeout or self.stalled:
                return None
            self.stalled = True
            self.stalls += 1
            return idle

    def while_stalled(self, report: Callable[[float], object]) -> None:
        """From the thread beside the loop: ``report(idle seconds)`` if the job is stalled,
        under the lock ``progress`` takes, so that a report never lands after the stall's
        end."""
        with self._lock:
            if self.stalled:
                report(self.clock() - self.last_finished)

    def check(self, tracker: CallTracker, *, stopping: bool = False) -> Stall | None:
        """``stopping``: once the job is stalled, every unfinished call is stuck (a stop or
        a resize waits no longer than the timeout for calls that may never land)."""
        with self._lock:
            return self._check(tracker, stopping)

    def _check(self, tracker: CallTracker, stopping: bool) -> Stall | None:
        now = self.clock()
        every = stopping and (self.stalled or now - self.last_progress >= self.timeout)
        stuck = [
            e
            for e in tracker
            if (every or (e.overtaken_at is not None and now - e.overtaken_at >= self.timeout))
            and not tracker.is_done(e.remote)
        ]
        idle = len(tracker) > 0 and now - self.last_progress >= self.timeout
        if not stuck and not idle:
            return None
        started = idle and not self.stalled
        if started:
            self.stalled = True
            self.stalls += 1
        idle_seconds = now - self.last_progress
        if idle:
            self.last_progress = now  # the next report comes after another full timeout
        return Stall(stuck=stuck, started=started, idle_seconds=idle_seconds)


@dataclass
class DrainWatch:
    """``--epochs``: after a worker reached the end of the data, the others drain what they
    hold, and the finished workers' calls come back empty meanwhile. Empty calls for the
    timeout with no example trained mean a worker whose data never ends (its tf.data
    service reads hang, or it stays frozen after its call was given up); the loop would
    spin on empty calls for ever. Only the time between calls coming back counts, at most
    ``max_gap`` seconds of each gap, so that a pause adds nothing."""

    timeout: float
    max_gap: float = 5.0
    clock: Callable[[], float] = time.monotonic
    waited: float = 0.0  # seconds of empty calls since the last one that trained
    _last: float | None = None  # when the last call came back

    def observe(self, examples: int, *, draining: bool) -> None:
        """A call came back with ``examples``; ``draining``: a worker is at the end."""
        now = self.clock()
        if examples > 0 or not draining:
            self.waited = 0.0
        elif self._last is not None:
            self.waited += min(now - self._last, self.max_gap)
        self._last = now

    def reset(self) -> None:
        """A new pass: nothing is draining."""
        self.waited, self._last = 0.0, None

    @property
    def expired(self) -> bool:
        return self.waited >= self.timeout
