"""The coordinator's Control service (psctl.control.v1.Control over gRPC): translates the
job's state (job_state.py) to the protos and the operators' calls into its requests; never
touches TensorFlow. Serves grpc.health.v1 and reflection beside it, and runs the task
health checks (health_poll.py) while it serves.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from functools import partial
from typing import Any, cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from psctl.cluster import ports
from psctl.cluster.address import split_host_port
from psctl.cluster.errors import ConfigError
from psctl.cluster.tunnel_state import read_state
from psctl.control.v1 import control_pb2, control_pb2_grpc
from psctl.coordinator.operations.health_poll import poll_health_forever
from psctl.coordinator.operations.job_state import Board, JobControl, Rejected
from psctl.coordinator.operations.security import (
    MAX_STREAMS,
    UNARY_THREADS,
    AuthInterceptor,
    ControlSecurity,
    PublishedTokens,
    Tokens,
    is_private_socket,
)
from psctl.coordinator.operations.state import FINAL_STATES, State
from psctl.coordinator.operations.stubs import add_control_servicer
from psctl.coordinator.operations.task_book import SERVING, UNKNOWN

__all__ = [
    "ControlServer",
    "ControlServicer",
    "start_control_server",
    "status_proto",
    "stop_control_server",
    "stream_status",
]

log = logging.getLogger(__name__)

WATCH_MIN_INTERVAL, WATCH_MAX_INTERVAL = 0.1, 60.0


def status_proto(job: JobControl) -> control_pb2.Status:
    """GetStatus's answer: the job's view as the proto."""
    view = job.view()
    board = view.board
    status = control_pb2.Status(
        job=view.job,
        state=view.state.value,
        global_step=board.global_step,
        target_steps=view.target_steps,
        steps_per_second=board.steps_per_second,
        examples_per_second=board.examples_per_second,
        loss=board.loss,
        eval_step=board.eval_step,
        uptime_seconds=view.uptime_seconds,
        steps_per_execution=view.steps_per_execution,
        message=board.message,
        cluster_generation=view.cluster_generation,
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
    if board.fresh:
        status.freshness.CopyFrom(freshness_proto(board, time.time()))
    tunnel = tunnel_proto(os.environ.get("PSCTL_TUNNEL_ADDRESS", ""))
    if tunnel is not None:
        status.tunnel.CopyFrom(tunnel)
    for name, counts in sorted(board.tables.items()):
        status.tables.append(
            control_pb2.Table(
                name=name,
                rows=counts["rows"],
                admitted=counts["admitted"],
                evicted=counts["evicted"],
                bytes=counts["bytes"],
            )
        )
    for task in view.tasks:
        key = (task.type, task.index)
        health = view.health.get(key, UNKNOWN)
        status.tasks.append(
            control_pb2.Task(
                type=task.type,
                index=task.index,
                address=task.address,
                health=cast(
                    control_pb2.TaskHealth, control_pb2.TaskHealth.Value(f"TASK_HEALTH_{health}")
                ),
                health_address=task.health_address,
                failures=view.failures.get(key, 0),
                metrics_url=task.metrics_url,
                pid=task.pid,
                state=cast(
                    control_pb2.TaskState,
                    control_pb2.TaskState.Value(f"TASK_STATE_{view.states.get(key, SERVING)}"),
                ),
            )
        )
    return status


def freshness_proto(board: Board, now: float) -> control_pb2.Freshness:
    def age(stamp: float) -> float:
        return max(0.0, now - stamp) if stamp else 0.0

    return control_pb2.Freshness(
        files_trained=board.files_trained,
        files_waiting=board.files_waiting,
        input_lag_seconds=age(board.newest_completed),
        newest_file=board.newest_file,
        published_version=board.published_version,
        publish_age_seconds=age(board.published_time),
        export_dir=board.export_dir,
        following=board.following,
        publish_decision=board.publish_decision,
    )


def tunnel_proto(address: str) -> control_pb2.Tunnel | None:
    """This host's tunnel as its process last wrote it (``address``: psctl.env's
    PSCTL_TUNNEL_ADDRESS); None without one."""
    state = read_state(address) if address else None
    if state is None:
        return None
    try:
        return control_pb2.Tunnel(
            address=str(state["address"]),
            updated_unix_seconds=float(state["updated"]),
            peers=[
                control_pb2.TunnelPeer(address=p["address"], handshake_unix_seconds=p["handshake"])
                for p in state["peers"]
            ],
            refused=[
                control_pb2.TunnelRefusal(
                    source=r["source"], count=r["count"], last_unix_seconds=r["last"]
                )
                for r in state["refused"]
            ],
        )
    except (KeyError, TypeError, ValueError):
        return None  # not the tunnel process's file


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
        return status_proto(self.control)

    def WatchStatus(
        self, request: Any, context: grpc.ServicerContext
    ) -> Iterator[control_pb2.Status]:
        return stream_status(partial(status_proto, self.control), request, context)

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
        ``unix:PATH`` for a launcher's private socket (see operations/front.py)."""
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
            if port:  # one line and exit 1, as every port psctl needs, not gRPC's log line
                ports.check_port_free(port, host=host, field="--control-address")
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
                target=poll_health_forever,
                args=(self._control, self._stop_polling),
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
