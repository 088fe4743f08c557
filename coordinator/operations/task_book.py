"""The tasks of a job's cluster as the training process sees them: their list, their
health (health_poll.py reports each check), the failures counted of each (carried over
from earlier training processes by address), and the workers that left. Part of
``JobControl`` (job_state.py), under its lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

# A task's health as its checks see it (the proto's TaskHealth names, TASK_HEALTH_ left off).
SERVING, NOT_SERVING, UNREACHABLE, UNKNOWN = "SERVING", "NOT_SERVING", "UNREACHABLE", "UNKNOWN"
HEALTH = (SERVING, NOT_SERVING, UNREACHABLE, UNKNOWN)

# A task's place in the cluster (the proto's TaskState names, TASK_STATE_ left off). The
# training process knows SERVING, DRAINING and LEFT for the tasks of its own cluster; the
# launcher adds JOINING (and DRAINING) during a resize, and the tasks of earlier generations
# that LEFT (launch/resize.py).
JOINING, DRAINING, LEFT = "JOINING", "DRAINING", "LEFT"
TASK_STATES = (JOINING, SERVING, DRAINING, LEFT)


@dataclass(frozen=True)
class TaskInfo:
    type: str
    index: int
    address: str
    health_address: str = ""
    metrics_url: str = ""
    pid: int = 0
    left: bool = False  # psctl local's tasks file: its server left (exit 0 after SIGTERM)


class TaskBook:
    """The tasks, their health and failures; ``lock``: the job's (``JobControl``'s), held
    around every change; ``fresh_start``: what a worker failure after others left calls
    (checkpoint, then a fresh start on the new cluster)."""

    def __init__(
        self, tasks: list[TaskInfo], lock: threading.Lock, *, fresh_start: Callable[[], None]
    ) -> None:
        self.tasks = tasks  # replaced whole (set_tasks), never changed in place
        self._lock = lock
        self._on_fresh_start = fresh_start
        self._health: dict[tuple[str, int], str] = {}  # (type, index) -> a HEALTH name
        # The server process that last answered for a task: its address and instance.
        self._instance: dict[tuple[str, int], tuple[str, str]] = {}
        # Restarts the checks counted from a new instance, whose TensorFlow error (if one
        # comes: failed_by_error) is then the same failure, not another.
        self._restarts_seen: set[tuple[str, int]] = set()
        self._failures: dict[tuple[str, int], int] = {}
        # Earlier training processes' counts by address (carry_failures), shown, not summed.
        self._failures_before: dict[str, int] = {}
        self.on_task_failure: Callable[[str], None] | None = None
        # Asked whether a worker that stops (or is lost for drop_after) may leave: True
        # takes it out (no failure counted for it from then on), False keeps it a member.
        self.on_task_leaving: Callable[[TaskInfo], bool] | None = None
        self._leaving: set[tuple[str, int]] = set()  # (type, index) of tasks that left
        self.drop_after = 0.0  # --drop-after: seconds a worker may be down; 0: forever
        self.clock = time.monotonic
        self._down_since: dict[tuple[str, int], float] = {}  # (type, index) -> since when
        self.on_recovery: Callable[[], None] | None = None
        self.recoveries = 0

    def task_failed(self, task_type: str, index: int) -> None:
        with self._lock:
            key = (task_type, index)
            self._failures[key] = self._failures.get(key, 0) + 1

    def failed_by_error(self, task_type: str, index: int) -> None:
        """TensorFlow's error named a task its health checks still see SERVING: it failed
        and came back between two checks (a restarted ps server: seen in bench/soak.py
        --netns), or no check ran since. A failure of it, counted once: its health reads
        UNKNOWN until the next check, which then counts no new failure, and a recovery once
        it sees it SERVING. Not counted when the checks have just counted its restart (a
        new server process answering, ``set_health``): the error is that failure's."""
        key = (task_type, index)
        with self._lock:
            if self._health.get(key) != SERVING:
                return  # down already: the checks counted it (or it never served)
            if key in self._restarts_seen:
                self._restarts_seen.discard(key)
                return  # its restart, counted by the checks (a new instance)
            self._health[key] = UNKNOWN
            self._failures[key] = self._failures.get(key, 0) + 1
        if self.on_task_failure is not None:
            self.on_task_failure(task_type)

    def unhealthy_tasks(self) -> list[str]:
        """Tasks whose last health check was not SERVING, as "type:index"."""
        with self._lock:
            return [f"{t}:{i}" for (t, i), h in sorted(self._health.items()) if h != SERVING]

    def _task_state(self, task: TaskInfo, health: str | None) -> str:  # under self._lock
        if (task.type, task.index) not in self._leaving and not task.left:
            return SERVING
        # Stopping while its health still answers (NOT_SERVING, its drain), gone after.
        return DRAINING if health in (SERVING, NOT_SERVING) else LEFT

    # -- health of the cluster's tasks -----------------------------------------------------

    def set_tasks(self, tasks: list[TaskInfo]) -> None:
        """The job's tasks as now (a restarted task's new pid): status and the health
        checks read the new list from their next look. A task newly marked ``left`` (psctl
        local saw its server exit 0) leaves as if its checks had seen it stop."""
        self.tasks = list(tasks)
        for task in tasks:
            with self._lock:
                known = (task.type, task.index) in self._leaving
            if task.left and not known:
                self._leave(task)

    def set_health(self, task: TaskInfo, health: str, instance: str = "") -> None:
        """The latest health check of ``task`` (a ``HEALTH`` name; health_poll.py) and the
        server process that answered it (``instance``, "" if unknown). A task going from
        SERVING to anything else counts as a failure of that task; its return to SERVING
        after a failure counts as a recovery (SERVING for the first time, a task starting,
        does not). So does a task SERVING in both checks but from a new process at the same
        address: it was restarted between them (a server starts in half a second). A worker
        going NOT_SERVING is stopping, and one down for longer than ``drop_after`` is lost:
        either leaves (``on_task_leaving``), and from then on its checks count nothing: the
        job goes on without it. So does a task the launcher marked ``left`` (psctl local saw
        its server exit 0)."""
        key = (task.type, task.index)
        where = task.health_address or task.address
        with self._lock:
            last = self._instance.get(key)
            if instance:
                self._instance[key] = (where, instance)
            # At the same address only: a resize may give another server this task's index.
            restarted = (
                bool(instance)
                and last is not None
                and last[0] == where
                and last[1] != instance
                and self._health.get(key) == SERVING == health
                and not task.left
                and key not in self._leaving
            )
            if health != SERVING:
                self._restarts_seen.discard(key)
        if restarted:
            log.warning("%s:%d was restarted between two health checks", task.type, task.index)
            self.set_health(task, UNKNOWN)  # the old process's end, unseen: a failure
            with self._lock:
                self._restarts_seen.add(key)
        now = self.clock()
        with self._lock:
            before = self._health.get(key)
            self._health[key] = health
            if task.left or key in self._leaving:
                self._down_since.pop(key, None)
                return
            failed_before = self._failures.get(key, 0) > 0
            if health == SERVING:
                self._down_since.pop(key, None)
            elif before == SERVING:
                self._down_since[key] = now
            down = now - self._down_since.get(key, now)
        if task.type == "worker" and self.drop_after and down > self.drop_after:
            # Unreachable for longer than --drop-after: a lost host, taken out (once).
            with self._lock:
                self._down_since.pop(key, None)
            log.warning(
                "%s:%d has not been SERVING for %.0fs (--drop-after): it leaves the cluster",
                task.type,
                task.index,
                down,
            )
            if self._leave(task):
                return
        if before == SERVING and health == NOT_SERVING and task.type == "worker":
            # A worker server says NOT_SERVING only while it stops (SIGTERM: a preemption
            # notice, cluster/server.py): it is leaving, not failing.
            log.warning("%s:%d is NOT_SERVING: it is stopping and leaves", task.type, task.index)
            if self._leave(task):
                return
        if before == SERVING and health != SERVING:
            log.warning("%s:%d is %s", task.type, task.index, health)
            self.task_failed(task.type, task.index)
            if self.on_task_failure is not None:
                self.on_task_failure(task.type)
            if task.type == "worker":
                self._fresh_start_if_departed(task)
        elif before is not None and before != SERVING and health == SERVING and failed_before:
            log.info("%s:%d is SERVING again", task.type, task.index)
            with self._lock:
                self.recoveries += 1
            if self.on_recovery is not None:
                self.on_recovery()

    def _fresh_start_if_departed(self, failed: TaskInfo) -> None:
        """A worker failed while others have left this process's cluster. TensorFlow
        recovers a failed worker by reconnecting to every task of the cluster, those that
        left included, so it never does: every call waits (seen in bench/soak.py: no step
        for 140 s, until the process was killed). Checkpoint, give up the calls in flight,
        and a fresh start on the cluster without them, as a resize does."""
        with self._lock:
            gone = sorted(f"{t}:{i}" for t, i in self._leaving)
        if not gone:
            return
        log.warning(
            "%s:%d failed after %s left this process's cluster: TensorFlow cannot recover it "
            "in this process; checkpoint, then a fresh start on the new cluster",
            failed.type,
            failed.index,
            ", ".join(gone),
        )
        self._on_fresh_start()

    def _leave(self, task: TaskInfo) -> bool:
        """``task`` leaves if ``on_task_leaving`` lets it (not the last worker, ...)."""
        if self.on_task_leaving is None or not self.on_task_leaving(task):
            return False
        with self._lock:
            self._leaving.add((task.type, task.index))
        return True

    def carry_failures(self, by_address: Mapping[str, int]) -> None:
        """What the job's earlier training processes counted for each task (by address):
        status shows it added to this process's own counts."""
        with self._lock:
            self._failures_before = dict(by_address)

    def failures_by_address(self) -> dict[str, int]:
        """This process's own counts, by task address (for the next training process)."""
        with self._lock:
            at = {(t.type, t.index): t.address for t in self.tasks}
            return {at[key]: n for key, n in self._failures.items() if key in at}

    def _failures_shown(self) -> dict[tuple[str, int], int]:  # under self._lock
        shown = dict(self._failures)
        for task in self.tasks:
            carried = self._failures_before.get(task.address, 0)
            if carried:
                key = (task.type, task.index)
                shown[key] = shown.get(key, 0) + carried
        return shown

    def failure_counts(self) -> dict[str, int]:
        with self._lock:
            counts = {"worker": 0, "ps": 0}
            for (task_type, _), n in self._failures.items():
                counts[task_type] = counts.get(task_type, 0) + n
            return counts

    def all_ps_serving(self) -> bool:
        with self._lock:
            return all(
                self._health.get((t.type, t.index)) == SERVING
                for t in self.tasks
                if t.type == "ps" and t.health_address
            )
