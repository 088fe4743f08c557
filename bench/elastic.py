"""Resizing a running job: the seconds without steps, and the steps redone, per kind of resize.

One ``psctl local`` job (``mlp``, 1 ps + 2 workers, checkpoints on, a progress line every
0.2 s) is resized with ``psctl scale`` while it trains, each kind ``--repeats`` times, the
kinds in this order in every round:

``add-worker``     1 ps + 2 workers -> 1 ps + 3 workers  (``psctl scale --workers 3``)
``remove-worker``  1 ps + 3 workers -> 1 ps + 2 workers  (``--workers 2``)
``add-ps``         1 ps + 2 workers -> 2 ps + 2 workers  (``--ps 2``)
``remove-ps``      2 ps + 2 workers -> 1 ps + 2 workers  (``--ps 1``)
``preemption``     1 ps + 3 workers -> 1 ps + 2 workers  (SIGTERM to the last worker server:
                   a preemption notice; no ``psctl scale``)

Where the job is not on a kind's first shape (``--kinds`` leaves some out), an unmeasured
resize takes it there first. Per resize, from the job's output lines, each stamped as it
arrives here:

seconds without steps
    from the first progress line that shows the old training process's last step to the
    first line of the new one past the step it restored (both +-0.2 s, the progress cadence);
    the new servers start before (``psctl local`` waits for them to be SERVING, training
    goes on meanwhile), so this is the checkpoint, the exit, and the new process's start-up
    (import, connect, restore, trace).
steps redone
    the old process's last step (its progress lines, and the step of the checkpoint it wrote
    for the resize) less the step the new process restored: 0 when no step is lost or trained
    twice.

Also shown: the ``psctl scale`` command's seconds (starting the new servers, then the
request) and the supervisor's (the summary's ``resizes[].seconds``: the request until the old
process exited). Only the resizes' checkpoints are written (``--checkpoint-every`` is out of
reach), so that no periodic one lands in a measured gap.

A preemption is measured otherwise: the job goes on without the worker in the same training
process (no checkpoint, no restart), so "seconds without steps" is the longest stretch
between two progress lines showing a new step, from the signal until 5 s after ``psctl
status`` shows the worker LEFT (the progress cadence, 0.2 s, when nothing stops), and "steps
redone" is 0 unless a new training process restored a checkpoint meanwhile.

Printed: a line per resize, a table per kind (median, max), and last::

    elastic: median seconds without steps = S.S, steps redone = N

(the median over every measured resize; N the largest). ``table.md`` and ``results.json``
(every resize, with its lines' steps and times) go to ``--out`` (default
``bench/results/elastic-<time>/``), with the job's work dir and log.

    .venv/bin/python bench/elastic.py                      # 4 kinds x 5, ~6-8 min on 2 cores
    .venv/bin/python bench/elastic.py --quick              # 4 kinds x 1, ~2 min
    .venv/bin/python bench/elastic.py --quick --kinds add-worker
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.harness import results_dir, spawn  # noqa: E402
from psctl.cluster.ports import free_ports  # noqa: E402
from psctl.coordinator.argv import psctl_argv  # noqa: E402

LAST_LINE = "elastic: median seconds without steps"
LOG_EVERY = 0.2  # seconds between the job's progress lines: the resolution of the gaps
PROGRESS = re.compile(r"^train \| step:\s*(\d+)")
RESTORED = re.compile(r"resuming: restored \S+ \(global step (\d+)\)")
FINAL = re.compile(r"resizing: checkpoint (\S+) at global step (\d+)")
SAVED = re.compile(r"checkpoints: checkpoint (\S+) \(([\d.]+)s\)")
START = (1, 2)  # (ps, workers): the job's first shape


@dataclass(frozen=True)
class Kind:
    name: str
    start: tuple[int, int]  # (ps, workers)
    end: tuple[int, int]
    preempt: bool = False  # SIGTERM to a worker server instead of psctl scale


KINDS = (
    Kind("add-worker", (1, 2), (1, 3)),
    Kind("remove-worker", (1, 3), (1, 2)),
    Kind("add-ps", (1, 2), (2, 2)),
    Kind("remove-ps", (2, 2), (1, 2)),
    Kind("preemption", (1, 3), (1, 2), preempt=True),
)
AFTER_LEFT = 5.0  # seconds of steps watched after a preempted worker is shown LEFT


class Output:
    """The job's output lines, each with the ``time.monotonic()`` it arrived at (and written
    to ``path``), read on a thread of their own."""

    def __init__(self, stream: IO[bytes], path: Path) -> None:
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._file = path.open("w")
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[bytes]) -> None:
        for raw in stream:
            line = raw.decode(errors="replace").rstrip("\n")
            with self._lock:
                self.lines.append((time.monotonic(), line))
            self._file.write(line + "\n")
            self._file.flush()
        self._file.close()

    def snapshot(self) -> list[tuple[float, str]]:
        with self._lock:
            return list(self.lines)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def start_job(
    argv: list[str], log: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], Output]:
    """A psctl command of a benchmark: in a session of its own (Ctrl-C reaches the bench
    only; the bench ends it), killed if the bench dies, its output stamped as it arrives
    (and written to ``log``). ``env``: extra variables."""
    environ = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    proc = spawn(argv, stdout=subprocess.PIPE, env={**environ, **(env or {})})
    assert proc.stdout is not None
    return proc, Output(proc.stdout, log)


def control_cli(
    address: str, *args: str, timeout: float, prefix: Sequence[str] = ()
) -> subprocess.CompletedProcess[str]:
    """``psctl ARGS --address ADDRESS`` (status, scale, stop, ...), its output captured;
    ``prefix``: what runs it on the coordinator's host (``ip netns exec NS``)."""
    return subprocess.run(
        [*prefix, *psctl_argv(*args, "--address", address)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        check=False,
    )


def progress(lines: list[tuple[float, str]], lo: int, hi: int | None) -> list[tuple[float, int]]:
    """(time, step) of the progress lines at indices lo..hi-1."""
    found = []
    for at, line in lines[lo:hi]:
        match = PROGRESS.match(line)
        if match:
            found.append((at, int(match.group(1))))
    return found


def last_index(lines: list[tuple[float, str]], pattern: re.Pattern[str], hi: int) -> int:
    """The index of the last line before ``hi`` matching ``pattern``; -1 if none."""
    for i in range(hi - 1, -1, -1):
        if pattern.search(lines[i][1]):
            return i
    return -1


def measure(lines: list[tuple[float, str]], mark: int) -> dict[str, Any] | None:
    """One resize asked for at line ``mark``, once the new process trained past its restore;
    None before that."""
    restore = next((i for i in range(mark, len(lines)) if RESTORED.search(lines[i][1])), None)
    if restore is None:
        return None
    restored = int(RESTORED.search(lines[restore][1]).group(1))  # type: ignore[union-attr]
    after = [(at, step) for at, step in progress(lines, restore, len(lines)) if step > restored]
    if not after:
        return None
    # The old process: its progress lines since its own restore (or the job's start), then
    # the checkpoint it wrote for the resize. It writes that once every call in flight has
    # finished, and prints no progress line meanwhile (seen: 8 calls of 49 steps after the
    # last line): its last step is the checkpoint's, reached when the save began.
    old = progress(lines, last_index(lines, RESTORED, mark) + 1, restore)
    final = [
        (m.group(1), int(m.group(2))) for _, t in lines[mark:restore] if (m := FINAL.search(t))
    ]
    if not old or not final:
        raise SystemExit(
            f"elastic: no progress or no checkpoint of the old process before {restore}"
        )
    path, checkpoint_step = final[-1]
    saves = [
        at - float(m.group(2))
        for at, text in lines[mark:restore]
        if (m := SAVED.search(text)) and m.group(1) == path
    ]
    last_step = max(checkpoint_step, *(step for _, step in old))
    shown = [at for at, step in old if step >= last_step]
    last_at = min(shown + saves[-1:]) if shown or saves else old[-1][0]
    at_request = [step for _, step in progress(lines, 0, mark)]
    first_at, first_step = after[0]
    return {
        "step_at_request": at_request[-1] if at_request else 0,
        "old_last_step": last_step,
        "checkpoint_step": checkpoint_step,
        "restored_step": restored,
        "first_step_after": first_step,
        "seconds_without_steps": round(first_at - last_at, 3),
        "steps_redone": max(0, last_step - restored),
    }


class Job:
    """The ``psctl local`` job under test, its output stamped as it arrives."""

    def __init__(self, out: Path, args: argparse.Namespace) -> None:
        (port,) = free_ports(1)
        self.address = f"127.0.0.1:{port}"
        self.summary = out / "summary.json"
        argv = psctl_argv(
            "local",
            "--job", "mlp",
            "--ps", str(START[0]),
            "--workers", str(START[1]),
            "--steps", str(10**8),  # until psctl stop
            "--checkpoint-dir", str(out / "checkpoints"),
            "--checkpoint-every", str(10**8),  # the resizes' checkpoints only
            "--log-every", str(LOG_EVERY),
            "--start-timeout", "300",  # a new server's start, on a loaded machine
            "--workdir", str(out / "work"),
            "--control-address", self.address,
            "--summary-json", str(self.summary),
        )  # fmt: skip
        self.log_path = out / "job.log"
        self.proc, self.output = start_job(argv, self.log_path, {"TF_CPP_MIN_LOG_LEVEL": "2"})
        self.shape = START

    def cli(self, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return control_cli(self.address, *args, timeout=timeout)

    def wait_training(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not progress(self.output.snapshot(), 0, 10**9):
            self.check_alive()
            if time.monotonic() > deadline:
                raise SystemExit(f"elastic: the job did not train within {timeout:.0f}s")
            time.sleep(0.2)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            tail = "\n".join(line for _, line in self.output.snapshot()[-20:])
            raise SystemExit(f"elastic: the job ended ({self.proc.returncode}):\n{tail}")

    def resize(self, to: tuple[int, int], timeout: float) -> dict[str, Any]:
        """``psctl scale`` to ``to`` (ps, workers), measured once the new process trains."""
        mark = len(self.output.snapshot())
        started = time.monotonic()
        proc = self.cli("scale", "--ps", str(to[0]), "--workers", str(to[1]), timeout=timeout)
        scale_seconds = time.monotonic() - started
        if proc.returncode != 0:
            raise SystemExit(f"elastic: psctl scale to {to} failed: {proc.stderr.strip()}")
        deadline = started + timeout
        while (result := measure(self.output.snapshot(), mark)) is None:
            self.check_alive()
            if time.monotonic() > deadline:
                raise SystemExit(f"elastic: no step on {to} within {timeout:.0f}s; see job.log")
            time.sleep(0.1)
        before, self.shape = self.shape, to
        return {"from": list(before), "to": list(to), "scale_seconds": scale_seconds, **result}

    def status(self) -> dict[str, Any]:
        proc = self.cli("status", "--json", timeout=30)
        if proc.returncode != 0:
            raise SystemExit(f"elastic: psctl status failed: {proc.stderr.strip()}")
        status: dict[str, Any] = json.loads(proc.stdout)
        return status

    def preempt(self, timeout: float) -> dict[str, Any]:
        """SIGTERM to the last serving worker server; measured from the job's lines once the
        worker is shown LEFT and AFTER_LEFT seconds of steps went by."""
        workers = [
            t
            for t in self.status()["tasks"]
            if t["type"] == "worker" and t.get("state") == "TASK_STATE_SERVING"
        ]
        victim = max(workers, key=lambda t: int(t["index"]))
        mark = len(self.output.snapshot())
        killed_at = time.monotonic()
        os.kill(int(victim["pid"]), signal.SIGTERM)
        deadline = killed_at + timeout
        while not any(
            t["address"] == victim["address"] and t.get("state") == "TASK_STATE_LEFT"
            for t in self.status()["tasks"]
        ):
            self.check_alive()
            if time.monotonic() > deadline:
                raise SystemExit(f"elastic: worker {victim['address']} not LEFT in {timeout}s")
            time.sleep(0.2)
        left_at = time.monotonic()
        time.sleep(AFTER_LEFT)
        self.check_alive()
        lines = self.output.snapshot()
        firsts: dict[int, float] = {}  # each step shown, when first shown
        for at, step in progress(lines, last_index(lines, PROGRESS, mark) if mark else 0, None):
            firsts.setdefault(step, at)
        shown = sorted((at, step) for step, at in firsts.items() if at <= time.monotonic())
        window = [(at, step) for at, step in shown if at >= killed_at - LOG_EVERY]
        if len(window) < 2:
            raise SystemExit("elastic: no steps after the preemption; see job.log")
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(window)]
        restored = [int(m.group(1)) for _, t in lines[mark:] if (m := RESTORED.search(t))]
        before = [step for at, step in shown if at < killed_at]
        last_step = before[-1] if before else 0
        before_shape, self.shape = self.shape, (self.shape[0], self.shape[1] - 1)
        return {
            "from": list(before_shape),
            "to": list(self.shape),
            "scale_seconds": 0.0,
            "step_at_request": last_step,
            "old_last_step": last_step,
            "checkpoint_step": None,
            "restored_step": restored[-1] if restored else None,
            "first_step_after": window[-1][1],
            "seconds_without_steps": round(max(gaps), 3),
            "seconds_to_left": round(left_at - killed_at, 3),
            "steps_redone": max(0, last_step - restored[-1]) if restored else 0,
        }

    def stop(self, timeout: float) -> dict[str, Any]:
        proc = self.cli("stop", "--timeout", str(timeout), timeout=timeout + 30)
        code = self.proc.wait(timeout=timeout + 30)
        self.output.join(timeout=10)
        if proc.returncode != 0 or code != 0:
            raise SystemExit(f"elastic: psctl stop {proc.returncode}, job {code}: {proc.stderr}")
        return json.loads(self.summary.read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the job's own session
            self.proc.wait()


def table(runs: list[dict[str, Any]], kinds: list[Kind]) -> list[str]:
    rows = [
        f"{'kind':<14} {'runs':>4} {'without steps s':>16} {'max':>6} {'redone max':>10} "
        f"{'psctl scale s':>13} {'ckpt+exit s':>11}"
    ]
    for kind in kinds:
        mine = [r for r in runs if r["kind"] == kind.name]
        gaps = [r["seconds_without_steps"] for r in mine]
        exits = [r["supervisor_seconds"] for r in mine if r.get("supervisor_seconds")]
        rows.append(
            f"{kind.name:<14} {len(mine):>4} {statistics.median(gaps):>16.1f} {max(gaps):>6.1f} "
            f"{max(r['steps_redone'] for r in mine):>10d} "
            f"{statistics.median(r['scale_seconds'] for r in mine):>13.1f} "
            f"{statistics.median(exits) if exits else float('nan'):>11.1f}"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat of each kind")
    parser.add_argument("--repeats", type=int, default=5, help="resizes of each kind (5)")
    parser.add_argument(
        "--kinds",
        default=",".join(k.name for k in KINDS),
        help=f"comma-separated subset of {','.join(k.name for k in KINDS)}",
    )
    parser.add_argument("--resize-timeout", type=float, default=240.0, help="seconds each")
    parser.add_argument("--out", help="results folder (default bench/results/elastic-<time>/)")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 1
    chosen = args.kinds.split(",")
    unknown = sorted(set(chosen) - {k.name for k in KINDS})
    if unknown or args.repeats < 1:
        parser.error(f"--kinds: unknown {unknown}" if unknown else "--repeats: give 1 or more")
    kinds = [k for k in KINDS if k.name in chosen]
    out = results_dir(args.out, "elastic")
    print(
        f"results {out}; mlp on {START[0]} ps + {START[1]} workers, {args.repeats} x "
        f"{', '.join(k.name for k in kinds)}; {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}",
        flush=True,
    )
    job = Job(out, args)
    runs: list[dict[str, Any]] = []
    resizes = 0  # every resize the job made, measured or not: its summary lists each
    try:
        job.wait_training(timeout=args.resize_timeout)
        for round_ in range(args.repeats):
            for kind in kinds:
                if job.shape != kind.start:
                    job.resize(kind.start, args.resize_timeout)  # unmeasured: to its first shape
                    resizes += 1
                run = {"kind": kind.name, "round": round_, "resize": resizes}
                if kind.preempt:
                    run.update(job.preempt(args.resize_timeout))
                else:
                    run.update(job.resize(kind.end, args.resize_timeout))
                resizes += 1
                runs.append(run)
                how = (
                    f"step {run['old_last_step']} -> {run['first_step_after']} in the same "
                    f"process, LEFT after {run['seconds_to_left']:.1f} s"
                    if kind.preempt
                    else f"step {run['old_last_step']} -> restored {run['restored_step']} -> "
                    f"{run['first_step_after']}"
                )
                print(
                    f"{kind.name:<14} round {round_}: {run['seconds_without_steps']:5.1f} s "
                    f"without steps ({how}), {run['steps_redone']} redone, psctl scale "
                    f"{run['scale_seconds']:.1f} s",
                    flush=True,
                )
        summary = job.stop(timeout=120)
    finally:
        job.kill()
    listed = summary.get("resizes", [])
    if len(listed) != resizes:
        raise SystemExit(f"elastic: the summary lists {len(listed)} resizes, made {resizes}")
    for run in runs:
        run["supervisor_seconds"] = listed[run["resize"]]["seconds"]
    lines = table(runs, kinds)
    gaps = [r["seconds_without_steps"] for r in runs]
    last = (
        f"{LAST_LINE} = {statistics.median(gaps):.1f}, "
        f"steps redone = {max(r['steps_redone'] for r in runs)}"
    )
    header = (
        f"mlp, {START[0]} ps + {START[1]} workers, psctl local, {args.repeats} x each; "
        f"final eval accuracy {summary.get('eval_accuracy', float('nan')):.4f}, "
        f"{summary.get('restarts', 0)} restarts"
    )
    print("\n" + header)
    print("\n".join(lines))
    print(last)
    (out / "table.md").write_text("\n".join([header, *lines, last]) + "\n")
    report = {"runs": runs, "summary": summary, "table": lines, "line": last}
    (out / "results.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
