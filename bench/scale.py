"""Many workers: N worker tasks (default 8, 32, 128) and 1-4 ps on this one machine, psctl's
coordinator (``psctl train``) training the built-in ``mlp`` job to a step count.

Hosting. A TensorFlow process costs about 350 MB (PSS) and several CPU-seconds of import, so
128 server processes would not fit 2 cores and 24 GiB; several ``tf.distribute.Server`` tasks
share a host process instead (``--tasks-per-host``, default 16; this file's ``--host`` mode),
each with small thread pools (workers: ``--worker-threads`` inter-op threads; a ps:
max(N + 2, 16), as psctl's servers). Each ps has a process of its own (the ps do the work), the
last worker too (the one this bench kills). The coordinator always runs in its own process:
32 in-process servers and a ``ClusterCoordinator`` in ONE process trained no step in 300 s
once (docs/performance.md, "Many workers"). Every host serves one grpc.health.v1 port that
stands for all its tasks, given to the coordinator in a tasks file as ``psctl local``'s.

Per N, in order:

start-up      host processes started, until every one is SERVING (all tasks created)
MB/task       the hosts' memory over their tasks: RSS, and PSS (shared library pages
              counted once over the processes that map them)
dispatch      calls/s of ``ClusterCoordinator.schedule`` of an almost empty function, in a
              coordinator process of its own (bench/throughput.py's ``dispatch`` mode)
first step    from ``psctl train``'s start (import, connect, build, trace) to its first
              progress line
steps/s       the summary's (one step = one batch on one worker)
coord CPU     the coordinator's CPU-seconds per second while it trains (1.0 = one core
              busy) and its peak RSS; machine CPU: every process's share of the 2 cores
status        ``psctl status`` wall time (the CLI, median of 3; the RPC alone, median of
              5), and how many tasks it listed SERVING
kill          the lone worker SIGKILLed mid-run: seconds until the coordinator's health
              poll logged it down (notice), the longest stretch without a progress line
              showing a new step in the --down-seconds it stays down (its in-flight call
              runs again elsewhere; a loop waiting on it shows here), then its host is
              started again on the same ports and the seconds until the coordinator logged
              it SERVING again (n/a: the job ended first)
series        the coordinator's /metrics series (Prometheus samples) at the end
limit         what limited steps/s: the coordinator's CPU (>= 0.8 of a core), else the
              machine's (>= 90% of its cores busy), else the round trips to the ps

Printed: a line per phase, a table, and last::

    scale: largest N trained = <N>, dispatch calls/s at 32 = <C>

(C is n/a when 32 was not run). ``results.json`` and every process's log go to ``--out``
(default ``bench/results/scale-<time>/``).

    .venv/bin/python bench/scale.py                    # N = 8, 32, 128: ~15 min on 2 cores
    .venv/bin/python bench/scale.py --workers 8,32 --steps 2000
    .venv/bin/python bench/scale.py --quick            # N = 4, 2000 steps: about a minute
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import throughput  # noqa: E402
from bench.elastic import PROGRESS, start_job  # noqa: E402
from bench.embeddings import memory_mb  # noqa: E402
from bench.harness import results_dir  # noqa: E402
from psctl.cluster.health import HealthChecker  # noqa: E402
from psctl.cluster.ports import free_ports  # noqa: E402
from psctl.cluster.processes.files import write_json_atomic  # noqa: E402
from psctl.cluster.processes.procs import spawn, stop_processes  # noqa: E402
from psctl.coordinator.argv import psctl_argv  # noqa: E402

LAST_LINE = "scale: largest N trained"
DOWN = r"worker:{} is (UNREACHABLE|NOT_SERVING|UNKNOWN)"  # .format(the killed one's index)
BACK = r"worker:{} is SERVING again"
LOG_EVERY = 0.5  # seconds between the job's progress lines


# -- host mode: K in-process servers --------------------------------------------------------


def host_main(args: argparse.Namespace) -> int:
    """Start every task in ``--tasks`` (type:index,...) as an in-process TF server, then
    health SERVING on ``--health-port``; serve until a signal."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    from psctl.cluster.health import HealthService
    from psctl.cluster.processes.logs import tensorflow_import_quietly

    # Nothing to drain: a signal ends the process at once (TF servers cannot be stopped).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: os._exit(0))
    health = HealthService(host="127.0.0.1", port=args.health_port, max_workers=2)
    with tensorflow_import_quietly():
        import tensorflow as tf

    cluster = json.loads(Path(args.cluster).read_text())["cluster"]
    spec = tf.train.ClusterSpec(cluster)
    servers = []
    for task in args.tasks.split(","):
        task_type, index = task.split(":")
        threads = args.ps_threads if task_type == "ps" else args.worker_threads
        config = tf.compat.v1.ConfigProto(
            inter_op_parallelism_threads=threads, intra_op_parallelism_threads=1
        )
        servers.append(
            tf.distribute.Server(
                spec, job_name=task_type, task_index=int(index), config=config, start=True
            )
        )
    health.set_serving(True)
    print(f"host {os.getpid()}: {len(servers)} task(s) serving", flush=True)
    while True:
        time.sleep(3600)


@dataclass
class Host:
    tasks: list[tuple[str, int]]
    health_port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def health_address(self) -> str:
        return f"127.0.0.1:{self.health_port}"


@dataclass
class Cluster:
    """One N's tasks and the host processes that run them."""

    num_workers: int
    num_ps: int
    out: Path
    args: argparse.Namespace
    hosts: list[Host] = field(default_factory=list)

    def __post_init__(self) -> None:
        n, ps = self.num_workers, self.num_ps
        tf_ports = free_ports(1 + ps + n)
        self.cluster = {
            "chief": [f"127.0.0.1:{tf_ports[0]}"],
            "ps": [f"127.0.0.1:{p}" for p in tf_ports[1 : 1 + ps]],
            "worker": [f"127.0.0.1:{p}" for p in tf_ports[1 + ps :]],
        }
        groups: list[list[tuple[str, int]]] = [[("ps", i)] for i in range(ps)]
        workers = [("worker", i) for i in range(n - 1)]
        k = self.args.tasks_per_host
        groups += [workers[i : i + k] for i in range(0, len(workers), k)]
        if self.args.quick:  # one TensorFlow import fewer: the ps beside the workers
            groups = [[task for group in groups for task in group]]
        groups.append([("worker", n - 1)])  # alone: the one killed
        health = free_ports(len(groups))
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for group, port in zip(groups, health, strict=True):
            name = f"{group[0][0]}-{group[0][1]}" + (f"-{group[-1][1]}" if len(group) > 1 else "")
            self.hosts.append(Host(group, port, logs / f"host-{name}.log"))
        self.cluster_file = self.out / "cluster.json"
        self.tasks_file = self.out / "tasks.json"
        write_json_atomic(self.cluster_file, {"cluster": self.cluster})

    @property
    def victim(self) -> Host:
        return self.hosts[-1]

    def start_host(self, host: Host) -> None:
        threads = max(self.num_workers + 2, 16)
        worker_threads = self.args.worker_threads or max(16, 2 * len(host.tasks) + 2)
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--host",
            "--cluster",
            str(self.cluster_file),
            "--tasks",
            ",".join(f"{t}:{i}" for t, i in host.tasks),
            "--health-port",
            str(host.health_port),
            "--ps-threads",
            str(threads),
            "--worker-threads",
            str(worker_threads),
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        # nice 0, not psctl local's SERVER_NICE: on a machine shared with other work at nice
        # 0, hosts at 10 were starved (3 hosts not SERVING after 4 min at load 27).
        host.proc = spawn(argv, log_path=host.log_path, env=env)

    def start(self, timeout: float) -> float:
        started = time.monotonic()
        for host in self.hosts:
            self.start_host(host)
        self.wait_serving(self.hosts, timeout=timeout)
        self.write_tasks()
        return time.monotonic() - started

    def wait_serving(self, hosts: list[Host], *, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        checker = HealthChecker()
        try:
            pending = list(hosts)
            while pending:
                for host in pending:
                    assert host.proc is not None
                    if host.proc.poll() is not None:
                        tail = host.log_path.read_text(errors="replace")[-2000:]
                        raise SystemExit(f"scale: a host exited ({host.proc.returncode}):\n{tail}")
                results = checker.check_all([h.health_address for h in pending], timeout=1.0)
                pending = [h for h in pending if not results[h.health_address].serving]
                if pending and time.monotonic() > deadline:
                    raise SystemExit(f"scale: {len(pending)} hosts not SERVING in {timeout:.0f}s")
                time.sleep(0.5)
        finally:
            checker.close()

    def write_tasks(self) -> None:
        """psctl local's tasks file: each task's health is its host's."""
        health = {task: h.health_address for h in self.hosts for task in h.tasks}
        pids = {task: h.proc.pid if h.proc else 0 for h in self.hosts for task in h.tasks}
        tasks: list[dict[str, Any]] = [
            {"type": "chief", "index": 0, "address": self.cluster["chief"][0]}
        ]
        for task_type in ("ps", "worker"):
            for index, address in enumerate(self.cluster[task_type]):
                key = (task_type, index)
                tasks.append(
                    {
                        "type": task_type,
                        "index": index,
                        "address": address,
                        "health_address": health[key],
                        "pid": pids[key],
                    }
                )
        write_json_atomic(self.tasks_file, tasks)

    def memory(self) -> dict[str, float]:
        """MB per task over the worker hosts: RSS and PSS (the shared libraries once)."""
        rss = pss = 0.0
        tasks = 0
        for host in self.hosts:
            if host.proc is None or host.tasks[-1][0] != "worker":
                continue
            rss += memory_mb(host.proc.pid, "VmRSS") or 0.0
            pss += _pss_mb(host.proc.pid)
            tasks += len(host.tasks)
        ps = [h for h in self.hosts if h.tasks[0][0] == "ps" and h.proc is not None]
        # (--quick: the ps share a host with workers; their RSS is the host's)
        return {
            "worker_rss_mb_per_task": rss / max(1, tasks),
            "worker_pss_mb_per_task": pss / max(1, tasks),
            "ps_rss_mb": max((memory_mb(h.proc.pid, "VmRSS") or 0.0) for h in ps if h.proc),
            "hosts": len(self.hosts),
            "threads_per_worker_task": _threads(self.hosts[-1]),
        }

    def stop(self) -> None:
        stop_processes([h.proc for h in self.hosts if h.proc is not None], timeout=10.0)


def _pss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _threads(host: Host) -> int:
    """Threads of a one-task host less a bare Python process's few."""
    if host.proc is None:
        return 0
    try:
        return len(os.listdir(f"/proc/{host.proc.pid}/task"))
    except OSError:
        return 0


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a live process; NaN once it has exited (or is a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    if fields[0] == "Z":
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy() -> tuple[float, float]:
    """(busy, total) CPU jiffies of the whole machine, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    return float(sum(values) - idle), float(sum(values))


# -- one N ----------------------------------------------------------------------------------


def dispatch(cluster: Cluster, args: argparse.Namespace) -> float:
    """Calls/s of an almost empty scheduled function (bench/throughput.py's dispatch mode)."""
    argv = [
        sys.executable,
        str(REPO / "bench" / "throughput.py"),
        "--run-mode",
        "dispatch",
        "--cluster",
        str(cluster.cluster_file),
        "--steps",
        str(args.dispatch_calls),
    ]
    out = cluster.out / "dispatch.out"
    result = throughput.run_measured("dispatch", argv, out, timeout=args.timeout)
    port = int(cluster.cluster["chief"][0].rsplit(":", 1)[1])
    throughput.wait_port_released(port, timeout=30)
    return float(result["steps_per_sec"])


class Sampler(threading.Thread):
    """The coordinator's CPU and RSS, and the machine's CPU, every second."""

    def __init__(self, pid: int) -> None:
        super().__init__(name="sampler", daemon=True)
        self.pid = pid
        self.done = threading.Event()
        self.rss: list[float] = []
        self.marks: list[tuple[float, float, float, float]] = []  # (t, cpu_s, busy, total)

    def run(self) -> None:
        while not self.done.wait(1.0):
            self.rss.append(memory_mb(self.pid, "VmRSS") or 0.0)
            self.mark()

    def mark(self) -> None:
        busy, total = _machine_busy()
        self.marks.append((time.monotonic(), _cpu_seconds(self.pid), busy, total))

    def between(self, start: float, end: float) -> dict[str, float]:
        inside = [m for m in self.marks if start <= m[0] <= end and m[1] == m[1]]
        if len(inside) < 2:
            return {"coordinator_cpu": float("nan"), "machine_cpu": float("nan")}
        (t0, c0, b0, a0), (t1, c1, b1, a1) = inside[0], inside[-1]
        return {
            "coordinator_cpu": (c1 - c0) / (t1 - t0),
            "machine_cpu": (b1 - b0) / max(1.0, a1 - a0),
        }

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=5)


def time_status(address: str, runs: int) -> tuple[float, int, int]:
    """``psctl status`` wall seconds (median of ``runs - 1``), then tasks listed and how many
    SERVING (the last run, ``--json``)."""
    times = []
    listed = serving = 0
    for i in range(runs):
        json_flag = ["--json"] if i == runs - 1 else []
        started = time.monotonic()
        proc = subprocess.run(
            psctl_argv("status", "--address", address, *json_flag),
            capture_output=True,
            text=True,
            timeout=30,
            cwd=REPO,
            check=False,
        )
        if proc.returncode != 0:
            continue
        if not json_flag:
            times.append(time.monotonic() - started)
            continue
        tasks = json.loads(proc.stdout).get("tasks", [])
        listed = len(tasks)
        serving = sum(1 for t in tasks if t.get("health") == "TASK_HEALTH_SERVING")
    return (statistics.median(times) if times else float("nan")), listed, serving


def time_status_rpc(address: str, runs: int = 5) -> float:
    """The GetStatus RPC alone (what the coordinator costs; the CLI adds Python's start and
    its imports, about 0.3 CPU-seconds): median wall seconds."""
    from psctl.control.v1 import control_pb2
    from psctl.coordinator.operations.client import ControlError, call

    times = []
    for _ in range(runs):
        started = time.monotonic()
        try:
            call(address, "GetStatus", control_pb2.GetStatusRequest())
        except ControlError:  # the job ended meanwhile
            break
        times.append(time.monotonic() - started)
    return statistics.median(times) if times else float("nan")


def scrape_series(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            body = resp.read().decode(errors="replace")
    except OSError:
        return 0
    return sum(1 for line in body.splitlines() if line and not line.startswith("#"))


def steps_in(lines: list[tuple[float, str]]) -> list[tuple[float, int]]:
    found = []
    for at, line in lines:
        match = PROGRESS.match(line)
        if match:
            found.append((at, int(match.group(1))))
    return found


def first_time(lines: list[tuple[float, str]], pattern: re.Pattern[str], after: float) -> float:
    for at, line in lines:
        if at >= after and pattern.search(line):
            return at
    return float("nan")


def longest_gap(steps: list[tuple[float, int]], start: float, end: float) -> float:
    """The longest time without a higher step between ``start`` and ``end``."""
    last_at, last_step, gap = start, -1, 0.0
    for at, step in steps:
        if at < start:
            last_step = step
            continue
        if at > end:
            break
        if step > last_step:
            gap = max(gap, at - last_at)
            last_at, last_step = at, step
    return max(gap, min(end, time.monotonic()) - last_at) if last_step >= 0 else float("nan")


def train(cluster: Cluster, args: argparse.Namespace, row: dict[str, Any]) -> None:
    control, metrics = free_ports(2)
    address = f"127.0.0.1:{control}"
    summary_path = cluster.out / "summary.json"
    argv = psctl_argv(
        "train",
        "--cluster", str(cluster.cluster_file),
        "--tasks-file", str(cluster.tasks_file),
        "--control-address", address,
        "--metrics-port", str(metrics),
        "--job", "mlp",
        "--steps", str(args.steps),
        "--log-every", str(LOG_EVERY),
        "--summary-json", str(summary_path),
        "--connect-timeout", str(args.timeout),
        "--once",  # the training process itself: no supervisor between (its CPU, its RSS)
    )  # fmt: skip
    started = time.monotonic()
    proc, output = start_job(argv, cluster.out / "train.log")
    sampler = Sampler(proc.pid)
    sampler.start()
    deadline = started + args.timeout
    try:

        def wait_for(condition: Any, what: str) -> None:
            while not condition():
                if proc.poll() is not None:
                    raise SystemExit(f"scale: psctl train exited ({proc.returncode}) {what}")
                if time.monotonic() > deadline:
                    raise SystemExit(f"scale: psctl train timed out {what}")
                time.sleep(0.1)

        wait_for(lambda: steps_in(output.snapshot()), "before its first step")
        first_at = steps_in(output.snapshot())[0][0]
        row["first_step_s"] = first_at - started
        # Once the job trains at its pace: status and /metrics, then the kill.
        mark_step = max(1, args.steps // 10)
        wait_for(
            lambda: any(s >= mark_step for _, s in steps_in(output.snapshot())),
            f"before step {mark_step}",
        )
        status_s, listed, serving = time_status(address, runs=2 if args.quick else 4)
        row.update(status_s=status_s, status_tasks=listed, status_serving=serving)
        row["status_rpc_s"] = time_status_rpc(address)
        row["series"] = scrape_series(metrics)
        row["kill_step"] = steps_in(output.snapshot())[-1][1]
        victim = cluster.victim
        assert victim.proc is not None
        killed_at = time.monotonic()
        victim.proc.kill()
        victim.proc.wait()
        time.sleep(args.down_seconds)
        cluster.start_host(victim)
        cluster.wait_serving([victim], timeout=args.timeout)
        cluster.write_tasks()  # the new pid
        restarted_at = time.monotonic()
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        ended = time.monotonic()
        output.join(timeout=10)
        lines = output.snapshot()
        if code != 0:
            tail = "\n".join(line for _, line in lines[-15:])
            raise SystemExit(f"scale: psctl train exited with {code}:\n{tail}")
        steps = steps_in(lines)
        down, back = (re.compile(p.format(cluster.num_workers - 1)) for p in (DOWN, BACK))
        row["notice_s"] = first_time(lines, down, killed_at) - killed_at
        # Up to the job's last progress line: a job that ended in the window did not stall.
        window_end = min(killed_at + args.down_seconds, steps[-1][0] if steps else killed_at)
        row["stall_after_kill_s"] = longest_gap(steps, killed_at, window_end)
        row["back_s"] = first_time(lines, back, restarted_at) - restarted_at
        summary = json.loads(summary_path.read_text())
        row["steps_per_sec"] = summary["steps_per_sec"]
        row["steps"] = summary["global_step"]
        row["trained"] = summary["global_step"] >= args.steps
        row["steps_per_execution"] = summary["steps_per_execution"]
        row.update(sampler.between(first_at, ended))
        row["coordinator_rss_mb"] = max(sampler.rss, default=float("nan"))
        row["load"] = os.getloadavg()[0]  # others' work on the machine skews every number
    finally:
        sampler.stop()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_n(n: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    num_ps = args.ps or min(4, max(1, n // 32))
    row: dict[str, Any] = {"workers": n, "ps": num_ps, "trained": False}
    cluster = Cluster(n, num_ps, out / f"n{n}", args)
    try:
        row["start_s"] = cluster.start(timeout=args.timeout)
        row.update(cluster.memory())
        print(
            f"N={n}: {len(cluster.hosts)} hosts SERVING in {row['start_s']:.1f}s, "
            f"{row['worker_pss_mb_per_task']:.0f} MB/worker task (PSS)",
            flush=True,
        )
        row["dispatch_calls_per_s"] = dispatch(cluster, args)
        print(f"N={n}: dispatch {row['dispatch_calls_per_s']:.0f} calls/s", flush=True)
        train(cluster, args, row)
        row["limit"] = limit(row)
        print(f"N={n}: {row['steps_per_sec']:.0f} steps/s, limited by {row['limit']}", flush=True)
    except (SystemExit, Exception) as err:  # recorded: the next N still runs
        row["error"] = str(err).splitlines()[0]
        print(f"N={n}: FAILED: {err}", flush=True)
    finally:
        cluster.stop()
    return row


def limit(row: dict[str, Any]) -> str:
    if row.get("coordinator_cpu", 0) >= 0.8:
        return "coordinator CPU"
    if row.get("machine_cpu", 0) >= 0.9:
        return f"machine CPU ({os.cpu_count()} cores)"
    return "ps round trips"


def _f(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "n/a"
    return format(value, fmt)


COLUMNS = (
    ("N", "workers", "d"),
    ("ps", "ps", "d"),
    ("hosts", "hosts", "d"),
    ("start s", "start_s", ".1f"),
    ("MB/task rss", "worker_rss_mb_per_task", ".0f"),
    ("MB/task pss", "worker_pss_mb_per_task", ".0f"),
    ("dispatch/s", "dispatch_calls_per_s", ".0f"),
    ("1st step s", "first_step_s", ".1f"),
    ("steps/s", "steps_per_sec", ".0f"),
    ("K", "steps_per_execution", "d"),
    ("coord CPU", "coordinator_cpu", ".2f"),
    ("coord MB", "coordinator_rss_mb", ".0f"),
    ("machine CPU", "machine_cpu", ".0%"),
    ("status s", "status_s", ".2f"),
    ("rpc s", "status_rpc_s", ".3f"),
    ("listed", "status_tasks", "d"),
    ("serving", "status_serving", "d"),
    ("notice s", "notice_s", ".1f"),
    ("no line s", "stall_after_kill_s", ".1f"),
    ("back s", "back_s", ".1f"),
    ("series", "series", "d"),
    ("load", "load", ".1f"),
    ("limit", "limit", "s"),
)


def table(rows: list[dict[str, Any]]) -> list[str]:
    cells = [[c[0] for c in COLUMNS]]
    cells += [[_f(r.get(key), fmt) for _, key, fmt in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return lines


def last_line(rows: list[dict[str, Any]]) -> str:
    trained = [r["workers"] for r in rows if r.get("trained")]
    at32 = [r.get("dispatch_calls_per_s") for r in rows if r["workers"] == 32]
    dispatch_32 = _f(at32[0] if at32 else None, ".0f")
    return f"{LAST_LINE} = {max(trained, default=0)}, dispatch calls/s at 32 = {dispatch_32}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="N worker tasks on this machine, psctl train driving them (see the docstring)"
    )
    parser.add_argument("--workers", default="8,32,128", help="N values (default %(default)s)")
    parser.add_argument("--ps", type=int, default=0, help="ps tasks (default: N/32, 1 to 4)")
    parser.add_argument("--steps", type=int, default=3000, help="steps to train (default 3000)")
    parser.add_argument(
        "--tasks-per-host", type=int, default=16, help="worker tasks per host process (16)"
    )
    parser.add_argument(
        "--worker-threads",
        type=int,
        default=0,
        help="a worker task's inter-op threads (default: max(16, 2 x its host's tasks + 2); "
        "4 with 7 tasks in a host trained no step in 60 s)",
    )
    parser.add_argument("--dispatch-calls", type=int, default=2000, help="(default 2000)")
    parser.add_argument(
        "--down-seconds", type=float, default=10.0, help="the killed worker stays down (10)"
    )
    # 128 tasks on 2 cores: about 390 s to the first step and 4 steps/s (measured), so a
    # phase of 3000 steps needs about 1100 s.
    parser.add_argument("--timeout", type=float, default=1500.0, help="per phase (1500 s)")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke test: N = 4, 2000 steps, ps beside workers"
    )
    parser.add_argument("--out", help="results dir (default bench/results/scale-TIME)")
    # Internal: a host process of in-process servers.
    parser.add_argument("--host", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    parser.add_argument("--tasks", help=argparse.SUPPRESS)
    parser.add_argument("--health-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ps-threads", type=int, default=16, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.host:
        return host_main(args)
    if args.quick:
        args.workers, args.steps, args.dispatch_calls, args.down_seconds = "4", 2000, 300, 2.0
        args.timeout = min(args.timeout, 120.0)
    ns = [int(n) for n in args.workers.split(",")]
    if any(n < 2 for n in ns):
        build_parser().error("--workers: each N must be >= 2 (one worker is killed)")
    out = results_dir(args.out, "scale")
    print(f"scale: N = {ns}, {args.steps} steps, results in {out}", flush=True)
    print(throughput._load(), flush=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, throughput._raise_interrupt)
    rows = []
    for n in ns:
        rows.append(run_n(n, args, out))
        write_json_atomic(out / "results.json", rows)
    lines = table(rows)
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(last_line(rows), flush=True)
    return 0 if all(r.get("trained") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
