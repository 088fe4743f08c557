"""grpc.health.v1 for psctl servers: the service side and a bounded client check."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from psctl.cluster import netns

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# A server still starting answers UNKNOWN, one stopping (its drain) NOT_SERVING: a worker
# restarted so fast that no health poll saw it unreachable must not read as one leaving.
UNKNOWN = health_pb2.HealthCheckResponse.UNKNOWN

# gRPC enables SO_REUSEPORT by default: a second server on a taken port would bind silently.
_SERVER_OPTIONS = [("grpc.so_reuseport", 0)]
# Health over TLS: the servers' certificate and key (also --health-tls-cert/--health-tls-key),
# and the CA every health client (the coordinator, psctl health, psctl deploy check) checks
# it with. Kubernetes' grpc probes cannot speak TLS: leave these unset there.
TLS_CERT_ENV, TLS_KEY_ENV = "PSCTL_HEALTH_TLS_CERT", "PSCTL_HEALTH_TLS_KEY"
TLS_CA_ENV = "PSCTL_HEALTH_TLS_CA"
TASK_TYPES = ("ps", "worker")
# Trailing metadata of every answer: which server process answered (its pid and start
# time). A server restarted between two checks of the coordinator answers SERVING both
# times; the new value tells a restart from a server that never stopped.
INSTANCE_KEY = "psctl-instance"


def task_service(task_type: str) -> str:
    """The health service a psctl server of ``task_type`` answers besides the overall one
    (with the same status), so that a client can tell a ps from a worker at an address.
    By type only: a resize may give a running server another index."""
    return f"psctl.task.{task_type}"


class HealthService:
    """A grpc health server whose overall status is UNKNOWN while the server starts,
    SERVING once it serves and NOT_SERVING while it stops."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        max_workers: int = 4,
        tls_cert: str = "",
        tls_key: str = "",
        task_type: str = "",
        enter_job_netns: bool = False,
    ) -> None:
        """``enter_job_netns``: once the port is bound here, the process joins the job's
        network namespace (``netns.enter``), if it has one, and listens on the same port
        there too, for the training process's health checks. Call it after every other
        side port is open: TensorFlow comes after."""
        self._services = ["", task_service(task_type)] if task_type else [""]
        self._servicer = _TaggedHealthServicer(f"{os.getpid()}-{time.time_ns()}")
        for service in self._services:
            self._servicer.set(service, UNKNOWN)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers), options=_SERVER_OPTIONS
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, self._server)
        bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        creds = None
        if tls_cert and tls_key:
            creds = grpc.ssl_server_credentials(
                [(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())]
            )
        self.port = self._listen(bind, creds)
        if enter_job_netns and netns.enter():
            # gRPC binds when a port is added: this one is the job namespace's.
            self._listen(f"127.0.0.1:{self.port}", creds)
        self._server.start()

    def _listen(self, bind: str, creds: grpc.ServerCredentials | None) -> int:
        if creds is not None:
            return self._server.add_secure_port(bind, creds)
        return self._server.add_insecure_port(bind)

    def set_serving(self, serving: bool) -> None:
        for service in self._services:
            self._servicer.set(service, SERVING if serving else NOT_SERVING)

    def stop(self, grace: float = 0.5) -> None:
        self._servicer.enter_graceful_shutdown()
        self._server.stop(grace).wait(grace + 1.0)


class _TaggedHealthServicer(health.HealthServicer):
    """grpc's health servicer, its Check answers tagged with this process (INSTANCE_KEY)."""

    def __init__(self, instance: str) -> None:
        super().__init__()
        self._tag = ((INSTANCE_KEY, instance),)

    def Check(self, request: object, context: grpc.ServicerContext) -> object:
        context.set_trailing_metadata(self._tag)
        return super().Check(request, context)


@dataclass(frozen=True)
class HealthResult:
    address: str
    status: str  # SERVING, NOT_SERVING, UNKNOWN, SERVICE_UNKNOWN or UNREACHABLE
    detail: str = ""
    instance: str = ""  # the answering server process (INSTANCE_KEY); "" if none said

    @property
    def serving(self) -> bool:
        return self.status == "SERVING"


def check(address: str, *, timeout: float = 2.0) -> HealthResult:
    """One Check RPC with a deadline; never raises for an unreachable server. Over TLS when
    ``$PSCTL_HEALTH_TLS_CA`` names the CA of the servers' health certificates."""
    with _channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as err:
            code = err.code() if isinstance(err, grpc.Call) else None
            detail = err.details() if isinstance(err, grpc.Call) else str(err)
            return HealthResult(address, "UNREACHABLE", f"{code.name if code else ''} {detail}")
    return HealthResult(address, health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def served_task_types(addresses: Sequence[str], *, timeout: float = 1.0) -> dict[str, str | None]:
    """The task type each psctl server at ``addresses`` (health addresses) says it serves,
    all asked at once; None where none answers: unreachable, not a psctl server, or one from
    before servers named their type. Never raises."""

    def ask(address: str) -> str | None:
        with _channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for task_type in TASK_TYPES:
                request = health_pb2.HealthCheckRequest(service=task_service(task_type))
                try:
                    stub.Check(request, timeout=timeout)
                except grpc.RpcError as err:
                    if isinstance(err, grpc.Call) and err.code() == grpc.StatusCode.NOT_FOUND:
                        continue  # another type's server, or one that names none
                    return None
                return task_type
        return None

    wanted = list(dict.fromkeys(addresses))
    if not wanted:
        return {}
    with futures.ThreadPoolExecutor(max_workers=min(16, len(wanted))) as pool:
        return dict(zip(wanted, pool.map(ask, wanted), strict=True))


def _channel(address: str, options: Sequence[tuple[str, int]] | None = None) -> grpc.Channel:
    ca = os.environ.get(TLS_CA_ENV, "")
    if not ca:
        return grpc.insecure_channel(address, options=options)
    creds = grpc.ssl_channel_credentials(root_certificates=Path(ca).read_bytes())
    return grpc.secure_channel(address, creds, options=options)


# A kept channel to a server that restarts reconnects on gRPC's backoff, 1 s growing to 120 s
# by default: a server back after a minute would read UNREACHABLE for up to two more.
_KEPT_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class HealthChecker:
    """Checks many servers at once, over channels kept between rounds: one round costs at
    most ``timeout`` seconds however many servers there are, and no channel set-up (a new
    channel per check costs about 2 ms of CPU more than a kept one, measured here: 128 tasks
    every 2 s would take a fifth of a core). Thread-safe; ``close()`` when done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stubs: dict[str, tuple[grpc.Channel, health_pb2_grpc.HealthStub]] = {}

    def check_all(self, addresses: Sequence[str], *, timeout: float) -> dict[str, HealthResult]:
        """One Check RPC to each address, all in flight together; never raises."""
        wanted = list(dict.fromkeys(addresses))
        with self._lock:
            for address in set(self._stubs) - set(wanted):  # out of the cluster now
                self._stubs.pop(address)[0].close()
            calls = {}
            for address in wanted:
                if address not in self._stubs:
                    channel = _channel(address, _KEPT_CHANNEL_OPTIONS)
                    self._stubs[address] = (channel, health_pb2_grpc.HealthStub(channel))
                request = health_pb2.HealthCheckRequest(service="")
                calls[address] = self._stubs[address][1].Check.future(request, timeout=timeout)
        results = {}
        for address, call in calls.items():
            try:
                resp = call.result()
            except grpc.RpcError as err:
                code = err.code() if isinstance(err, grpc.Call) else None
                detail = err.details() if isinstance(err, grpc.Call) else str(err)
                status = f"{code.name if code else ''} {detail}"
                results[address] = HealthResult(address, "UNREACHABLE", status)
                continue
            name = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
            results[address] = HealthResult(address, name, instance=_instance(call))
        return results

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._stubs.values():
                channel.close()
            self._stubs.clear()


def _instance(call: grpc.Call) -> str:
    for key, value in call.trailing_metadata() or ():
        if key == INSTANCE_KEY:
            return str(value)
    return ""


def wait_serving(address: str, *, timeout: float, poll: float = 0.2) -> HealthResult:
    """Poll until SERVING or ``timeout`` seconds pass; returns the last result."""
    deadline = time.monotonic() + timeout
    while True:
        result = check(address, timeout=min(2.0, max(0.1, deadline - time.monotonic())))
        if result.serving or time.monotonic() >= deadline:
            return result
        time.sleep(poll)
