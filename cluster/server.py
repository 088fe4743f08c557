"""Server bootstrap shared by `ps-server` and `worker-server`.

Start order: check every port is free, /metrics, health service (UNKNOWN: starting), the
job's network namespace where it has one (cluster/netns.py), the TensorFlow server, then
health SERVING and systemd READY=1. SIGTERM turns health NOT_SERVING for --shutdown-grace
and exits 0 (SIGINT: at once): a TF server cannot be stopped in-process.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from psctl.cluster import ports
from psctl.cluster.address import canonical_host
from psctl.cluster.dataservice import dispatcher_address, start_data_worker
from psctl.cluster.errors import EXIT_FAILURE, ConfigError, OneLineParser
from psctl.cluster.processes import sdnotify
from psctl.cluster.processes.logs import (
    configure_logging,
    quiet_tensorflow,
    tensorflow_import_quietly,
)
from psctl.cluster.processes.requirements import require_tensorflow
from psctl.cluster.processes.signals import SignalRelay
from psctl.cluster.spec import ClusterConfig, TaskConfig
from psctl.cluster.tf_config import resolve_task
from psctl.cluster.tf_runtime import server_api

# The names only: psctl.cluster.metrics imports prometheus_client, deferred to serve().
TLS_CERT_ENV, TLS_KEY_ENV = "PSCTL_METRICS_TLS_CERT", "PSCTL_METRICS_TLS_KEY"
HEALTH_TLS_CERT_ENV, HEALTH_TLS_KEY_ENV = "PSCTL_HEALTH_TLS_CERT", "PSCTL_HEALTH_TLS_KEY"

# Longer than the coordinator's health poll (2 s, operations/health_poll.py): it sees the
# NOT_SERVING of a server that stops (a preemption notice) and takes the worker out.
SHUTDOWN_GRACE = 2.5
log = logging.getLogger(__name__)
# A frozen worker holds some of its peers' inter-op threads while they wait on it. With 4
# (workers + 2 on 2 CPUs) the other worker stalled with it in 2 of 3 chaos runs (the job
# waited for the thaw); with 16, in none of 6. Idle threads cost nothing.
MIN_INTER_OP_THREADS = 16
# Threads per op (TensorFlow's intra-op pool) default to this machine's CPUs shared by the
# cluster's tasks on this host: each task's own pool of every CPU, with 6 tasks on 2 cores
# (psctl local), made them wait on each other (measured: ctr at 1M rows, Adagrad, 2 ps + 2
# workers on loopback, 59-72 steps/s with pools of 2 threads, 81 with 1; docs/performance.md).

BIND_HOST_ENV = "PSCTL_BIND_HOST"


def bind_host(flag: str | None, environ: Mapping[str, str], task_host: str) -> str:
    """Where a process's side ports (health, metrics) listen: ``flag``, else
    ``$PSCTL_BIND_HOST``, else the task's own host from the cluster, when it is an address
    of this machine. Never every interface (0.0.0.0) unless asked for."""
    if flag:
        return flag
    if environ.get(BIND_HOST_ENV):
        return environ[BIND_HOST_ENV]
    try:
        infos = socket.getaddrinfo(task_host, 0, type=socket.SOCK_STREAM)
        family, _, _, _, sockaddr = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((sockaddr[0], 0))
        return str(sockaddr[0])
    except (OSError, IndexError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ConfigError(
            "--bind-host",
            f"the task's host {task_host!r} is not an address of this machine ({reason}), "
            "and no bind address is set",
            f"pass --bind-host or set {BIND_HOST_ENV} to this machine's address "
            "(0.0.0.0: every interface)",
        ) from None


def tasks_on_host(cluster: ClusterConfig, host: str) -> int:
    """How many of the cluster's tasks run on ``host`` (every loopback address one host),
    at least 1."""

    def machine(name: str) -> str:
        name = canonical_host(name)
        if name == "localhost":
            return "loopback"
        try:
            return "loopback" if ipaddress.ip_address(name).is_loopback else name
        except ValueError:
            return name

    here = machine(host)
    return max(1, sum(1 for _, _, a in cluster.task_addresses() if machine(a.host) == here))


def intra_op_threads(cluster: ClusterConfig, host: str, cpus: int) -> int:
    """The default ``--intra-op-threads``: ``cpus`` shared by the cluster's tasks on
    ``host``, at least 1."""
    return max(1, cpus // tasks_on_host(cluster, host))


def thread_spinning(setting: str, cluster: ClusterConfig, host: str) -> bool:
    """``--thread-spinning``: ``auto`` spins (TensorFlow's default) only where this task
    has its host to itself; tasks sharing a host would burn each other's CPUs waiting."""
    if setting == "auto":
        return tasks_on_host(cluster, host) == 1
    return setting == "on"


@dataclass(frozen=True)
class ServerOptions:
    task: TaskConfig
    bind_host: str
    health_port: int
    metrics_port: int  # 0: no /metrics
    shutdown_grace: float
    inter_op_threads: int
    intra_op_threads: int = 0  # 0: TensorFlow's default (every CPU)
    thread_spinning: bool = True  # TensorFlow's default: idle pool threads spin a while
    data_dispatcher: str | None = None  # worker only: host a tf.data service worker
    data_port: int = 0
    metrics_tls_cert: str = ""  # both set: /metrics over HTTPS
    metrics_tls_key: str = ""
    health_tls_cert: str = ""  # both set: health over TLS
    health_tls_key: str = ""


def build_parser(task_type: str) -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=f"{task_type}-server",
        description=f"Run one TensorFlow {task_type} task of a psctl cluster until SIGTERM.",
        epilog=(
            "The task comes from --cluster FILE --index I, or else from TF_CONFIG. "
            "Side ports default to the TF port + "
            f"{ports.HEALTH_PORT_OFFSET} (health) and + {ports.METRICS_PORT_OFFSET} (metrics); "
            "PSCTL_HEALTH_PORT / PSCTL_METRICS_PORT / PSCTL_BIND_HOST set them from the "
            "environment (flags win). Exit status 78 means a configuration error."
        ),
    )
    parser.add_argument("--cluster", metavar="FILE", help="cluster file (TF_CONFIG's JSON)")
    parser.add_argument("--index", type=int, help="this task's index in the cluster file")
    parser.add_argument("--health-port", type=int, help="grpc.health.v1 port")
    parser.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (0: off)")
    parser.add_argument(
        "--bind-host",
        help="address the health and metrics ports listen on (default: this task's host "
        "in the cluster, e.g. 127.0.0.1 for a loopback cluster; 0.0.0.0: every interface)",
    )
    parser.add_argument(
        "--metrics-tls-cert",
        metavar="PEM",
        help="serve /metrics over HTTPS with this certificate (default $PSCTL_METRICS_TLS_CERT)",
    )
    parser.add_argument(
        "--metrics-tls-key",
        metavar="PEM",
        help="the certificate's private key (default $PSCTL_METRICS_TLS_KEY)",
    )
    parser.add_argument(
        "--health-tls-cert",
        metavar="PEM",
        help="serve health over TLS with this certificate (default $PSCTL_HEALTH_TLS_CERT; "
        "clients then need $PSCTL_HEALTH_TLS_CA)",
    )
    parser.add_argument(
        "--health-tls-key",
        metavar="PEM",
        help="the certificate's private key (default $PSCTL_HEALTH_TLS_KEY)",
    )
    parser.add_argument(
        "--shutdown-grace",
        type=float,
        default=SHUTDOWN_GRACE,
        help="seconds health reports NOT_SERVING before exit, so that the coordinator sees a "
        "worker leave rather than fail (default %(default)s; at most 4)",
    )
    parser.add_argument(
        "--inter-op-threads",
        type=int,
        help=f"TF inter-op threads (default: max(workers + 2, CPUs, {MIN_INTER_OP_THREADS}); "
        "fewer than workers + 1 can hang the cluster)",
    )
    parser.add_argument(
        "--intra-op-threads",
        type=int,
        help="TF threads per op (default: this machine's CPUs divided by the cluster's tasks "
        "on this host, at least 1: all of them on a host of its own; 0: TensorFlow's default, "
        "every CPU)",
    )
    parser.add_argument(
        "--thread-spinning",
        choices=("auto", "on", "off"),
        default="auto",
        help="let TF's idle pool threads spin before they sleep (default auto: off where the "
        "cluster puts other tasks on this host, on where this task has the host to itself)",
    )
    if task_type == "worker":
        parser.add_argument(
            "--data-dispatcher",
            metavar="HOST:PORT",
            help="tf.data service dispatcher (psctl train --epochs): host a data worker for it "
            "(default: $PSCTL_DATA_DISPATCHER, else the cluster file's data_service.dispatcher)",
        )
        parser.add_argument(
            "--data-port",
            type=int,
            help=f"the data worker's port (default TF port + {ports.DATA_PORT_OFFSET})",
        )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs, TF logs")
    return parser


def _port_setting(flag: int | None, env: Mapping[str, str], name: str, field: str) -> int | None:
    if flag is not None:
        value, where = flag, field
    elif env.get(name):
        where = name
        try:
            value = int(env[name])
        except ValueError:
            raise ConfigError(name, f"{env[name]!r} is not a port number", "set 1-65535") from None
    else:
        return None
    if not 0 <= value < 65536:
        raise ConfigError(where, f"{value} is out of range", "use 1-65535 (0 turns it off)")
    return value


def resolve_options(
    task_type: str, args: argparse.Namespace, environ: Mapping[str, str]
) -> ServerOptions:
    task = resolve_task(
        cluster_file=args.cluster,
        task_type=task_type if args.cluster else None,
        task_index=args.index,
        environ=environ,
        default_type=task_type,
    )
    if task.task_type != task_type:
        # Only ps and worker tasks have a server command; the chief is `psctl train`.
        runs = {
            "ps": "run ps-server for this task",
            "worker": "run worker-server for this task",
            "chief": "the chief task is the coordinator: run `psctl train` for it",
        }.get(task.task_type, f"psctl has no server for {task.task_type!r} tasks")
        raise ConfigError(
            "TF_CONFIG.task.type",
            f"is {task.task_type!r} but this is the {task_type} server",
            f"{runs}, or set task.type to {task_type!r}",
        )
    health = _port_setting(args.health_port, environ, "PSCTL_HEALTH_PORT", "--health-port")
    if health is None or health == 0:
        # Where the cluster file's "health" section puts it (psctl health and status look
        # there), else TF port + 1000.
        health = (
            ports.HealthAddresses.of_file(args.cluster)
            .require(task.task_type, task.task_index, task.task_address, field="--health-port")
            .port
        )
    metrics = _port_setting(args.metrics_port, environ, "PSCTL_METRICS_PORT", "--metrics-port")
    if metrics is None:
        metrics = ports.side_port(task.port, ports.METRICS_PORT_OFFSET, field="--metrics-port")
    if len({task.port, health, metrics} - {0}) != len(
        [p for p in (task.port, health, metrics) if p]
    ):
        raise ConfigError(
            "--health-port/--metrics-port",
            f"ports collide (tf {task.port}, health {health}, metrics {metrics})",
            "give each a different port",
        )
    for flag, cert, key in (
        ("--metrics-tls-cert/--metrics-tls-key", args.metrics_tls_cert, args.metrics_tls_key),
        ("--health-tls-cert/--health-tls-key", args.health_tls_cert, args.health_tls_key),
    ):
        if bool(cert) != bool(key):
            raise ConfigError(flag, "only one is given", "give both")
    if not 0 <= args.shutdown_grace <= 4:
        raise ConfigError("--shutdown-grace", f"{args.shutdown_grace} s", "use 0 to 4 seconds")
    threads = args.inter_op_threads or max(
        task.cluster.num_workers + 2, os.cpu_count() or 1, MIN_INTER_OP_THREADS
    )
    if threads < task.cluster.num_workers + 1:
        raise ConfigError(
            "--inter-op-threads",
            f"{threads} is fewer than workers + 1 = {task.cluster.num_workers + 1}",
            "raise it (TensorFlow's PS cluster can hang with fewer)",
        )
    intra = args.intra_op_threads
    if intra is None:
        intra = intra_op_threads(task.cluster, task.task_address.host, os.cpu_count() or 1)
    elif intra < 0:
        raise ConfigError("--intra-op-threads", f"{intra} is negative", "use 0 or more")
    dispatcher = dispatcher_address(
        flag=getattr(args, "data_dispatcher", None), cluster_file=args.cluster, environ=environ
    )
    data_port = 0
    if task_type == "worker" and dispatcher:
        data_port = _port_setting(args.data_port, environ, "PSCTL_DATA_PORT", "--data-port") or 0
        if not data_port:
            data_port = ports.side_port(task.port, ports.DATA_PORT_OFFSET, field="--data-port")
        if data_port in (task.port, health, metrics):
            raise ConfigError("--data-port", f"{data_port} is taken by another port", "change it")
    return ServerOptions(
        task=task,
        data_dispatcher=dispatcher if data_port else None,
        data_port=data_port,
        bind_host=bind_host(args.bind_host, environ, task.task_address.host),
        metrics_tls_cert=args.metrics_tls_cert or environ.get(TLS_CERT_ENV, ""),
        metrics_tls_key=args.metrics_tls_key or environ.get(TLS_KEY_ENV, ""),
        health_tls_cert=args.health_tls_cert or environ.get(HEALTH_TLS_CERT_ENV, ""),
        health_tls_key=args.health_tls_key or environ.get(HEALTH_TLS_KEY_ENV, ""),
        health_port=health,
        metrics_port=metrics,
        shutdown_grace=args.shutdown_grace,
        inter_op_threads=threads,
        intra_op_threads=intra,
        thread_spinning=thread_spinning(args.thread_spinning, task.cluster, task.task_address.host),
    )


class _Stop:
    """Set by a stop signal (on cluster.signals' relay thread); the main thread waits on it."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal_name = ""

    def handle(self, signum: int) -> None:
        self.signal_name = self.signal_name or signal.Signals(signum).name
        self.event.set()


def _start_tf_server(opts: ServerOptions) -> object:
    with tensorflow_import_quietly():
        api = server_api()  # deferred: TensorFlow's import, after the ports are known free
    log.debug("TensorFlow's server imported %s", "whole" if api.whole else "without its API")
    config = api.ConfigProto(
        inter_op_parallelism_threads=opts.inter_op_threads,
        intra_op_parallelism_threads=opts.intra_op_threads,
    )
    config.experimental.disable_thread_spinning = not opts.thread_spinning
    return api.Server(
        api.ClusterSpec(opts.task.cluster.as_dict()),
        job_name=opts.task.task_type,
        task_index=opts.task.task_index,
        protocol="grpc",
        config=config,
        start=True,
    )


def serve(opts: ServerOptions, stop: _Stop) -> int:
    from prometheus_client import CollectorRegistry

    from psctl.cluster.health import HealthService
    from psctl.cluster.metrics import ProcessMetrics, serve_metrics

    task = opts.task
    name = f"{task.task_type}:{task.task_index}"
    ports.check_port_free(task.port, field=f"cluster.{task.task_type}[{task.task_index}] port")
    ports.check_port_free(opts.health_port, host=opts.bind_host, field="--health-port")
    if opts.metrics_port:
        ports.check_port_free(opts.metrics_port, host=opts.bind_host, field="--metrics-port")
    if opts.data_dispatcher:
        ports.check_port_free(opts.data_port, field="--data-port")

    registry = CollectorRegistry()
    metrics = ProcessMetrics(
        registry=registry, task_type=task.task_type, task_index=task.task_index
    )
    if opts.metrics_port:
        serve_metrics(
            registry,
            host=opts.bind_host,
            port=opts.metrics_port,
            certfile=opts.metrics_tls_cert,
            keyfile=opts.metrics_tls_key,
        )
    # Last of the side ports: then into the job's network namespace, if it has one
    # (cluster/netns.py), where TensorFlow's port will be.
    health = HealthService(
        host=opts.bind_host,
        port=opts.health_port,
        tls_cert=opts.health_tls_cert,
        tls_key=opts.health_tls_key,
        task_type=task.task_type,
        enter_job_netns=True,
    )
    log.info("%s starting TF server on %s", name, task.address)
    started = time.monotonic()
    server = _start_tf_server(opts)
    if stop.event.is_set():
        return 0
    if opts.data_dispatcher:
        start_data_worker(
            dispatcher=opts.data_dispatcher, worker=task.task_address.with_port(opts.data_port)
        )
        log.info("%s data worker :%d, dispatcher %s", name, opts.data_port, opts.data_dispatcher)
    health.set_serving(True)
    metrics.health.state("serving")
    log.info(
        "%s serving: tf %s, health :%d, metrics %s (%.1fs)",
        name,
        getattr(server, "target", task.address),
        opts.health_port,
        f":{opts.metrics_port}" if opts.metrics_port else "off",
        time.monotonic() - started,
    )
    sdnotify.notify(f"READY=1\nSTATUS=serving {name} on {task.address}")
    sdnotify.keep_watchdog_fed(stop.event)
    while not stop.event.wait(1.0):
        pass
    # SIGTERM is a preemption notice (systemctl stop, a spot reclaim): NOT_SERVING for the
    # grace, so that the coordinator sees a worker leave, not fail. SIGINT (Ctrl-C, or
    # psctl local stopping its own servers) stops at once.
    grace = 0.0 if stop.signal_name == "SIGINT" else opts.shutdown_grace
    log.info("%s got %s: health NOT_SERVING, exiting in %.1fs", name, stop.signal_name, grace)
    sdnotify.notify("STOPPING=1")
    health.set_serving(False)
    metrics.health.state("not_serving")
    time.sleep(grace)
    health.stop(grace=0.2)
    return 0


def main(task_type: str, argv: Sequence[str] | None = None) -> int:
    stop = _Stop()
    # Handlers first: a SIGTERM during TensorFlow's import still ends the process cleanly.
    SignalRelay(stop.handle)
    args = build_parser(task_type).parse_args(argv)
    configure_logging(verbose=args.verbose, name=f"{task_type}-server")
    quiet_tensorflow(verbose=args.verbose)
    try:
        require_tensorflow()
        opts = resolve_options(task_type, args, os.environ)
        status = serve(opts, stop)
    except ConfigError as err:
        print(f"{task_type}-server: error: {err}", file=sys.stderr)
        status = err.exit_status
    except Exception as err:  # the TF server failed to start: one line, not a traceback
        log.debug("start-up failed", exc_info=True)
        print(
            f"{task_type}-server: error: {type(err).__name__}: {err}".splitlines()[0],
            file=sys.stderr,
        )
        status = EXIT_FAILURE
    sys.stdout.flush()
    sys.stderr.flush()
    # TensorFlow's server threads never join: leave without waiting for them.
    os._exit(status)
