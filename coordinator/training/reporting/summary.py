"""What a run reports at the end: the ``done |`` line and ``--summary-json``."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from psctl.cluster.processes.files import write_json_atomic


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
