"""How fast `psctl status` answers while a job trains, with and without open watch streams.

Starts `psctl local` (default job, enough steps to outlast the bench), waits until it trains,
times `--runs` `psctl status` processes and as many GetStatus RPCs alone (a fresh channel
each, as the CLI makes), then opens `--watch-streams` WatchStatus streams (kept read, as
`psctl watch` does) and times both again; prints median and p99 beside the target, then
`psctl stop` must end the job. See bench/README.md.

    .venv/bin/python bench/control_latency.py                 # ~3 min on 2 cores
    .venv/bin/python bench/control_latency.py --runs 10 --watch-streams 100
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

# This process forks a `psctl status` per timed run while its own gRPC threads serve 100
# streams: gRPC's fork handlers (on by default) would charge their wait to every run, a
# cost an operator's shell never pays. psctl's own launchers turn them off the same way
# (coordinator/cli/__init__.py).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc

from psctl.cluster.ports import free_ports
from psctl.control.v1 import control_pb2
from psctl.coordinator.argv import psctl_argv
from psctl.coordinator.operations.client import ControlError, Target, call
from psctl.coordinator.operations.stubs import control_stub

TARGET_MEDIAN, TARGET_P99 = 0.3, 1.0  # seconds, for `psctl status` with the streams open


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def time_cli(address: str, runs: int, cpu: list[float] | None = None) -> list[float]:
    """Wall time of ``runs`` `psctl status` processes; their CPU time (user + system) is
    appended to ``cpu``: what the client costs apart from waiting for a core."""
    times = []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.monotonic()
        proc = subprocess.run(
            psctl_argv("status", "--address", address), capture_output=True, text=True, timeout=60
        )
        times.append(time.monotonic() - started)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if cpu is not None:
            cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        if proc.returncode != 0:
            raise SystemExit(f"psctl status failed ({proc.returncode}): {proc.stderr.strip()}")
    return times


def time_rpc(address: str, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        started = time.monotonic()
        call(Target.of(address), "GetStatus", control_pb2.GetStatusRequest(), timeout=30)
        times.append(time.monotonic() - started)
        time.sleep(0.05)
    return times


class Watchers:
    """``count`` WatchStatus streams over a few channels, each drained by its own thread."""

    def __init__(self, address: str, count: int) -> None:
        target = Target.of(address)
        self.channels = [grpc.insecure_channel(address) for _ in range(max(1, count // 25))]
        self.streams = []
        self.updates = 0
        self._lock = threading.Lock()
        request = control_pb2.WatchStatusRequest(interval_seconds=1.0)
        for i in range(count):
            stub = control_stub(self.channels[i % len(self.channels)])
            self.streams.append(stub.WatchStatus(request, timeout=3600, metadata=target.metadata))
        self.threads = [
            threading.Thread(target=self._drain, args=(s,), daemon=True) for s in self.streams
        ]
        for thread in self.threads:
            thread.start()

    def _drain(self, stream: object) -> None:
        try:
            for _ in stream:  # type: ignore[attr-defined]
                with self._lock:
                    self.updates += 1
        except grpc.RpcError:
            pass

    def wait_first(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.updates < len(self.streams) and time.monotonic() < deadline:
            time.sleep(0.2)
        if self.updates < len(self.streams):
            raise SystemExit(f"only {self.updates} of {len(self.streams)} streams answered")

    def close(self) -> None:
        for stream in self.streams:
            stream.cancel()  # type: ignore[attr-defined]
        for channel in self.channels:
            channel.close()


def row(name: str, times: list[float], target: bool) -> str:
    median, tail = statistics.median(times), p99(times)
    goal = f"  target median < {TARGET_MEDIAN}s, p99 < {TARGET_P99}s" if target else ""
    verdict = ""
    if target:
        verdict = "  MET" if median < TARGET_MEDIAN and tail < TARGET_P99 else "  NOT MET"
    return f"{name:<34} median {median:6.3f}s  p99 {tail:6.3f}s  (n={len(times)}){goal}{verdict}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="timed runs of each kind")
    parser.add_argument("--watch-streams", type=int, default=100)
    parser.add_argument("--steps", type=int, default=10_000_000, help="psctl local --steps")
    parser.add_argument("--workdir", default=f"psctl-work/bench-control-{time.strftime('%H%M%S')}")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    log = (workdir / "local.log").open("w")
    job = subprocess.Popen(
        psctl_argv(
            "local",
            "--workdir",
            str(workdir / "run"),
            "--control-address",
            address,
            "--steps",
            str(args.steps),
            "--checkpoint-every",
            "100000",
        ),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    watchers = None
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                status = call(Target.of(address), "GetStatus", control_pb2.GetStatusRequest())
                if status.global_step > 200:
                    break
            except ControlError:
                pass
            if job.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the job did not start training; see {workdir / 'local.log'}")
            time.sleep(1.0)
        print(
            f"job training on {address} (load average {os.getloadavg()[0]:.1f}, "
            f"{os.cpu_count()} CPUs)",
            flush=True,
        )
        before = call(Target.of(address), "GetStatus", control_pb2.GetStatusRequest())
        results = {
            "cli_no_streams": time_cli(address, args.runs),
            "rpc_no_streams": time_rpc(address, args.runs),
        }
        watchers = Watchers(address, args.watch_streams)
        watchers.wait_first(60)
        mid = call(Target.of(address), "GetStatus", control_pb2.GetStatusRequest())
        cpu: list[float] = []
        results["cli_streams"] = time_cli(address, args.runs, cpu)
        results["cli_streams_cpu"] = cpu
        results["rpc_streams"] = time_rpc(address, args.runs)
        after = call(Target.of(address), "GetStatus", control_pb2.GetStatusRequest())
        n = args.watch_streams
        print(row("psctl status (process), 0 streams", results["cli_no_streams"], False))
        print(row("GetStatus RPC alone, 0 streams", results["rpc_no_streams"], False))
        print(row(f"psctl status (process), {n} streams", results["cli_streams"], True))
        print(row(f"GetStatus RPC alone, {n} streams", results["rpc_streams"], False))
        print(row("psctl status CPU time (user+sys)", cpu, False))
        print(
            f"training: {before.steps_per_second:.0f} steps/s before the streams, "
            f"{mid.steps_per_second:.0f} / {after.steps_per_second:.0f} with them; "
            f"{watchers.updates} watch updates received"
        )
        started = time.monotonic()
        stop = subprocess.run(
            psctl_argv("stop", "--address", address), capture_output=True, text=True, timeout=180
        )
        print(
            f"psctl stop with {n} streams open: exit {stop.returncode} in "
            f"{time.monotonic() - started:.1f}s"
        )
        (workdir / "control_latency.json").write_text(json.dumps(results, indent=1))
        return 0 if stop.returncode == 0 else 1
    finally:
        if watchers is not None:
            watchers.close()
        if job.poll() is None:
            job.terminate()
            try:
                job.wait(60)
            except subprocess.TimeoutExpired:
                job.kill()
                job.wait()
        log.close()


if __name__ == "__main__":
    sys.exit(main())
