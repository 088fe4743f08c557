"""The job's state in one plain object: its life-cycle state and the transitions allowed
(state.py), the progress board, the tasks and their health (task_book.py), and the
operators' pending requests. The training loop writes it and polls it; the Control service
(service.py) only reads its view and files requests, translating both to and from the
protos; the health checks (health_poll.py) report into it. No gRPC here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from psctl.coordinator.operations.state import (
    ACTIVITIES,
    ACTIVITY_HOST_STATES,
    CHECKPOINT_STATES,
    FINAL_STATES,
    SCHEDULING_STATES,
    InvalidTransition,
    State,
    check_transition,
)
from psctl.coordinator.operations.task_book import TaskBook, TaskInfo

log = logging.getLogger(__name__)

# What the training side counts of each dynamic embedding table: its live rows, the ids
# admitted and rows evicted in total (restored with each checkpoint, so a restarted process
# goes on from the checkpoint's totals), and its bytes on the ps tasks.
TABLE_COUNTS = ("rows", "admitted", "evicted", "bytes")


def table_counts(stats: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """``stats`` (``TrainState.table_stats()``) copied, by table name, with exactly the
    ``TABLE_COUNTS`` as ints (0 for one left out)."""
    return {
        str(name): {key: int(counts.get(key, 0)) for key in TABLE_COUNTS}
        for name, counts in sorted(stats.items())
    }


class Rejected(Exception):
    """A request that does not fit the job's state (FAILED_PRECONDITION)."""


@dataclass
class Board:
    """What GetStatus reports; written by the training loop under JobControl's lock."""

    global_step: int = 0
    steps_per_second: float = 0.0
    examples_per_second: float = 0.0
    loss: float = float("nan")
    metrics: dict[str, float] = field(default_factory=dict)
    eval_metrics: dict[str, float] = field(default_factory=dict)
    eval_step: int = 0
    checkpoint_path: str = ""
    checkpoint_step: int = 0
    checkpoint_time: float = 0.0
    message: str = ""
    # Per dynamic embedding table (by layer name): TABLE_COUNTS, as last published.
    tables: dict[str, dict[str, int]] = field(default_factory=dict)
    # Freshness (--follow, --export-every): shown only when ``fresh`` says either is on.
    fresh: bool = False
    following: bool = False
    files_trained: int = 0
    files_waiting: int = 0
    newest_file: str = ""
    newest_completed: float = 0.0  # Unix time the newest trained file was complete
    published_version: int = 0
    published_time: float = 0.0  # Unix time of the published version's checkpoint
    export_dir: str = ""
    publish_decision: str = ""  # --export-if-better: the last candidate judged, and how


class CheckpointRequest:
    """Filed by an RPC thread, fulfilled by the training loop."""

    def __init__(self) -> None:
        self.future: futures.Future[tuple[str, int]] = futures.Future()


class JobControl(TaskBook):
    """The job's state, progress board, task health (``TaskBook``, task_book.py) and pending
    operator requests.

    ``state`` is the life-cycle state (``set_state`` moves it along ``TRANSITIONS``);
    ``reported_state`` is what GetStatus and the ``on_state`` callback see: the state, or
    CHECKPOINTING while a "checkpointing" activity runs beside RUNNING, PAUSED or STOPPING.
    """

    def __init__(
        self,
        *,
        job: str,
        target_steps: int,
        steps_per_execution: int,
        tasks: list[TaskInfo],
        can_checkpoint: bool,
        on_state: Callable[[str], None] | None = None,
    ) -> None:
        self.job = job
        self.target_steps = target_steps
        self.steps_per_execution = steps_per_execution
        self.can_checkpoint = can_checkpoint
        self.started = time.monotonic()
        self._lock = threading.Lock()
        TaskBook.__init__(self, tasks, self._lock, fresh_start=self._fresh_start)
        self._state = State.STARTING
        self._activities: dict[str, int] = {}
        self._board = Board()
        self._pause_requested = False
        self._checkpoints: list[CheckpointRequest] = []
        self.stop_requested = threading.Event()
        # Set with stop_requested by a resize (SIGUSR1 from the launcher): the loop ends at
        # a checkpoint and the process exits for a fresh start on the new cluster.
        self.resize_requested = threading.Event()
        self._operator_stop = False  # request_stop or a signal: wins over a resize
        # The calls in flight will never land (a failure this process cannot recover
        # from): the loop gives them up at once instead of waiting for them.
        self.abandon_in_flight = threading.Event()
        self.cluster_generation = 0  # resizes before this process (the supervisor's count)
        self._on_state = on_state  # e.g. the coordinator_state metric
        # Held while the callback runs, so that the last call reports the latest state.
        self._notify_lock = threading.Lock()
        self.on_start: Callable[[int], None] | None = None  # the loop's start step, once

    # -- the training loop's side --------------------------------------------------------

    @property
    def state(self) -> State:
        """The life-cycle state (never CHECKPOINTING because of an activity)."""
        with self._lock:
            return self._state

    @property
    def reported_state(self) -> State:
        """The state GetStatus, Pause/Resume/Stop and ``on_state`` report."""
        with self._lock:
            return self._reported()

    def _reported(self) -> State:  # under self._lock
        if self._state in ACTIVITY_HOST_STATES:
            for name, shown in ACTIVITIES.items():
                if self._activities.get(name):
                    return shown
        return self._state

    def set_state(self, state: State, message: str = "") -> None:
        """Move to ``state`` and set the status message.

        The same state again only sets the message. A transition ``TRANSITIONS`` does not
        allow is logged and raises ``InvalidTransition``; state and message stay as they
        were.
        """
        with self._lock:
            old = self._state
            try:
                check_transition(old, state)
            except InvalidTransition as err:
                log.error("%s", err)
                raise
            if old is not state:
                log.debug("state %s -> %s", old.name, state.name)
            self._state = state
            self._board.message = message
        self._notify()

    def begin_activity(self, name: str) -> None:
        """Start ``name`` (a key of ``ACTIVITIES``, e.g. "checkpointing") beside the current
        state: while any such activity runs in RUNNING, PAUSED or STOPPING, the reported
        state is the activity's (CHECKPOINTING) and ``state`` does not change. Activities
        nest: each begin needs its end_activity."""
        self._check_activity(name)
        with self._lock:
            self._activities[name] = self._activities.get(name, 0) + 1
        self._notify()

    def end_activity(self, name: str) -> None:
        """End one ``begin_activity(name)``. An end without a begin is logged, not raised:
        it runs in ``finally`` blocks, where it must not hide the real error."""
        self._check_activity(name)
        with self._lock:
            running = self._activities.get(name, 0)
            if running <= 0:
                log.error("end_activity(%r) without begin_activity", name)
                return
            self._activities[name] = running - 1
        self._notify()

    @contextmanager
    def activity(self, name: str) -> Iterator[None]:
        """``with control.activity("checkpointing"): save()``."""
        self.begin_activity(name)
        try:
            yield
        finally:
            self.end_activity(name)

    @staticmethod
    def _check_activity(name: str) -> None:
        if name not in ACTIVITIES:
            raise ValueError(f"unknown activity {name!r}; one of {sorted(ACTIVITIES)}")

    def _notify(self) -> None:
        if self._on_state is None:
            return
        with self._notify_lock:
            self._on_state(self.reported_state.name.lower())

    def set_message(self, message: str) -> None:
        with self._lock:
            self._board.message = message

    @property
    def pause_requested(self) -> bool:
        with self._lock:
            return self._pause_requested

    @property
    def operator_stop(self) -> bool:
        """The operator's stop (``request_stop``) or a stop signal came; ``stop_requested``
        alone may be a resize's."""
        with self._lock:
            return self._operator_stop

    def update(self, **values: Any) -> None:
        with self._lock:
            self._board = replace(self._board, **values)

    def set_tables(self, stats: dict[str, dict[str, int]]) -> None:
        """The dynamic embedding tables' counts as now (``table_counts``), replacing the
        last ones whole."""
        self.update(tables=table_counts(stats))

    def take_checkpoint_requests(self) -> list[CheckpointRequest]:
        with self._lock:
            taken, self._checkpoints = self._checkpoints, []
            return taken

    def finish(self, state: State, message: str = "") -> None:
        """DONE or FAILED; pending checkpoint requests are answered with an error.

        Finishing again with the other final state (FAILED after DONE) is logged and
        ignored: the first outcome stands, and the caller, often an error handler, goes on.
        Any other transition the table refuses raises ``InvalidTransition``.
        """
        if not state.final:
            raise ValueError(f"finish() takes DONE or FAILED, not {state.name}")
        current = self.state
        if current.final and current is not state:
            log.error("job already %s: finish(%s) ignored (%s)", current.name, state.name, message)
            return
        check_transition(current, state)
        for request in self.take_checkpoint_requests():
            request.future.set_exception(
                Rejected(
                    f"the job ended ({state.name}) before taking this checkpoint: its final "
                    "checkpoint, the newest in --checkpoint-dir, holds every step"
                    if state is State.DONE
                    else f"the job ended ({state.name}) before taking this checkpoint"
                )
            )
        try:
            self.set_state(state, message)
        except InvalidTransition:
            if not self.state.final:
                raise
            # Another thread finished the job meanwhile (set_state logged it): that stands.

    # -- the operators' side (RPC threads) -----------------------------------------------

    def request_pause(self) -> State:
        return self._set_pause(True, "pause")

    def request_resume(self) -> State:
        return self._set_pause(False, "resume")

    def _set_pause(self, paused: bool, verb: str) -> State:
        with self._lock:
            if self._state not in SCHEDULING_STATES:
                then = (
                    "the job has ended"
                    if self._state in FINAL_STATES
                    else "try again when psctl status says RUNNING or PAUSED"
                )
                raise Rejected(f"cannot {verb} while {self._state.name}; {then}")
            self._pause_requested = paused
            return self._reported()

    def request_stop(self) -> State:
        with self._lock:
            if self._state in FINAL_STATES:
                raise Rejected(f"the job is already {self._state.name}")
            self._stop_wins()
            return self._reported()

    def stop_on_signal(self) -> None:
        """SIGTERM/SIGINT: as ``request_stop``, in any state."""
        with self._lock:
            self._stop_wins()

    def _stop_wins(self) -> None:
        # An operator's stop ends the run (final checkpoint, evaluation, summary, exit 0)
        # even while a resize is asked for: the launcher starts no training process after
        # a stop, so an exit for a fresh start would end the job without its summary.
        self._operator_stop = True
        self.resize_requested.clear()
        self.stop_requested.set()

    def request_resize(self) -> None:
        """The launcher's: end the loop at a checkpoint, then exit for a new cluster
        (ignored once an operator's stop came: the stop wins)."""
        with self._lock:
            if self._state in FINAL_STATES or self._operator_stop:
                return
            self.resize_requested.set()
            self.stop_requested.set()

    def _fresh_start(self) -> None:
        """The calls in flight given up, and a fresh start on the new cluster (TaskBook's
        worker failure after others left)."""
        self.abandon_in_flight.set()
        self.request_resize()

    def request_checkpoint(self) -> CheckpointRequest:
        with self._lock:
            if not self.can_checkpoint:
                raise Rejected(
                    "the job has no checkpoint directory; restart it with --checkpoint-dir"
                )
            if self._state not in CHECKPOINT_STATES:
                raise Rejected(
                    f"cannot checkpoint while {self._state.name}; try again when "
                    "the job is RUNNING or PAUSED"
                )
            request = CheckpointRequest()
            self._checkpoints.append(request)
            return request

    def view(self) -> JobView:
        """A consistent copy of what status reports (the Control service's GetStatus)."""
        with self._lock:
            return JobView(
                job=self.job,
                state=self._reported(),
                board=replace(self._board),
                target_steps=self.target_steps,
                steps_per_execution=self.steps_per_execution,
                uptime_seconds=time.monotonic() - self.started,
                tasks=list(self.tasks),
                health=dict(self._health),
                failures=self._failures_shown(),
                cluster_generation=self.cluster_generation,
                states={
                    (t.type, t.index): self._task_state(t, self._health.get((t.type, t.index)))
                    for t in self.tasks
                },
            )


@dataclass(frozen=True)
class JobView:
    """A consistent copy of the job's state, for GetStatus."""

    job: str
    state: State
    board: Board
    target_steps: int
    steps_per_execution: int
    uptime_seconds: float
    tasks: list[TaskInfo]
    health: dict[tuple[str, int], str]
    failures: dict[tuple[str, int], int]
    cluster_generation: int = 0
    states: dict[tuple[str, int], str] = field(default_factory=dict)  # a TASK_STATES name
