"""The coordinator's Control service: shared job state and the requests operators send.

``JobControl`` is the one place the training loop and the gRPC threads meet: the loop
publishes progress into it and polls it for pause, resume, checkpoint and stop requests;
the servicer only reads snapshots and files requests, never touches TensorFlow.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from psctl.cluster import health as health_check
from psctl.cluster.errors import ConfigError
from psctl.cluster.spec import split_host_port
from psctl.control.v1 import control_pb2, control_pb2_grpc
from psctl.coordinator.control.security import (
    MAX_STREAMS,
    UNARY_THREADS,
    AuthInterceptor,
    ControlSecurity,
    PublishedTokens,
    Tokens,
    is_private_socket,
)
from psctl.coordinator.control.state import (
    ACTIVITIES,
    ACTIVITY_HOST_STATES,
    CHECKPOINT_STATES,
    FINAL_STATES,
    SCHEDULING_STATES,
    InvalidTransition,
    State,
    check_transition,
)
from psctl.coordinator.control.stubs import add_control_servicer

# State, FINAL_STATES and InvalidTransition are re-exported for the callers that import
# them from here; new code imports them from psctl.coordinator.control.state.
__all__ = [
    "FINAL_STATES",
    "Board",
    "CheckpointRequest",
    "ControlServer",
    "ControlServicer",
    "InvalidTransition",
    "JobControl",
    "Rejected",
    "State",
    "TaskInfo",
    "stream_status",
]

log = logging.getLogger(__name__)

WATCH_MIN_INTERVAL, WATCH_MAX_INTERVAL = 0.1, 60.0
HEALTH_POLL_SECONDS = 2.0


class Rejected(Exception):
    """A request that does not fit the job's state (FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class TaskInfo:
    type: str
    index: int
    address: str
    health_address: str = ""
    metrics_url: str = ""
    pid: int = 0


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


class CheckpointRequest:
    """Filed by an RPC thread, fulfilled by the training loop."""

    def __init__(self) -> None:
        self.future: futures.Future[tuple[str, int]] = futures.Future()


class JobControl:
    """The job's state, progress board, task health and pending operator requests.

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
        self.tasks = tasks  # replaced whole (set_tasks), never changed in place
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._state = State.STARTING
        self._activities: dict[str, int] = {}
        self._board = Board()
        self._health: dict[tuple[str, int], int] = {}
        self._failures: dict[tuple[str, int], int] = {}
        self._pause_requested = False
        self._checkpoints: list[CheckpointRequest] = []
        self.stop_requested = threading.Event()
        self._on_state = on_state  # e.g. the coordinator_state metric
        # Held while the callback runs, so that the last call reports the latest state.
        self._notify_lock = threading.Lock()
        self.on_task_failure: Callable[[str], None] | None = None
        self.on_recovery: Callable[[], None] | None = None
        self.recoveries = 0

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

    def update(self, **values: Any) -> None:
        with self._lock:
            self._board = replace(self._board, **values)

    def task_failed(self, task_type: str, index: int) -> None:
        with self._lock:
            key = (task_type, index)
            self._failures[key] = self._failures.get(key, 0) + 1

    def unhealthy_tasks(self) -> list[str]:
        """Tasks whose last health check was not SERVING, as "type:index"."""
        with self._lock:
            return [
                f"{t}:{i}"
                for (t, i), h in sorted(self._health.items())
                if h != control_pb2.TASK_HEALTH_SERVING
            ]

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
            request.future.set_exception(Rejected(f"the job ended ({state.name})"))
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
                raise Rejected(f"cannot {verb} while {self._state.name}")
            self._pause_requested = paused
            return self._reported()

    def request_stop(self) -> State:
        with self._lock:
            if self._state in FINAL_STATES:
                raise Rejected(f"the job is already {self._state.name}")
            self.stop_requested.set()
            return self._reported()

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

    def snapshot(self) -> control_pb2.Status:
        with self._lock:
            board, state = replace(self._board), self._reported()
            healths, failures = dict(self._health), dict(self._failures)
        status = control_pb2.Status(
            job=self.job,
            state=state.value,
            global_step=board.global_step,
            target_steps=self.target_steps,
            steps_per_second=board.steps_per_second,
            examples_per_second=board.examples_per_second,
            loss=board.loss,
            eval_step=board.eval_step,
            uptime_seconds=time.monotonic() - self.started,
            steps_per_execution=self.steps_per_execution,
            message=board.message,
        )
        status.metrics.update(board.metrics)
        status.eval_metrics.update(board.eval_metrics)
        if board.checkpoint_path:
            status.last_checkpoint.CopyFrom(
                control_pb2.Checkpoint(
                    path=board.checkpoint_path,
                    step=board.checkpoint_step,
                    time_unix_seconds=board.checkpoint_time,
                )
            )
        for task in self.tasks:
            key = (task.type, task.index)
            status.tasks.append(
                control_pb2.Task(
                    type=task.type,
                    index=task.index,
                    address=task.address,
                    health=cast(
                        control_pb2.TaskHealth, healths.get(key, control_pb2.TASK_HEALTH_UNKNOWN)
                    ),
                    health_address=task.health_address,
                    failures=failures.get(key, 0),
                    metrics_url=task.metrics_url,
                    pid=task.pid,
                )
            )
        return status

    # -- health of the cluster's tasks -----------------------------------------------------

    def set_tasks(self, tasks: list[TaskInfo]) -> None:
        """The job's tasks as now (a restarted task's new pid): status and the health
        checks read the new list from their next look."""
        self.tasks = list(tasks)

    def poll_health_forever(self, stop: threading.Event) -> None:
        """Check every task's health service in the background (status must answer fast).

        A task going from SERVING to anything else counts as a failure of that task; its
        return to SERVING counts as a recovery.
        """
        to_enum = {
            "SERVING": control_pb2.TASK_HEALTH_SERVING,
            "NOT_SERVING": control_pb2.TASK_HEALTH_NOT_SERVING,
            "UNREACHABLE": control_pb2.TASK_HEALTH_UNREACHABLE,
        }
        serving = control_pb2.TASK_HEALTH_SERVING
        while not stop.is_set():
            for task in self.tasks:
                if task.type == "chief":
                    result = serving
                elif task.health_address:
                    status = health_check.check(task.health_address, timeout=1.0).status
                    result = to_enum.get(status, control_pb2.TASK_HEALTH_UNKNOWN)
                else:
                    continue
                key = (task.type, task.index)
                with self._lock:
                    before = self._health.get(key)
                    self._health[key] = result
                if before == serving and result != serving:
                    log.warning(
                        "%s:%d is %s", task.type, task.index, control_pb2.TaskHealth.Name(result)
                    )
                    self.task_failed(task.type, task.index)
                    if self.on_task_failure is not None:
                        self.on_task_failure(task.type)
                elif before is not None and before != serving and result == serving:
                    with self._lock:
                        failed_before = self._failures.get(key, 0) > 0
                    if not failed_before:  # SERVING for the first time (a worker starting)
                        continue
                    log.info("%s:%d is SERVING again", task.type, task.index)
                    with self._lock:
                        self.recoveries += 1
                    if self.on_recovery is not None:
                        self.on_recovery()
            stop.wait(HEALTH_POLL_SECONDS)

    def failure_counts(self) -> dict[str, int]:
        with self._lock:
            counts = {"worker": 0, "ps": 0}
            for (task_type, _), n in self._failures.items():
                counts[task_type] = counts.get(task_type, 0) + n
            return counts

    def all_ps_serving(self) -> bool:
        with self._lock:
            return all(
                self._health.get((t.type, t.index)) == control_pb2.TASK_HEALTH_SERVING
                for t in self.tasks
                if t.type == "ps" and t.health_address
            )


def stream_status(
    snapshot: Callable[[], control_pb2.Status], request: Any, context: grpc.ServicerContext
) -> Iterator[control_pb2.Status]:
    """WatchStatus: ``snapshot()`` every ``request.interval_seconds`` (0: 1 s) until the
    job is DONE or FAILED or the client goes."""
    interval = request.interval_seconds or 1.0
    if not WATCH_MIN_INTERVAL <= interval <= WATCH_MAX_INTERVAL:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"interval_seconds {interval} is out of range; use "
            f"{WATCH_MIN_INTERVAL} to {WATCH_MAX_INTERVAL} (0 means 1 s)",
        )
    # Woken when the client goes: its thread (and its stream slot) is free at once.
    gone = threading.Event()
    context.add_callback(gone.set)
    final = {s.value for s in FINAL_STATES}
    while context.is_active():
        status = snapshot()
        yield status
        if status.state in final:
            return
        gone.wait(interval)


class ControlServicer(control_pb2_grpc.ControlServicer):
    def __init__(self, control: JobControl, *, checkpoint_timeout: float = 300.0) -> None:
        self.control = control
        self.checkpoint_timeout = checkpoint_timeout

    def GetStatus(self, request: Any, context: grpc.ServicerContext) -> control_pb2.Status:
        return self.control.snapshot()

    def WatchStatus(
        self, request: Any, context: grpc.ServicerContext
    ) -> Iterator[control_pb2.Status]:
        return stream_status(self.control.snapshot, request, context)

    def Checkpoint(
        self, request: Any, context: grpc.ServicerContext
    ) -> control_pb2.CheckpointResponse:
        try:
            pending = self.control.request_checkpoint()
            remaining = context.time_remaining()
            timeout = self.checkpoint_timeout if remaining is None else remaining
            path, step = pending.future.result(timeout=timeout)
        except Rejected as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except futures.TimeoutError:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the checkpoint is still running")
        except Exception as err:  # the save itself failed
            context.abort(grpc.StatusCode.INTERNAL, f"checkpoint failed: {err}")
        return control_pb2.CheckpointResponse(
            checkpoint=control_pb2.Checkpoint(path=path, step=step, time_unix_seconds=time.time())
        )

    def Pause(self, request: Any, context: grpc.ServicerContext) -> control_pb2.PauseResponse:
        return control_pb2.PauseResponse(state=self._do(self.control.request_pause, context))

    def Resume(self, request: Any, context: grpc.ServicerContext) -> control_pb2.ResumeResponse:
        return control_pb2.ResumeResponse(state=self._do(self.control.request_resume, context))

    def Stop(self, request: Any, context: grpc.ServicerContext) -> control_pb2.StopResponse:
        state = self._do(self.control.request_stop, context)
        log.warning("stop requested over the control API")
        return control_pb2.StopResponse(state=state)

    @staticmethod
    def _do(action: Callable[[], State], context: grpc.ServicerContext) -> control_pb2.JobState:
        try:
            return action().value
        except Rejected as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
            raise  # unreachable: abort raises


class ControlServer:
    """Control + grpc.health.v1 + reflection on one address.

    Every call but a health Check needs one of ``tokens`` (``AuthInterceptor``); streams
    are bounded (``MAX_STREAMS``) and unary calls keep ``UNARY_THREADS`` threads of their
    own, so open ``psctl watch`` streams never lock out `psctl status` or `stop`. With
    ``security.tls_cert`` the port speaks TLS only.
    """

    def __init__(
        self,
        control: JobControl | None,
        address: str,
        *,
        servicer: control_pb2_grpc.ControlServicer | None = None,
        tokens: Tokens | None = None,
        security: ControlSecurity | None = None,
        max_streams: int = MAX_STREAMS,
    ) -> None:
        """Serve ``servicer`` (default: ``ControlServicer(control)``, and ``control``'s task
        health is polled while the server runs) on ``address``: HOST:PORT, or
        ``unix:PATH`` for a launcher's private socket (see control/front.py)."""
        if servicer is None:
            if control is None:
                raise ValueError("ControlServer needs a JobControl or a servicer")
            servicer = ControlServicer(control)
        self.security = security or ControlSecurity()
        self.tokens = tokens or Tokens.generate()
        self.auth = AuthInterceptor(self.tokens, max_streams=max_streams)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=max_streams + UNARY_THREADS, thread_name_prefix="control"
            ),
            interceptors=[self.auth],
            options=[("grpc.so_reuseport", 0)],
        )
        add_control_servicer(servicer, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (
            control_pb2.DESCRIPTOR.services_by_name["Control"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, self.server)
        if is_private_socket(address):
            bind, host = address, ""
        else:
            host, port = split_host_port(address, field="--control-address", allow_port_zero=True)
            bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        credentials = self.security.server_credentials()
        try:
            if credentials is None:
                bound = self.server.add_insecure_port(bind)
            else:
                bound = self.server.add_secure_port(bind, credentials)
        except RuntimeError:
            bound = 0
        if not bound:
            raise ConfigError(
                "--control-address",
                f"cannot listen on {address} (in use?)",
                "stop what holds it or pass another --control-address",
            )
        self.address = address if not host else f"{host}:{bound}"
        self.published: PublishedTokens | None = None  # start_control_server's token files
        self._stop_polling = threading.Event()
        self._control = control

    def start(self) -> None:
        self.server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set("psctl.control.v1.Control", health_pb2.HealthCheckResponse.SERVING)
        if self._control is not None:
            threading.Thread(
                target=self._control.poll_health_forever,
                args=(self._stop_polling,),
                name="task-health",
                daemon=True,
            ).start()
        # A training process behind its launcher's front: not the operator's address.
        log.log(
            logging.DEBUG if is_private_socket(self.address) else logging.INFO,
            "control API on %s (pid %d, %s)",
            self.address,
            os.getpid(),
            "TLS" if self.security.tls_cert else "plaintext",
        )

    def stop(self, grace: float = 1.0) -> None:
        self._stop_polling.set()
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait(grace + 1.0)


def start_control_server(
    control: JobControl, address: str, security: ControlSecurity
) -> ControlServer:
    """The one way a training process serves the Control API: check the flags (off
    loopback: TLS and a token file, or --insecure-control; exit 78), read or make the
    tokens, publish them for this user when the launcher has not (a bare ``train --once``),
    listen and start. ``server.published`` (or None) is removed by ``stop_control_server``.
    """
    if is_private_socket(address):  # behind the launcher's front: it holds TLS
        security = security.for_private_socket()
    security.check_server(address)
    tokens = security.server_tokens()
    server = ControlServer(control, address, tokens=tokens, security=security)
    server.published = None if security.token_file else PublishedTokens(server.address, tokens)
    server.start()
    return server


def stop_control_server(server: ControlServer, grace: float = 1.0) -> None:
    server.stop(grace)
    if server.published is not None:
        server.published.remove()
