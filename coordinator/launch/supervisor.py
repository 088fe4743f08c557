"""Restart policy for psctl's child processes: the training process and local servers.

TensorFlow recovers from a ps failure only through a new coordinator, so the training
process exits with EXIT_RESTART once the ps tasks are back, and the supervisor starts a
fresh one, which restores the latest checkpoint. A training process killed by a signal
(it crashed, or someone killed it) is restarted too, with backoff and jitter, within a
crash-loop budget; then the job is FAILED. Any other non-zero status (configuration error,
the job's code raising) is permanent and ends the job at once.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType

from psctl.cluster.errors import EXIT_FAILURE

log = logging.getLogger(__name__)

EXIT_RESTART = 75  # EX_TEMPFAIL: "start me again" (a ps failed and is back, the model went NaN)


class RestartFromCheckpoint(Exception):
    """Raised in the training process when only a fresh one can go on: it exits with
    EXIT_RESTART, and the supervisor starts a new one that restores the latest checkpoint."""


EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 10  # within `window` seconds, then give up
    window: float = 600.0
    backoff_initial: float = 1.0
    backoff_max: float = 30.0

    def delay(self, consecutive: int) -> float:
        """Exponential backoff with full jitter on the upper half."""
        base = min(self.backoff_max, self.backoff_initial * (2 ** max(0, consecutive - 1)))
        return base / 2 + random.uniform(0, base / 2)


class RestartBudget:
    """At most ``max_restarts`` restarts in any ``window`` seconds."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.times: collections.deque[float] = collections.deque()
        self.total = 0

    def allow(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        while self.times and now - self.times[0] > self.policy.window:
            self.times.popleft()
        if len(self.times) >= self.policy.max_restarts:
            return False
        self.times.append(now)
        self.total += 1
        return True


@dataclass
class Counters:
    """What the supervisor saw, handed to each new training process."""

    restarts: int = 0
    ps_failures: int = 0  # training restarts for a ps failure, or ps servers restarted
    coordinator_failures: int = 0
    worker_failures: int = 0  # worker servers psctl local restarted


def describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


class TrainingSupervisor:
    """Runs the training process until it finishes, restarting it when it should."""

    def __init__(
        self,
        start: Callable[[Counters], subprocess.Popen[bytes]],
        *,
        policy: RestartPolicy,
        tick: Callable[[], None] | None = None,
        counters: Counters | None = None,
    ) -> None:
        self.start = start
        self.policy = policy
        self.budget = RestartBudget(policy)
        self.tick = tick or (lambda: None)
        self.counters = counters or Counters()
        self.child: subprocess.Popen[bytes] | None = None
        self.stopping = False

    def run(self) -> int:
        consecutive_crashes = 0
        while True:
            self.child = self.start(self.counters)
            code = self._wait(self.child)
            if code == 0 or self.stopping:
                return code if code >= 0 else EXIT_INTERRUPTED
            if code > 0 and code != EXIT_RESTART:
                # A configuration error (78), a bad command line (2) or the job's own code
                # raising (1): permanent, restarting cannot help. Fail fast.
                return code
            if code == EXIT_RESTART:
                consecutive_crashes = 0
                delay = 0.5
                reason = "the training process asked for a fresh start"
            else:
                self.counters.coordinator_failures += 1
                consecutive_crashes += 1
                delay = self.policy.delay(consecutive_crashes)
                reason = f"the training process ended with {describe_exit(code)}"
            if not self.budget.allow():
                log.error(
                    "%s; %d restarts within %.0fs: giving up (job FAILED)",
                    reason,
                    self.policy.max_restarts,
                    self.policy.window,
                )
                return EXIT_FAILURE
            self.counters.restarts += 1
            log.warning(
                "%s: restarting it in %.1fs from the latest checkpoint (restart %d)",
                reason,
                delay,
                self.counters.restarts,
            )
            if self._sleep(delay):
                return EXIT_INTERRUPTED

    def _wait(self, child: subprocess.Popen[bytes]) -> int:
        while True:
            try:
                return child.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                self.tick()

    def _sleep(self, seconds: float) -> bool:
        """Sleep while ticking; True if a stop was requested meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self.stopping:
            self.tick()
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        return self.stopping

    def request_stop(self, signum: int) -> None:
        """Forward a stop to the training process; never restart after it."""
        self.stopping = True
        child = self.child
        if child is not None and child.poll() is None:
            log.warning(
                "%s: asking the training process to stop (checkpoint first)",
                signal.Signals(signum).name,
            )
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)


@contextlib.contextmanager
def forward_stop_signals(supervisor: TrainingSupervisor) -> Iterator[None]:
    def handle(signum: int, _frame: FrameType | None) -> None:
        supervisor.request_stop(signum)

    old = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
