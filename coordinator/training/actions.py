"""Cadenced actions the controller runs after every scheduling turn (orbit-style): status
and progress with the NaN guard, periodic checkpoints, inline evaluation."""

from __future__ import annotations

import math
import sys
import time
from typing import Protocol

from psctl.coordinator.failures import RestartFromCheckpoint
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.evaluation.inline_eval import InlineEval
from psctl.coordinator.training.job_model.model import TrainState
from psctl.coordinator.training.reporting.progress import Progress
from psctl.coordinator.training.reporting.publish import Publisher
from psctl.coordinator.training.saving.checkpoints import Checkpointer

STATUS_EVERY = 1.0  # seconds between status/metrics updates


class Loop(Protocol):
    """What an action reads of its loop (loop.py's ``TrainingLoop``): the steps finished."""

    @property
    def completed(self) -> int: ...


class Action(Protocol):
    def __call__(self, loop: Loop) -> None: ...


def check_finite(values: dict[str, float], step: int) -> None:
    """A NaN or infinite training loss ruins the model for good (seen: a worker frozen for a
    minute thawed, landed its stale optimizer update, and the loss went NaN).
    Only a fresh process restoring the last (finite) checkpoint can go on."""
    loss = values.get("loss")
    if loss is not None and not math.isfinite(loss):
        raise RestartFromCheckpoint(f"training loss is {loss} near global step {step}")


class PublishStatus:
    """Every ``every`` seconds with new steps: read the training metrics, publish them, guard
    against a non-finite loss; every ``log_every`` seconds, a progress line."""

    def __init__(
        self,
        *,
        state: TrainState,
        publisher: Publisher,
        progress: Progress,
        every: float,
        log_every: float,
        batch_size: int,
        start_step: int,
    ) -> None:
        self.state = state
        self.publisher = publisher
        self.progress = progress
        self.every = every
        self.log_every = log_every
        self.batch_size = batch_size
        self.start_step = start_step
        self.last_values: dict[str, float] = {}
        self.last_status = self.last_log = time.monotonic()
        self.status_step = start_step

    def restart_window(self, completed: int) -> None:
        """No rate over a pause: the next window starts now."""
        self.last_status, self.status_step = time.monotonic(), completed

    def __call__(self, loop: Loop) -> None:
        now = time.monotonic()
        if now - self.last_status < self.every or loop.completed <= self.status_step:
            return
        rate = (loop.completed - self.status_step) / (now - self.last_status)
        self.last_values = self.state.read_train_metrics()
        # Published before the guard: a NaN loss shows in the status and psctl_train_loss
        # before it ends the process (it is counted on the way out, train.py).
        self.publisher.progress(loop.completed, rate, self.last_values)
        if loop.completed > self.start_step:  # else the window has no step yet
            check_finite(self.last_values, loop.completed)
        self.last_status, self.status_step = now, loop.completed
        if now - self.last_log >= self.log_every:
            self.progress.report(
                loop.completed,
                rate * self.batch_size,
                self.last_values,
                self.publisher.last_tables,
            )
            self.last_log = now


class CheckpointEvery:
    """A background checkpoint every ``every`` steps; what a background save raised for the
    loop (a refused non-finite checkpoint) is raised here, on the loop's thread."""

    def __init__(self, checkpointer: Checkpointer, *, every: int, start_step: int) -> None:
        self.checkpointer = checkpointer
        self.every = every
        self.next_step = (start_step // every + 1) * every

    def __call__(self, loop: Loop) -> None:
        error = self.checkpointer.take_error()
        if error is not None:
            raise error
        if self.checkpointer.enabled and loop.completed >= self.next_step:
            self.checkpointer.save_in_background()
            self.next_step = (loop.completed // self.every + 1) * self.every


def status_and_checkpoints(
    settings: TrainSettings,
    *,
    state: TrainState,
    publisher: Publisher,
    checkpointer: Checkpointer,
    progress_total: int,
    batch_size: int,
    start_step: int,
) -> tuple[PublishStatus, list[Action]]:
    """The chief's status action (progress lines on stderr) and the actions a loop starts
    with: that status, then a checkpoint every ``settings.checkpoints.checkpoint_every`` steps."""
    progress = Progress(total=progress_total, start=start_step, stream=sys.stderr)
    status = PublishStatus(
        state=state,
        publisher=publisher,
        progress=progress,
        every=min(STATUS_EVERY, settings.reporting.log_every),
        log_every=settings.reporting.log_every,
        batch_size=batch_size,
        start_step=start_step,
    )
    checkpoints = CheckpointEvery(
        checkpointer, every=settings.checkpoints.checkpoint_every, start_step=start_step
    )
    return status, [status, checkpoints]


class EvalEvery:
    """``--eval-every``: collect finished eval shards, start an evaluation when due."""

    def __init__(self, evals: InlineEval) -> None:
        self.evals = evals

    def __call__(self, loop: Loop) -> None:
        self.evals.tick(loop.completed)
