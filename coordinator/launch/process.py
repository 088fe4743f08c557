"""What every training process does, whatever the strategy: serve its /metrics, list the
job's tasks for status, and end its run: a finished one with its summary, one that raised
as the failure policy decides. `psctl train`'s parameter-server process (train.py) and sync
mode's worker processes (sync.py) both use it; their launchers (the supervisor, the control
front) are assembled in assembly.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from psctl.cluster import ports
from psctl.cluster.errors import ConfigError
from psctl.cluster.spec import ClusterConfig
from psctl.coordinator.data import bad_records
from psctl.coordinator.failures import (
    EXIT_RESTART,
    Decision,
    Failure,
    FailurePolicy,
    ResizeRequested,
    Scope,
    classify,
    describe,
    exit_status,
    restart_if_starting,
    tasks_named,
    unstaged,
)
from psctl.coordinator.launch.resize import shape_of
from psctl.coordinator.launch.supervisor import Counters
from psctl.coordinator.operations.job_state import JobControl
from psctl.coordinator.operations.metrics import metrics_scheme
from psctl.coordinator.operations.security import ControlSecurity
from psctl.coordinator.operations.service import start_control_server, stop_control_server
from psctl.coordinator.operations.state import State
from psctl.coordinator.operations.task_book import TaskInfo
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.reporting.summary import (
    Summary,
    complete,
    kept_summary,
)

if TYPE_CHECKING:
    from psctl.coordinator.operations.metrics import CoordinatorMetrics

log = logging.getLogger("psctl.train")


def handed_counters(args: argparse.Namespace) -> Counters:
    """What the supervisor handed this training process (``--supervisor-counters``)."""
    return Counters(**json.loads(args.supervisor_counters or "{}"))


def count_nonfinite(counters: Counters, metrics: CoordinatorMetrics | None) -> None:
    """A NaN/inf loss or model ends this process: counted in psctl_nonfinite_loss_total, and
    left for the supervisor, so the next process's counter goes on from it (PsctlLossNaN)."""
    counters.nonfinite_losses += 1
    counters.leave_report()
    if metrics is not None:
        metrics.nonfinite_loss()


def let_workers_leave(
    control: JobControl,
    settings: TrainSettings,
    counters: Counters,
    metrics: CoordinatorMetrics | None = None,
) -> None:
    """The parameter-server mode's departures: a worker that stops, or stays down for
    --drop-after, leaves the cluster (``leave_cluster``). Not in a job fed by the tf.data
    service (--epochs, --follow): its data worker's tasks would stay in every later pass and
    hold it up (TensorFlow drops none), so it stays a failure until it serves again at its
    address, where psctl local restarts it (LocalCluster._left)."""
    if settings.strategy != "async" or settings.data_service:
        return
    control.on_task_leaving = lambda task: leave_cluster(control, counters, task, metrics)
    control.drop_after = settings.elastic.drop_after


def leave_cluster(
    control: JobControl,
    counters: Counters,
    task: TaskInfo,
    metrics: CoordinatorMetrics | None = None,
) -> bool:
    """A worker is stopping (health NOT_SERVING) or lost (--drop-after): it leaves, unless
    it is the last one. Training goes on without a pause: TensorFlow moves its calls to the
    other workers, and this process stops counting its checks. The supervisor reads the
    report at once and takes it out of the launcher's cluster (TrainingSupervisor.on_left),
    so the next training process starts without it."""
    workers = sum(t.type == "worker" for t in control.tasks)
    if any(entry[2] == task.address for entry in counters.left):
        return True
    if not task.left and workers - len(counters.left) <= 1:  # left: the launcher's word
        log.warning("%s:%d is the last worker: it stays in the cluster", task.type, task.index)
        return False
    num_ps = sum(t.type == "ps" for t in control.tasks)
    before = shape_of(num_ps, workers - len(counters.left))
    counters.left.append([task.type, task.index, task.address])
    counters.leave_report()
    # For this process's summary (the supervisor records it too, for the next processes).
    after = shape_of(num_ps, workers - len(counters.left))
    reason = f"{task.type}:{task.index} left"
    counters.resizes.append(
        {"time": time.time(), "from": before, "to": after, "reason": reason, "seconds": 0.0}
    )
    if metrics is not None:
        metrics.task_left(task.type)
    # Still connecting, perhaps to the task that left: start again without it.
    restart_if_starting(control.state is State.STARTING, f"{reason} the cluster")
    return True


def end_on_error(
    err: BaseException,
    control: JobControl,
    failures: FailurePolicy,
    *,
    recovery_timeout: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """The training process's exit status after ``err`` ended its run, as the policy
    decides: RECOVERING and a restart's status; servers not there in time FAILED and exit
    69; any other permanent failure marks the job FAILED and raises ``err`` again, for the
    CLI's one-line report and its exit status (the same as ``exit_status(decision)``)."""
    decision = failures.decide(classify(err), scope=Scope.PROCESS)
    if decision is Decision.WAIT_FOR_PS_THEN_RESTART:
        return recover(control, err, timeout=recovery_timeout, clock=clock, sleep=sleep)
    if decision is Decision.RESTART:
        log.error("%s: restarting the training process from the latest checkpoint", err)
        control.set_state(State.RECOVERING, str(err))
        return exit_status(decision)
    if decision is Decision.FAIL_UNREACHABLE:
        # Permanent (exit 69): the wait was the retry (docs/operations.md).
        status = exit_status(decision)
        print(f"psctl: error: {err}; giving up (exit {status})", file=sys.stderr)
        control.finish(State.FAILED, str(err))
        return status
    if decision is Decision.FAIL:
        # Not handled by psctl: the whole error, once (TensorFlow's per-call reports of it
        # are at DEBUG). The CLI adds one line, and the traceback with -v.
        log.error("job FAILED, not restarted: %s: %s", type(err).__name__, str(err).strip())
    control.finish(State.FAILED, describe(err))
    raise err


def run_training_process(
    args: argparse.Namespace,
    settings: TrainSettings,
    tasks: list[TaskInfo],
    counters: Counters,
    metrics: CoordinatorMetrics | None,
    train: Callable[[JobControl, FailurePolicy], Summary],
    *,
    serve_control: bool,
    at_exit: Callable[[], None] = lambda: None,
) -> int:
    """A training process, whatever the strategy, around ``train(control, policy)``: the
    job's state (its tasks followed in ``--tasks-file``, its failures and recoveries on
    /metrics), the Control API when this process serves it (``serve_control``: the
    coordinator, sync mode's worker 0, which also reports the summary), the end of a run
    that finished (``complete``), and of one that raised as the policy decides
    (``end_on_error``); ``at_exit`` runs last, whatever happened."""
    failures = FailurePolicy()
    control = JobControl(
        job=settings.job,
        target_steps=0 if settings.data_service else settings.loop.steps,  # 0: the data decides
        steps_per_execution=settings.loop.steps_per_execution,
        tasks=tasks,
        can_checkpoint=serve_control and bool(settings.checkpoints.checkpoint_dir),
        on_state=metrics.set_state if metrics else None,
    )
    control.recoveries = counters.restarts + counters.task_recoveries
    control.carry_failures(counters.seen_task_failures)
    control.cluster_generation = len(counters.resizes)
    if counters.stop_at_start:
        log.warning(
            "the job was stopped while the last training process exited for a fresh start: "
            "restoring the latest checkpoint for the final evaluation and summary"
        )
        control.request_stop()
    if serve_control:
        let_workers_leave(control, settings, counters, metrics)
    # After on_task_leaving: a task marked left before this line leaves at the first read.
    follow_tasks_file(args.tasks_file, control)  # a restarted task's new pid

    def task_failure(task_type: str) -> None:
        # Reported at once: the next training process's counts go on from it, even if this
        # one is killed next.
        counters.process_failures = control.failure_counts()
        counters.process_task_failures = control.failures_by_address()
        counters.leave_report()
        if metrics is not None:
            metrics.task_failure(task_type)

    def task_recovery() -> None:
        counters.process_recoveries += 1
        counters.leave_report()
        if metrics is not None:
            metrics.recovery()

    def started_at(step: int) -> None:
        counters.process_start_step, counters.process_started = step, time.time()
        counters.leave_report()

    control.on_task_failure = task_failure
    control.on_recovery = task_recovery
    control.on_start = started_at
    server = None
    if serve_control:
        server = start_control_server(
            control, args.control_address, ControlSecurity.from_args(args, os.environ)
        )
    try:
        return complete(
            train(control, failures),
            settings=settings,
            control=control,
            counters=counters,
            metrics=metrics,
            report=serve_control,
        )
    except ResizeRequested as err:
        log.info("resizing: %s; a fresh training process goes on on the new cluster", err)
        control.set_state(State.RECOVERING, f"resizing the cluster ({err})")
        return EXIT_RESTART
    except BaseException as caught:
        error = unstaged(caught)  # a ConfigError raised in a traced function: as itself
        if classify(error) is Failure.NON_FINITE:
            count_nonfinite(counters, metrics)
        bad_record = bad_records.as_config_error(error)  # one line naming the file and line
        if bad_record is not None:
            error = bad_record
        code = end_on_error(
            error, control, failures, recovery_timeout=settings.supervision.recovery_timeout
        )
        if code == 0 and serve_control:  # stopped while a lost ps stayed down: no evaluation
            return complete(
                kept_summary(settings, control),
                settings=settings,
                control=control,
                counters=counters,
                metrics=metrics,
            )
        return code
    finally:
        at_exit()
        if server is not None:
            stop_control_server(server)


# After a stop while waiting for a lost ps: how long it may take to serve again, so that one
# more training process can run the final evaluation (psctl local restarts a ps in seconds).
STOP_GRACE = 30.0


def recover(
    control: JobControl,
    err: BaseException,
    *,
    timeout: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """RECOVERING: wait with backoff until every ps is SERVING again, then ask the
    supervisor for a fresh training process (the only recovery TensorFlow supports).
    Logs what failed, and what psctl does about it, in a line each."""
    log.error("%s failed: %s", failed_tasks(err, control), describe(err))
    for name in tasks_named(err):
        task_type, index = name.split(":")
        if task_type == "ps":
            control.failed_by_error(task_type, int(index))
    control.set_state(State.RECOVERING, f"waiting for the ps tasks: {describe(err)}")
    started = clock()
    deadline = started + timeout
    delay = 0.5
    stop_by: float | None = None  # after the operator's stop: how long the ps may take
    while clock() < deadline:
        sleep(delay + random.uniform(0, delay / 2))
        if control.all_ps_serving():
            log.warning(
                "restarting the training process from the latest checkpoint (after %.1fs; "
                "the ps health checks pass)",
                clock() - started,
            )
            break
        if control.operator_stop:
            # The operator's stop (or SIGTERM), not a resize's: a ps back soon (psctl local
            # restarts it) still gets the job its final evaluation from one more training
            # process (supervisor.py); one that stays down ends the job on the latest
            # checkpoint, as nothing could restore or evaluate without it.
            if stop_by is None:
                stop_by = clock() + STOP_GRACE
                log.warning(
                    "stop requested while waiting for the ps tasks: %.0fs more for them (the "
                    "final evaluation needs them), then the job ends on the latest checkpoint",
                    STOP_GRACE,
                )
            elif clock() >= stop_by:
                down = ", ".join(t for t in control.unhealthy_tasks() if t.startswith("ps:"))
                log.warning(
                    "stopped while waiting for the ps tasks (%s not SERVING): the job ends "
                    "on the latest checkpoint, with no final evaluation",
                    down or "a ps",
                )
                control.finish(State.DONE, "stopped while waiting for the ps tasks")
                return 0
        delay = min(delay * 2, 2.0)  # the health checks run every 2 s
    else:
        log.error(
            "ps tasks not SERVING after %.0fs (--recovery-timeout): restarting anyway; the "
            "new training process waits --connect-timeout for them, then the job ends "
            "with exit 69",
            timeout,
        )
    return exit_status(Decision.WAIT_FOR_PS_THEN_RESTART)


def failed_tasks(err: BaseException, control: JobControl) -> str:
    """The tasks to blame, with their addresses: the ps tasks the error names, else those
    the health checks saw fail, else whatever the error names."""
    named = tasks_named(err)
    unhealthy = control.unhealthy_tasks()
    tasks = (
        [t for t in named if t.startswith("ps:")]
        or [t for t in unhealthy if t.startswith("ps:")]
        or named
        or unhealthy
    )
    addresses = {f"{t.type}:{t.index}": t.address for t in control.tasks}
    shown = [f"{t} ({addresses[t]})" if addresses.get(t) else t for t in tasks]
    return ", ".join(shown) or "a task TensorFlow did not name"


def follow_tasks_file(
    tasks_file: str | None, control: JobControl, *, every: float = 1.0
) -> threading.Thread | None:
    """psctl local rewrites its tasks file whenever a task's process starts again (a new
    pid) or leaves: read it at once (it may have changed since this process loaded it:
    seen, a worker marked left then was never acted on, and the process hung connecting
    to it), then again whenever it changes, so that status shows the processes of now. A
    file caught half-written or gone is read at the next change."""
    if not tasks_file:
        return None
    path = Path(tasks_file)

    def stamp() -> int:
        try:
            return path.stat().st_mtime_ns
        except OSError:
            return 0

    def follow() -> None:
        seen = -1
        while True:
            now = stamp()
            if now != seen:
                seen = now
                with contextlib.suppress(ConfigError):
                    control.set_tasks(load_tasks(tasks_file, ClusterConfig(jobs={})))
            time.sleep(every)

    thread = threading.Thread(target=follow, name="psctl-tasks-file", daemon=True)
    thread.start()
    return thread


def load_tasks(
    tasks_file: str | None,
    cluster: ClusterConfig,
    *,
    chief_metrics_port: int = 0,
    health: ports.HealthAddresses | None = None,
) -> list[TaskInfo]:
    """The tasks GetStatus reports: from psctl local's tasks file (with pids), or else from
    the cluster with the cluster file's health addresses (``health``) or the default side
    ports, and the chief's /metrics on ``chief_metrics_port`` (this process's; 0: none)."""
    if tasks_file:
        try:
            entries = json.loads(Path(tasks_file).read_text())
            tasks = [TaskInfo(**entry) for entry in entries]
        except (OSError, ValueError, TypeError) as err:
            raise ConfigError(
                "--tasks-file",
                f"cannot read {tasks_file}: {err}",
                "give the tasks.json psctl local wrote",
            ) from None
        return [replace(t, pid=os.getpid()) if t.type == "chief" else t for t in tasks]
    health = health or ports.HealthAddresses()
    tasks = []
    for task_type, index, address in cluster.task_addresses():
        health_address = metrics_url = ""
        if task_type == "chief" and chief_metrics_port:
            metrics_url = f"{metrics_scheme()}://{address.with_port(chief_metrics_port)}/metrics"
        if task_type in ("ps", "worker"):
            found = health.get(task_type, index, address)
            health_address = str(found) if found else ""
            metrics_port = address.port + ports.METRICS_PORT_OFFSET
            if metrics_port < 65536:
                metrics_url = f"http://{address.with_port(metrics_port)}/metrics"
        pid = os.getpid() if task_type == "chief" else 0
        tasks.append(TaskInfo(task_type, index, str(address), health_address, metrics_url, pid))
    return tasks
