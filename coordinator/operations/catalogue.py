"""Every series the coordinator exports, by name, help text, labels and buckets: the
catalogue docs/metrics.md describes, apart from where the series are registered and set
(``metrics.CoordinatorMetrics``). Names and help texts are the API of dashboards and alert
rules (deploy/prometheus/): change them only with those."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass(frozen=True)
class Series:
    name: str
    help: str
    labels: tuple[str, ...] = ()


class CounterSpec(Series):
    def make(self, registry: CollectorRegistry) -> Counter:
        return Counter(self.name, self.help, self.labels, registry=registry)


class GaugeSpec(Series):
    def make(self, registry: CollectorRegistry) -> Gauge:
        return Gauge(self.name, self.help, self.labels, registry=registry)


@dataclass(frozen=True)
class HistogramSpec(Series):
    buckets: tuple[float, ...] = Histogram.DEFAULT_BUCKETS

    def make(self, registry: CollectorRegistry) -> Histogram:
        return Histogram(self.name, self.help, self.labels, buckets=self.buckets, registry=registry)


# Per step: 1 step per call costs ~2-10 ms, packed steps ~5-15 ms each (2 cores, seed MLP);
# the tail reaches seconds for big models or a slow ps.
STEP_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
# One scheduled function of 20 steps: ~0.1-0.3 s here; 1 step: a few ms; stalls: minutes.
CALL_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)
# Checkpoints: 0.1-0.7 s for the seed model, minutes for big ones.
CHECKPOINT_BUCKETS = (
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
)


# -- the series --------------------------------------------------------------------------------

RESIZES = CounterSpec(
    "psctl_resizes",
    "Resizes of the job's cluster (psctl scale, SIGHUP); carried across restarts.",
)
RESIZE_SECONDS = HistogramSpec(
    "psctl_resize_seconds",
    "Seconds from a resize's request until the training process on the new cluster started.",
    buckets=(1, 2, 5, 10, 15, 20, 30, 60, 120, 300),
)
STEPS_PER_EXECUTION = GaugeSpec(
    "psctl_steps_per_execution",
    "Train steps packed into one scheduled function.",
)
TRAIN_STEPS_TOTAL = CounterSpec(
    "psctl_train_steps_total",
    "Train steps finished on workers, counted when their scheduled function returns. A "
    "closure retried after a worker failure counts once.",
)
TRAIN_EXAMPLES_TOTAL = CounterSpec(
    "psctl_train_examples_total",
    "Training examples consumed (finished steps x per-worker batch size).",
)
STEP_DURATION_SECONDS = HistogramSpec(
    "psctl_step_duration_seconds",
    "Seconds per train step on a worker: each scheduled function's duration (tf.timestamp"
    " on the worker) divided by its step count, observed once per step.",
    buckets=STEP_BUCKETS,
)
SCHEDULED_FUNCTION_DURATION_SECONDS = HistogramSpec(
    "psctl_scheduled_function_duration_seconds",
    "Seconds one scheduled function (steps_per_execution steps) ran on a worker, measured"
    " with tf.timestamp on the worker.",
    buckets=CALL_BUCKETS,
)
GLOBAL_STEP = GaugeSpec(
    "psctl_global_step",
    "Global step (the step variable on the ps).",
)
TARGET_STEPS = GaugeSpec(
    "psctl_target_steps",
    "Global step the run trains to (--steps).",
)
CLOSURES_IN_FLIGHT = GaugeSpec(
    "psctl_closures_in_flight",
    "Scheduled functions handed to ClusterCoordinator and not yet finished.",
)
CLOSURES_QUEUED = GaugeSpec(
    "psctl_closures_queued",
    "Scheduled functions waiting in ClusterCoordinator's queue for a worker.",
)
STALLED = GaugeSpec(
    "psctl_stalled",
    "1 while the stall watchdog sees no step finish for --stall-timeout, else 0.",
)
STALLS = CounterSpec(
    "psctl_stalls",
    "Stalls the watchdog reported (no step finished for --stall-timeout).",
)
LAST_EVAL_STEP = GaugeSpec(
    "psctl_last_eval_step",
    "Global step of the latest evaluation.",
)
EVALUATIONS_TOTAL = CounterSpec(
    "psctl_evaluations_total",
    "Evaluations finished.",
)
WORKER_FAILURES_TOTAL = CounterSpec(
    "psctl_worker_failures_total",
    "Worker failures the coordinator saw (closures rescheduled elsewhere).",
)
PS_FAILURES_TOTAL = CounterSpec(
    "psctl_ps_failures_total",
    "Parameter server failures (training must restore from a checkpoint).",
)
RECOVERIES_TOTAL = CounterSpec(
    "psctl_recoveries_total",
    "Recoveries finished: a new coordinator restored the latest checkpoint.",
)
RESTARTS_TOTAL = CounterSpec(
    "psctl_restarts_total",
    "Training processes of this job its supervisor started again (a ps failure, a "
    "non-finite loss, a crash); carried across restarts.",
)
NONFINITE_LOSS_TOTAL = CounterSpec(
    "psctl_nonfinite_loss_total",
    "Times the training loss (or the model, checked before each checkpoint) was NaN or "
    "infinite, each ending its training process for a restart from the latest checkpoint;"
    " carried across restarts.",
)
CHECKPOINT_DURATION_SECONDS = HistogramSpec(
    "psctl_checkpoint_duration_seconds",
    "Seconds to write one checkpoint.",
    buckets=CHECKPOINT_BUCKETS,
)
LAST_CHECKPOINT_TIMESTAMP_SECONDS = GaugeSpec(
    "psctl_last_checkpoint_timestamp_seconds",
    "Unix time the latest checkpoint was written by this process (0: none yet).",
)
LAST_CHECKPOINT_STEP = GaugeSpec(
    "psctl_last_checkpoint_step",
    "Global step of the latest checkpoint written by this process.",
)
CHECKPOINTS_TOTAL = CounterSpec(
    "psctl_checkpoints_total",
    "Checkpoints written by this process.",
)
# -- freshness (--follow, --export-every) --------------------------------------------------
FOLLOW_FILES_TRAINED_TOTAL = CounterSpec(
    "psctl_follow_files_trained_total",
    "Input files follow mode (--follow) trained, each once, as this process saw them.",
)
FOLLOW_FILES_WAITING = GaugeSpec(
    "psctl_follow_files_waiting",
    "Files matching --train-data whose partition is not complete yet (no marker, or still "
    "changing), as last looked at.",
)
INPUT_LAST_COMPLETED_TIMESTAMP_SECONDS = GaugeSpec(
    "psctl_input_last_completed_timestamp_seconds",
    "Unix time the newest trained file's partition was complete (its marker, else its last "
    "change); 0: none trained yet.",
)
INPUT_LAG_SECONDS = GaugeSpec(
    "psctl_input_lag_seconds",
    "Now minus psctl_input_last_completed_timestamp_seconds: how far the trained input is "
    "behind (0 before the first file).",
)
PUBLISHED_VERSION = GaugeSpec(
    "psctl_published_version",
    "The newest serving version --export-every published (its global step); 0: none yet.",
)
LAST_PUBLISH_TIMESTAMP_SECONDS = GaugeSpec(
    "psctl_last_publish_timestamp_seconds",
    "Unix time of the checkpoint the newest serving version was exported from; 0: none yet.",
)
PUBLISH_AGE_SECONDS = GaugeSpec(
    "psctl_publish_age_seconds",
    "Now minus psctl_last_publish_timestamp_seconds: the age of the model in serving (0 "
    "before the first version).",
)
EXPORT_EVERY_SECONDS = GaugeSpec(
    "psctl_export_every_seconds",
    "--export-every: seconds between serving versions (0: no publishing).",
)
PUBLISHES_TOTAL = CounterSpec(
    "psctl_publishes_total", "Serving versions published by this process (--export-every)."
)
PUBLISH_FAILURES_TOTAL = CounterSpec(
    "psctl_publish_failures_total",
    "Exports of --export-every that failed (the previous version stays in serving).",
)
TABLE_ROWS = GaugeSpec(
    "psctl_table_rows",
    "Live rows of a dynamic embedding table (label table), as last reported.",
    labels=("table",),
)
TABLE_ADMITTED_TOTAL = CounterSpec(
    "psctl_table_admitted_total",
    "Ids a dynamic embedding table (label table) admitted, as this process saw them (from"
    " 0 with the tables at step 0, else from the restored totals on).",
    labels=("table",),
)
TABLE_EVICTED_TOTAL = CounterSpec(
    "psctl_table_evicted_total",
    "Rows a dynamic embedding table (label table) evicted, as this process saw them (from"
    " 0 with the tables at step 0, else from the restored totals on).",
    labels=("table",),
)
TABLE_BYTES = GaugeSpec(
    "psctl_table_bytes",
    "Memory of a dynamic embedding table's shard (label table) on a ps task (label ps): "
    "its rows with their optimizer slots and counts, and its admission sketch, as last "
    "reported.",
    labels=("table", "ps"),
)


# -- the cluster -----------------------------------------------------------------------------

WORKERS = GaugeSpec("psctl_workers", "Worker tasks in the cluster.")
PS = GaugeSpec("psctl_ps", "Parameter server (ps) tasks in the cluster.")
CLUSTER_TASKS = GaugeSpec(
    "psctl_cluster_tasks",
    "Tasks in the cluster this training process trains on (label type: ps, worker); "
    "changes with a resize (psctl scale).",
    # Not "task_type": the scrape target's own label (the chief's) would take it.
    labels=("type",),
)
BATCH_SIZE = GaugeSpec("psctl_batch_size", "Examples per step per worker.")
ALLREDUCE_SECONDS = HistogramSpec(
    "psctl_allreduce_seconds",
    "Sync mode (--strategy sync) only: seconds the all-reduce that starts each "
    "call took on the chief; it waits for the slowest worker, so it is the "
    "workers' skew plus one all-reduce's latency. Observed once per call.",
    buckets=STEP_BUCKETS,
)
