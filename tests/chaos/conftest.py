"""The chaos table: every scenario adds a row; the table is printed at the end of the run
(and appended to $PSCTL_CHAOS_RESULTS when set)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest

HEADER = (
    "| scenario | steps lost | s to first new step | s from return to full speed |"
    " eval accuracy | restarts | worker failures | ps failures |\n"
    "|---|---|---|---|---|---|---|---|"
)
ROWS: list[str] = []


def record(name: str, lost: int, to_step: float, to_full: float | None, summary: dict) -> None:
    """One row. ``to_full`` is None where the task never returns (or nothing slowed)."""
    full = "n/a" if to_full is None else f"{to_full:.1f}"
    row = (
        f"| {name} | {lost} | {to_step:.1f} | {full} | {summary['eval_accuracy']:.4f} | "
        f"{summary.get('restarts', 0)} | {summary.get('worker_failures', 0)} | "
        f"{summary.get('ps_failures', 0)} |"
    )
    ROWS.append(row)
    print("\nchaos:", row, flush=True)
    out = os.environ.get("PSCTL_CHAOS_RESULTS")
    if out:
        with open(out, "a") as f:
            f.write(row + "\n")


def full_speed_after(
    samples: list[tuple[float, int]],
    *,
    baseline: float,
    since: float,
    window: float = 3.0,
    fraction: float = 0.8,
) -> float | None:
    """Seconds from ``since`` until the step rate over ``window`` seconds first reaches
    ``fraction`` of ``baseline`` steps/s; None if it never does within the samples.

    ``samples`` are (monotonic time, global step) in time order."""
    after = [(t, s) for t, s in samples if t >= since]
    for i, (t0, s0) in enumerate(after):
        for t1, s1 in after[i + 1 :]:
            if t1 - t0 >= window:
                if (s1 - s0) / (t1 - t0) >= fraction * baseline:
                    return t0 - since
                break
    return None


def rate_between(samples: list[tuple[float, int]], start: float, end: float) -> float:
    """Steps per second between two times, from the samples nearest inside them."""
    inside = [(t, s) for t, s in samples if start <= t <= end]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return 0.0
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


RUNNING = ("JOB_STATE_RUNNING", "JOB_STATE_CHECKPOINTING")


class Sampler:
    """Reads a job's status feed (dicts of `psctl status --json`, None while the coordinator
    does not answer) in the background: (time, global step) while it trains, and since when
    each task has been SERVING."""

    def __init__(self, feed: Iterator[dict | None]) -> None:
        self._feed = feed
        self.samples: list[tuple[float, int]] = []
        self.serving_since: dict[str, float] = {}  # "worker:1" -> start of its SERVING run
        # A server restarted between two of the coordinator's health checks (in half a
        # second) is SERVING in every status: its new pid or failure count starts a new run.
        self._process: dict[str, tuple[object, object]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        for status in self._feed:
            if self._stop.is_set():
                return
            now = time.monotonic()
            if status is None:
                self.serving_since.clear()  # unknown while the coordinator is away
                continue
            if status.get("state") in RUNNING:
                self.samples.append((now, int(status.get("global_step", 0))))
            for task in status.get("tasks", []):
                name = f"{task['type']}:{task['index']}"
                process = (task.get("pid", 0), task.get("failures", 0))
                if task.get("health") != "TASK_HEALTH_SERVING":
                    self.serving_since.pop(name, None)
                elif name not in self.serving_since or self._process.get(name) != process:
                    self.serving_since[name] = now
                self._process[name] = process

    def stop(self) -> None:
        self._stop.set()

    def step(self) -> int | None:
        return self.samples[-1][1] if self.samples else None

    def step_at(self, at: float) -> int:
        """The last step sampled at or before ``at`` (monotonic); 0 before any sample."""
        return max((s for t, s in self.samples if t <= at), default=0)

    def timeline(self, since: float, every: float = 4.0) -> str:
        """Steps/s per ``every`` seconds from ``since`` on (printed with each scenario)."""
        rows, t = [], since
        while self.samples and t < self.samples[-1][0]:
            rows.append(f"{t - since:+.0f}s {rate_between(self.samples, t, t + every):.0f}")
            t += every
        return "steps/s: " + ", ".join(rows)

    def rate_before(self, at: float, seconds: float = 6.0) -> float:
        return rate_between(self.samples, at - seconds, at)

    def first_new_step(self, fault_at: float, timeout: float = 150) -> float:
        """Seconds from the fault until the job makes a step beyond the first one it
        reports after the fault (after a restore to an older checkpoint: its first new
        step)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            after = [s for t, s in self.samples if t > fault_at]
            for t, s in self.samples:
                if t > fault_at and after and s > after[0]:
                    return t - fault_at
            time.sleep(0.2)
        raise AssertionError(f"no new step within {timeout}s after the fault")

    def wait_serving(self, task: str, after: float, timeout: float = 120) -> float:
        """When ``task`` was first seen SERVING again after ``after`` (monotonic)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            since = self.serving_since.get(task)
            if since is not None and since > after:
                return since
            time.sleep(0.2)
        raise AssertionError(f"{task} not SERVING again within {timeout}s")


def before_fault(sampler: Sampler, seconds: float = 6.0) -> tuple[int, float, float]:
    """Let the job train steadily for ``seconds``; returns (global step, time, baseline
    steps/s over those seconds) just before the fault."""
    time.sleep(seconds)
    now = time.monotonic()
    return sampler.step() or 0, now, sampler.rate_before(now, seconds)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if ROWS:
        terminalreporter.write_line("")
        terminalreporter.write_line("chaos table (measured in this run):")
        for line in [*HEADER.splitlines(), *ROWS]:
            terminalreporter.write_line(line)
