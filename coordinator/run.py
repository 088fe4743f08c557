"""`psctl train`: resolve the cluster and settings, wait for the servers, run the Trainer."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from typing import Any

from cluster import ports
from cluster.errors import EXIT_UNAVAILABLE, ConfigError
from cluster.spec import (
    ClusterConfig,
    TaskConfig,
    load_cluster_file,
    parse_tf_config,
    require_chief,
    split_host_port,
)
from coordinator.settings import resolve_settings

log = logging.getLogger("psctl.train")


def resolve_chief_cluster(cluster_file: str | None) -> tuple[ClusterConfig, str]:
    """The cluster this coordinator drives, and where it came from."""
    if cluster_file:
        cluster = load_cluster_file(cluster_file)
        require_chief(cluster, source=cluster_file)
        return cluster, cluster_file
    text = os.environ.get("TF_CONFIG", "").strip()
    if not text:
        raise ConfigError("TF_CONFIG", "is not set", "set TF_CONFIG or pass --cluster FILE")
    task: TaskConfig = parse_tf_config(text)
    if task.task_type != "chief":
        raise ConfigError(
            "TF_CONFIG.task.type",
            f"is {task.task_type!r}; the coordinator runs as the chief task",
            'set task.type to "chief" for the coordinator',
        )
    return task.cluster, "TF_CONFIG"


def wait_for_tf_ports(cluster: ClusterConfig, *, timeout: float) -> None:
    """Bounded wait until every ps and worker accepts TCP connections on its TF port."""
    deadline = time.monotonic() + timeout
    pending = [(t, i, a) for t, i, a in cluster.tasks() if t in ("ps", "worker")]
    announced = False
    while pending:
        still = []
        for task_type, index, address in pending:
            host, port = split_host_port(address, field=f"cluster.{task_type}[{index}]")
            try:
                with socket.create_connection((host, port), timeout=1.0):
                    pass
            except OSError:
                still.append((task_type, index, address))
        pending = still
        if not pending:
            return
        if time.monotonic() >= deadline:
            names = ", ".join(f"{t}:{i} ({a})" for t, i, a in pending)
            raise Unreachable(f"servers not reachable after {timeout:.0f}s: {names}")
        if not announced:
            log.info("waiting for %d server(s) to listen...", len(pending))
            announced = True
        time.sleep(0.5)


class Unreachable(Exception):
    exit_status = EXIT_UNAVAILABLE


def train_main(args: argparse.Namespace, flags: dict[str, Any]) -> int:
    cluster, source = resolve_chief_cluster(args.cluster)
    settings = resolve_settings(flags=flags, config_file=args.config)
    chief = require_chief(cluster, source=source)
    _, chief_port = split_host_port(chief, field="cluster.chief[0]")
    # TensorFlow binds the chief's port when it connects to the cluster.
    ports.check_port_free(chief_port, field="cluster.chief[0] port")
    try:
        wait_for_tf_ports(cluster, timeout=args.connect_timeout)
    except Unreachable as err:
        print(f"psctl: error: {err}", file=sys.stderr)
        return err.exit_status

    from coordinator.job import load_job

    job = load_job(settings.job)
    from coordinator.trainer import Trainer, print_summary, write_summary

    log.info(
        "job %s on %d ps + %d workers (%s), %d steps, batch %d/worker, %d steps/call",
        settings.job,
        cluster.num_ps,
        cluster.num_workers,
        source,
        settings.steps,
        settings.batch_size,
        settings.steps_per_execution,
    )
    trainer = Trainer(job=job, cluster=cluster, settings=settings)
    summary = trainer.run()
    print_summary(summary)
    if settings.summary_json:
        write_summary(summary, settings.summary_json)
        log.info("summary written to %s", settings.summary_json)
    return 0
