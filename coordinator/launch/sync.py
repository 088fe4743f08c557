"""`--strategy sync`: `psctl train` on a worker host, and `psctl local` with N workers.

Every worker runs the training program (coordinator/training/sync.py) in its own process,
under its own ``TrainingSupervisor`` (the same crash-loop budget as the coordinator's).
Worker 0 is the chief: it serves the Control API and the coordinator's metrics, and writes
checkpoints, TensorBoard and the summary. There are no ps or worker servers in this mode.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

from psctl.cluster import netns, ports
from psctl.cluster.address import Address
from psctl.cluster.errors import ConfigError
from psctl.cluster.health import TLS_CERT_ENV as HEALTH_TLS_CERT_ENV
from psctl.cluster.health import TLS_KEY_ENV as HEALTH_TLS_KEY_ENV
from psctl.cluster.health import HealthService
from psctl.cluster.metrics import ProcessMetrics
from psctl.cluster.processes.files import write_json_atomic
from psctl.cluster.processes.logs import import_tensorflow_quietly
from psctl.cluster.processes.procs import spawn, stop_processes
from psctl.cluster.server import bind_host
from psctl.cluster.spec import ClusterConfig, format_table
from psctl.cluster.tf_config import resolve_training_task
from psctl.coordinator.argv import psctl_argv, run_settings_argv
from psctl.coordinator.failures import FailurePolicy
from psctl.coordinator.launch.assembly import TrainingAssembly, supervise_train
from psctl.coordinator.launch.process import (
    handed_counters,
    load_tasks,
    run_training_process,
)
from psctl.coordinator.launch.supervisor import Counters, RestartPolicy, TrainingSupervisor
from psctl.coordinator.operations.job_state import JobControl
from psctl.coordinator.operations.metrics import (
    CoordinatorMetrics,
    start_metrics,
    start_worker_metrics,
)
from psctl.coordinator.operations.security import ControlSecurity
from psctl.coordinator.operations.task_book import TaskInfo
from psctl.coordinator.settings import DEFAULT_METRICS_PORT, TrainSettings
from psctl.coordinator.training.reporting.summary import Summary
from psctl.coordinator.training.saving.checkpoint_files import check_output_dirs

log = logging.getLogger("psctl.sync")
_KEEP_ALIVE: list[object] = []
STOP_GRACE = 30.0  # seconds the workers get to finish after a stop (checkpoint, eval)


def resolve_sync_cluster(
    cluster_file: str | None, task_index: int | None
) -> tuple[ClusterConfig, int, str]:
    """(cluster, this worker's index, where they came from): ``--cluster FILE`` with
    ``--task-index``, or TF_CONFIG with task type worker (``--task-index`` overrides its
    index)."""
    return resolve_training_task(
        role="worker", cluster_file=cluster_file, task_index=task_index, environ=os.environ
    )


def workers_only(cluster: ClusterConfig) -> ClusterConfig:
    return ClusterConfig(jobs={"worker": cluster.workers})


def sync_train_main(args: argparse.Namespace, settings: TrainSettings) -> int:
    """`psctl train --strategy sync`: this worker's training process, supervised."""
    full, index, source = resolve_sync_cluster(args.cluster, getattr(args, "task_index", None))
    if index == 0:  # the only one that writes them
        check_output_dirs(
            settings.checkpoints.checkpoint_dir,
            settings.reporting.summary_json,
            logdir=settings.reporting.logdir,
        )
    if not args.once:
        return supervise_train(args, settings, serve_control=index == 0)
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    cluster = workers_only(full)
    if full.num_ps and index == 0:
        log.info(
            "sync mode: the %d ps task(s) in %s are not used; gradients are all-reduced over "
            "the %d workers",
            full.num_ps,
            source,
            cluster.num_workers,
        )
    counters = handed_counters(args)
    is_chief = index == 0
    address = cluster.task_address("worker", index)
    host = bind_host(None, os.environ, address.host)
    metrics_port = worker_metrics_port(cluster, index, args)
    health_addresses = ports.HealthAddresses.of_file(args.cluster)
    health_port = args.health_port
    if health_port is None:  # as a worker-server's: the cluster file's, else TF port + 1000
        health_port = health_addresses.require("worker", index, address, field="--health-port").port
    if health_port:
        ports.check_port_free(health_port, host=host, field="--health-port")
    # Every worker serves /metrics on its host: the chief the coordinator's series (steps,
    # loss, ...: the job's, once), every other worker those of a worker task (its task info,
    # health state and process), as a worker-server does in the parameter-server mode.
    metrics = None
    process_metrics = None
    if is_chief and metrics_port:  # 0: none (the chief's address would be worker 0's own)
        metrics = start_metrics(
            metrics_port,
            settings,  # psctl_batch_size: per worker, as in the parameter-server mode
            cluster.with_chief(str(address.with_port(metrics_port))),
            counters,
            # A sync step reads a batch on every worker: examples are counted per step so.
            examples_per_step=settings.loop.batch_size * cluster.num_workers,
        )
    elif metrics_port:
        process_metrics = start_worker_metrics(metrics_port, host=host, index=index)
    if args.tasks_file:
        tasks = load_tasks(args.tasks_file, cluster)
    else:
        tasks = sync_tasks(
            cluster,
            index,
            chief_metrics_port=worker_metrics_port(cluster, 0, args),
            health=health_addresses,
            own_health_port=health_port,
            own_metrics_port=metrics_port,
        )
    # SERVING from when this worker joined the group until it is done, as a server's. The
    # last side port: then into the job's network namespace where it has one
    # (cluster/netns.py), with TensorFlow's port.
    health = WorkerHealth(host=host, port=health_port, metrics=process_metrics)
    ports.check_port_free(
        cluster.task_address("worker", index).port, field=f"cluster.worker[{index}] port"
    )
    import_tensorflow_quietly()
    import tensorflow as tf

    # Each worker waits on its peers in collectives: too few inter-op threads can hang the
    # group (ARCHITECTURE.md).
    if (os.cpu_count() or 1) < cluster.num_workers + 2:
        tf.config.threading.set_inter_op_parallelism_threads(cluster.num_workers + 2)

    def train(control: JobControl, failures: FailurePolicy) -> Summary:
        return _train(cluster, index, settings, control, metrics, args, health)

    return run_training_process(
        args,
        settings,
        tasks,
        counters,
        metrics,
        train,
        serve_control=is_chief,  # the chief's: the Control API, the summary
        at_exit=lambda: health.set_serving(False),
    )


class WorkerHealth:
    """A sync worker's grpc.health.v1 service (port 0: none) and the health state its
    /metrics shows (a worker other than the chief), set together. Made after every other
    side port: the process is in the job's network namespace after it (``netns.enter``)."""

    def __init__(self, *, host: str, port: int, metrics: ProcessMetrics | None) -> None:
        cert, key = os.environ.get(HEALTH_TLS_CERT_ENV, ""), os.environ.get(HEALTH_TLS_KEY_ENV, "")
        self.service = None
        if port:
            self.service = HealthService(
                host=host, port=port, tls_cert=cert, tls_key=key, enter_job_netns=True
            )
        else:
            netns.enter()
        self.metrics = metrics

    def set_serving(self, serving: bool) -> None:
        if self.service is not None:
            self.service.set_serving(serving)
        if self.metrics is not None:
            self.metrics.health.state("serving" if serving else "not_serving")


def worker_metrics_port(cluster: ClusterConfig, index: int, args: argparse.Namespace) -> int:
    """Worker ``index``'s /metrics port: worker 0 the coordinator's (``--metrics-port``),
    every other worker ``--worker-metrics-port``, else its TF port + 2000 (several workers
    may share a host, as worker-servers do; the units pass every worker the coordinator's
    ``--metrics-port``)."""
    if index == 0:
        return DEFAULT_METRICS_PORT if args.metrics_port is None else int(args.metrics_port)
    flag = getattr(args, "worker_metrics_port", None)
    if flag is not None:
        return int(flag)
    port = cluster.task_address("worker", index).port + ports.METRICS_PORT_OFFSET
    return port if port < 65536 else 0


def sync_tasks(
    cluster: ClusterConfig,
    index: int,
    *,
    chief_metrics_port: int,
    health: ports.HealthAddresses,
    own_health_port: int,
    own_metrics_port: int,
) -> list[TaskInfo]:
    """Every worker of a sync job as status lists it: its health where the cluster file's
    "health" section says (``health``), else at its TF port + 1000, and its /metrics
    (worker 0's on the coordinator's port); this worker's pid, and its own health and
    /metrics ports as its flags set them (the others' pids are on their hosts)."""
    tasks = []
    for task in load_tasks(None, cluster, health=health):
        address = cluster.task_address("worker", task.index)
        if task.index == 0:
            url = f"http://{address.with_port(chief_metrics_port)}/metrics"
            task = replace(task, metrics_url=url if chief_metrics_port else "")
        if task.index == index:
            own = str(address.with_port(own_health_port)) if own_health_port else ""
            task = replace(task, pid=os.getpid(), health_address=own)
            if index != 0:
                url = f"http://{address.with_port(own_metrics_port)}/metrics"
                task = replace(task, metrics_url=url if own_metrics_port else "")
        tasks.append(task)
    return tasks


def _train(
    cluster: ClusterConfig,
    index: int,
    settings: TrainSettings,
    control: JobControl,
    metrics: CoordinatorMetrics | None,
    args: argparse.Namespace,
    health: WorkerHealth | None = None,
) -> Summary:
    from psctl.coordinator.job import load_job
    from psctl.coordinator.training.loop import install_stop_signals
    from psctl.coordinator.training.sync import SyncTrainer, sync_strategy

    install_stop_signals(control)
    log.info(
        "job %s: worker %d of %d (sync, %s), %s, batch %d/worker",
        settings.job,
        index,
        cluster.num_workers,
        cluster.task_address("worker", index),
        settings.length,
        settings.loop.batch_size,
    )
    # Before the job is loaded: a job that runs TensorFlow ops when imported would set up
    # the eager context before the strategy could configure collectives (seen: ctr).
    strategy = sync_strategy(cluster, index, connect_timeout=settings.supervision.connect_timeout)
    if health is not None:
        health.set_serving(True)
    # Again: TensorFlow's coordination service (started with the strategy) takes SIGTERM
    # for its preemption notifier; ours must handle it (graceful stop of the group).
    install_stop_signals(control)
    trainer = SyncTrainer(
        job=load_job(settings.job),
        cluster=cluster,
        index=index,
        settings=settings,
        control=control,
        strategy=strategy,
        metrics=metrics,
    )
    _KEEP_ALIVE.append(trainer)  # never collected: the process ends by os._exit
    return trainer.run()


# -- psctl local --strategy sync -------------------------------------------------------


def worker_argv(
    *,
    cluster_file: Path,
    tasks_file: Path,
    index: int,
    control_address: str,
    metrics_port: int,
    flags: dict[str, Any],
    args: argparse.Namespace,
    health_port: int = 0,
    security: ControlSecurity | None = None,
) -> list[str]:
    """Worker ``index``'s training process; ``security``: the launcher's published control
    credentials (worker 0 serves Control with them, the same after every restart)."""
    argv = psctl_argv(
        "train",
        "--cluster",
        str(cluster_file),
        "--task-index",
        str(index),
        "--tasks-file",
        str(tasks_file),
        "--control-address",
        control_address,
        "--metrics-port" if index == 0 else "--worker-metrics-port",
        str(metrics_port),
        "--health-port",
        str(health_port),
        "--once",
        *(security.as_argv() if security and index == 0 else []),
    )
    return argv + run_settings_argv(args, flags)


class LocalSyncJob:
    """N worker training processes on loopback, each under its own supervisor (a thread
    here), every child with a parent-death signal; ``stop`` leaves nothing running."""

    def __init__(self, *, num_workers: int, workdir: Path, control_address: str) -> None:
        if num_workers < 1:
            raise ConfigError("--workers", f"got {num_workers}", "run at least 1 worker")
        self.workdir = workdir
        self.control_address = control_address
        # Per worker: its TF port, its health port and its /metrics port.
        control = Address.parse(control_address, field="--control-address").port
        found = ports.free_ports(3 * num_workers, avoid=(control,))  # bound later, by the front
        tf_ports, self.health_ports, self.metrics_ports = (
            found[:num_workers],
            found[num_workers : 2 * num_workers],
            found[2 * num_workers :],
        )
        self.metrics_port = self.metrics_ports[0]  # the chief's: the job's series
        self.cluster = ClusterConfig(jobs={"worker": tuple(f"127.0.0.1:{p}" for p in tf_ports)})
        self.cluster_file = workdir / "cluster.json"
        self.tasks_file = workdir / "tasks.json"
        self.pids: dict[int, int] = {}  # worker -> its training process's pid, as now
        self._tasks_lock = threading.Lock()
        self.supervisors: list[TrainingSupervisor] = []
        self.statuses: dict[int, int] = {}  # in the order the supervisors ended
        self._threads: list[threading.Thread] = []
        self._stop_at: float | None = None

    def write_files(self) -> None:
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.cluster_file, {"cluster": self.cluster.as_dict()})
        self.write_tasks()

    def write_tasks(self) -> None:
        """tasks.json: every worker with its health address, metrics URL and pid, for the
        chief's status; rewritten when a worker's process starts again (its new pid), and
        read again by the chief when it changes."""
        with self._tasks_lock:
            tasks = [
                {
                    "type": "worker",
                    "index": i,
                    "address": address,
                    "health_address": f"127.0.0.1:{self.health_ports[i]}",
                    "metrics_url": f"http://127.0.0.1:{self.metrics_ports[i]}/metrics",
                    "pid": self.pids.get(i, 0),
                }
                for _, i, address in self.cluster.tasks()
            ]
            write_json_atomic(self.tasks_file, tasks)

    def _started(self, index: int, pid: int) -> None:
        self.pids[index] = pid
        self.write_tasks()

    def start(
        self,
        flags: dict[str, Any],
        args: argparse.Namespace,
        security: ControlSecurity | None = None,
        *,
        max_restarts: int,
    ) -> None:
        self.write_files()
        for index in range(self.cluster.num_workers):
            argv = worker_argv(
                cluster_file=self.cluster_file,
                tasks_file=self.tasks_file,
                index=index,
                control_address=self.control_address,
                metrics_port=self.metrics_ports[index],
                health_port=self.health_ports[index],
                flags=flags,
                args=args,
                security=security,
            )
            log_path = None if index == 0 else self.workdir / "logs" / f"worker-{index}.log"
            supervisor = TrainingSupervisor(
                _starter(argv, log_path, on_start=partial(self._started, index)),
                policy=RestartPolicy(max_restarts=max_restarts),
            )
            self.supervisors.append(supervisor)
            thread = threading.Thread(
                target=self._supervise, args=(index, supervisor), name=f"worker-{index}"
            )
            self._threads.append(thread)
            thread.start()

    def _supervise(self, index: int, supervisor: TrainingSupervisor) -> None:
        try:
            self.statuses[index] = supervisor.run()
        except BaseException:  # reported as a failed worker
            log.exception("worker %d's supervisor failed", index)
            self.statuses[index] = 1

    def wait(self) -> int:
        """Until every worker's supervisor is done; the chief's status, or the first
        failure's. A worker that ends in failure stops the others (they could only wait);
        after a stop, workers get STOP_GRACE seconds before ``stop`` kills what is left
        (one waiting for a peer that is gone may not see its signal)."""
        while any(t.is_alive() for t in self._threads):
            for thread in self._threads:
                thread.join(timeout=0.2)
            failed = [i for i, code in self.statuses.items() if code != 0]
            if failed and self._stop_at is None:
                log.error(
                    "worker %d ended with status %d: stopping the other workers",
                    failed[0],
                    self.statuses[failed[0]],
                )
                self.request_stop(signal.SIGTERM)
            if self._stop_at is not None and time.monotonic() - self._stop_at > STOP_GRACE:
                log.error("workers still running %.0fs after the stop: killing them", STOP_GRACE)
                break
        # The first failure's (the one that stopped the others): a worker that gave up
        # (exit 70) ends the job with 70, not with the 75 of a peer stopped meanwhile.
        failed = [code for code in self.statuses.values() if code != 0]
        return failed[0] if failed else self.statuses.get(0, 1)

    def control_stop(self, forwarded: bool) -> None:
        """A Stop over the control API (``TrainingSupervisor.control_stop``): worker 0 took
        it and the workers finish together, or none did and they stop as on SIGTERM."""
        if forwarded:
            for supervisor in self.supervisors:
                supervisor.stopping = True
        else:
            self.request_stop(signal.SIGTERM)

    def request_stop(self, signum: int) -> None:
        if self._stop_at is None:
            self._stop_at = time.monotonic()
        for supervisor in self.supervisors:
            supervisor.request_stop(signum)

    def stop(self) -> None:
        """Every training process gone (SIGTERM, then SIGKILL), every supervisor done."""
        for supervisor in self.supervisors:
            supervisor.stopping = True
        children = [s.child for s in self.supervisors if s.child is not None]
        stop_processes(children, timeout=10.0)
        for thread in self._threads:
            thread.join(timeout=5.0)


def _starter(argv: list[str], log_path: Path | None, *, on_start: Callable[[int], None]) -> Any:
    def start(counters: Counters) -> subprocess.Popen[bytes]:
        # Without the launcher no worker may go on: SIGKILL when it dies.
        proc = spawn(
            [*argv, "--supervisor-counters", counters.handed()],
            log_path=log_path,
            death_signal=signal.SIGKILL,
        )
        on_start(proc.pid)
        return proc

    return start


def local_sync_main(
    args: argparse.Namespace, flags: dict[str, Any], workdir: Path, settings: TrainSettings
) -> int:
    """`psctl local --strategy sync`: ``--workers`` training processes, no servers."""
    if args.ps != 1:  # only the default is quietly ignored
        log.info("sync mode: --ps %d ignored (no ps tasks)", args.ps)
    job = LocalSyncJob(
        num_workers=args.workers, workdir=workdir, control_address=args.control_address
    )
    log.info("work dir %s", workdir)
    job.write_files()
    # As psctl local in the parameter-server mode: the job's tokens in this user's runtime
    # directory, handed to worker 0's training process (so that they stay the same across
    # its restarts), which listens behind this process's control front.
    security = ControlSecurity.from_args(args, os.environ)
    print(format_table(job.cluster, source=str(job.cluster_file)), flush=True)
    log.info("worker logs in %s; psctl status --address %s", workdir / "logs", args.control_address)

    def handle(signum: int, _frame: FrameType | None) -> None:
        job.request_stop(signum)

    old = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    started = time.monotonic()
    try:
        with TrainingAssembly(
            job=settings.job,
            control_address=args.control_address,
            security=security,
            on_stop=job.control_stop,  # every worker's supervisor, not one
        ) as assembly:
            job.control_address = assembly.address
            try:
                job.start(
                    flags, args, assembly.security, max_restarts=settings.supervision.max_restarts
                )
                return job.wait()
            finally:
                job.stop()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        log.info(
            "all %d workers stopped (%.0fs)", job.cluster.num_workers, time.monotonic() - started
        )
