"""`psctl train`: resolve the cluster and settings, wait for the servers, run the Trainer."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from coordinator.control import ControlServer, JobControl, State, TaskInfo
from coordinator.settings import TrainSettings, resolve_settings

if TYPE_CHECKING:
    from coordinator.job import Job
    from coordinator.metrics import CoordinatorMetrics

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
    metrics = start_metrics(args.metrics_port, settings, cluster)
    control = JobControl(
        job=settings.job,
        target_steps=settings.steps,
        steps_per_execution=settings.steps_per_execution,
        tasks=load_tasks(args.tasks_file, cluster),
        can_checkpoint=bool(settings.checkpoint_dir),
        on_state=metrics.set_state if metrics else None,
    )
    server = ControlServer(control, args.control_address)
    server.start()
    try:
        return _train(job, cluster, source, settings, control, metrics)
    except BaseException as err:
        control.finish(State.FAILED, f"{type(err).__name__}: {err}")
        raise
    finally:
        server.stop()


def start_metrics(
    port: int, settings: TrainSettings, cluster: ClusterConfig
) -> CoordinatorMetrics | None:
    """The coordinator's /metrics (its own registry); port 0 turns it off."""
    if not port:
        return None
    from prometheus_client import CollectorRegistry

    from cluster.metrics import serve_metrics
    from coordinator.metrics import CoordinatorMetrics

    ports.check_port_free(port, field="--metrics-port")
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(
        registry=registry,
        job=settings.job,
        num_workers=cluster.num_workers,
        num_ps=cluster.num_ps,
        batch_size=settings.batch_size,
    )
    serve_metrics(registry, host=os.environ.get("PSCTL_BIND_HOST", "0.0.0.0"), port=port)
    log.info("metrics on :%d/metrics", port)
    return metrics


def _train(
    job: Job,
    cluster: ClusterConfig,
    source: str,
    settings: TrainSettings,
    control: JobControl,
    metrics: CoordinatorMetrics | None,
) -> int:
    from coordinator.trainer import Trainer, install_stop_signals, print_summary, write_summary

    install_stop_signals(control)
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
    trainer = Trainer(job=job, cluster=cluster, settings=settings, control=control, metrics=metrics)
    summary = trainer.run()
    print_summary(summary)
    if settings.summary_json:
        write_summary(summary, settings.summary_json)
        log.info("summary written to %s", settings.summary_json)
    control.finish(State.DONE)
    return 0


def load_tasks(tasks_file: str | None, cluster: ClusterConfig) -> list[TaskInfo]:
    """The tasks GetStatus reports: from psctl local's tasks file (with pids), or else from
    the cluster with the default side ports."""
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
    tasks = []
    for task_type, index, address in cluster.tasks():
        host, port = split_host_port(address, field=f"cluster.{task_type}[{index}]")
        health_address = metrics_url = ""
        if task_type in ("ps", "worker"):
            health_port = port + ports.HEALTH_PORT_OFFSET
            metrics_port = port + ports.METRICS_PORT_OFFSET
            if health_port < 65536:
                health_address = f"{host}:{health_port}"
            if metrics_port < 65536:
                metrics_url = f"http://{host}:{metrics_port}/metrics"
        pid = os.getpid() if task_type == "chief" else 0
        tasks.append(TaskInfo(task_type, index, address, health_address, metrics_url, pid))
    return tasks
