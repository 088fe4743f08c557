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
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from itertools import pairwise

from prometheus_client import CollectorRegistry, Info
from prometheus_client.core import GaugeMetricFamily, Metric

from psctl.cluster import ports
from psctl.cluster.metrics import (
    TLS_CERT_ENV,
    TLS_KEY_ENV,
    ProcessMetrics,
    StateGauge,
    serve_metrics,
)
from psctl.cluster.server import bind_host
from psctl.cluster.spec import ClusterConfig
from psctl.coordinator.operations.catalogue import (
    ALLREDUCE_SECONDS,
    BATCH_SIZE,
    CHECKPOINT_DURATION_SECONDS,
    CHECKPOINTS_TOTAL,
    CLOSURES_IN_FLIGHT,
    CLOSURES_QUEUED,
    CLUSTER_TASKS,
    EVALUATIONS_TOTAL,
    EXPORT_EVERY_SECONDS,
    FOLLOW_FILES_TRAINED_TOTAL,
    FOLLOW_FILES_WAITING,
    GLOBAL_STEP,
    INPUT_LAG_SECONDS,
    INPUT_LAST_COMPLETED_TIMESTAMP_SECONDS,
    LAST_CHECKPOINT_STEP,
    LAST_CHECKPOINT_TIMESTAMP_SECONDS,
    LAST_EVAL_STEP,
    LAST_PUBLISH_TIMESTAMP_SECONDS,
    NONFINITE_LOSS_TOTAL,
    PS,
    PS_FAILURES_TOTAL,
    PUBLISH_AGE_SECONDS,
    PUBLISH_FAILURES_TOTAL,
    PUBLISHED_VERSION,
    PUBLISHES_TOTAL,
    RECOVERIES_TOTAL,
    RESIZE_SECONDS,
    RESIZES,
    RESTARTS_TOTAL,
    SCHEDULED_FUNCTION_DURATION_SECONDS,
    STALLED,
    STALLS,
    STEP_DURATION_SECONDS,
    STEPS_PER_EXECUTION,
    TABLE_ADMITTED_TOTAL,
    TABLE_BYTES,
    TABLE_EVICTED_TOTAL,
    TABLE_ROWS,
    TARGET_STEPS,
    TRAIN_EXAMPLES_TOTAL,
    TRAIN_STEPS_TOTAL,
    WORKER_FAILURES_TOTAL,
    WORKERS,
)
from psctl.coordinator.operations.counters import Counters
from psctl.coordinator.settings import TrainSettings

# The training process's lines (/metrics served), as when launch/process.py logged them.
log = logging.getLogger("psctl.train")

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
        WORKERS.make(r).set(num_workers)
        PS.make(r).set(num_ps)
        tasks = CLUSTER_TASKS.make(r)
        tasks.labels("ps").set(num_ps)
        tasks.labels("worker").set(num_workers)
        self._cluster_tasks = tasks
        self._resizes = RESIZES.make(r)
        self._resize_seconds = RESIZE_SECONDS.make(r)
        BATCH_SIZE.make(r).set(batch_size)
        self._steps_per_execution = STEPS_PER_EXECUTION.make(r)

        # -- progress ------------------------------------------------------------------
        self._steps = TRAIN_STEPS_TOTAL.make(r)
        self._examples = TRAIN_EXAMPLES_TOTAL.make(r)
        self._step_seconds = STEP_DURATION_SECONDS.make(r)
        self._call_seconds = SCHEDULED_FUNCTION_DURATION_SECONDS.make(r)
        self._global_step = GLOBAL_STEP.make(r)
        self._target_steps = TARGET_STEPS.make(r)
        self._in_flight = CLOSURES_IN_FLIGHT.make(r)
        self._queued = CLOSURES_QUEUED.make(r)

        self._stalled = STALLED.make(r)
        self._allreduce_seconds = ALLREDUCE_SECONDS.make(r) if sync else None
        self._stalls = STALLS.make(r)

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
        self._last_eval_step = LAST_EVAL_STEP.make(r)
        self._evaluations = EVALUATIONS_TOTAL.make(r)

        # -- failures --------------------------------------------------------------------
        self._worker_failures = WORKER_FAILURES_TOTAL.make(r)
        self._ps_failures = PS_FAILURES_TOTAL.make(r)
        self._recoveries = RECOVERIES_TOTAL.make(r)
        self._restarts = RESTARTS_TOTAL.make(r)
        self._nonfinite = NONFINITE_LOSS_TOTAL.make(r)

        # -- checkpoints -----------------------------------------------------------------
        self._checkpoint_seconds = CHECKPOINT_DURATION_SECONDS.make(r)
        self._last_checkpoint_time = LAST_CHECKPOINT_TIMESTAMP_SECONDS.make(r)
        self._last_checkpoint_step = LAST_CHECKPOINT_STEP.make(r)
        self._checkpoints = CHECKPOINTS_TOTAL.make(r)

        # -- freshness -------------------------------------------------------------------
        self._files_trained = FOLLOW_FILES_TRAINED_TOTAL.make(r)
        self._files_waiting = FOLLOW_FILES_WAITING.make(r)
        self._input_completed = INPUT_LAST_COMPLETED_TIMESTAMP_SECONDS.make(r)
        self._completed_at = 0.0  # the newest trained file's completion; 0: none yet
        INPUT_LAG_SECONDS.make(r).set_function(lambda: _age(self._completed_at))
        self._published_version = PUBLISHED_VERSION.make(r)
        self._published_time = LAST_PUBLISH_TIMESTAMP_SECONDS.make(r)
        self._published_at = 0.0
        PUBLISH_AGE_SECONDS.make(r).set_function(lambda: _age(self._published_at))
        self._export_every = EXPORT_EVERY_SECONDS.make(r)
        self._publishes = PUBLISHES_TOTAL.make(r)
        self._publish_failures = PUBLISH_FAILURES_TOTAL.make(r)

        # -- dynamic embedding tables ----------------------------------------------------
        # Labelled by table: nothing is exported until the first report, and a job without
        # dynamic tables exports none of these.
        self._table_rows = TABLE_ROWS.make(r)
        self._table_admitted = TABLE_ADMITTED_TOTAL.make(r)
        self._table_evicted = TABLE_EVICTED_TOTAL.make(r)
        self._table_bytes = TABLE_BYTES.make(r)
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

    def files_trained(self, count: int, completed_at: float) -> None:
        """A round of ``count`` files trained, its partition complete at ``completed_at``."""
        self._files_trained.inc(count)
        self._completed_at = max(completed_at, self._completed_at)
        self._input_completed.set(self._completed_at)

    def set_files_waiting(self, n: int) -> None:
        self._files_waiting.set(n)

    def set_export_every(self, seconds: float) -> None:
        self._export_every.set(seconds)

    def published(self, *, version: int, checkpoint_time: float) -> None:
        self._published_version.set(version)
        self._published_at = checkpoint_time
        self._published_time.set(checkpoint_time)
        self._publishes.inc()

    def publish_failed(self) -> None:
        self._publish_failures.inc()

    def observe_checkpoint(self, *, seconds: float, step: int, timestamp: float) -> None:
        self._checkpoint_seconds.observe(seconds)
        self._last_checkpoint_time.set(timestamp)
        self._last_checkpoint_step.set(step)
        self._checkpoints.inc()


def _age(stamp: float) -> float:
    """Seconds since the Unix time ``stamp``; 0 while it is 0 (nothing yet)."""
    return max(0.0, time.time() - stamp) if stamp else 0.0


# -- a training process's /metrics served ------------------------------------------------


def start_metrics(
    port: int,
    settings: TrainSettings,
    cluster: ClusterConfig,
    counters: Counters,
    *,
    examples_per_step: int = 0,
) -> CoordinatorMetrics | None:
    """The coordinator's /metrics (its own registry), counting on from the earlier training
    processes' ``counters``; port 0 turns it off. ``examples_per_step``: see
    CoordinatorMetrics."""
    if not port:
        return None
    ports.check_port_free(port, field="--metrics-port")
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(
        registry=registry,
        job=settings.job,
        num_workers=cluster.num_workers,
        num_ps=cluster.num_ps,
        batch_size=settings.loop.batch_size,
        examples_per_step=examples_per_step,
        sync=settings.strategy == "sync",
    )
    earlier = counters.failures_seen({})
    metrics.carry_over(
        restarts=counters.restarts,
        task_recoveries=counters.task_recoveries,
        ps_failures=earlier["ps"],
        worker_failures=earlier["worker"],
        nonfinite_losses=counters.nonfinite_losses,
        resize_seconds=[float(str(r.get("seconds", 0.0))) for r in counters.resizes],
    )
    _serve(registry, bind_host(None, os.environ, cluster.task_address("chief", 0).host), port)
    return metrics


def start_worker_metrics(port: int, *, host: str, index: int) -> ProcessMetrics:
    """A sync worker's /metrics but the chief's: a worker task's series (its task info,
    health state and process), as a worker-server's in the parameter-server mode."""
    ports.check_port_free(port, host=host, field="--metrics-port")
    registry = CollectorRegistry()
    metrics = ProcessMetrics(registry=registry, task_type="worker", task_index=index)
    _serve(registry, host, port)
    return metrics


def _serve(registry: CollectorRegistry, host: str, port: int) -> None:
    cert, key = os.environ.get(TLS_CERT_ENV, ""), os.environ.get(TLS_KEY_ENV, "")
    serve_metrics(registry, host=host, port=port, certfile=cert, keyfile=key)
    log.info("metrics on %s://%s:%d/metrics", metrics_scheme(), host, port)


def metrics_scheme() -> str:
    """How this process serves /metrics: over TLS when it has a certificate (``_serve``)."""
    return "https" if os.environ.get(TLS_CERT_ENV) else "http"
