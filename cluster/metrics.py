"""Prometheus metrics every psctl process exports: identity, build, uptime, health.

Each process builds its own CollectorRegistry and passes it in, so tests never share state.
"""

from __future__ import annotations

import platform
import time
from importlib import metadata

from prometheus_client import (
    CollectorRegistry,
    Enum,
    Gauge,
    Info,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

HEALTH_STATES = ["starting", "serving", "not_serving"]


def psctl_version() -> str:
    try:
        return metadata.version("psctl")
    except metadata.PackageNotFoundError:
        return "unknown"


class ProcessMetrics:
    """The series every psctl process has, whatever its role."""

    def __init__(self, *, registry: CollectorRegistry, task_type: str, task_index: int) -> None:
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        self.registry = registry
        Info("psctl_build", "psctl build information.", registry=registry).info(
            {"version": psctl_version(), "python": platform.python_version()}
        )
        task_info = Gauge(
            "psctl_task_info",
            "Always 1; labels name this process's task in the cluster.",
            ["task_type", "task_index"],
            registry=registry,
        )
        task_info.labels(task_type, str(task_index)).set(1)
        started = time.time()
        Gauge("psctl_start_time_seconds", "Unix time this process started.", registry=registry).set(
            started
        )
        Gauge(
            "psctl_uptime_seconds", "Seconds since this process started.", registry=registry
        ).set_function(lambda: time.time() - started)
        self.health = Enum(
            "psctl_health_state",
            "Health state this server reports on grpc.health.v1.",
            states=HEALTH_STATES,
            registry=registry,
        )
        self.health.state("starting")


def serve_metrics(registry: CollectorRegistry, *, host: str, port: int) -> None:
    """Serve /metrics from a daemon thread."""
    start_http_server(port, addr=host, registry=registry)
