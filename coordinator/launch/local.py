"""`psctl local`: a whole cluster on this machine, as real server processes.

Starts ps and worker servers on free loopback ports, waits until each reports SERVING,
runs `psctl train` against them as a child process, then stops every server. Every child
gets a parent-death signal, so none outlives the launcher, even if it is SIGKILLed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

from psctl.cluster import ports
from psctl.cluster.address import Address
from psctl.cluster.errors import EXIT_CONFIG, EXIT_FAILURE, ConfigError
from psctl.cluster.health import HealthChecker
from psctl.cluster.processes.files import write_json_atomic
from psctl.cluster.processes.procs import spawn, spawn_training, stop_processes
from psctl.cluster.spec import ClusterConfig, format_table, summary
from psctl.coordinator.argv import psctl_argv, run_settings_argv, server_argv
from psctl.coordinator.launch.assembly import Resizing, TrainingAssembly
from psctl.coordinator.launch.resize import local_prepare, shape_of
from psctl.coordinator.launch.supervisor import (
    Counters,
    RestartBudget,
    RestartPolicy,
    describe_exit,
)
from psctl.coordinator.operations.front import Refused
from psctl.coordinator.operations.security import ControlSecurity
from psctl.coordinator.settings import TrainSettings, env_name, load_toml
from psctl.coordinator.training.saving.checkpoint_files import require_creatable_dir

log = logging.getLogger("psctl.local")

# TensorFlow's many busy threads in every server would starve the coordinator and the
# operator's shell on a small machine (seen: `psctl status` took 2-4 s on 2 cores). Each
# server is a session, so an autogroup, of its own: spawn sets the group's nice too
# (cluster/processes/procs.py), without which a process's nice does not count against other
# groups (`psctl status` with the default job training: median 0.35-0.44 s before, 0.15 s
# after; same steps/s). 10, not 19: at 19 a server group gets 1/70 of a core against one
# busy process of the operator's, and two such (a build, another job) kept the servers from
# starting in 120 s; at 10, 47 s, and `psctl status` stays at 0.2 s median.
SERVER_NICE = 10
# A server whose health service has not answered for this long is frozen (SIGSTOP, a
# hung interpreter): killed, then restarted like any dead server. systemd does the same
# with the units' WatchdogSec=30. TensorFlow sometimes lets a frozen worker hold up the ps
# (seen: every step waited 7 min, until the test gave up), so leaving it frozen can stall
# the whole job.
WATCHDOG_SECONDS = 30.0
# A server imports TensorFlow's server modules only (cluster/tf_runtime.py), then starts its
# TF server: 17 servers were SERVING 7.3 s after they started on 2 cores, beside the
# training process's import (2026-12-07), about 0.9 CPU-seconds each (8.5 with the whole
# TensorFlow import, before). All start at once, so N servers need about 1.0 N / CPUs
# seconds; the default wait leaves 3 times that, and never less than START_TIMEOUT.
SERVER_START_CPU_SECONDS = 1.0
START_TIMEOUT = 120.0
# Start-up progress off a terminal: a "N of M servers SERVING" line at most this often.
PROGRESS_SECONDS = 10.0
# More servers than this: the cluster printed as its summary line, not a line per task (the
# whole table is in cluster.json and `psctl status`).
TABLE_MAX_SERVERS = 12


@dataclass
class ServerProcess:
    task_type: str
    index: int
    address: str
    health_port: int
    metrics_port: int
    log_path: Path
    proc: subprocess.Popen[bytes]
    left: bool = False  # out of the cluster: the next training process starts without it

    @property
    def name(self) -> str:
        return f"{self.task_type}:{self.index}"

    @property
    def health_address(self) -> str:
        return f"127.0.0.1:{self.health_port}"

    def last_log_lines(self, count: int = 15) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join("    " + line for line in lines[-count:])


class LocalCluster:
    """ps and worker server processes on loopback, plus the chief's address for a coordinator."""

    def __init__(
        self,
        *,
        num_ps: int,
        num_workers: int,
        workdir: Path,
        verbose: bool = False,
        data_service: bool = False,
        reserved_ports: Collection[int] = (),
    ):
        """``reserved_ports``: chosen for something else on this host and not bound yet (the
        control API's): never given to a server."""
        if num_ps < 1:
            raise ConfigError("--ps", f"got {num_ps}", "run at least 1 ps server")
        if num_workers < 1:
            raise ConfigError("--workers", f"got {num_workers}", "run at least 1 worker server")
        self.workdir = workdir
        self.verbose = verbose
        count = num_ps + num_workers
        self.reserved_ports = frozenset(reserved_ports)
        free = ports.free_ports(2 + 3 * count, avoid=self.reserved_ports)
        chosen = self.reserved_ports | set(free)
        self.coordinator_metrics_port = free.pop()
        tf_ports, side = free[: 1 + count], free[1 + count :]
        self.cluster = ClusterConfig(
            jobs={
                "chief": (f"127.0.0.1:{tf_ports[0]}",),
                "ps": tuple(f"127.0.0.1:{p}" for p in tf_ports[1 : 1 + num_ps]),
                "worker": tuple(f"127.0.0.1:{p}" for p in tf_ports[1 + num_ps :]),
            }
        )
        self._side_ports = iter(side)
        # --epochs: the coordinator's tf.data service dispatcher, and a data worker port
        # for each worker server (cluster.json's data_service, read by both).
        self.dispatcher: str | None = None
        self._data_ports: dict[int, int] = {}
        if data_service:
            # None of the ports just chosen either: they are not bound yet (seen: the
            # dispatcher given a ps's /metrics port; the data workers then registered with
            # that HTTP server, blocking their servers' start for good).
            extra = ports.free_ports(1 + num_workers, avoid=chosen)
            self.dispatcher = f"127.0.0.1:{extra[0]}"
            self._data_ports = dict(enumerate(extra[1:]))
        self.cluster_file = workdir / "cluster.json"
        self.tasks_file = workdir / "tasks.json"
        self.targets_file = workdir / "targets.json"
        self.servers: list[ServerProcess] = []
        self.retiring: list[ServerProcess] = []  # out of the cluster, stopped by retire()
        self.on_left: Callable[[ServerProcess], None] | None = None  # see restart_failed_servers
        self.policy = RestartPolicy(backoff_initial=0.5, backoff_max=10.0)
        self._budgets: dict[str, RestartBudget] = {}
        self._restart_due: dict[str, float] = {}
        self.counters = Counters()  # shared with the training supervisor
        self._tasks_written = False

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        plan = [
            (task_type, index, address, next(self._side_ports), next(self._side_ports))
            for task_type, index, address in self.cluster.tasks()
            if task_type in ("ps", "worker")
        ]
        self._write_cluster_file([(t, h) for t, _, _, h, _ in plan])
        for task_type, index, address, health_port, metrics_port in plan:
            self.servers.append(
                self._start_server(task_type, index, address, health_port, metrics_port)
            )

    def _write_cluster_file(self, health_ports: Sequence[tuple[str, int]]) -> None:
        """The cluster file, plus where each health service listens (for `psctl health`)."""
        health: dict[str, list[str]] = {}
        for task_type, health_port in health_ports:
            health.setdefault(task_type, []).append(f"127.0.0.1:{health_port}")
        body: dict[str, Any] = {"cluster": self.cluster.as_dict(), "health": health}
        if self.dispatcher:
            body["data_service"] = {"dispatcher": self.dispatcher}
        write_json_atomic(self.cluster_file, body)

    def resize(self, *, num_ps: int, num_workers: int, timeout: float) -> None:
        """A new shape: servers started for the new tasks (SERVING within ``timeout``, else
        Refused and nothing changed), the cluster file and task list rewritten. Tasks
        past the new counts (the highest indices) are retired: they serve on until
        ``retire()``, once the training process that uses them has exited."""
        keep = {"ps": num_ps, "worker": num_workers}
        kept = [s for s in self.servers if s.index < keep[s.task_type]]
        leaving = [s for s in self.servers if s.index >= keep[s.task_type]]
        new = [
            (task_type, index)
            for task_type, count in keep.items()
            for index in range(sum(1 for s in kept if s.task_type == task_type), count)
        ]
        # A data worker for each new worker server (--follow): the tf.data service's
        # dispatcher takes it in as it registers.
        data = [i for t, i in new if t == "worker" and self.dispatcher]
        # At once: never the same port twice, nor a data worker's (bound only once the
        # dispatcher answers).
        avoid = self.reserved_ports | set(self._data_ports.values())
        free = iter(ports.free_ports(3 * len(new) + len(data), avoid=avoid))
        plan = [
            (task_type, index, f"127.0.0.1:{next(free)}", next(free), next(free))
            for task_type, index in new
        ]
        self._data_ports.update((index, next(free)) for index in data)
        previous = self.cluster
        jobs = {"chief": previous.jobs["chief"]}
        for task_type in keep:
            addresses = [s.address for s in kept if s.task_type == task_type]
            addresses += [address for t, _, address, _, _ in plan if t == task_type]
            jobs[task_type] = tuple(addresses)
        self.cluster = ClusterConfig(jobs=jobs)
        self._write_cluster_file(
            [(s.task_type, s.health_port) for s in kept] + [(t, h) for t, _, _, h, _ in plan]
        )
        started = [self._start_server(*task) for task in plan]
        try:
            self._wait(started, timeout=timeout)
        except ServerFailed as err:
            stop_processes([s.proc for s in started])
            self.cluster = previous
            self._write_cluster_file([(s.task_type, s.health_port) for s in self.servers])
            first = str(err).split("; last lines of ")[0]
            log.error("resize refused: %s", err)
            raise Refused(
                f"{first}; the job goes on on the old cluster (see the server logs in "
                f"{self.workdir / 'logs'})"
            ) from None
        self.servers = sorted(kept + started, key=lambda s: (s.task_type, s.index))
        self.retiring += leaving
        if self._tasks_written:
            self.write_tasks()

    def _left(self, server: ServerProcess) -> bool:
        return (
            self.on_left is not None
            and not server.left
            and server.task_type == "worker"
            and server.proc.poll() == 0
            and self.cluster.num_workers > 1
            and not self.dispatcher  # --epochs: its data workers are numbered by index
        )

    def drop(self, server: ServerProcess) -> None:
        """Take a worker that left out of the cluster: the others keep their order and
        take indices 0..N-2 (TensorFlow's servers serve under the index their coordinator
        gives them); the cluster file and task list rewritten."""
        self.servers.remove(server)
        workers = [s for s in self.servers if s.task_type == "worker"]
        for index, worker in enumerate(workers):
            worker.index = index
        jobs = dict(self.cluster.jobs)
        jobs["worker"] = tuple(s.address for s in workers)
        self.cluster = ClusterConfig(jobs=jobs)
        self.servers.sort(key=lambda s: (s.task_type, s.index))
        self._write_cluster_file([(s.task_type, s.health_port) for s in self.servers])
        if self._tasks_written:
            self.write_tasks()

    def drop_tasks(self, tasks: Sequence[tuple[str, int]]) -> list[ServerProcess]:
        """``drop`` the servers of ``tasks`` ((type, index) in the cluster now); returns
        them. Found first, and dropped from the highest index down: each drop renumbers
        the workers after it, and a server dropped keeps the index (and name, for the
        logs) it had in the cluster it leaves."""
        leaving = [s for s in self.servers if (s.task_type, s.index) in tasks]
        for server in sorted(leaving, key=lambda s: s.index, reverse=True):
            self.drop(server)
        return leaving

    def mark_left(self, addresses: Sequence[str]) -> tuple[str, str]:
        """Servers that left while a training process runs: marked (``"left": true`` in
        the tasks file, never restarted) but kept at their indices, which that process
        still uses; ``drop_left`` takes them out before the next one starts. Returns
        (old shape, new shape)."""

        def members() -> str:
            counts = [
                sum(s.task_type == kind and not s.left for s in self.servers)
                for kind in ("ps", "worker")
            ]
            return shape_of(*counts)

        old = members()
        for server in self.servers:
            if server.address in addresses:
                server.left = True
        if self._tasks_written:
            self.write_tasks()
        return old, members()

    def drop_left(self) -> None:
        """Before a training process starts: the servers that left go out of the cluster
        (the others renumbered); those still draining are stopped by ``retire``."""
        self.retiring += self.drop_tasks([(s.task_type, s.index) for s in self.servers if s.left])

    def retire(self) -> None:
        """Stop the servers a resize took out of the cluster."""
        leaving, self.retiring = self.retiring, []
        if leaving:
            log.info("stopping %s (out of the cluster)", ", ".join(s.name for s in leaving))
            stop_processes([s.proc for s in leaving], signum=signal.SIGINT)

    def _start_server(
        self, task_type: str, index: int, address: str, health_port: int, metrics_port: int
    ) -> ServerProcess:
        log_path = self.workdir / "logs" / f"{task_type}-{index}.log"
        argv = (
            server_argv(task_type)
            + [
                "--cluster",
                str(self.cluster_file),
                "--index",
                str(index),
                "--health-port",
                str(health_port),
                "--metrics-port",
                str(metrics_port),
                "--bind-host",
                "127.0.0.1",
            ]
            + (["--verbose"] if self.verbose else [])
        )
        if task_type == "worker" and index in self._data_ports:
            argv += ["--data-port", str(self._data_ports[index])]
        proc = spawn(argv, log_path=log_path, nice=SERVER_NICE)
        return ServerProcess(task_type, index, address, health_port, metrics_port, log_path, proc)

    def write_tasks(self) -> None:
        """tasks.json: every task with its health address, metrics URL and pid, for the
        coordinator's status (the chief's pid is filled in by the coordinator itself); and
        targets.json, the same processes as Prometheus file_sd targets."""
        chief_metrics = f"127.0.0.1:{self.coordinator_metrics_port}"
        tasks: list[dict[str, Any]] = [
            {
                "type": "chief",
                "index": 0,
                "address": self.cluster.chief or "",
                "metrics_url": f"http://{chief_metrics}/metrics",
            }
        ]
        targets = [_target(chief_metrics, "psctl-coordinator", "chief", 0)]
        for s in self.servers:
            metrics = f"127.0.0.1:{s.metrics_port}"
            tasks.append(
                {
                    "type": s.task_type,
                    "index": s.index,
                    "address": s.address,
                    "health_address": s.health_address,
                    "metrics_url": f"http://{metrics}/metrics",
                    "pid": s.proc.pid,
                    **({"left": True} if s.left else {}),
                }
            )
            if not s.left:  # out of the cluster: no scrape of it, no alert that it is down
                targets.append(_target(metrics, f"psctl-{s.task_type}", s.task_type, s.index))
        # Each written whole then renamed: Prometheus and training processes may read them at
        # any moment; a restarted server rewrites them (its new pid).
        write_json_atomic(self.tasks_file, tasks)
        write_json_atomic(self.targets_file, targets)
        self._tasks_written = True

    def wait_serving(self, *, timeout: float, tick: Callable[[], None] = lambda: None) -> None:
        """Bounded wait for every server's health; a failed server shows its last log lines.
        ``tick()`` each round (it may raise: the wait ends there)."""
        self._wait(self.servers, timeout=timeout, tick=tick)

    def _wait(
        self,
        servers: Sequence[ServerProcess],
        *,
        timeout: float,
        tick: Callable[[], None] = lambda: None,
    ) -> None:
        """Every server checked at once each round (a round costs at most its deadline,
        however many servers); progress as one "N of M servers SERVING" line."""
        deadline = time.monotonic() + timeout
        pending = list(servers)
        progress = _Progress(len(pending))
        checker = HealthChecker()
        try:
            while pending:
                for server in pending:
                    code = server.proc.poll()
                    if code is not None:
                        raise ServerFailed(
                            f"{server.name} exited with status {code} during start-up; "
                            f"last lines of {server.log_path}:\n{server.last_log_lines()}"
                        )
                tick()
                results = checker.check_all([s.health_address for s in pending], timeout=1.0)
                pending = [s for s in pending if not results[s.health_address].serving]
                progress.show(len(servers) - len(pending))
                if not pending:
                    return
                if time.monotonic() >= deadline:
                    server = pending[0]
                    raise ServerFailed(
                        f"{len(pending)} of {len(servers)} servers not SERVING after "
                        f"{timeout:.0f}s ({', '.join(s.name for s in pending[:8])}"
                        f"{', ...' if len(pending) > 8 else ''}); a larger --start-timeout "
                        f"gives them longer; "
                        f"last lines of {server.log_path}:\n{server.last_log_lines()}"
                    )
                time.sleep(0.5)
        finally:
            progress.done()
            checker.close()

    def restart_failed_servers(self) -> None:
        """psctl local's restart policy (systemd's Restart=on-failure in production): a
        server that died is started again on the same ports, with backoff, in budget. A
        worker that exited 0 was stopped (SIGTERM: a preemption notice) and has left: with
        ``on_left`` set, it is handed over (a resize without it), not restarted."""
        for server in [s for s in self.servers if self._left(s)]:
            assert self.on_left is not None
            self.on_left(server)
        now = time.monotonic()
        for i, server in enumerate(self.servers):
            code = server.proc.poll()
            if code is None or server.left:
                continue
            due = self._restart_due.get(server.name)
            if due is None:
                budget = self._budgets.setdefault(server.name, RestartBudget(self.policy))
                if not budget.allow(now):
                    continue  # out of budget: stays down; the coordinator reports it
                delay = self.policy.delay(len(budget.times))
                self._restart_due[server.name] = now + delay
                log.warning(
                    "%s %s; restarting it in %.1fs", server.name, describe_exit(code), delay
                )
                if server.task_type == "ps":
                    self.counters.ps_failures += 1
                else:
                    self.counters.worker_failures += 1
            elif now >= due:
                del self._restart_due[server.name]
                self.servers[i] = self._start_server(
                    server.task_type,
                    server.index,
                    server.address,
                    server.health_port,
                    server.metrics_port,
                )
                log.info("%s restarted (pid %d)", server.name, self.servers[i].proc.pid)
                if self._tasks_written:
                    self.write_tasks()

    def stop(self) -> None:
        # SIGINT: stop at once. SIGTERM (a preemption notice) would drain for --shutdown-grace.
        stop_processes([s.proc for s in self.servers + self.retiring], signum=signal.SIGINT)


def _target(address: str, job: str, task_type: str, index: int) -> dict[str, Any]:
    labels = {"job": job, "task_type": task_type, "task_index": str(index)}
    return {"targets": [address], "labels": labels}


class _Progress:
    """One "N of M servers SERVING" line while servers start: rewritten in place on a
    terminal, else logged when it changed, at most every ``PROGRESS_SECONDS``."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.started = time.monotonic()
        self.tty = sys.stderr.isatty()
        self._shown = -1
        self._logged_at = self.started

    def show(self, serving: int) -> None:
        if serving == self._shown:
            return
        now = time.monotonic()
        line = f"{serving} of {self.total} servers SERVING ({now - self.started:.0f}s)"
        if self.tty:
            print(f"\r{line}", end="", file=sys.stderr, flush=True)
        elif now - self._logged_at < PROGRESS_SECONDS and serving < self.total:
            return
        else:
            log.info("%s", line)
            self._logged_at = now
        self._shown = serving

    def done(self) -> None:
        if self.tty and self._shown >= 0:
            print(file=sys.stderr, flush=True)


class FrozenServerWatchdog:
    """Kills a server that stopped answering its health checks (SIGKILL), so that
    ``LocalCluster.restart_failed_servers`` starts it again. Armed for a process once it has
    answered: one still starting is ``wait_serving``'s to judge."""

    def __init__(
        self,
        servers: Callable[[], Sequence[ServerProcess]],
        *,
        timeout: float = WATCHDOG_SECONDS,
        interval: float = 2.0,
    ) -> None:
        self.servers = servers
        self.timeout = timeout
        self.interval = interval
        self.killed: list[str] = []
        self._answered: dict[int, float] = {}  # pid -> when its health service last answered
        self._checker = HealthChecker()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="psctl-watchdog", daemon=True)

    def start(self) -> FrozenServerWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval + 5.0)
        self._checker.close()

    def _run(self) -> None:
        said = ""
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception as err:  # one failed look must not end the watch
                # (seen: "can't start new thread" on a machine out of threads)
                if str(err) != said:
                    said = str(err)
                    log.warning("frozen-server watchdog: a check failed (%s); trying again", err)

    def check(self) -> None:
        """One look at every server, all at once (one health check's deadline bounds it)."""
        servers = [s for s in self.servers() if s.proc.poll() is None]
        for pid in set(self._answered) - {s.proc.pid for s in servers}:
            del self._answered[pid]
        results = self._checker.check_all(
            [s.health_address for s in servers], timeout=min(2.0, self.timeout / 3)
        )
        now = time.monotonic()
        for server in servers:
            pid = server.proc.pid
            if results[server.health_address].status != "UNREACHABLE":
                self._answered[pid] = now
                continue
            last = self._answered.get(pid)
            if last is None or now - last < self.timeout or self._stop.is_set():
                continue
            log.warning(
                "%s (pid %d) has not answered a health check for %.0fs (frozen?): killing it "
                "to start it again",
                server.name,
                pid,
                now - last,
            )
            server.proc.kill()
            self._answered.pop(pid, None)
            self.killed.append(server.name)


class ServerFailed(Exception):
    exit_status = EXIT_FAILURE


class JobRejected(Exception):
    """The first training process ended with exit 78 (the job's own mistake, its one line
    printed) while the servers started: no reason to wait for them."""


def _rejected(training: subprocess.Popen[bytes]) -> None:
    if training.poll() == EXIT_CONFIG:
        raise JobRejected


def default_start_timeout(servers: int, cpus: int | None = None) -> float:
    """``--start-timeout``'s default: 120 s, or 3 times what the servers' start needs."""
    cpus = cpus or os.cpu_count() or 1
    return max(START_TIMEOUT, 3 * SERVER_START_CPU_SECONDS * servers / cpus)


def default_workdir() -> Path:
    return Path("psctl-work") / time.strftime("local-%Y%m%d-%H%M%S")


def train_argv(
    local: LocalCluster,
    flags: dict[str, Any],
    args: argparse.Namespace,
    security: ControlSecurity | None = None,
    control_address: str = "",
) -> list[str]:
    """The training process's command line; ``security``: its control credentials,
    ``control_address``: where it listens (the launcher's private socket; default
    ``--control-address``)."""
    argv = psctl_argv(
        "train",
        "--cluster",
        str(local.cluster_file),
        "--tasks-file",
        str(local.tasks_file),
        "--control-address",
        control_address or args.control_address,
        "--metrics-port",
        str(local.coordinator_metrics_port),
        "--once",
        *(security.as_argv() if security else []),
    )
    return argv + run_settings_argv(args, flags)


def prepare_local(args: argparse.Namespace, flags: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """`psctl local` in either strategy, before any process starts: its work dir, the run
    settings' defaults there (checkpoints, TensorBoard), and the control address checked
    (port 0: a free one; ``args.control_address`` is set to it)."""
    workdir = Path(args.workdir) if args.workdir else default_workdir()
    # Its places below are flags' defaults: a work dir that cannot be written is named so.
    require_creatable_dir(str(workdir), field="--workdir")
    flags = dict(flags)
    # The work dir's places are defaults: below a flag, PSCTL_<NAME> and --config's [train]
    # (they were put in as flags, above the config file's, which was then ignored).
    configured = load_toml(args.config) if getattr(args, "config", None) else {}
    for name, place in (("checkpoint_dir", "checkpoints"), ("logdir", "tensorboard")):
        if not flags.get(name) and not os.environ.get(env_name(name)) and name not in configured:
            flags[name] = str(workdir / place)
    control = Address.parse(args.control_address, field="--control-address", allow_port_zero=True)
    if control.port == 0:
        control = control.with_port(ports.free_ports(1, control.host)[0])
    else:  # fail before starting any server
        ports.check_port_free(control.port, host=control.host, field="--control-address")
    args.control_address = str(control)
    ControlSecurity.from_args(args, os.environ).check_server(args.control_address)
    return workdir, flags


def local_ps_main(
    args: argparse.Namespace, flags: dict[str, Any], workdir: Path, settings: TrainSettings
) -> int:
    """`psctl local` in the parameter-server mode: ps and worker servers, a coordinator."""
    local = LocalCluster(
        num_ps=args.ps,
        num_workers=args.workers,
        workdir=workdir,
        verbose=args.verbose,
        data_service=settings.data_service,
        # Bound only later, by the control front: not a port for a server.
        reserved_ports=(Address.parse(args.control_address, field="--control-address").port,),
    )
    local.counters.launched = getattr(args, "started", 0.0) or time.time()
    log.info("work dir %s", workdir)
    if args.start_timeout is None:
        args.start_timeout = default_start_timeout(len(local.cluster.tasks()) - 1)
    # A signal before the coordinator starts must still stop the servers: raise into `finally`.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _raise_interrupt)
    # The job's tokens in this user's runtime directory: the same user's `psctl status` /
    # `stop --address ADDR` find them; every training process is given them and listens
    # behind this process's control front, which answers while one restarts.
    security = ControlSecurity.from_args(args, os.environ)
    watchdog = FrozenServerWatchdog(lambda: local.servers)
    assembly = TrainingAssembly(
        job=settings.job, control_address=args.control_address, security=security
    )
    # The first training process starts with the servers: its TensorFlow import and its
    # check of the job overlap their start-up (it waits for their ports itself).
    first: subprocess.Popen[bytes] | None = None
    early: list[subprocess.Popen[bytes]] = []  # first, until the supervisor takes it
    try:
        with assembly:
            local.start()
            local.write_tasks()
            argv = train_argv(local, flags, args, assembly.security, assembly.address)

            def start(counters: Counters, *extra: str) -> subprocess.Popen[bytes]:
                if early:
                    return early.pop()
                # Without the launcher the servers go too, and a coordinator waiting for them
                # would wait forever: it gets SIGKILL (its periodic checkpoints remain).
                local.drop_left()  # workers that left while the last process ran
                local.retire()  # a resize's leaving servers: the last process is gone
                return spawn_training(
                    [*argv, *extra, "--supervisor-counters", counters.handed()],
                    verbose=args.verbose,
                )

            # It waits for the servers' ports as long as this process waits for them to
            # serve (--start-timeout): the servers' start is judged here.
            wait = max(args.start_timeout, settings.supervision.connect_timeout)
            first = start(local.counters, "--connect-timeout", f"{wait:g}")
            early.append(first)
            source = str(local.cluster_file)
            if len(local.servers) <= TABLE_MAX_SERVERS:
                print(format_table(local.cluster, source=source), flush=True)
            else:
                print(summary(local.cluster, source=source), flush=True)
            started = time.monotonic()
            try:
                local.wait_serving(timeout=args.start_timeout, tick=partial(_rejected, first))
                log.info(
                    "%d servers SERVING in %.1fs (logs in %s)",
                    len(local.servers),
                    time.monotonic() - started,
                    workdir / "logs",
                )
            except JobRejected:  # its one line is out; the supervisor ends the job with 78
                pass
            watchdog.start()
            log.info("psctl status --address %s: the job's status", args.control_address)

            def left(server: ServerProcess) -> None:
                log.warning("%s (pid %d) left: stopped by a signal", server.name, server.proc.pid)
                if assembly.supervisor is not None:  # it ticks this: it is running
                    assembly.supervisor.depart([(server.task_type, server.index, server.address)])

            local.on_left = left
            try:
                return assembly.run(
                    start,
                    policy=RestartPolicy(max_restarts=settings.supervision.max_restarts),
                    tick=local.restart_failed_servers,
                    counters=local.counters,
                    finish_after_stop=True,
                    resizing=Resizing(
                        prepare=local_prepare(
                            local,
                            timeout=args.start_timeout,
                            exactly_once=settings.exactly_once_flag,
                        ),
                        cluster=lambda: local.cluster,
                        without=lambda tasks: local.mark_left([address for _, _, address in tasks]),
                        checkpoints=bool(settings.checkpoints.checkpoint_dir),
                    ),
                )
            finally:
                if assembly.supervisor is not None and assembly.supervisor.child is not None:
                    stop_processes([assembly.supervisor.child], timeout=60.0)
    except ServerFailed as err:
        print(f"psctl: error: {err}", file=sys.stderr)
        return err.exit_status
    finally:
        watchdog.stop()
        if first is not None and first.poll() is None:  # the servers failed to start
            stop_processes([first], timeout=60.0)
        local.stop()
        log.info("all servers stopped")


def _raise_interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt
