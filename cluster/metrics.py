"""Prometheus metrics every psctl process exports: identity, build, uptime, health.

Each process builds its own CollectorRegistry and passes it in, so tests never share state.
"""

from __future__ import annotations

import platform
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from importlib import metadata

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    Info,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric

HEALTH_STATES = ["starting", "serving", "not_serving"]


def psctl_version() -> str:
    try:
        return metadata.version("psctl")
    except metadata.PackageNotFoundError:
        return "unknown"


class StateGauge:
    """A gauge per state under one ``state`` label: 1 for the current state, 0 for the others.

    prometheus_client's ``Enum`` names its label after the metric
    (``psctl_health_state{psctl_health_state="serving"}``); this one uses the conventional
    ``state`` (as kube-state-metrics does). The states are fixed up front, and one scrape
    always sees exactly one of them at 1.
    """

    def __init__(
        self, name: str, documentation: str, *, states: Sequence[str], registry: CollectorRegistry
    ) -> None:
        if not states:
            raise ValueError(f"states: {name} needs at least one state")
        self.name, self.documentation = name, documentation
        self.states = list(states)
        self._lock = threading.Lock()
        self._current = self.states[0]
        registry.register(self)

    def state(self, state: str) -> None:
        if state not in self.states:
            raise ValueError(f"unknown {self.name} state {state!r}; one of {self.states}")
        with self._lock:
            self._current = state

    @property
    def current(self) -> str:
        with self._lock:
            return self._current

    def describe(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(self.name, self.documentation, labels=["state"])

    def collect(self) -> Iterator[Metric]:
        current = self.current
        family = GaugeMetricFamily(self.name, self.documentation, labels=["state"])
        for state in self.states:
            family.add_metric([state], 1.0 if state == current else 0.0)
        yield family


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
        self.health = StateGauge(
            "psctl_health_state",
            "Health state this process reports on grpc.health.v1 (1 for the current state).",
            states=HEALTH_STATES,
            registry=registry,
        )


# /metrics over HTTPS: a PEM certificate and key for every process's /metrics (servers also
# take them as --metrics-tls-cert/--metrics-tls-key).
TLS_CERT_ENV, TLS_KEY_ENV = "PSCTL_METRICS_TLS_CERT", "PSCTL_METRICS_TLS_KEY"


def serve_metrics(
    registry: CollectorRegistry,
    *,
    host: str,
    port: int,
    certfile: str | None = None,
    keyfile: str | None = None,
) -> None:
    """Serve /metrics from a daemon thread; HTTPS when ``certfile`` and ``keyfile`` are
    given (else plain HTTP)."""
    if bool(certfile) != bool(keyfile):
        from psctl.cluster.errors import ConfigError

        raise ConfigError(
            "--metrics-tls-cert/--metrics-tls-key",
            "only one is given",
            f"give both (or {TLS_CERT_ENV} and {TLS_KEY_ENV})",
        )
    start_http_server(
        port, addr=host, registry=registry, certfile=certfile or None, keyfile=keyfile or None
    )
