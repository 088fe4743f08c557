"""`psctl train`: resolve the cluster and settings, wait for the servers, run the Trainer."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from psctl.cluster import netns, ports
from psctl.cluster.dataservice import dispatcher_address, require_dispatcher
from psctl.cluster.errors import ConfigError
from psctl.cluster.health import TASK_TYPES, served_task_types
from psctl.cluster.processes.logs import import_tensorflow_quietly
from psctl.cluster.processes.signals import EarlyStops
from psctl.cluster.spec import ClusterConfig, require_chief
from psctl.cluster.tf_config import resolve_training_task
from psctl.coordinator.failures import (
    FailurePolicy,
    Scope,
    Unreachable,
    classify,
    exit_status,
)
from psctl.coordinator.launch.assembly import supervise_train
from psctl.coordinator.launch.process import (
    handed_counters,
    load_tasks,
    run_training_process,
)
from psctl.coordinator.operations.job_state import JobControl
from psctl.coordinator.operations.task_book import TaskInfo
from psctl.coordinator.settings import (
    DEFAULT_METRICS_PORT,
    TrainSettings,
    show_steps_per_execution,
)
from psctl.coordinator.training.reporting.summary import Summary
from psctl.coordinator.training.saving.checkpoint_files import check_output_dirs

if TYPE_CHECKING:
    from psctl.coordinator.job import Job
    from psctl.coordinator.operations.metrics import CoordinatorMetrics

log = logging.getLogger("psctl.train")
_KEEP_ALIVE: list[object] = []


def resolve_chief_cluster(cluster_file: str | None) -> tuple[ClusterConfig, str]:
    """The cluster this coordinator drives, and where it came from."""
    cluster, _, source = resolve_training_task(
        role="chief", cluster_file=cluster_file, task_index=None, environ=os.environ
    )
    return cluster, source


def wait_for_tf_ports(
    cluster: ClusterConfig, *, timeout: float, tick: Callable[[], None] = lambda: None
) -> None:
    """Bounded wait until every ps and worker accepts TCP connections on its TF port;
    ``Unreachable`` (the job ends with exit 69) after ``timeout`` seconds. ``tick()`` between
    two looks (a stop ends the wait there)."""
    started = time.monotonic()
    deadline = started + timeout
    pending = [(t, i, a) for t, i, a in cluster.task_addresses() if t in ("ps", "worker")]
    announced = False
    while pending:
        still = []
        for task_type, index, address in pending:
            try:
                with socket.create_connection((address.host, address.port), timeout=1.0):
                    pass
            except OSError:
                still.append((task_type, index, address))
        pending = still
        if not pending:
            if announced:
                log.info("every server listens (after %.1fs)", time.monotonic() - started)
            return
        names = ", ".join(f"{t}:{i} ({a})" for t, i, a in pending)
        if time.monotonic() >= deadline:
            raise Unreachable(
                f"servers not reachable after {timeout:.0f}s (--connect-timeout): {names}"
            )
        if not announced:
            log.info(
                "waiting up to %.0fs for %d server(s) to listen: %s", timeout, len(pending), names
            )
            announced = True
        tick()
        time.sleep(0.5)


# How long a new training process waits for the chief's port held by the job's previous one
# (its launcher killed: it stops as at a stop, checkpoint and evaluation included).
PORT_GRACE = 60.0


def check_server_types(tasks: Sequence[TaskInfo], *, source: str) -> None:
    """Refuse a cluster whose ps and worker addresses are not where its servers are (two
    swapped in the file): TensorFlow would place the variables on a worker's process and
    train on, and a lost ps would be taken for a worker. Servers that name no type
    (unreachable health, not psctl's) are taken as the cluster says."""
    tasks = [t for t in tasks if t.type in TASK_TYPES and t.health_address]
    served = served_task_types([t.health_address for t in tasks])
    wrong = [(t, served[t.health_address]) for t in tasks]
    wrong = [(t, other) for t, other in wrong if other not in (None, t.type)]
    if wrong:
        task, other = wrong[0]
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise ConfigError(
            f"{source}: cluster.{task.type}[{task.index}]",
            f"{task.address} is a {other}-server, not a {task.type}-server (its health "
            f"service at {task.health_address} says so){more}",
            "give each task the address of its own server, or start the servers from "
            "this cluster file",
        )


def ps_train_main(args: argparse.Namespace, settings: TrainSettings) -> int:
    """`psctl train` in the parameter-server mode: the coordinator, supervised."""
    cluster, source = resolve_chief_cluster(args.cluster)
    check_output_dirs(
        settings.checkpoints.checkpoint_dir,
        settings.reporting.summary_json,
        settings.publishing.export_dir,
        settings.reporting.logdir,
    )  # not after training
    dispatcher = None
    if settings.data_service:
        dispatcher = require_dispatcher(
            dispatcher_address(flag=None, cluster_file=args.cluster, environ=os.environ),
            settings.exactly_once_flag,
        )
    if not args.once:
        return supervise_train(args, settings)
    early = EarlyStops()  # a stop while this process starts: kept for the loop
    require_chief(cluster, source=source)
    # TensorFlow binds the chief's port when it connects to the cluster (in the job's
    # network namespace where it has one: cluster/netns.py).
    chief_port = cluster.task_address("chief", 0).port
    netns.run_inside(
        lambda: ports.wait_port_free(chief_port, field="cluster.chief[0] port", grace=PORT_GRACE)
    )
    counters = handed_counters(args)
    metrics_port = DEFAULT_METRICS_PORT if args.metrics_port is None else args.metrics_port
    # /metrics first (STARTING, the counts carried from the earlier processes): a process
    # that restarts waits for its servers, and one stopped meanwhile would otherwise leave
    # Prometheus without its restart (seen in bench/soak.py --netns).
    from psctl.coordinator.operations.metrics import start_metrics

    metrics = start_metrics(metrics_port, settings, cluster, counters)
    netns.enter()  # the side ports are open: from here on, TensorFlow's side
    # TensorFlow and the job load beside the wait (psctl local starts this process with its
    # servers). The wait stays first to see the cluster: a task that left meanwhile is
    # found by the health checks that follow it, and this process starts again without it.
    loading = JobLoad(settings.job)

    def tick() -> None:
        early.die()
        loading.raise_if_failed()  # a job that does not load: its one line, now

    try:
        wait_for_tf_ports(cluster, timeout=settings.supervision.connect_timeout, tick=tick)
    except Unreachable as err:
        # Permanent (exit 69): the wait was the retry, and neither the supervisor nor
        # systemd nor Kubernetes starts the job again (docs/operations.md).
        status = exit_status(FailurePolicy().decide(classify(err), scope=Scope.PROCESS))
        print(f"psctl: error: {err}; giving up (exit {status})", file=sys.stderr)
        return status
    job = loading.result()
    if counters.job_start_step < 0:  # no training process of this job has trained yet
        warn_if_same_data(job, settings, num_workers=cluster.num_workers)

    health = ports.HealthAddresses.of_file(args.cluster)
    tasks = load_tasks(args.tasks_file, cluster, chief_metrics_port=metrics_port, health=health)
    check_server_types(tasks, source=source)

    def train(control: JobControl, failures: FailurePolicy) -> Summary:
        return _train(job, cluster, source, settings, control, metrics, dispatcher, failures, early)

    return run_training_process(args, settings, tasks, counters, metrics, train, serve_control=True)


class JobLoad:
    """``import tensorflow`` and the job's module, on a thread of their own (2-3 s of CPU)
    while the process waits for its servers; ``result()`` joins it, raising what it raised."""

    def __init__(self, spec: str) -> None:
        self.job: Job | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._load, args=(spec,), name="psctl-job-load", daemon=True
        )
        self._thread.start()

    def _load(self, spec: str) -> None:
        try:
            import_tensorflow_quietly()  # the job imports it: its start-up lines, filtered
            from psctl.coordinator.job import load_job

            self.job = load_job(spec)
        except BaseException as err:  # raised in the main thread (result, raise_if_failed)
            self.error = err

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def result(self) -> Job:
        self._thread.join()
        self.raise_if_failed()
        assert self.job is not None
        return self.job


def warn_if_same_data(job: Job, settings: TrainSettings, *, num_workers: int) -> None:
    """One warning line where every worker would read the same examples
    (``same_data_warning``). A dataset this process cannot read ahead of training (data only
    the workers' hosts have, a bad record, a job's mistake) is left to the training that
    follows: its errors are reported there, with their own lines and exit statuses."""
    from psctl.coordinator.training.job_model.same_data import same_data_warning

    try:
        warning = same_data_warning(job, settings, num_workers=num_workers)
    except Exception as err:  # a look ahead, never the run's failure
        log.debug("workers' first batches not compared: %s", err)
        return
    if warning:
        log.warning("%s", warning)


def _train(
    job: Job,
    cluster: ClusterConfig,
    source: str,
    settings: TrainSettings,
    control: JobControl,
    metrics: CoordinatorMetrics | None,
    dispatcher: str | None,
    policy: FailurePolicy,
    early: EarlyStops,
) -> Summary:
    from psctl.coordinator.training.loop import install_stop_signals
    from psctl.coordinator.training.trainer import Trainer

    install_stop_signals(control, early)
    log.info(
        "job %s on %d ps + %d workers (%s), %s, batch %d/worker, %s steps/call",
        settings.job,
        cluster.num_ps,
        cluster.num_workers,
        source,
        settings.length,
        settings.loop.batch_size,
        show_steps_per_execution(settings.loop.steps_per_execution),
    )
    trainer = Trainer(
        job=job,
        cluster=cluster,
        settings=settings,
        control=control,
        metrics=metrics,
        data_dispatcher=dispatcher,
        policy=policy,
    )
    # Never collected before the process exits: destroying its per-worker resources sends
    # ops to every worker and waits on a frozen one (seen). The process ends by os._exit.
    _KEEP_ALIVE.append(trainer)
    return trainer.run()
