"""How many steps one scheduled call runs (``--steps-per-execution``), fixed or ``auto``.

``auto`` measures, over windows of completed calls, the seconds the calls ran on their
workers (the train function times itself) against the workers' wall capacity
(workers x window). What is left is per-call overhead: dispatch, the coordinator's round
trip, queueing, idle workers. It picks the smallest K that keeps that overhead under
``target`` (10%) of a call's time, within bounds that keep progress, checkpoints and
preemption responsive: no call longer than ``max_call_seconds`` and no more steps than
between two checkpoints. It re-checks every window, so a change in step time (another load
on the machine, a slower worker) moves K too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from psctl.coordinator.settings import TrainSettings

INITIAL_K = 20  # the first window runs at the old fixed default
MIN_K = 8  # a window that sees no overhead (noise) must not drop K to 1-2 (seen)
MAX_K = 1000
SMOOTHING = 0.5  # weight of the newest window in the running estimates


def choose_k(
    *, step_seconds: float, overhead_seconds: float, target: float, min_k: int, max_k: int
) -> int:
    """The smallest K with overhead / (overhead + K * step) <= target, clamped."""
    if not min_k <= max_k:
        raise ValueError(f"min_k {min_k} > max_k {max_k}")
    if step_seconds <= 0:
        return max_k
    overhead = max(0.0, overhead_seconds)
    k = math.ceil(overhead * (1.0 - target) / (target * step_seconds))
    return max(min_k, min(max_k, k))


@dataclass(frozen=True)
class Measurement:
    """One window: what choose_k was given, and what it chose."""

    calls: int
    steps: int
    step_seconds: float  # worker seconds per step
    overhead_seconds: float  # per call
    overhead_fraction: float  # of the workers' capacity in the window
    k: int


class Packer:
    """Steps per call: fixed, or chosen by measurement (``auto``)."""

    def __init__(
        self,
        *,
        fixed: int = 0,
        num_workers: int = 1,
        max_steps: int = MAX_K,
        initial_k: int = INITIAL_K,
        target: float = 0.10,
        max_call_seconds: float = 0.5,
        window_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if fixed < 0 or num_workers < 1 or max_steps < 1:
            raise ValueError("fixed >= 0, num_workers >= 1 and max_steps >= 1 are required")
        self.auto = fixed == 0
        self.max_k = min(MAX_K, max_steps)
        self.k = fixed if fixed else min(initial_k, self.max_k)
        self.num_workers = num_workers
        self.target = target
        self.max_call_seconds = max_call_seconds
        self.window_seconds = window_seconds
        self.clock = clock
        self.last: Measurement | None = None
        self._step_s: float | None = None  # running estimates over windows
        self._overhead_s: float | None = None
        self._reset(None)

    def _reset(self, now: float | None) -> None:
        self._since = now  # the window opens at the first finished call (tracing is left out)
        self._calls = self._steps = 0
        self._worker_seconds = 0.0

    @staticmethod
    def _smooth(previous: float | None, value: float) -> float:
        return value if previous is None else SMOOTHING * value + (1 - SMOOTHING) * previous

    def observe(self, *, steps: int, worker_seconds: float) -> int | None:
        """One call finished; returns the new K when this closes a window and K changes."""
        if not self.auto:
            return None
        now = self.clock()
        if self._since is None:
            self._reset(now)
            return None
        self._calls += 1
        self._steps += steps
        self._worker_seconds += worker_seconds
        elapsed = now - self._since
        if elapsed < self.window_seconds or self._calls < 2 * self.num_workers:
            return None
        capacity = self.num_workers * elapsed
        idle = max(0.0, capacity - self._worker_seconds)
        step_seconds = self._smooth(self._step_s, self._worker_seconds / max(1, self._steps))
        overhead = self._smooth(self._overhead_s, idle / self._calls)
        self._step_s, self._overhead_s = step_seconds, overhead
        bound = max(1, min(self.max_k, int(self.max_call_seconds / max(step_seconds, 1e-9))))
        k = choose_k(
            step_seconds=step_seconds,
            overhead_seconds=overhead,
            target=self.target,
            min_k=min(MIN_K, bound),
            max_k=bound,
        )
        # Move at most 4x per window: one noisy window must not swing K across its range.
        k = max(self.k // 4, min(self.k * 4, k), 1)
        self.last = Measurement(
            calls=self._calls,
            steps=self._steps,
            step_seconds=step_seconds,
            overhead_seconds=overhead,
            overhead_fraction=idle / capacity,
            k=k,
        )
        self._reset(now)
        if k == self.k or abs(k - self.k) <= 0.1 * self.k:
            return None
        self.k = k
        return k


def packer_for(settings: TrainSettings, num_workers: int) -> Packer:
    """Local-step mode runs ``--local-steps`` per call; otherwise ``--steps-per-execution``
    (0 = auto), never more steps per call than between two checkpoints."""
    fixed = (
        settings.loop.local_steps
        if settings.loop.update_mode == "local"
        else settings.loop.steps_per_execution
    )
    limit = settings.checkpoints.checkpoint_every if settings.checkpoints.checkpoint_dir else MAX_K
    return Packer(fixed=fixed, num_workers=num_workers, max_steps=min(limit, settings.loop.steps))
