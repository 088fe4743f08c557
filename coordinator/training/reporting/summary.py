"""What a run reports at the end: the ``done |`` line and ``--summary-json``; a training
process that finished completes its job with them (``complete``), its supervisor's counts
added."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from psctl.cluster.processes.files import write_json_atomic
from psctl.coordinator.operations.counters import Counters
from psctl.coordinator.operations.job_state import JobControl
from psctl.coordinator.operations.state import State
from psctl.coordinator.settings import TrainSettings

if TYPE_CHECKING:
    from psctl.coordinator.operations.metrics import CoordinatorMetrics

# The training process's lines, as when launch/process.py logged them.
log = logging.getLogger("psctl.train")


@dataclass
class Summary:
    """What a run reports at the end (``--summary-json``)."""

    job: str
    global_step: int
    start_step: int
    target_steps: int
    loss: float | None
    accuracy: float | None
    eval_accuracy: float | None
    eval_loss: float | None
    examples_per_sec: float
    steps_per_sec: float
    wall_seconds: float  # from the first training process's loop start to the end
    train_seconds: float
    num_workers: int
    num_ps: int
    batch_size: int
    steps_per_execution: int
    checkpoint: str | None
    stopped_early: bool
    stalls: int = 0
    restarts: int = 0  # training processes started again by the supervisor
    ps_failures: int = 0
    worker_failures: int = 0
    coordinator_failures: int = 0
    recoveries: int = 0  # restarts + tasks seen back to SERVING after a failure
    eval_auc: float | None = None  # the job's "auc" metric in the final evaluation, if it has one
    metrics: dict[str, float] = field(default_factory=dict)
    eval_metrics: dict[str, float] = field(default_factory=dict)
    # Per dynamic embedding table (by layer name) at the end: its live "rows" and the
    # "admitted" and "evicted" totals; {} without dynamic tables.
    tables: dict[str, dict[str, int]] = field(default_factory=dict)
    # Every resize of the cluster during the run (psctl scale, SIGHUP), in order: when
    # ("time", Unix seconds), "from" and "to" (e.g. "1 ps + 2 workers") and "seconds" from
    # the request until the new cluster's training process started.
    resizes: list[dict[str, object]] = field(default_factory=list)
    # From the command's start (psctl local's, else its training supervisor's) to the first
    # training loop's: servers, TensorFlow's import, the job's check and model; None where
    # unknown (a bare --once process).
    startup_seconds: float | None = None
    # Follow mode and publishing: "files_trained" and "files" (in training order) of this
    # run's history, "files_waiting", "input_lag_seconds", "published_version", "export_dir";
    # {} without --follow or --export-every.
    freshness: dict[str, object] = field(default_factory=dict)


def accuracy_of(values: dict[str, float]) -> float | None:
    """The run's accuracy: the metric named "accuracy", else the only one whose Keras name
    ends in it (a compiled ``SparseCategoricalAccuracy()`` is "sparse_categorical_accuracy")."""
    if "accuracy" in values:
        return values["accuracy"]
    found = [value for name, value in values.items() if name.endswith("accuracy")]
    return found[0] if len(found) == 1 else None


def write_summary(summary: Summary, path: str) -> None:
    """Write atomically, so a reader never sees half a file."""
    write_json_atomic(path, asdict(summary), sort_keys=True, newline=True)


def print_summary(summary: Summary) -> None:
    def show(v: float | None) -> str:
        return "n/a" if v is None or math.isnan(v) else f"{v:.4f}"

    print(
        f"done | step: {summary.global_step} | loss: {show(summary.loss)} | "
        f"accuracy: {show(summary.accuracy)} | eval_accuracy: {show(summary.eval_accuracy)} | "
        + (f"eval_auc: {show(summary.eval_auc)} | " if summary.eval_auc is not None else "")
        + f"{summary.examples_per_sec:.0f} ex/s | {summary.steps_per_sec:.1f} steps/s | "
        f"wall {summary.wall_seconds:.1f}s"
        + (f" | start-up {summary.startup_seconds:.1f}s" if summary.startup_seconds else ""),
        flush=True,
    )


# -- the end of a training process that finished ---------------------------------------


def kept_summary(settings: TrainSettings, control: JobControl) -> Summary:
    """The summary of a job that ends on its latest checkpoint, with no final evaluation
    (stopped while a lost ps stayed down): what that checkpoint holds, and the training
    values last published. Written, so that --summary-json is never an earlier run's."""
    from psctl.coordinator.training.saving.checkpoint_files import checkpoints_in

    found = (
        checkpoints_in(settings.checkpoints.checkpoint_dir)
        if settings.checkpoints.checkpoint_dir
        else []
    )
    view = control.view()
    board = view.board
    workers = sum(t.type == "worker" for t in view.tasks)
    return Summary(
        job=settings.job,
        global_step=found[0].step if found else 0,  # the steps since are lost with the ps
        start_step=0,  # the job's, from its first training process (``complete``)
        target_steps=view.target_steps,
        loss=board.loss if math.isfinite(board.loss) else None,
        accuracy=accuracy_of(board.metrics),
        eval_accuracy=None,
        eval_loss=None,
        examples_per_sec=0.0,
        steps_per_sec=0.0,
        wall_seconds=0.0,  # the job's (``complete``)
        train_seconds=0.0,
        num_workers=workers,
        num_ps=sum(t.type == "ps" for t in view.tasks),
        batch_size=settings.loop.batch_size,
        steps_per_execution=view.steps_per_execution,
        checkpoint=found[0].prefix if found else None,
        stopped_early=True,
        metrics=dict(board.metrics),
    )


def complete(
    summary: Summary,
    *,
    settings: TrainSettings,
    control: JobControl,
    counters: Counters,
    metrics: CoordinatorMetrics | None,
    report: bool = True,
) -> int:
    """The training process's end after a run that finished: the summary with what this
    process and its supervisor counted, printed and written (``report``: the chief's to
    do), DONE, and (so that no alert takes this exit for a crash) the final state scraped
    once; exit 0."""
    if report:
        failures = counters.failures_seen(control.failure_counts())
        summary.restarts = counters.restarts
        # The job's, over every training process: where and when the first one started
        # (this process's own would be only the last part of the run).
        if counters.job_start_step >= 0:
            summary.start_step = counters.job_start_step
        if counters.job_started:
            summary.wall_seconds = max(summary.wall_seconds, time.time() - counters.job_started)
        first_loop = counters.job_started or counters.process_started
        if counters.launched and first_loop:
            summary.startup_seconds = round(max(0.0, first_loop - counters.launched), 1)
        summary.ps_failures = failures["ps"]
        summary.worker_failures = failures["worker"]
        summary.coordinator_failures = counters.coordinator_failures
        summary.recoveries = control.recoveries
        summary.resizes = list(counters.resizes)
        # Workers that left while this process trained: out of the cluster it ends on.
        summary.num_workers -= sum(entry[0] == "worker" for entry in counters.left)
        print_summary(summary)
        if settings.reporting.summary_json:
            write_summary(summary, settings.reporting.summary_json)
            log.info("summary written to %s", settings.reporting.summary_json)
    control.finish(State.DONE)
    if metrics is not None:
        metrics.wait_until_scraped()
    return 0
