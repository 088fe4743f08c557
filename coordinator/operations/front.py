"""The job's control address, served by its launcher while training processes come and go.

A launcher (`psctl local`, the `psctl train` supervisor, worker 0's supervisor in sync mode)
outlives every training process it starts, so it holds the job's public control address:
its tokens, its TLS, its stream bound (``ControlServer``). Each training process serves the
Control API only on a Unix socket in the launcher's private directory (mode 0700), and the
front forwards to it:

- GetStatus asks the training process (deadline ``FORWARD_SECONDS``); while none answers
  (it is restarting, or not up yet) the front answers for it: the last status it saw, as
  RECOVERING (or STARTING before the first), so dashboards and `psctl status` never see a
  closed port during a restart.
- WatchStatus streams are served from one poller (``POLL_SECONDS``): however many are
  open, the training process answers one caller.
- Checkpoint, Pause and Resume are forwarded; with no training process to take them they
  are FAILED_PRECONDITION ("restarting; try again").
- Stop is forwarded, and the launcher is told not to start another training process
  (``on_stop(True)``); with none answering the launcher stops as on SIGTERM
  (``on_stop(False)``).

No TensorFlow here: the launcher never imports it.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from psctl.cluster.errors import ConfigError
from psctl.control.v1 import control_pb2, control_pb2_grpc
from psctl.coordinator.operations.security import (
    ControlSecurity,
    Tokens,
    bearer,
    publish_for_launch,
)
from psctl.coordinator.operations.service import ControlServer, stream_status
from psctl.coordinator.operations.state import FINAL_STATES, State
from psctl.coordinator.operations.stubs import control_stub

log = logging.getLogger(__name__)

POLL_SECONDS = 0.25  # how fresh the streams' statuses are
FORWARD_SECONDS = 2.0  # a forwarded GetStatus, Pause, Resume or Stop
CHECKPOINT_SECONDS = 300.0  # a forwarded Checkpoint without the caller's deadline
# Reconnect at once when a new training process listens (gRPC's default backoff grows to
# two minutes, which would show RECOVERING long after it is back).
RECONNECT_SECONDS = 0.5
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", int(RECONNECT_SECONDS * 1000)),
]
_FINAL = frozenset(s.value for s in FINAL_STATES)


class Refused(Exception):
    """A request the launcher cannot take now (a resize while one is under way, or while no
    training process runs): one line, to retry later."""


class FrontServicer(control_pb2_grpc.ControlServicer):
    """The Control service of the launcher: forwards to the training process on
    ``backend`` (with the job's control ``token``), answers for it while it is away."""

    def __init__(self, backend: str, token: str, *, job: str = "") -> None:
        self.backend = backend
        self.job = job  # shown before the first training process answers
        self._channel = grpc.insecure_channel(backend, options=_CHANNEL_OPTIONS)
        self._stub = control_stub(self._channel)
        self._metadata = bearer(token)
        # Set by the launcher once its supervisor exists (``ControlFront.on_stop``).
        self.on_stop: Callable[[bool], None] = lambda forwarded: None
        # Set by a launcher that can resize its cluster (launch/resize.py): the request in,
        # the answer out; a ConfigError is the operator's to fix (INVALID_ARGUMENT), a
        # Refused one to retry later (FAILED_PRECONDITION).
        # (request, seconds until the caller's deadline or None) -> the response.
        self.on_scale: Callable[[Any, float | None], control_pb2.ScaleResponse] | None = None
        # The launcher's view of the cluster, added to every status it answers (a resize's
        # tasks joining and draining, the tasks that left; launch/resize.py Membership).
        self.membership: Callable[[control_pb2.Status], None] | None = None
        self._lock = threading.Lock()
        self._last: control_pb2.Status | None = None  # what the training process said last
        self._last_seen = 0.0
        self._answering = False

    def close(self) -> None:
        self._channel.close()

    # -- what the training process says, or the front's stand-in -------------------------

    def refresh(self, timeout: float = FORWARD_SECONDS) -> control_pb2.Status:
        """Ask the training process; on no answer, the stand-in (``current``)."""
        request = control_pb2.GetStatusRequest()
        try:
            status = self._stub.GetStatus(request, timeout=timeout, metadata=self._metadata)
        except ValueError:  # the channel is closed: the launcher is stopping
            return self.current()
        except grpc.RpcError as err:
            # DEADLINE_EXCEEDED on a fail-fast call: it was connected, the process is busy.
            # UNAVAILABLE: not connected: gone, or a new process the channel has not dialled
            # yet (reconnect backoff, at most RECONNECT_SECONDS): wait for that once.
            if err.code() is not grpc.StatusCode.UNAVAILABLE:
                return self.current()
            try:
                status = self._stub.GetStatus(
                    request,
                    timeout=min(timeout, RECONNECT_SECONDS),
                    metadata=self._metadata,
                    wait_for_ready=True,
                )
            except (grpc.RpcError, ValueError):
                with self._lock:
                    self._answering = False
                return self.current()
        with self._lock:
            self._last, self._last_seen, self._answering = status, time.monotonic(), True
        return status

    def current(self) -> control_pb2.Status:
        """The last status, or while no training process answers, the front's own."""
        with self._lock:
            last, seen, answering = self._last, self._last_seen, self._answering
        if last is None:
            return control_pb2.Status(
                job=self.job,
                state=State.STARTING.value,
                loss=float("nan"),
                message="starting the training process",
            )
        status = control_pb2.Status()
        status.CopyFrom(last)
        if answering or last.state in _FINAL:
            return status
        status.state = State.RECOVERING.value
        status.steps_per_second = status.examples_per_second = 0.0
        for task in status.tasks:  # not known here: the training process checks them
            task.health = (
                control_pb2.TASK_HEALTH_UNREACHABLE
                if task.type == "chief"
                else control_pb2.TASK_HEALTH_UNKNOWN
            )
        status.message = (
            f"the training process is restarting (last seen "
            f"{control_pb2.JobState.Name(last.state).removeprefix('JOB_STATE_')} at step "
            f"{last.global_step}, {time.monotonic() - seen:.0f}s ago)"
        )
        return status

    def poll_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.refresh(timeout=min(FORWARD_SECONDS, 1.0))
            stop.wait(POLL_SECONDS)

    # -- the RPCs ----------------------------------------------------------------------------

    def GetStatus(self, request: Any, context: grpc.ServicerContext) -> control_pb2.Status:
        return self._shown(self.refresh(timeout=_timeout(context, FORWARD_SECONDS)))

    def WatchStatus(
        self, request: Any, context: grpc.ServicerContext
    ) -> Iterator[control_pb2.Status]:
        return stream_status(lambda: self._shown(self.current()), request, context)

    def _shown(self, status: control_pb2.Status) -> control_pb2.Status:
        """``status`` with the launcher's view of the cluster (``membership``), a copy."""
        if self.membership is None:
            return status
        shown = control_pb2.Status()
        shown.CopyFrom(status)
        self.membership(shown)
        return shown

    def Checkpoint(
        self, request: Any, context: grpc.ServicerContext
    ) -> control_pb2.CheckpointResponse:
        response: control_pb2.CheckpointResponse = self._forward(
            "Checkpoint", request, context, CHECKPOINT_SECONDS
        )
        return response

    def Pause(self, request: Any, context: grpc.ServicerContext) -> control_pb2.PauseResponse:
        response: control_pb2.PauseResponse = self._forward("Pause", request, context)
        return response

    def Resume(self, request: Any, context: grpc.ServicerContext) -> control_pb2.ResumeResponse:
        response: control_pb2.ResumeResponse = self._forward("Resume", request, context)
        return response

    def Stop(self, request: Any, context: grpc.ServicerContext) -> control_pb2.StopResponse:
        try:
            response: control_pb2.StopResponse = self._call(
                "Stop", request, context, FORWARD_SECONDS
            )
        except grpc.RpcError as err:
            if err.code() is grpc.StatusCode.FAILED_PRECONDITION:  # already DONE or FAILED
                context.abort(err.code(), err.details() or "")
            log.warning("stop requested over the control API while the training process is away")
            self.on_stop(False)
            return control_pb2.StopResponse(state=self.current().state)
        log.warning("stop requested over the control API")
        self.on_stop(True)
        return response

    def Scale(self, request: Any, context: grpc.ServicerContext) -> control_pb2.ScaleResponse:
        if self.on_scale is None:
            context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                "this launcher does not resize its cluster (psctl local and psctl train "
                "--cluster FILE in the parameter-server mode do, once training has started)",
            )
        try:
            return self.on_scale(request, context.time_remaining())  # type: ignore[misc]
        except ConfigError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except Refused as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        raise AssertionError("unreachable: abort raises")

    def _call(
        self, method: str, request: Any, context: grpc.ServicerContext, default: float
    ) -> Any:
        call = getattr(self._stub, method)
        try:
            return call(request, timeout=_timeout(context, default), metadata=self._metadata)
        except ValueError:  # the channel is closed: the launcher is stopping
            context.abort(grpc.StatusCode.UNAVAILABLE, "the job is ending")
            raise  # unreachable: abort raises

    def _forward(
        self,
        method: str,
        request: Any,
        context: grpc.ServicerContext,
        default: float = FORWARD_SECONDS,
    ) -> Any:
        try:
            return self._call(method, request, context, default)
        except grpc.RpcError as err:
            code = err.code()
            if code is grpc.StatusCode.UNAVAILABLE:
                state = control_pb2.JobState.Name(self.current().state).removeprefix("JOB_STATE_")
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"cannot {method.lower()} while {state}: the training process is "
                    "restarting; try again when psctl status says RUNNING",
                )
            context.abort(code, err.details() or "")
            raise  # unreachable: abort raises


def _timeout(context: grpc.ServicerContext, default: float) -> float:
    remaining = context.time_remaining()
    return default if remaining is None else max(0.05, min(default, remaining))


def _private_dir() -> Path:
    """A new directory, mode 0700, whose socket path fits a Unix socket's 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="psctl-control-"))
    if len(str(path / "control.sock")) < 100:
        return path
    path.rmdir()  # a long $TMPDIR
    return Path(tempfile.mkdtemp(prefix="psctl-control-", dir="/tmp"))


class ControlFront:
    """The job's control server in the launcher; ``backend_address`` is what each training
    process is given as its ``--control-address`` (a Unix socket in a private directory).

    ``security`` and ``tokens`` are the job's (``publish_for_launch``). ``on_stop(forwarded)``
    is called on every Stop (the launcher sets it to its supervisor's ``control_stop``):
    start no other training process, and when none took the request, stop as on SIGTERM.
    """

    def __init__(
        self, address: str, security: ControlSecurity, tokens: Tokens, *, job: str = ""
    ) -> None:
        self._dir = _private_dir()
        self.backend_address = f"unix:{self._dir / 'control.sock'}"
        self.servicer = FrontServicer(self.backend_address, tokens.control, job=job)
        try:
            self.server = ControlServer(
                None, address, servicer=self.servicer, tokens=tokens, security=security
            )
        except BaseException:
            self.servicer.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self.address = self.server.address
        self._stop_polling = threading.Event()
        self._poller = threading.Thread(
            target=self.servicer.poll_forever,
            args=(self._stop_polling,),
            name="control-front-poll",
            daemon=True,
        )

    @property
    def on_scale(self) -> Callable[[Any, float | None], control_pb2.ScaleResponse] | None:
        return self.servicer.on_scale

    @on_scale.setter
    def on_scale(
        self, callback: Callable[[Any, float | None], control_pb2.ScaleResponse] | None
    ) -> None:
        self.servicer.on_scale = callback

    @property
    def membership(self) -> Callable[[control_pb2.Status], None] | None:
        return self.servicer.membership

    @membership.setter
    def membership(self, callback: Callable[[control_pb2.Status], None] | None) -> None:
        self.servicer.membership = callback

    @property
    def on_stop(self) -> Callable[[bool], None]:
        return self.servicer.on_stop

    @on_stop.setter
    def on_stop(self, callback: Callable[[bool], None]) -> None:
        self.servicer.on_stop = callback

    def start(self) -> ControlFront:
        self.server.start()
        self._poller.start()
        return self

    def stop(self, grace: float = 1.0) -> None:
        self._stop_polling.set()
        if self._poller.is_alive():
            self._poller.join(timeout=FORWARD_SECONDS + RECONNECT_SECONDS + 1.0)
        self.server.stop(grace)
        self.servicer.close()
        shutil.rmtree(self._dir, ignore_errors=True)


@contextlib.contextmanager
def launch_control(
    address: str, security: ControlSecurity, *, job: str = ""
) -> Iterator[tuple[ControlFront, ControlSecurity]]:
    """For a launcher: check the control flags, publish the job's tokens for this user and
    serve the front on ``address`` until the block ends. Yields the front and the security
    settings its training processes get (the token files; they listen on
    ``front.backend_address``), so that every restarted process keeps the same tokens."""
    security.check_server(address)
    front = ControlFront(address, security, security.server_tokens(), job=job)  # binds
    try:
        published, child = publish_for_launch(address, security, front.server.tokens)
        try:
            yield front.start(), child
        finally:
            published.remove()
    finally:
        front.stop()
