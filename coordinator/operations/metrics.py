"""The coordinator's Prometheus metrics: training progress, values, failures, checkpoints.

Built on an injected ``CollectorRegistry`` (never the global one), so every test owns its
registry. The series every psctl process has (``psctl_task_info``, ``psctl_build_info``,
uptime, ``process_*``) come from ``cluster.metrics.ProcessMetrics`` with task ``chief:0``:
task identity lives there only, not as labels on the series below.

Naming follows Prometheus practice: base units (seconds), ``_total`` counters, histograms
(not summaries, so quantiles aggregate across runs), and no unbounded labels: the only
labels are the coordinator state (``state``, a fixed set), the job's metric names (fixed
by the job's ``metrics`` list) and its dynamic embedding tables (``table``: the layers'
names, fixed by the job's model).

A job outlives its training processes (the supervisor starts a fresh one after a ps failure
or a non-finite loss), so the counters the alerts count on (restarts, recoveries, ps
failures, non-finite losses) start from what the supervisor carried over, before /metrics
serves: they never go back when a new process takes over.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable, Iterator
from itertools import pairwise

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import GaugeMetricFamily, Metric

from psctl.cluster.metrics import ProcessMetrics, StateGauge

STATES = [
    "starting",
    "running",
    "paused",
    "checkpointing",
    "recovering",
    "stopping",
    "done",
    "failed",
]

# psctl_health_state (shared with the servers) mirrors the coordinator state coarsely.
_HEALTH_OF_STATE = {
    "starting": "starting",
    "stopping": "not_serving",
    "done": "not_serving",
    "failed": "not_serving",
}

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


class _LatestValues:
    """Loss and job metrics as last reported: one gauge plus one labelled gauge.

    A custom collector rather than ``Gauge``: nothing is exported until the first report
    (a default 0 would read as a perfect loss), and a metric name the job no longer
    reports disappears instead of going stale.
    """

    def __init__(self, *, loss_name: str, loss_help: str, metric_name: str, metric_help: str):
        self._loss_name, self._loss_help = loss_name, loss_help
        self._metric_name, self._metric_help = metric_name, metric_help
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}

    def set(self, values: dict[str, float]) -> None:
        with self._lock:
            self._values = {str(k): float(v) for k, v in values.items()}

    def describe(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(self._loss_name, self._loss_help)
        yield GaugeMetricFamily(self._metric_name, self._metric_help, labels=["name"])

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            values = dict(self._values)
        if "loss" in values:
            yield GaugeMetricFamily(self._loss_name, self._loss_help, value=values.pop("loss"))
        if values:
            family = GaugeMetricFamily(self._metric_name, self._metric_help, labels=["name"])
            for name in sorted(values):
                family.add_metric([name], values[name])
            yield family


class _ScrapeWatch:
    """Notes each read of the registry (a scrape of /metrics) and exports nothing: a process
    that ends can wait until the scraper that keeps coming back (Prometheus) has seen its
    final state once."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._count = 0
        # The last three: the longer gap of the two is the scrape interval, even when one
        # stray read (an operator's curl just after a scrape) came between.
        self._times: collections.deque[float] = collections.deque(maxlen=3)

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        with self._changed:
            self._count += 1
            self._times.append(time.monotonic())
            self._changed.notify_all()
        return iter(())

    def wait_for_next(self, *, max_seconds: float) -> bool:
        """Wait for the next scrape of a scraper that comes back: due one interval after the
        last scrape, it is given until two intervals and a second after it, and never more
        than ``max_seconds`` from now. No wait at all when fewer than two scrapes came (a
        single read, an operator's curl or a test's, is no scraper: waiting for its next
        scrape held every stopped job ``max_seconds`` longer), nor when the next is already
        that late (the scraper has gone). True if a scrape came."""
        with self._changed:
            if len(self._times) < 2:
                return False
            interval = max(later - earlier for earlier, later in pairwise(self._times))
            due = self._times[-1] + 2 * interval + 1.0
            timeout = min(max_seconds, due - time.monotonic())
            if timeout <= 0:
                return False
            seen = self._count
            return self._changed.wait_for(lambda: self._count > seen, timeout=timeout)


class CoordinatorMetrics:
    """Every series the coordinator exports; the trainer calls the methods below."""

    def __init__(
        self,
        *,
        registry: CollectorRegistry,
        job: str,
        num_workers: int,
        num_ps: int,
        batch_size: int,
        examples_per_step: int = 0,
        sync: bool = False,
    ) -> None:
        """``batch_size`` is per worker; ``examples_per_step`` (default ``batch_size``: a
        parameter-server step is one worker's batch) counts examples, a sync step being
        every worker's batch. ``sync``: --strategy sync (its all-reduce histogram)."""
        self.registry = registry
        self.job = job
        self.batch_size = examples_per_step or batch_size
        self.process = ProcessMetrics(registry=registry, task_type="chief", task_index=0)
        r = registry

        self._state = StateGauge(
            "psctl_coordinator_state",
            "Coordinator life-cycle state (1 for the current state, label state).",
            states=STATES,
            registry=r,
        )
        # "name", not "job": Prometheus owns the job label (it names the scrape job).
        Info("psctl_job", "The training job this coordinator runs.", registry=r).info({"name": job})
        Gauge("psctl_workers", "Worker tasks in the cluster.", registry=r).set(num_workers)
        Gauge("psctl_ps", "Parameter server (ps) tasks in the cluster.", registry=r).set(num_ps)
        tasks = Gauge(
            "psctl_cluster_tasks",
            "Tasks in the cluster this training process trains on (label type: ps, worker); "
            "changes with a resize (psctl scale).",
            # Not "task_type": the scrape target's own label (the chief's) would take it.
            ["type"],
            registry=r,
        )
        tasks.labels("ps").set(num_ps)
        tasks.labels("worker").set(num_workers)
        self._cluster_tasks = tasks
        self._resizes = Counter(
            "psctl_resizes",
            "Resizes of the job's cluster (psctl scale, SIGHUP); carried across restarts.",
            registry=r,
        )
        self._resize_seconds = Histogram(
            "psctl_resize_seconds",
            "Seconds from a resize's request until the training process on the new cluster "
            "started.",
            buckets=(1, 2, 5, 10, 15, 20, 30, 60, 120, 300),
            registry=r,
        )
        Gauge(
            "psctl_batch_size",
            "Examples per step per worker.",
            registry=r,
        ).set(batch_size)
        self._steps_per_execution = Gauge(
            "psctl_steps_per_execution",
            "Train steps packed into one scheduled function.",
            registry=r,
        )

        # -- progress ------------------------------------------------------------------
        self._steps = Counter(
            "psctl_train_steps_total",
            "Train steps finished on workers, counted when their scheduled function "
            "returns. A closure retried after a worker failure counts once.",
            registry=r,
        )
        self._examples = Counter(
            "psctl_train_examples_total",
            "Training examples consumed (finished steps x per-worker batch size).",
            registry=r,
        )
        self._step_seconds = Histogram(
            "psctl_step_duration_seconds",
            "Seconds per train step on a worker: each scheduled function's duration "
            "(tf.timestamp on the worker) divided by its step count, observed once per step.",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self._call_seconds = Histogram(
            "psctl_scheduled_function_duration_seconds",
            "Seconds one scheduled function (steps_per_execution steps) ran on a worker, "
            "measured with tf.timestamp on the worker.",
            buckets=CALL_BUCKETS,
            registry=r,
        )
        self._global_step = Gauge(
            "psctl_global_step", "Global step (the step variable on the ps).", registry=r
        )
        self._target_steps = Gauge(
            "psctl_target_steps", "Global step the run trains to (--steps).", registry=r
        )
        self._in_flight = Gauge(
            "psctl_closures_in_flight",
            "Scheduled functions handed to ClusterCoordinator and not yet finished.",
            registry=r,
        )
        self._queued = Gauge(
            "psctl_closures_queued",
            "Scheduled functions waiting in ClusterCoordinator's queue for a worker.",
            registry=r,
        )

        self._stalled = Gauge(
            "psctl_stalled",
            "1 while the stall watchdog sees no step finish for --stall-timeout, else 0.",
            registry=r,
        )
        self._allreduce_seconds = (
            Histogram(
                "psctl_allreduce_seconds",
                "Sync mode (--strategy sync) only: seconds the all-reduce that starts each "
                "call took on the chief; it waits for the slowest worker, so it is the "
                "workers' skew plus one all-reduce's latency. Observed once per call.",
                buckets=STEP_BUCKETS,
                registry=r,
            )
            if sync
            else None
        )
        self._stalls = Counter(
            "psctl_stalls",
            "Stalls the watchdog reported (no step finished for --stall-timeout).",
            registry=r,
        )

        # -- values ----------------------------------------------------------------------
        self._train_values = _LatestValues(
            loss_name="psctl_train_loss",
            loss_help="Mean training loss over the steps since the previous report.",
            metric_name="psctl_train_metric",
            metric_help="Training metric of the job (label name), as last reported.",
        )
        self._eval_values = _LatestValues(
            loss_name="psctl_eval_loss",
            loss_help="Loss of the latest evaluation on the held-out split.",
            metric_name="psctl_eval_metric",
            metric_help="Metric of the job (label name) in the latest evaluation.",
        )
        r.register(self._train_values)
        r.register(self._eval_values)
        self._last_eval_step = Gauge(
            "psctl_last_eval_step", "Global step of the latest evaluation.", registry=r
        )
        self._evaluations = Counter("psctl_evaluations_total", "Evaluations finished.", registry=r)

        # -- failures --------------------------------------------------------------------
        self._worker_failures = Counter(
            "psctl_worker_failures_total",
            "Worker failures the coordinator saw (closures rescheduled elsewhere).",
            registry=r,
        )
        self._ps_failures = Counter(
            "psctl_ps_failures_total",
            "Parameter server failures (training must restore from a checkpoint).",
            registry=r,
        )
        self._recoveries = Counter(
            "psctl_recoveries_total",
            "Recoveries finished: a new coordinator restored the latest checkpoint.",
            registry=r,
        )
        self._restarts = Counter(
            "psctl_restarts_total",
            "Training processes of this job its supervisor started again (a ps failure, a "
            "non-finite loss, a crash); carried across restarts.",
            registry=r,
        )
        self._nonfinite = Counter(
            "psctl_nonfinite_loss_total",
            "Times the training loss (or the model, checked before each checkpoint) was NaN or "
            "infinite, each ending its training process for a restart from the latest "
            "checkpoint; carried across restarts.",
            registry=r,
        )

        # -- checkpoints -----------------------------------------------------------------
        self._checkpoint_seconds = Histogram(
            "psctl_checkpoint_duration_seconds",
            "Seconds to write one checkpoint.",
            buckets=CHECKPOINT_BUCKETS,
            registry=r,
        )
        self._last_checkpoint_time = Gauge(
            "psctl_last_checkpoint_timestamp_seconds",
            "Unix time the latest checkpoint was written by this process (0: none yet).",
            registry=r,
        )
        self._last_checkpoint_step = Gauge(
            "psctl_last_checkpoint_step",
            "Global step of the latest checkpoint written by this process.",
            registry=r,
        )
        self._checkpoints = Counter(
            "psctl_checkpoints_total", "Checkpoints written by this process.", registry=r
        )

        # -- dynamic embedding tables ----------------------------------------------------
        # Labelled by table: nothing is exported until the first report, and a job without
        # dynamic tables exports none of these.
        self._table_rows = Gauge(
            "psctl_table_rows",
            "Live rows of a dynamic embedding table (label table), as last reported.",
            ["table"],
            registry=r,
        )
        self._table_admitted = Counter(
            "psctl_table_admitted_total",
            "Ids a dynamic embedding table (label table) admitted, as this process saw them "
            "(from 0 with the tables at step 0, else from the restored totals on).",
            ["table"],
            registry=r,
        )
        self._table_evicted = Counter(
            "psctl_table_evicted_total",
            "Rows a dynamic embedding table (label table) evicted, as this process saw them "
            "(from 0 with the tables at step 0, else from the restored totals on).",
            ["table"],
            registry=r,
        )
        self._table_bytes = Gauge(
            "psctl_table_bytes",
            "Memory of a dynamic embedding table's shard (label table) on a ps task (label "
            "ps): its rows with their optimizer slots and counts, and its admission sketch, "
            "as last reported.",
            ["table", "ps"],
            registry=r,
        )
        self._table_lock = threading.Lock()
        self._table_last: dict[str, tuple[int, int]] = {}  # table -> (admitted, evicted)
        self._first_step: int | None = None  # the first global step this process reported
        # Last: it sees a scrape once every other collector was read.
        self._scrapes = _ScrapeWatch()
        r.register(self._scrapes)

    # -- the trainer's calls -------------------------------------------------------------

    def set_state(self, state: str) -> None:
        if state not in STATES:
            raise ValueError(f"unknown coordinator state {state!r}; one of {STATES}")
        self._state.state(state)
        self.process.health.state(_HEALTH_OF_STATE.get(state, "serving"))

    def observe_call(self, *, steps: int, seconds: float) -> None:
        """One scheduled function ran ``steps`` steps in ``seconds`` (timed on the worker)."""
        if steps <= 0:
            return
        self._steps.inc(steps)
        self._examples.inc(steps * self.batch_size)
        self._call_seconds.observe(seconds)
        per_step = seconds / steps
        for _ in range(steps):
            self._step_seconds.observe(per_step)

    def observe_allreduce(self, seconds: float) -> None:
        """Sync mode: one call's opening all-reduce took ``seconds`` (sync.py)."""
        if self._allreduce_seconds is not None:
            self._allreduce_seconds.observe(seconds)

    def set_global_step(self, step: int) -> None:
        self._note_step(step)
        self._global_step.set(step)

    def _note_step(self, step: int) -> None:
        with self._table_lock:
            if self._first_step is None:
                self._first_step = step

    def set_table_stats(self, stats: dict[str, dict[str, int]], *, step: int) -> None:
        """The dynamic embedding tables' counts at global step ``step``: per table (by
        name) its live ``rows`` and its ``admitted`` and ``evicted`` totals.

        ``rows`` is a gauge. The totals come from the tables, and a restarted training
        process restores them from the checkpoint: lower than what the process before it
        last exported, when ids came and went after that checkpoint. Exported as they are
        (a custom collector, as ``_LatestValues``), every restart would read to Prometheus
        as a counter reset to 0 and a jump to the restored total, which ``rate()`` and
        ``increase()`` would count as that many new admissions. So the counters count by
        the difference between reports, what this process saw happen, as
        ``psctl_train_steps_total`` counts this process's steps while ``psctl_global_step``
        holds the run's: a process that started at step 0 (its tables empty) counts from 0,
        so its counters are the totals; one that started later (restored) counts from its
        first report of each table, the totals before it having been counted by the
        processes that made them. A restart is then the usual reset to 0 of a new
        process's counters. A total lower than the last report within a process (not
        expected: a restore starts a new process) is taken as the new base, counting
        nothing. The run's totals themselves are in the status, the summary and
        TensorBoard.
        """
        self._note_step(step)
        with self._table_lock:
            fresh = self._first_step == 0
            for name, counts in sorted(stats.items()):
                table = str(name)
                admitted, evicted = int(counts.get("admitted", 0)), int(counts.get("evicted", 0))
                self._table_rows.labels(table=table).set(int(counts.get("rows", 0)))
                last = self._table_last.get(table)
                if last is None:
                    last = (0, 0) if fresh else (admitted, evicted)
                self._table_admitted.labels(table=table).inc(max(0, admitted - last[0]))
                self._table_evicted.labels(table=table).inc(max(0, evicted - last[1]))
                self._table_last[table] = (admitted, evicted)

    def set_table_bytes(self, found: dict[tuple[str, str], int]) -> None:
        """Each dynamic table shard's bytes, by (table, ps task)."""
        for (table, ps), nbytes in sorted(found.items()):
            self._table_bytes.labels(table=table, ps=ps).set(nbytes)

    def set_target_steps(self, steps: int) -> None:
        self._target_steps.set(steps)

    def set_steps_per_execution(self, k: int) -> None:
        self._steps_per_execution.set(k)

    def set_train_values(self, values: dict[str, float]) -> None:
        """``loss`` goes to psctl_train_loss, every other key to psctl_train_metric{name}."""
        self._train_values.set(values)

    def set_eval_values(self, values: dict[str, float], *, step: int) -> None:
        self._eval_values.set(values)
        self._last_eval_step.set(step)
        self._evaluations.inc()

    def set_closures(self, *, in_flight: int, queued: int) -> None:
        self._in_flight.set(in_flight)
        self._queued.set(queued)

    def set_stalled(self, stalled: bool) -> None:
        if stalled:
            self._stalls.inc()
        self._stalled.set(1 if stalled else 0)

    def task_failure(self, task_type: str) -> None:
        """A task seen going from SERVING to down (worker or ps)."""
        if task_type == "ps":
            self.ps_failure()
        elif task_type == "worker":
            self.worker_failure()

    def worker_failure(self, n: int = 1) -> None:
        self._worker_failures.inc(n)

    def ps_failure(self, n: int = 1) -> None:
        self._ps_failures.inc(n)

    def recovery(self) -> None:
        self._recoveries.inc()

    def task_left(self, task_type: str) -> None:
        """A task left the cluster while this process trains on (a worker stopped, or was
        lost for --drop-after): one task fewer, a resize that cost no pause."""
        self._cluster_tasks.labels(task_type).dec()
        self._resizes.inc()
        self._resize_seconds.observe(0.0)

    def carry_over(
        self,
        *,
        restarts: int,
        ps_failures: int,
        nonfinite_losses: int,
        worker_failures: int = 0,
        task_recoveries: int = 0,
        resize_seconds: Iterable[float] = (),
    ) -> None:
        """What the supervisor counted in this job's earlier training processes; call it
        before /metrics serves, so that no scrape sees these counters go back."""
        for seconds in resize_seconds:
            self._resizes.inc()
            self._resize_seconds.observe(seconds)
        self._restarts.inc(restarts)
        # Each restarted process restored the latest checkpoint; and the tasks seen back.
        self._recoveries.inc(restarts + task_recoveries)
        self._ps_failures.inc(ps_failures)
        self._worker_failures.inc(worker_failures)
        self._nonfinite.inc(nonfinite_losses)

    def nonfinite_loss(self) -> None:
        """The loss (or the model) is NaN or infinite: this process ends for a restart."""
        self._nonfinite.inc()

    def wait_until_scraped(self, *, max_seconds: float = 30.0) -> bool:
        """Before the process exits: let Prometheus read the final state once (DONE, so that
        no alert takes the exit for a crash). Waits until two scrape intervals after the last
        scrape at most; not at all unless something scrapes again and again; True if a
        scrape came."""
        if not self._scrapes.wait_for_next(max_seconds=max_seconds):
            return False
        time.sleep(0.2)  # the scrape read every series; let its response go out
        return True

    def observe_checkpoint(self, *, seconds: float, step: int, timestamp: float) -> None:
        self._checkpoint_seconds.observe(seconds)
        self._last_checkpoint_time.set(timestamp)
        self._last_checkpoint_step.set(step)
        self._checkpoints.inc()
