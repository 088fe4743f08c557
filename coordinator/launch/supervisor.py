"""Restart policy for psctl's child processes: the training process and local servers.

TensorFlow recovers from a ps failure only through a new coordinator, so the training
process exits with EXIT_RESTART once the ps tasks are back, and the supervisor starts a
fresh one, which restores the latest checkpoint. A training process killed by a signal
(it crashed, or someone killed it) is restarted too, with backoff and jitter. Both count
against one crash-loop budget; past it the job is FAILED with EXIT_GAVE_UP. Any other
non-zero status (configuration error, servers unreachable, the job's code raising) is
permanent and ends the job at once with that status. What each exit status means and what
to do about it come from psctl.coordinator.failures; the rule across psctl, systemd and
Kubernetes is in docs/operations.md ("Who gives up when").
"""

from __future__ import annotations

import collections
import contextlib
import logging
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType

from psctl.cluster.processes.signals import RESIZE_SIGNAL
from psctl.coordinator.failures import (
    EXIT_RESTART,
    JOIN_DEADLINE,
    RESTARTS,
    Decision,
    Failure,
    FailurePolicy,
    Scope,
    classify_exit,
    exit_status,
)
from psctl.coordinator.operations.counters import Counters

log = logging.getLogger(__name__)

RESIZE_RESEND = 2.0  # seconds between resize signals to a training process not yet acting
# A task left while the training process was still starting: it exits for a fresh start by
# itself (restart_if_starting) once it reads that. One that has not within this many seconds
# is blocked in TensorFlow's connection to the cluster it started on (which held a process
# for 140 s, until a test killed it): it is ended (nothing trained, nothing to save).
DEPART_GRACE = 5.0


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


def describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


# A stop signal repeated within this many seconds is one stop (request_stop).
STOP_ECHO = 1.0


class TrainingSupervisor:
    """Runs the training process until it finishes, restarting it when it should.

    ``start`` returns a Popen-like child (``wait(timeout)``, ``poll``, ``send_signal``);
    ``clock`` and ``sleep`` are time.monotonic and time.sleep unless a test scripts them.
    """

    def __init__(
        self,
        start: Callable[[Counters], subprocess.Popen[bytes]],
        *,
        policy: RestartPolicy,
        tick: Callable[[], None] | None = None,
        counters: Counters | None = None,
        failures: FailurePolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        finish_after_stop: bool = False,
    ) -> None:
        self.start = start
        # A stop that meets a training process exiting for a fresh start: one more process
        # (``Counters.stop_at_start``) gives the job its final evaluation and summary. Off
        # where one process cannot start alone (sync mode's workers start together).
        self.finish_after_stop = finish_after_stop
        self.policy = policy
        self.budget = RestartBudget(policy)
        self.tick = tick or (lambda: None)
        self.counters = counters or Counters()
        if not self.counters.launched:
            self.counters.launched = time.time()
        self.failures = failures or FailurePolicy()
        self.clock = clock
        self.sleep = sleep
        self.child: subprocess.Popen[bytes] | None = None
        self.stopping = False
        # The launcher's: take tasks that left ((type, index, address) in the running
        # training process's cluster) out of the cluster the next one starts on, returning
        # (old shape, new shape); None: nothing leaves (sync mode).
        self.on_left: Callable[[list[tuple[str, int, str]]], tuple[str, str]] | None = None
        self._departed: set[str] = set()  # addresses taken out while this child runs
        self._departed_at: float | None = None  # the first such, while it had not trained
        self._ended_starting = False  # this child was ended for it (DEPART_GRACE)
        self._resize: dict[str, object] | None = None  # asked for, not done yet
        self._resize_started = self._resize_sent = 0.0
        self._forwarded = 0  # the stop signal request_stop sent the training process
        self._forwarded_at = -STOP_ECHO  # when (clock)
        # Children inherit it ignored: a resize signal that reaches a training process
        # before it installs its handler (training/loop.py) must not kill it.
        with contextlib.suppress(ValueError):  # not the main thread: a test's supervisor
            signal.signal(RESIZE_SIGNAL, signal.SIG_IGN)

    @property
    def resizing(self) -> bool:
        """A resize was asked for and the training process has not exited for it yet."""
        return self._resize is not None

    def request_resize(self, *, old: str, new: str, reason: str = "psctl scale") -> bool:
        """Ask the training process to checkpoint now and exit for a fresh start (the next
        one starts on the new cluster: ``start`` reads it); False when none is running."""
        child = self.child
        if self.stopping:
            return False
        record: dict[str, object] = {"time": time.time(), "from": old, "to": new, "reason": reason}
        if child is None or child.poll() is not None:
            # Between two training processes: the next one starts on the new cluster.
            self.counters.resizes.append({**record, "seconds": 0.0})
            log.warning("resized %s -> %s: the next training process starts on it", old, new)
            return True
        if self._resize is not None:  # one under way: the next process reads the newest
            self._resize["to"] = new
            return True
        self._resize = record
        self._resize_started = self._resize_sent = self.clock()
        log.warning("resizing %s -> %s: the training process checkpoints and exits", old, new)
        self._signal_resize(child)
        return True

    def depart(self, tasks: list[tuple[str, int, str]], *, reason: str = "") -> None:
        """Tasks that left ((type, index, address) in the running training process's
        cluster: it saw them stop, or psctl local saw their servers exit 0) go out of the
        launcher's cluster now; the training process goes on without them (no pause, no
        restart) and the next one starts without them. Recorded as a resize of 0 s."""
        new = [t for t in tasks if t[2] not in self._departed]
        if not new or self.on_left is None:
            return
        self._departed.update(address for _, _, address in new)
        if self._departed_at is None and not self.counters.peek_started():
            self._departed_at = self.clock()
        old, shape = self.on_left(new)
        names = ", ".join(f"{t}:{i}" for t, i, _ in new)
        record = {"time": time.time(), "from": old, "to": shape, "seconds": 0.0}
        self.counters.resizes.append({**record, "reason": reason or f"{names} left"})
        log.warning(
            "%s left: %s -> %s; training goes on without it, the next training process "
            "starts on the new cluster",
            names,
            old,
            shape,
        )

    def _signal_resize(self, child: subprocess.Popen[bytes]) -> None:
        # Sent again every RESIZE_RESEND seconds until the process exits: one that is still
        # starting ignores the signal (inherited SIG_IGN, see __init__) until it can act on it.
        self._resize_sent = self.clock()
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(RESIZE_SIGNAL)

    def run(self) -> int:
        consecutive_crashes = 0
        while True:
            self.child = self.start(self.counters)
            self._departed = set()  # the new process's cluster has none of them
            self._departed_at, self._ended_starting = None, False
            code = self._wait(self.child)
            self.counters.take_report()
            if self._ended_starting and not self.stopping:
                log.info("starting the training process on the cluster without the tasks that left")
                continue  # not a failure: no restart counted, no backoff
            resize, self._resize = self._resize, None
            left, self.counters.left = self.counters.left, []
            self.depart([(str(t), int(str(i)), str(a)) for t, i, a in left])
            if resize is not None and code == EXIT_RESTART:
                resize["seconds"] = round(self.clock() - self._resize_started, 3)
                self.counters.resizes.append(resize)
                if not self.stopping:
                    log.info("starting the training process on the new cluster (%s)", resize["to"])
                    continue  # not a failure: no restart counted, no backoff
            if self._finish_stopped_job(code):
                continue
            failure = classify_exit(code)
            if failure is None:
                return code  # finished, or stopped gracefully after a checkpoint
            if self.stopping:
                failure = Failure.STOP_SIGNAL  # the operator's: never restart after it
            decision = self.failures.decide(failure, scope=Scope.PROCESS)
            if decision not in RESTARTS:
                # A configuration error (78), a bad command line (2), servers unreachable
                # for --connect-timeout (69), the job's own code raising (1) or a stop:
                # restarting cannot help. The child's status is the job's; one killed by a
                # signal ends it with the decision's.
                if code == -JOIN_DEADLINE and not self.stopping:  # sync: no group in time
                    log.error("not every worker joined within --connect-timeout")
                    print(
                        "psctl: error: not every worker joined within --connect-timeout; "
                        "start psctl train --strategy sync on every worker of the cluster "
                        f"file, or raise --connect-timeout; giving up (exit "
                        f"{exit_status(decision)})",
                        file=sys.stderr,
                        flush=True,
                    )
                return code if code >= 0 else exit_status(decision)
            if decision is Decision.RESTART_WITH_BACKOFF:
                self.counters.coordinator_failures += 1
                consecutive_crashes += 1
                delay = self.policy.delay(consecutive_crashes)
                reason = f"the training process ended with {describe_exit(code)}"
            else:
                consecutive_crashes = 0
                delay = 0.5
                reason = "the training process asked for a fresh start"
            if not self.budget.allow(self.clock()):
                status = exit_status(Decision.GIVE_UP)
                log.error(
                    "%s; %d restarts within %.0fs already: giving up (job FAILED, exit %d)",
                    reason,
                    self.policy.max_restarts,
                    self.policy.window,
                    status,
                )
                return status
            self.counters.restarts += 1
            log.warning(
                "%s: restarting it in %.1fs from the latest checkpoint (restart %d; %d of "
                "%d allowed within %.0fs)",
                reason,
                delay,
                self.counters.restarts,
                len(self.budget.times),
                self.policy.max_restarts,
                self.policy.window,
            )
            if self._sleep(delay) and not self._finish_stopped_job(EXIT_RESTART):
                return exit_status(Decision.ABORT)

    def _finish_stopped_job(self, code: int) -> bool:
        """A stop came while the training process exited for a fresh start (EXIT_RESTART:
        its checkpoint written for a resize, or a ps to be recovered), while the next one
        was due, or while it started (the stop signal forwarded to it killed it before it
        could handle one): True to start one more, which restores the latest checkpoint and
        ends as a stop does, instead of ending the job with no evaluation and no summary.
        Once: a second such exit ends it."""
        if not (
            (code == EXIT_RESTART or (self._forwarded and code == -self._forwarded))
            and self.stopping
            and self.finish_after_stop
            and not self.counters.stop_at_start
        ):
            return False
        self.counters.stop_at_start = True
        log.warning(
            "stopped while the training process restarted: one more restores the latest "
            "checkpoint for the final evaluation and summary"
        )
        return True

    def _wait(self, child: subprocess.Popen[bytes]) -> int:
        while True:
            try:
                return child.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                self.tick()
                self.depart(self.counters.peek_left())
                if self._resize is not None and self.clock() - self._resize_sent >= RESIZE_RESEND:
                    self._signal_resize(child)
                self._end_if_stuck_starting(child)

    def _end_if_stuck_starting(self, child: subprocess.Popen[bytes]) -> None:
        """A task left DEPART_GRACE seconds ago while ``child`` was starting, and it still
        has not trained a step: SIGKILL (it has nothing to save), and a fresh start."""
        if (
            self._departed_at is None
            or self._ended_starting
            or self.stopping
            or self.clock() - self._departed_at < DEPART_GRACE
        ):
            return
        if self.counters.peek_started():
            self._departed_at = None  # it trains on without the task: nothing to do
            return
        log.warning(
            "the training process is still starting %.0fs after a task left its cluster "
            "(held in TensorFlow's connection to it): ending it for a fresh start without it",
            self.clock() - self._departed_at,
        )
        self._ended_starting = True
        with contextlib.suppress(ProcessLookupError):
            child.kill()

    def _sleep(self, seconds: float) -> bool:
        """Sleep while ticking; True if a stop was requested meanwhile."""
        deadline = self.clock() + seconds
        while self.clock() < deadline and not self.stopping:
            self.tick()
            self.sleep(min(0.2, max(0.0, deadline - self.clock())))
        return self.stopping

    def control_stop(self, forwarded: bool) -> None:
        """A Stop over the control API (operations/front.py): the training process took it
        (``forwarded``) and will checkpoint and exit: start no other after it. None took
        it (none running, or not answering yet): stop as on SIGTERM."""
        if forwarded:
            self.stopping = True
        else:
            self.request_stop(signal.SIGTERM)

    def request_stop(self, signum: int) -> None:
        """Forward a stop to the training process; never restart after it. The same signal
        again within STOP_ECHO seconds is the same stop, not the second one that aborts:
        `timeout` sends its signal to the command and again to its process group (seen: a
        run aborted with no checkpoint, 1 in 3), and systemd may do alike."""
        self.stopping = True
        child = self.child
        now = self.clock()
        if signum == self._forwarded and now - self._forwarded_at < STOP_ECHO:
            log.debug("%s again at once: the same stop", signal.Signals(signum).name)
            return
        if child is not None and child.poll() is None:
            self._forwarded_at = now
            log.warning(
                "%s: asking the training process to stop (checkpoint first)",
                signal.Signals(signum).name,
            )
            self._forwarded = signum
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
