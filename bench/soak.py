"""A soak under random faults: one ``psctl local`` job through a seeded schedule of kills,
freezes, preemptions and operator commands that overlap, then every invariant checked.

The job (``mlp`` on 2 ps + 3 workers by default; ``--job``, ``--ps``, ``--workers``,
``--max-shards``, ``--strategy``, ``--epochs`` passed through) trains with checkpoints every
``--checkpoint-every`` steps
while the schedule (``--seed``, ``--minutes``, ``--faults``: about one every 30 s by
default; printed first) injects, at random times, so that recoveries overlap:

``kill-worker``   SIGKILL of a worker server (psctl local restarts it at its address)
``kill-ps``       SIGKILL of a ps server (a new training process restores the checkpoint)
``kill-trainer``  SIGKILL of the training process (its supervisor starts a new one)
``freeze``        SIGSTOP of a worker, a ps or the training process for 2-15 s, then SIGCONT
``preempt``       SIGTERM of a worker server (a preemption notice: it leaves the cluster),
                  then ``psctl scale --workers N`` 15-40 s later: a resize back to N
``pause``         ``psctl pause``, 2-6 s, ``psctl resume``
``checkpoint``    ``psctl checkpoint``
``cut-link``      ``--netns`` only: a worker's, a ps's or the coordinator's link down for
                  2-15 s (``ip link set ... down``: packets dropped silently), then up

``psctl status`` is read twice a second all along (and its CLI run once per fault). Half
way, the operator stops the job (``psctl stop``: a final checkpoint) and starts it again on
the same checkpoint directory with a target step that the measured rate reaches before the
time is up; the faults go on against the second run.

``--netns``: every task on a host of its own (a network namespace, bench/harness/soak_hosts.py): the
servers as their systemd units run them (``ps-server`` / ``worker-server --cluster FILE
--index I``, restarted on failure 1 s later by the soak, systemd's part), the coordinator
``psctl train --cluster FILE`` on host ``chief``, its control API and Prometheus reached
there through ``ip netns exec``; ``cut-link`` joins the schedule, ``preempt`` leaves it (a
resize starts servers: psctl local's part, an operator's on real hosts). Needs root and
iproute2; ``--strategy sync`` and ``--epochs`` are psctl local's only here. ``--rtt MS``:
every connection to a server through bench/harness/netlab.py's relay, delayed MS/2 each way (this
kernel has no netem; loss only as a cut link).

Checked at the end, one ``invariant:`` line each (``held`` or ``BROKEN``):

- the second run reaches its target step (exit 0, the summary's global step); with
  ``--epochs``, the end of its passes;
- its eval accuracy is within 0.01 of a fault-free run of the same seed (``--baseline``:
  ``psctl local`` with the same flags and as many steps, at most ``--baseline-steps``);
- the checkpoints' steps only grow, in the order they were written, and each kept one
  restores (every tensor read back with ``tf.train.load_checkpoint``);
- every restart was within the restart budget (both runs exit 0, or 70 with ``FAILED``);
- the failures the summaries count cover what was injected where a fault is observable (a
  ``kill-worker`` or ``kill-ps`` while the job RUNS: a worker or ps failure; a ``kill-ps``
  or ``kill-trainer`` while it RUNS, recovered before the operator's stop: a restart), and
  no more restarts than the faults that can cause one;
- no process of the job is left;
- with a real Prometheus scraping the job every second (psctl local's targets.json; off
  with ``--no-prometheus``, left out where ``prometheus`` is not on PATH): each run's
  ``psctl_restarts_total`` equals its summary's restarts, and the alerts of
  deploy/prometheus/alerts.yml that fired are those the restarts call for
  (``PsctlRestartLoop`` at 3 in a run) and no other: no server or coordinator down, no
  stall, no NaN, as every fault here recovers within the rules' ``for:``.

With ``--epochs N`` the job is the visitation job (tests/jobs/visit.py, unless ``--job``
names another), over ``--examples`` ids (default: what trains here in about 35% of
``--minutes``, over N): the first run trains 100 x N passes until the operator's stop, the
second N passes from its checkpoint, and the data decides when it ends (the faults due after
that are not injected). ``preempt`` is left out (``psctl scale`` refuses an ``--epochs``
job). One more invariant, from the ``visits`` vector of the checkpoints that run started
from and ended on: every id trained at least N times, and at most once per pass started (N
per training process, one per make-up pass: docs/data.md). A job without a ``visits``
vector gets a line saying so instead.

Then a table per fault kind (count, seconds to the first step after it: p50, p95, max;
steps redone) and the last line::

    soak: F faults in M min, invariants held = K/K, recovery p95 = S s

"Seconds to the first step after it": from the fault (for a freeze or a pause: from its
end; for a resize back, from when its new servers serve and the training process is told to
exit, as the job trains on until then) to the first status sample that shows a step
finished after it, in a training process
that already ran a step since (a restarted one restores first). A fault not recovered
before the operator's planned stop is "cut": the restarted job's first step would measure
that restart, not the fault; it counts in no percentile. "Steps redone": the highest step
seen before the fault less the step a training process restored after it. results.json
keeps every fault and status sample.

    .venv/bin/python bench/soak.py --minutes 30 --seed 1     # 60 faults, about 35 min
    .venv/bin/python bench/soak.py --minutes 3 --faults 10   # a smoke run, about 5 min
    .venv/bin/python bench/soak.py --minutes 10 --epochs 1   # the visitation job's passes
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.elastic import control_cli, progress, start_job  # noqa: E402
from bench.harness import results_dir, spawn  # noqa: E402
from bench.harness.netlab import LabError  # noqa: E402
from bench.harness.promserver import Prometheus  # noqa: E402
from bench.harness.soak_hosts import CONTROL, COORDINATOR_METRICS, SoakHosts  # noqa: E402
from psctl.cluster.ports import free_ports  # noqa: E402
from psctl.cluster.processes.files import write_json_atomic  # noqa: E402
from psctl.cluster.processes.procs import command_lines  # noqa: E402
from psctl.control.v1 import control_pb2  # noqa: E402
from psctl.coordinator.argv import psctl_argv  # noqa: E402
from psctl.coordinator.operations.client import ControlError, call, status_dict  # noqa: E402

LAST_LINE = "soak: "
# Relative frequency of each kind of fault.
WEIGHTS = {
    "kill-worker": 3,
    "kill-ps": 1,
    "kill-trainer": 1,
    "freeze": 3,
    "preempt": 1,
    "pause": 1,
    "checkpoint": 1,
    "cut-link": 3,
}
NETNS_ONLY = ("cut-link",)
NOT_IN_NETNS = ("preempt",)  # a resize starts servers: psctl local's part
RESTARTING = ("kill-ps", "kill-trainer")  # faults that need a new training process
INTERRUPTING = ("freeze", "cut-link", "scale-back")  # faults that may start one
# deploy/prometheus/alerts.yml: PsctlRestartLoop fires at 3 restarts (or 3 new training
# processes) within 30 min; none of the others may fire under these faults (each recovers
# within their "for:"), nor for a worker that left (it is no target then).
RESTART_LOOP, LOOP_AT = "PsctlRestartLoop", 3
RUNNING = ("JOB_STATE_RUNNING", "JOB_STATE_CHECKPOINTING")
RESTORED = re.compile(r"restored (.*) \(global step (\d+)\)")
# --epochs: each training process logs the passes it starts (its N, then make-up passes).
PASSES = re.compile(r"(\d+) pass\(es\) through the tf.data service")
# The supervisor's line when the new servers of a resize are SERVING: from here the training
# process checkpoints and exits, and the next one starts on the new cluster.
RESIZING = re.compile(r"resizing .* -> .*: the training process checkpoints and exits")
# --epochs: the visitation job (tests/jobs/visit.py) counts on the ps how often each of its
# ids was trained. VISIT_EXAMPLES_PER_SEC sizes its data when --examples is not given: its
# rate here (2 ps + 3 workers, batch 64, 2 cores) was 4,454 ex/s fault-free, start-up
# included, when it handed out single ids; with pieces of 1,000 it runs up to 15,000 ex/s,
# so the second run's passes may end before the schedule does (10 min, seed 1: at 8.7 min).
VISIT_JOB = str(REPO / "tests" / "jobs" / "visit.py")
VISITS = "visits/.ATTRIBUTES/VARIABLE_VALUE"
VISIT_EXAMPLES_PER_SEC = 4000
FIRST_RUN_EPOCHS = 100  # x --epochs: the first run trains passes until the operator's stop
NOT_IN_EPOCHS = ("preempt",)  # psctl scale refuses an --epochs job (resize.py)
WARMUP = 20.0  # seconds of training before the first fault
STOP_AT = 0.5  # of --minutes: the operator's stop and restart
ENDGAME = 0.85  # of --minutes: the second run's target is reached about then
PATTERNS = {
    "worker": r"worker_server\.main .*--index {index}( |$)",
    "ps": r"ps_server\.main .*--index {index}( |$)",
    "trainer": r"-m psctl train .*--once",
}


@dataclass
class Fault:
    at: float  # seconds since the soak started
    kind: str
    target: str = ""  # freeze: "worker", "ps" or "trainer"; cut-link: "chief" for "trainer"
    hold: float = 0.0  # freeze, pause: seconds
    # Filled in when injected:
    injected: float = 0.0  # time.monotonic()
    released: float = 0.0  # the end of a freeze or a pause
    answered: float = 0.0  # scale-back: psctl scale returned
    signalled: float = 0.0  # scale-back: the training process told to exit for the resize
    victim: str = ""
    while_running: bool = False
    step_before: int = 0
    skipped: str = ""  # why it was not injected
    recovery: float | None = None
    cut: bool = False  # its recovery ran into the operator's stop: not a fault's to count
    redone: int = 0
    notes: list[str] = field(default_factory=list)


def make_schedule(
    seed: int, minutes: float, count: int, only: tuple[str, ...] = tuple(WEIGHTS)
) -> list[Fault]:
    rng = random.Random(seed)
    span = minutes * 60.0
    kinds, weights = zip(*((k, w) for k, w in WEIGHTS.items() if k in only), strict=True)
    faults = []
    for _ in range(count):
        kind = rng.choices(kinds, weights)[0]
        fault = Fault(at=rng.uniform(WARMUP, span * 0.95), kind=kind)
        if kind == "freeze":
            fault.target = rng.choice(["worker", "worker", "ps", "trainer"])
            fault.hold = round(rng.uniform(2.0, 15.0), 1)
        elif kind == "cut-link":
            fault.target = rng.choice(["worker", "worker", "ps", "chief"])
            fault.hold = round(rng.uniform(2.0, 15.0), 1)
        elif kind == "pause":
            fault.hold = round(rng.uniform(2.0, 6.0), 1)
        faults.append(fault)
    return sorted(faults, key=lambda f: f.at)


class Run:
    """One ``psctl local`` (or ``--netns``: ``psctl train``) run, its output stamped as it
    arrives; ``prefix``: what runs a command on its host."""

    def __init__(
        self,
        argv: list[str],
        log: Path,
        address: str,
        env: dict[str, str],
        prefix: Sequence[str] = (),
    ) -> None:
        self.address = address
        self.prefix = list(prefix)
        self.proc, self.output = start_job(argv, log, {"TF_CPP_MIN_LOG_LEVEL": "2", **env})

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        try:
            return control_cli(self.address, *args, timeout=timeout, prefix=self.prefix)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(args, 124, "", f"timed out after {timeout}s")

    def resize_signalled(self, asked: float, answered: float) -> float:
        """When the supervisor told the training process to exit for the resize ``psctl
        scale`` asked at ``asked`` (it logs that before it answers, at ``answered``); 0.0:
        it did not (none was running: the next one starts on the new cluster)."""
        for at, line in self.output.snapshot():
            if asked <= at <= answered + 2.0 and RESIZING.search(line):
                return at
        return 0.0

    def restores(self) -> list[tuple[float, int]]:
        return [
            (at, int(m.group(2)))
            for at, line in self.output.snapshot()
            if (m := RESTORED.search(line))
        ]

    def first_restored(self) -> str | None:
        """The checkpoint this run started from (its path prefix), if it restored one."""
        for _, line in self.output.snapshot():
            if m := RESTORED.search(line):
                return m.group(1)
        return None

    def passes(self) -> list[int]:
        """--epochs: the passes each of this run's iterators was started with, in order."""
        return [int(m.group(1)) for _, line in self.output.snapshot() if (m := PASSES.search(line))]

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class Sampler:
    """``GetStatus`` twice a second: (time, step, state, uptime) while it answers; with a
    ``prefix`` (the coordinator on another host), from a status feed running there."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, str, float]] = []
        self.prefix: list[str] = []  # set before the address
        self.address = ""
        self._feed: subprocess.Popen[str] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            if not self.address:
                continue
            if self.prefix:
                self._follow()
                return
            try:
                status = call(self.address, "GetStatus", control_pb2.GetStatusRequest(), timeout=2)
            except ControlError:
                continue
            self._add(status_dict(status))

    def _follow(self) -> None:
        """One long-lived feed on the coordinator's host (a psctl per poll would cost a CPU's
        worth of interpreter starts): a JSON status per line, null while it does not answer."""
        feed = [sys.executable, "-m", "bench.harness.status_feed", self.address, "0.5"]
        argv = [*self.prefix, *feed]
        self._feed = spawn(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            text=True,
        )
        assert self._feed.stdout is not None
        for line in self._feed.stdout:
            if self._stop.is_set():
                return
            with contextlib.suppress(ValueError):
                if found := json.loads(line):
                    self._add(found)

    def _add(self, found: dict[str, Any]) -> None:
        self.samples.append(
            (
                time.monotonic(),
                int(found.get("global_step", 0)),
                str(found.get("state", "")),
                float(found.get("uptime_seconds", 0.0)),
            )
        )

    def latest(self) -> tuple[float, int, str, float] | None:
        return self.samples[-1] if self.samples else None

    def max_step_before(self, at: float) -> int:
        return max((s for t, s, _, _ in self.samples if t <= at), default=0)

    def first_step_after(self, at: float, *, new_process: bool = False) -> float | None:
        """When a status first showed a step finished after ``at``: two samples of one
        training process (its uptime growing) with the step growing, the second after it;
        with ``new_process``, of a training process started after ``at``."""
        after = [s for s in self.samples if s[0] > at]
        before = [s for s in self.samples if s[0] <= at][-1:]
        for a, b in itertools.pairwise(before + after):
            fresh = not new_process or b[3] < b[0] - at
            if b[0] > at and b[3] > a[3] and b[1] > a[1] and b[2] in RUNNING and fresh:
                return b[0] - at
        return None

    def stop(self) -> None:
        self._stop.set()
        if self._feed is not None:
            self._feed.kill()
            self._feed.wait(timeout=10)
        self._thread.join(timeout=5)


class Soak:
    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args = args
        self.out = out
        self.workdir = out / "work"
        self.checkpoints = self.workdir / "checkpoints"
        self.hosts = (
            SoakHosts(args.ps, args.workers, self.workdir, args.rtt) if args.netns else None
        )
        self.sampler = Sampler()
        self.started = time.monotonic()
        self.runs: list[Run] = []
        self.summaries: list[dict[str, Any]] = []
        self.codes: list[int] = []
        self.written: list[tuple[float, int]] = []  # checkpoints as they appeared
        self.workers = args.workers
        self.timers: list[threading.Timer] = []
        # The operator's stop and restart: (when asked, when the new run trains).
        self.restart: tuple[float, float] | None = None
        self.coordinators: list[str] = []  # each run's coordinator /metrics (host:port)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def job_argv(
        self, workdir: Path, length: int, address: str, summary: Path, *, local: bool = True
    ) -> list[str]:
        """``length``: steps to train to, or with ``--epochs``, passes over the data.
        ``local``: psctl local; else (``--netns``) psctl train on the hosts' cluster."""
        a = self.args
        if not local:
            assert self.hosts is not None
            return psctl_argv(
                "train",
                "--cluster", str(self.hosts.cluster_file),
                "--job", a.job,
                "--max-shards", str(a.max_shards),
                "--steps", str(length),
                "--seed", str(a.seed),
                "--checkpoint-dir", str(self.checkpoints),
                "--checkpoint-every", str(a.checkpoint_every),
                "--keep-checkpoints", "1000",
                "--log-every", "1",
                "--metrics-port", str(COORDINATOR_METRICS + len(self.runs) + 1),
                "--control-address", address,
                "--summary-json", str(summary),
            )  # fmt: skip
        return psctl_argv(
            "local",
            "--job", a.job,
            "--ps", str(a.ps),
            "--workers", str(a.workers),
            "--max-shards", str(a.max_shards),
            "--strategy", a.strategy,
            "--epochs" if a.epochs else "--steps", str(length),
            "--seed", str(a.seed),
            "--checkpoint-every", str(a.checkpoint_every),
            "--keep-checkpoints", "1000",  # every one kept: each must restore
            "--log-every", "1",
            "--start-timeout", "300",
            "--workdir", str(workdir),
            "--control-address", address,
            "--summary-json", str(summary),
        )  # fmt: skip

    def env(self) -> dict[str, str]:
        return {"VISIT_IDS": str(self.args.examples)} if self.args.epochs else {}

    def start(self, length: int) -> Run:
        n = len(self.runs) + 1
        summary = self.out / f"summary-{n}.json"
        if self.hosts is not None:  # on host "chief", as its operator would run it
            address = CONTROL
            argv = self.job_argv(self.workdir, length, address, summary, local=False)
            prefix = self.hosts.prefix()
            argv, env = [*prefix, *argv], {**self.env(), **self.hosts.coordinator_env()}
            # Prometheus scrapes this run's coordinator (and no longer the last one's).
            targets = self.hosts.targets([COORDINATOR_METRICS + n])
            write_json_atomic(self.workdir / "targets.json", targets)
        else:
            (port,) = free_ports(1)
            address = f"127.0.0.1:{port}"
            argv, prefix = self.job_argv(self.workdir, length, address, summary), []
            env = self.env()
        run = Run(argv, self.out / f"job-{n}.log", address, env, prefix)
        self.runs.append(run)
        self.sampler.prefix = run.prefix
        self.sampler.address = address
        self.workers = self.args.workers
        return run

    def note_coordinator(self) -> None:
        """The running job's coordinator /metrics address, from psctl local's targets.json."""
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            groups = json.loads((self.workdir / "targets.json").read_text())
            for group in groups:
                if group["labels"]["job"] == "psctl-coordinator":
                    self.coordinators.append(group["targets"][0])
                    return

    def watch_checkpoints(self) -> None:
        known = {step for _, step in self.written}
        new = set()
        for index in self.checkpoints.glob("ckpt-*.index"):
            with contextlib.suppress(ValueError):
                new.add(int(index.name[len("ckpt-") : -len(".index")]))
        now = time.monotonic()
        self.written += [(now, step) for step in sorted(new - known)]

    def pid(self, kind: str, index: int = 0) -> int | None:
        pattern = re.compile(PATTERNS[kind].format(index=index))
        for pid, cmdline in sorted(command_lines(str(self.workdir)).items()):
            if pattern.search(cmdline):
                return pid
        return None

    def running(self) -> bool:
        latest = self.sampler.latest()
        return latest is not None and latest[2] in RUNNING and time.monotonic() - latest[0] < 2

    def inject(self, fault: Fault, run: Run, rng: random.Random, later: list[Fault]) -> None:
        fault.injected = time.monotonic()
        fault.while_running = self.running()
        fault.step_before = self.sampler.max_step_before(fault.injected)
        kind = fault.kind
        if kind == "cut-link":
            assert self.hosts is not None
            count = {"worker": self.workers, "ps": self.args.ps, "chief": 1}[fault.target]
            index = rng.randrange(count)
            host = "chief" if fault.target == "chief" else f"{fault.target}{index}"
            fault.victim = f"link of {host}"
            hosts = self.hosts
            hosts.set_link(host, up=False)
            self.later(fault, lambda: hosts.set_link(host, up=True))
        elif kind in ("kill-worker", "kill-ps", "kill-trainer", "freeze", "preempt"):
            target = {"kill-worker": "worker", "kill-ps": "ps", "kill-trainer": "trainer"}.get(
                kind, fault.target or "worker"
            )
            count = {"worker": self.workers, "ps": self.args.ps, "trainer": 1}[target]
            if kind == "preempt" and self.workers < 2:
                fault.skipped = "one worker left"
                return
            index = count - 1 if kind == "preempt" else rng.randrange(count)
            pid = self.pid(target, index)
            if pid is None:
                fault.skipped = f"no {target}:{index} process (restarting)"
                return
            fault.victim = f"{target}:{index} (pid {pid})"
            if kind == "freeze":
                os.kill(pid, signal.SIGSTOP)
                self.later(fault, lambda: os.kill(pid, signal.SIGCONT))
            elif kind == "preempt":
                os.kill(pid, signal.SIGTERM)
                self.workers -= 1
                back = Fault(at=self.elapsed() + rng.uniform(15.0, 40.0), kind="scale-back")
                later.append(back)
            else:
                os.kill(pid, signal.SIGKILL)
        elif kind == "scale-back":
            if self.workers >= self.args.workers:
                fault.skipped = "already at its size"
                return
            proc = run.cli("scale", "--workers", str(self.args.workers), timeout=300)
            fault.answered = time.monotonic()
            fault.victim = f"psctl scale --workers {self.args.workers}: exit {proc.returncode}"
            if proc.returncode == 0:
                self.workers = self.args.workers
            else:
                fault.notes.append(proc.stderr.strip()[-300:])
        elif kind == "pause":
            proc = run.cli("pause")
            fault.victim = f"psctl pause: exit {proc.returncode}"
            self.later(fault, lambda: resume(run, fault))
        elif kind == "checkpoint":
            proc = run.cli("checkpoint", timeout=120)
            fault.victim = f"psctl checkpoint: exit {proc.returncode}"
        status = run.cli("status", timeout=30)
        if status.returncode not in (0, 69):
            fault.notes.append(f"psctl status: exit {status.returncode}")

    def later(self, fault: Fault, release: Callable[[], object]) -> None:
        """``release()`` after ``fault.hold`` seconds, on a thread of its own: other faults go
        on meanwhile (a freeze overlaps the next kill)."""

        def end() -> None:
            with contextlib.suppress(ProcessLookupError):
                release()
            fault.released = time.monotonic()

        timer = threading.Timer(fault.hold, end)
        timer.start()
        self.timers.append(timer)

    def release_all(self) -> None:
        for timer in self.timers:
            timer.join()

    def drive(self, run: Run, faults: list[Fault], until: float, rng: random.Random) -> None:
        """Inject the faults due before ``until`` (seconds since start) while ``run`` runs."""
        while self.elapsed() < until and run.proc.poll() is None:
            self.watch_checkpoints()
            due = [f for f in faults if not f.injected and not f.skipped and f.at <= self.elapsed()]
            if not due:
                time.sleep(0.2)
                continue
            fault = due[0]
            self.inject(fault, run, rng, faults)
            faults.sort(key=lambda f: f.at)
            print(
                f"{self.elapsed():7.1f}s {fault.kind:<13} {fault.victim or fault.skipped}"
                f"{' (job not running)' if fault.injected and not fault.while_running else ''}",
                flush=True,
            )

    def wait_training(self, run: Run, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not progress(run.output.snapshot(), 0, None):
            if run.proc.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(line for _, line in run.output.snapshot()[-20:])
                raise SystemExit(f"soak: the job did not train (exit {run.proc.poll()}):\n{tail}")
            time.sleep(0.5)

    def finish(self, run: Run, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while run.proc.poll() is None and time.monotonic() < deadline:
            self.watch_checkpoints()
            time.sleep(0.5)
        if run.proc.poll() is None:
            run.kill()
            self.codes.append(-9)
        else:
            self.codes.append(run.proc.returncode)
        run.output.join(timeout=10)
        self.watch_checkpoints()
        path = self.out / f"summary-{len(self.runs)}.json"
        self.summaries.append(json.loads(path.read_text()) if path.exists() else {})


def resume(run: Run, fault: Fault, tries: int = 30) -> None:
    """``psctl resume`` as an operator does: again until it is done (it fails while the
    training process cannot answer, e.g. frozen; seen: a job left PAUSED for good)."""
    for _ in range(tries):
        code = run.cli("resume", timeout=30).returncode
        fault.notes.append(f"resume: exit {code}")
        if code == 0 or run.proc.poll() is not None:
            return
        time.sleep(2.0)


def measure(faults: list[Fault], soak: Soak) -> None:
    """Each fault's seconds to the first step after it (a ps or training-process kill: the
    first step of the training process that replaced the killed one), and the steps redone
    by the restores it caused: each restore is charged to the latest fault before it that
    can make one (a kill of a ps or the training process, a freeze, a resize), not to the
    operator's restart."""
    done = [f for f in faults if f.injected and not f.skipped]
    for fault in done:
        if fault.kind == "scale-back":
            # A resize interrupts training only from when its new servers serve and the
            # training process is told to exit: until then it trains on the workers it has.
            asked, answered = fault.injected, fault.answered
            told = [t for run in soak.runs if (t := run.resize_signalled(asked, answered))]
            fault.signalled = min(told, default=0.0)
            if fault.signalled:
                fault.notes.append(
                    f"new servers SERVING after {fault.signalled - fault.injected:.1f} s "
                    "(the job trained on meanwhile)"
                )
        start = fault.released or fault.signalled or fault.injected
        fresh = fault.kind in (*RESTARTING, "scale-back")  # a resize runs a new process too
        fault.recovery = soak.sampler.first_step_after(start, new_process=fresh)
        # Not recovered before the operator's planned stop: the first step after it is the
        # restarted job's, whose start-up is no recovery of this fault.
        stop = soak.restart[0] if soak.restart is not None else math.inf
        if fault.injected < stop and (fault.recovery is None or start + fault.recovery > stop):
            fault.cut, fault.recovery = True, None
    causes = [f for f in done if f.kind in (*RESTARTING, *INTERRUPTING)]
    for number, run in enumerate(soak.runs):
        restores = run.restores()[1 if number else 0 :]  # a later run's start restores: planned
        for at, step in restores:
            before = [f for f in causes if f.injected < at]
            if before:
                fault = before[-1]
                fault.redone = max(fault.redone, fault.step_before - step)


def restores_every_checkpoint(directory: Path) -> tuple[bool, str]:
    code = (
        "import sys, tensorflow as tf\n"
        "bad = []\n"
        "for prefix in sys.argv[1:]:\n"
        "    try:\n"
        "        r = tf.train.load_checkpoint(prefix)\n"
        "        [r.get_tensor(k) for k in r.get_variable_to_shape_map()]\n"
        "    except Exception as e:\n"
        "        bad.append(f'{prefix}: {type(e).__name__}')\n"
        "print('; '.join(bad) or 'ok')\n"
    )
    prefixes = sorted(str(p)[: -len(".index")] for p in directory.glob("ckpt-*.index"))
    proc = subprocess.run(
        [sys.executable, "-c", code, *prefixes],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        check=False,
    )
    verdict = proc.stdout.strip().splitlines()[-1:] or [proc.stderr.strip()[-200:]]
    return verdict == ["ok"], f"{len(prefixes)} checkpoint(s): {verdict[0]}"


def baseline(args: argparse.Namespace, soak: Soak, length: int) -> dict[str, Any]:
    (port,) = free_ports(1)
    workdir = soak.out / "baseline"
    summary = soak.out / "summary-baseline.json"
    argv = soak.job_argv(workdir, length, f"127.0.0.1:{port}", summary)
    run = Run(argv, soak.out / "baseline.log", f"127.0.0.1:{port}", soak.env())
    try:
        run.proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        run.kill()
    run.output.join(timeout=10)
    return json.loads(summary.read_text()) if summary.exists() else {}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def table(faults: list[Fault]) -> list[str]:
    rows = [
        f"{'kind':<13} {'count':>5} {'skipped':>7} {'p50 s':>6} {'p95 s':>6} {'max s':>6} "
        f"{'no step':>7} {'cut':>4} {'redone':>6}"
    ]
    kinds = [*WEIGHTS, "scale-back"]
    for kind in kinds:
        mine = [f for f in faults if f.kind == kind and (f.injected or f.skipped)]
        if not mine:
            continue
        done = [f for f in mine if not f.skipped]
        times = [f.recovery for f in done if f.recovery is not None]
        rows.append(
            f"{kind:<13} {len(done):>5} {len(mine) - len(done):>7} "
            f"{percentile(times, 0.5):>6.1f} {percentile(times, 0.95):>6.1f} "
            f"{max(times, default=math.nan):>6.1f} "
            f"{sum(f.recovery is None and not f.cut for f in done):>7} "
            f"{sum(f.cut for f in done):>4} {sum(f.redone for f in done):>6}"
        )
    return rows


def invariants(
    soak: Soak, faults: list[Fault], target: int, base: dict[str, Any] | None
) -> list[tuple[str, bool, str]]:
    found: list[tuple[str, bool, str]] = []
    last = soak.summaries[-1] if soak.summaries else {}
    step = int(last.get("global_step", 0))
    if soak.args.epochs:
        found.append(
            (
                f"reaches the end of its {soak.args.epochs} pass(es)",
                soak.codes[-1:] == [0]
                and last.get("stopped_early") is False
                and step == last.get("target_steps"),
                f"exit {soak.codes}, global step {step}, stopped early: "
                f"{last.get('stopped_early')}",
            )
        )
    else:
        found.append(
            (
                "reaches its target step",
                soak.codes[-1:] == [0] and step >= target,
                f"exit {soak.codes}, global step {step} of {target}",
            )
        )
    if base is not None:
        found.append(evaluated_like(last, base))
    steps = [s for _, s in sorted(soak.written)]
    growing = all(b > a for a, b in itertools.pairwise(steps))
    ok, detail = restores_every_checkpoint(soak.checkpoints)
    found.append(
        (
            "checkpoint steps only grow, and each restores",
            growing and ok and bool(steps),
            f"written in order: {steps[:6]}{' ...' if len(steps) > 6 else ''} "
            f"({'growing' if growing else 'NOT growing'}); {detail}",
        )
    )
    found.append(
        (
            "every restart within the budget",
            all(code in (0, 70) for code in soak.codes),
            f"exits {soak.codes}, restarts {[s.get('restarts') for s in soak.summaries]}",
        )
    )
    # The summaries count per run: sum both runs.
    restarts = sum(int(s.get("restarts", 0)) for s in soak.summaries)
    worker_failures = sum(int(s.get("worker_failures", 0)) for s in soak.summaries)
    ps_failures = sum(int(s.get("ps_failures", 0)) for s in soak.summaries)
    done = [f for f in faults if f.injected and not f.skipped]
    seen_workers, seen_ps = (seen_kills(done, kind) for kind in ("kill-worker", "kill-ps"))
    # A kill that needs a new training process, recovered before the operator's stop: one
    # cut by it is not restarted (the stop's last process only restores, for the summary).
    seen_restarts = sum(f.kind in RESTARTING and f.while_running and not f.cut for f in done)
    can_restart = sum(f.kind in (*RESTARTING, *INTERRUPTING) for f in done)
    found.append(
        (
            "failures counted cover the observable faults",
            worker_failures >= seen_workers
            and ps_failures >= seen_ps
            and seen_restarts <= restarts <= can_restart + 1,
            f"worker failures {worker_failures} for {seen_workers} worker kill(s) while running; "
            f"ps failures {ps_failures} for {seen_ps}; restarts {restarts} for {seen_restarts} "
            f"ps/trainer kill(s) while running, recovered before the stop (at most "
            f"{can_restart + 1}: those, freezes, cuts, resizes and the stop)",
        )
    )
    deadline = time.monotonic() + 20
    while command_lines(str(soak.workdir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = command_lines(str(soak.workdir))
    found.append(("no process left", not left, f"{len(left)} left: {sorted(left)[:5]}"))
    return found


def seen_kills(done: list[Fault], kind: str) -> int:
    """The ``kind`` kills a job's health checks can see: while it runs, and not of a server
    killed within 30 s before (still down, or just back: one failure for both)."""
    kills = [f for f in done if f.kind == kind]
    return sum(
        f.while_running
        and not any(
            g.victim.split()[0] == f.victim.split()[0] and 0 < f.injected - g.injected < 30
            for g in kills
        )
        for f in kills
    )


def evaluated_like(last: dict[str, Any], base: dict[str, Any]) -> tuple[str, bool, str]:
    """Eval accuracy within 0.01 of the fault-free run's; for a job without an accuracy (the
    visitation job: a regression), eval loss at most 0.01 above it."""
    runs = f"{base.get('global_step', '?')} steps without faults"
    if base.get("eval_accuracy") is None:
        loss, reference = (float(s.get("eval_loss") or math.nan) for s in (last, base))
        return (
            "eval loss within 0.01 of a fault-free run (the job has no accuracy)",
            loss <= reference + 0.01,
            f"{loss:.4f} against {reference:.4f} ({runs})",
        )
    accuracy, reference = (float(s.get("eval_accuracy") or math.nan) for s in (last, base))
    return (
        "eval accuracy within 0.01 of a fault-free run",
        accuracy >= reference - 0.01,
        f"{accuracy:.4f} against {reference:.4f} ({runs})",
    )


def trained_counts(start: str | None, end: str) -> dict[int, int] | None:
    """How often each id of the job's ``visits`` vector was trained between two checkpoints
    (``start`` None: from zero), as {times: ids}; None when the job keeps no such vector."""
    code = (
        "import json, sys, numpy as np, tensorflow as tf\n"
        "def visits(prefix):\n"
        "    r = tf.train.load_checkpoint(prefix)\n"
        "    names = [n for n in r.get_variable_to_shape_map() if n.endswith(sys.argv[3])]\n"
        "    return r.get_tensor(names[0]) if names else None\n"
        "end = visits(sys.argv[2])\n"
        "if end is None:\n"
        "    print('null'); sys.exit()\n"
        "start = visits(sys.argv[1]) if sys.argv[1] else np.zeros_like(end)\n"
        "times, ids = np.unique(np.rint(end - start).astype(np.int64), return_counts=True)\n"
        "print(json.dumps({str(t): int(n) for t, n in zip(times, ids)}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, start or "", end, VISITS],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        raise RuntimeError(f"reading {end}: {proc.stderr.strip()[-300:]}")
    found = json.loads(lines[-1])
    return None if found is None else {int(t): n for t, n in found.items()}


def visits_within_bound(soak: Soak) -> tuple[str, bool, str] | None:
    """--epochs: every id of the second run's data trained at least --epochs times and at
    most once per pass its training processes started (docs/data.md: N per training process,
    one per make-up pass); None (said in a line) for a job without a ``visits`` vector."""
    epochs, last = soak.args.epochs, soak.summaries[-1] if soak.summaries else {}
    name = f"every example trained at least {epochs} time(s), at most once per pass started"
    if len(soak.runs) < 2 or not last.get("checkpoint"):
        return (name, False, "the second run wrote no final checkpoint")
    run = soak.runs[-1]
    try:
        counts = trained_counts(run.first_restored(), str(last["checkpoint"]))
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        return (name, False, str(err))
    if counts is None:
        print(f"soak: the job keeps no `visits` vector ({VISIT_JOB} does): which examples "
              "were trained is not checked", flush=True)  # fmt: skip
        return None
    passes = run.passes()  # each training process's N, then any make-up passes
    bound = sum(passes)
    return (
        name,
        bool(counts) and min(counts) >= epochs and max(counts) <= bound,
        f"times trained: ids {counts}; {bound} pass(es) started {passes} (restarts "
        f"{last.get('restarts')}, worker failures {last.get('worker_failures')})",
    )


def start_prometheus(args: argparse.Namespace, soak: Soak) -> Prometheus | None:
    """A real Prometheus scraping the job (psctl local's targets.json, or with ``--netns``
    the soak's, from host ``chief``) every second and
    evaluating deploy/prometheus/alerts.yml; None (said in a line) without ``prometheus``."""
    binary = shutil.which("prometheus")
    if not args.prometheus or binary is None:
        if args.prometheus:
            print("soak: no prometheus on PATH (sh tools/ensure-prometheus.sh installs it): "
                  "its invariants are left out", flush=True)  # fmt: skip
        return None
    soak.workdir.mkdir(parents=True, exist_ok=True)
    scrape = {
        "job_name": "psctl",
        "file_sd_configs": [{"files": [str(soak.workdir / "targets.json")]}],
    }
    prefix = soak.hosts.prefix() if soak.hosts else ()  # where the targets are
    prom = Prometheus(soak.out / "prometheus", [scrape], binary=binary, prefix=prefix)
    prom.start()
    return prom


def scraped(soak: Soak, prom: Prometheus, at: float, minutes: float) -> list[tuple[str, bool, str]]:
    """What Prometheus saw, as of ``at`` (epoch seconds: the last run's end, before the
    stopped servers are down long enough for an alert): each run's psctl_restarts_total
    against its summary, and the alerts that fired against those the restarts call for."""
    window = f"{math.ceil(minutes) + 30}m"

    def query(expr: str) -> list[dict[str, Any]]:
        return list(prom.api("query", query=expr, time=f"{at:.3f}")["result"])

    seen: list[int | None] = []
    for instance in soak.coordinators:
        found = query(
            f'max_over_time(psctl_restarts_total{{job="psctl-coordinator",instance="{instance}"}}'
            f"[{window}])"
        )
        seen.append(int(float(found[0]["value"][1])) if found else None)
    want = [int(s.get("restarts", -1)) for s in soak.summaries]
    checks = [
        (
            "Prometheus's restart counts equal the summaries",
            seen == want,
            f"psctl_restarts_total per run {seen}, summaries {want}",
        )
    ]
    fired = sorted(
        {
            r["metric"]["alertname"]
            for r in query(f'max_over_time(ALERTS{{alertstate="firing"}}[{window}])')
        }
    )
    restarts = max(want, default=0)
    # New training processes in a run: restarts and resizes (psctl scale) start one each.
    processes = max(
        (
            int(s.get("restarts", 0))
            + sum(r.get("reason") == "psctl scale" for r in s.get("resizes", []))
            for s in soak.summaries
        ),
        default=0,
    )
    must = {RESTART_LOOP} if restarts >= LOOP_AT else set()
    may = must | ({RESTART_LOOP} if processes >= LOOP_AT else set())
    checks.append(
        (
            "the alerts that should fire did, and no other",
            must <= set(fired) <= may,
            f"fired: {', '.join(fired) or 'none'}; expected: {', '.join(sorted(must)) or 'none'} "
            f"(most restarts in a run {restarts}, new training processes {processes}; "
            f"{RESTART_LOOP} at {LOOP_AT})",
        )
    )
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="length of the schedule")
    parser.add_argument("--seed", type=int, default=1, help="the schedule's and the job's seed")
    parser.add_argument("--faults", type=int, help="faults to inject (default: 2 a minute)")
    parser.add_argument(
        "--kinds",
        help=f"comma-separated fault kinds to draw from (default all: {','.join(WEIGHTS)}; "
        f"with --epochs all but {','.join(NOT_IN_EPOCHS)})",
    )  # fmt: skip
    parser.add_argument(
        "--job", help=f"the job (default mlp; with --epochs, the visitation job {VISIT_JOB})"
    )
    parser.add_argument(
        "--epochs", type=int, default=0,
        help="the restarted run trains N passes (psctl local --epochs N) instead of a target "
        "step; the first trains passes until the operator's stop (default 0: steps)",
    )  # fmt: skip
    parser.add_argument(
        "--examples", type=int,
        help="--epochs: the visitation job's ids (VISIT_IDS; default: what about 35%% of "
        "--minutes trains here, over --epochs)",
    )  # fmt: skip
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--max-shards", type=int, default=1)
    parser.add_argument("--strategy", default="async", choices=("async", "sync"))
    parser.add_argument("--checkpoint-every", type=int, default=300)
    parser.add_argument(
        "--baseline", action=argparse.BooleanOptionalAction, default=True,
        help="run the job without faults too, for the accuracy invariant (default on)",
    )  # fmt: skip
    parser.add_argument("--baseline-steps", type=int, default=20_000, help="at most (20,000)")
    parser.add_argument(
        "--prometheus", action=argparse.BooleanOptionalAction, default=True,
        help="a real Prometheus scrapes the job; its counters and alerts are checked "
        "(default on where `prometheus` is on PATH)",
    )  # fmt: skip
    parser.add_argument(
        "--netns", action="store_true",
        help="every task on a network-namespace host of its own, servers restarted as "
        "systemd does, psctl train as the coordinator; adds cut-link (needs root)",
    )  # fmt: skip
    parser.add_argument(
        "--rtt", type=float, metavar="MS",
        help="--netns: every connection to a server through bench/harness/netlab.py's relay, which "
        "delays it by MS/2 each way (default: the direct network)",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run's end")
    parser.add_argument("--out", help="results folder (default bench/results/soak-<time>/)")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.workers < 1 or args.ps < 1 or args.epochs < 0:
        parser.error("--minutes, --workers and --ps: give positive numbers; --epochs: 0 or more")
    if args.rtt is not None and not (args.netns and 0 <= args.rtt <= 1000):
        parser.error("--rtt: milliseconds from 0 to 1000, with --netns")
    if args.netns and (args.epochs or args.strategy != "async"):
        parser.error("--netns: the parameter-server mode with --steps only (--epochs and "
                     "--strategy sync run under psctl local)")  # fmt: skip
    excluded = (NOT_IN_NETNS if args.netns else NETNS_ONLY) + (NOT_IN_EPOCHS if args.epochs else ())
    allowed = [k for k in WEIGHTS if k not in excluded]
    kinds = args.kinds if args.kinds is not None else ",".join(allowed)
    only = tuple(kind.strip() for kind in kinds.split(",") if kind.strip())
    if not only or set(only) - set(allowed):
        parser.error(f"--kinds: give some of {','.join(allowed)}, comma-separated")
    if args.job is None:
        args.job = VISIT_JOB if args.epochs else "mlp"
    if args.examples is None:
        share = (ENDGAME - STOP_AT) * args.minutes * 60 * 0.7  # faults slow it down
        args.examples = max(2000, round(VISIT_EXAMPLES_PER_SEC * share / max(1, args.epochs)))
    elif args.examples < 1:
        parser.error("--examples: give a positive number")
    count = args.faults if args.faults is not None else max(1, round(2 * args.minutes))
    out = results_dir(args.out, "soak")
    faults = make_schedule(args.seed, args.minutes, count, only)
    data = f", {args.epochs} pass(es) of {args.examples} ids (VISIT_IDS)" if args.epochs else ""
    data += ", each task on a network-namespace host" if args.netns else ""
    data += f", {args.rtt:g} ms round trips (relay)" if args.rtt is not None else ""
    print(
        f"results {out}; {args.job} on {args.ps} ps + {args.workers} workers{data}, seed "
        f"{args.seed}, {count} faults over {args.minutes:g} min; {os.cpu_count()} CPUs, load "
        f"{os.getloadavg()[0]:.1f}\nschedule:",
        flush=True,
    )
    for fault in faults:
        extra = f" {fault.target}" if fault.target else ""
        extra += f" for {fault.hold:g}s" if fault.hold else ""
        print(f"  {fault.at:7.1f}s {fault.kind}{extra}", flush=True)
    rng = random.Random(args.seed + 1)
    soak = Soak(args, out)
    span = args.minutes * 60.0
    target = 0
    prom: Prometheus | None = None
    watched: list[tuple[str, bool, str]] = []
    try:
        if soak.hosts is not None:
            try:
                soak.hosts.start()
            except LabError as err:
                print(f"soak: --netns: {err}", file=sys.stderr)
                return 2
        prom = start_prometheus(args, soak)
        # Until the operator's stop.
        run = soak.start(args.epochs * FIRST_RUN_EPOCHS if args.epochs else 10**8)
        soak.wait_training(run, timeout=300)
        soak.note_coordinator()
        soak.started = time.monotonic()  # the schedule counts from the first step
        soak.drive(run, faults, span * STOP_AT, rng)
        soak.release_all()
        stop_at = time.monotonic()
        stopped = run.cli("stop", "--timeout", "180", timeout=240)
        print(f"{soak.elapsed():7.1f}s stop (operator)  exit {stopped.returncode}", flush=True)
        soak.finish(run, timeout=240)
        # The summary's step; without one (the stop went wrong: an invariant says so), the
        # highest step seen.
        at_stop = int(soak.summaries[-1].get("global_step", 0)) or soak.sampler.max_step_before(
            time.monotonic()
        )
        rate = at_stop / max(1.0, soak.elapsed())
        target = at_stop + max(500, int(rate * span * (ENDGAME - STOP_AT)))
        if args.epochs:  # the data decides where the passes end
            target = 0
            run = soak.start(args.epochs)
            goal = f"{args.epochs} pass(es)"
        else:
            run = soak.start(target)
            goal = f"target {target}"
        print(f"{soak.elapsed():7.1f}s restart      on step {at_stop}, {goal}", flush=True)
        soak.wait_training(run, timeout=300)
        soak.restart = (stop_at, time.monotonic())
        soak.note_coordinator()
        soak.drive(run, faults, span, rng)
        soak.release_all()
        soak.finish(run, timeout=args.timeout)
        if prom is not None:
            time.sleep(3)  # the last scrapes
            watched = scraped(soak, prom, time.time(), args.minutes)
    finally:
        for run in soak.runs:
            run.kill()
        soak.sampler.stop()
        if prom is not None:
            prom.stop()
        if soak.hosts is not None:
            soak.hosts.stop()
    measure(faults, soak)
    length = args.epochs or min(target, args.baseline_steps)
    base = baseline(args, soak, length) if args.baseline else None
    checked = invariants(soak, faults, target, base) + watched
    if args.epochs and (visited := visits_within_bound(soak)) is not None:
        checked.append(visited)
    for name, held, detail in checked:
        print(f"invariant: {name}: {'held' if held else 'BROKEN'} ({detail})")
    rows = table(faults)
    print("\n".join(rows))
    done = [f for f in faults if f.injected and not f.skipped]
    times = [f.recovery for f in done if f.recovery is not None]
    kept = sum(ok for _, ok, _ in checked)
    last = (
        f"{LAST_LINE}{len(done)} faults in {soak.elapsed() / 60:.1f} min, invariants held = "
        f"{kept}/{len(checked)}, recovery p95 = {percentile(times, 0.95):.1f} s"
    )
    print(last)
    report = {
        "args": vars(args),
        "faults": [vars(f) for f in faults],
        # (seconds since the first fault's clock, global step, state, uptime) twice a second
        "samples": [
            (round(t - soak.started, 2), step, state, round(up, 1))
            for t, step, state, up in soak.sampler.samples
        ],
        "summaries": soak.summaries,
        # --netns: each server's restarts by the soak's Restart=on-failure loop
        "server_restarts": soak.hosts.restarts() if soak.hosts else None,
        "baseline": base,
        "invariants": [{"name": n, "held": h, "detail": d} for n, h, d in checked],
        "table": rows,
        "line": last,
    }
    (out / "results.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "table.md").write_text("\n".join([*rows, last]) + "\n")
    return 0 if kept == len(checked) else 1


if __name__ == "__main__":
    sys.exit(main())
