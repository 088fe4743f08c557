"""Prometheus targets for a rendered cluster: ``OUT/prometheus.yml`` and one file_sd JSON
file per role (``OUT/prometheus-<role>.json``: every process's /metrics address with its
``task_type`` and ``task_index``), in the layout of deploy/prometheus/. Files at the top of
OUT, beside README.md: a host directory could be named like any folder."""

from __future__ import annotations

import json
from collections.abc import Sequence

from psctl.cluster.address import Address
from psctl.cluster.spec import ClusterConfig
from psctl.coordinator.deploy.plan import COORDINATOR_METRICS_PORT, HostPlan, sync_metrics_port
from psctl.coordinator.deploy.units import fill

ROLES = ("coordinator", "ps", "worker")


def target_file(role: str) -> str:
    return f"prometheus-{role}.json"


def _entry(address: Address, port: int, task_type: str, index: int) -> dict[str, object]:
    return {
        "targets": [str(address.with_port(port))],
        "labels": {"task_type": task_type, "task_index": str(index)},
    }


def _files(targets: dict[str, list[dict[str, object]]]) -> dict[str, str]:
    files = {target_file(role): json.dumps(targets[role], indent=2) + "\n" for role in ROLES}
    names = {f"{role}_targets": target_file(role) for role in ROLES}
    files["prometheus.yml"] = fill("prometheus.yml.in", **names)
    return files


def prometheus_files(cluster: ClusterConfig, plans: Sequence[HostPlan]) -> dict[str, str]:
    """The parameter-server mode: the coordinator on the chief's host, every server."""
    targets: dict[str, list[dict[str, object]]] = {role: [] for role in ROLES}
    chief = cluster.task_address("chief", 0)
    targets["coordinator"].append(_entry(chief, COORDINATOR_METRICS_PORT, "chief", 0))
    servers = sorted((s for plan in plans for s in plan.servers), key=lambda s: s.index)
    for server in servers:
        entry = _entry(server.address, server.metrics_port, server.task_type, server.index)
        targets[server.task_type].append(entry)
    return _files(targets)


def sync_prometheus_files(cluster: ClusterConfig) -> dict[str, str]:
    """The synchronous mode: worker 0 serves the coordinator's series, every other worker a
    worker task's at its TF port + 2000 (docs/sync.md)."""
    targets: dict[str, list[dict[str, object]]] = {role: [] for role in ROLES}
    for task_type, index, address in cluster.task_addresses():
        if task_type != "worker":
            continue
        port = sync_metrics_port(index, address.port)
        if index == 0:
            targets["coordinator"].append(_entry(address, port, "chief", 0))
        elif port < 65536:
            targets["worker"].append(_entry(address, port, "worker", index))
    return _files(targets)
