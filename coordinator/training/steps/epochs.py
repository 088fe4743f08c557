"""``--epochs N``: exactly-once epochs through the tf.data service.

The coordinator runs the service's dispatcher; every worker server hosts a data worker
(cluster/dataservice.py). The job's one-pass dataset, repeated N times, is registered with
the dispatcher as ONE job in ``distributed_epoch`` mode: the dispatcher hands the source's
pieces (files, or ranges of tensor slices) to the data workers, each piece once, and every
PS worker's per-worker dataset reads from that job. So, without failures, every example is
trained on exactly once per epoch, whichever worker's steps take it; epoch e's pieces are
all handed out before epoch e + 1's, so workers overlap at an epoch boundary by at most
their buffered batches.

Each scheduled call runs up to K steps and returns how many it really ran: a worker whose
iterator is exhausted returns fewer than K. The loop schedules until EVERY worker has
reported the end of the data (a worker with buffered batches drains them first), so
nothing is left unread and nothing waits on uneven shards.

A worker whose data never ends while another's has ended (its reads of the service hang
after a restart, or it stays frozen) would keep the loop spinning on the finished workers'
empty calls: after ``--stall-timeout`` of them with no example trained, the training process
ends with RestartFromCheckpoint and its supervisor starts a fresh one, which trains the
pass again from the latest checkpoint.

Failures: ``schedule`` is at-least-once and the service hands each piece out once, so a
worker that dies loses the batches it had taken (in its call, its iterator buffer and its
data worker's pieces): an epoch can then miss examples, it does not repeat them. See
docs/data.md ("Exactly-once epochs").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from psctl.cluster import ports
from psctl.cluster.address import split_host_port
from psctl.cluster.dataservice import require_dispatcher
from psctl.cluster.errors import ConfigError
from psctl.coordinator.failures import RestartFromCheckpoint
from psctl.coordinator.training.inflight import DrainWatch
from psctl.coordinator.training.loop import OPEN_TARGET
from psctl.coordinator.training.steps.graph_ops import seconds_since
from psctl.coordinator.training.steps.programs import (
    Runtime,
    make_replica_step,
    options_read_while_tracing,
)

log = logging.getLogger(__name__)

# Servers started in this process: never collected, a dispatcher serves until exit.
_DISPATCHERS: list[Any] = []


def journal_dir(address: str, checkpoint_dir: str) -> str:
    """Where the dispatcher on ``address`` keeps its journal: in the job's checkpoint
    directory (``data-service/HOST_PORT``), else in a temporary one of this supervisor's
    (the parent process: the training processes it restarts share it)."""
    name = address.replace(":", "_").replace("/", "_")
    if checkpoint_dir:
        return os.path.join(checkpoint_dir, "data-service", name)
    return os.path.join(tempfile.gettempdir(), f"psctl-data-service-{os.getppid()}", name)


def start_dispatcher(address: str, journal: str) -> Any:
    """The tf.data service dispatcher, in the coordinator's process, on ``address``'s port.

    Fault-tolerant: it journals its state in ``journal`` and a restarted coordinator's
    dispatcher recovers it. Without that, the new dispatcher numbers its jobs and tasks
    from the start again, the data workers (in the worker servers, which outlive the
    coordinator) still hold the old dispatcher's tasks under those numbers and serve them
    instead: the new passes then ended at once with nothing trained (seen: 0 examples after a
    ps SIGKILL; tests/chaos/test_epochs_chaos.py).
    """
    _, port = split_host_port(address, field="data_service.dispatcher")
    ports.check_port_free(port, field="data_service.dispatcher port")
    config = tf.data.experimental.service.DispatcherConfig(
        port=port, protocol="grpc", work_dir=journal, fault_tolerant_mode=True
    )
    dispatcher = tf.data.experimental.service.DispatchServer(config, start=True)
    _DISPATCHERS.append(dispatcher)
    log.info("tf.data service dispatcher on %s (journal %s)", address, journal)
    return dispatcher


def make_epoch_train_fn(rt: Runtime) -> Any:
    """The scheduled function: up to ``num_steps`` steps, stopping at the end of the data.

    Returns [steps run, examples, worker index, microseconds] (int64).
    """
    replica_step = make_replica_step(rt.state, rt.job.loss_fn)
    global_step, strategy = rt.state.global_step, rt.strategy

    # No autograph (see local_step.py): the loop is the tf.while_loop it would make, ending
    # early at the end of the data.
    def train_fn(iterator: Any, num_steps: tf.Tensor) -> tf.Tensor:
        def step(steps: tf.Tensor, examples: tf.Tensor, _: tf.Tensor) -> tuple[Any, ...]:
            batch = iterator.get_next_as_optional()

            def run() -> tuple[Any, ...]:
                value = batch.get_value()
                strategy.run(replica_step, args=(value,))
                n = tf.cast(tf.shape(value[1])[0], tf.int64)
                return steps + 1, examples + n, tf.constant(False)

            ended = (steps, examples, tf.constant(True))
            return tuple(tf.cond(batch.has_value(), run, lambda: ended))

        started = tf.timestamp()
        zero = tf.constant(0, tf.int64)
        with tf.control_dependencies([started]):
            steps, examples, _ = tf.while_loop(
                lambda steps, _, ended: tf.logical_and(steps < num_steps, tf.logical_not(ended)),
                step,
                (zero, zero, tf.constant(False)),
            )
        done = global_step.assign_add(steps)
        index = tf.distribute.coordinator.experimental_get_current_worker_index()
        micros = tf.cast(seconds_since(started, after=done) * 1e6, tf.int64)
        return tf.stack([steps, examples, tf.cast(index, tf.int64), micros])

    return tf.function(train_fn, autograph=False)


class EpochProgram:
    """The step program of ``--epochs``: runs until every worker saw the end of the data."""

    target = OPEN_TARGET  # unknown in advance; the end of the data ends the loop
    progress_total = 0

    def __init__(
        self,
        rt: Runtime,
        *,
        dispatcher: str | None,
        worker_failures: Callable[[], int],
        train_data: str | None = None,
    ) -> None:
        """``train_data``: the files to read instead of --train-data's (follow mode)."""
        s = rt.settings
        self.rt = rt
        self.address = require_dispatcher(dispatcher, s.exactly_once_flag)
        self.worker_failures = worker_failures  # seen by the health checks so far
        self.finished_workers: set[int] = set()
        self.drain = DrainWatch(timeout=s.loop.stall_timeout)
        self.examples = 0
        self.context = dataclasses.replace(rt.data_context(0, 1, s.loop.batch_size), one_pass=True)
        if train_data is not None:
            self.context = dataclasses.replace(self.context, train_data=train_data)
        dataset = rt.job.dataset_fn(self.context)
        if int(dataset.cardinality()) == int(tf.data.INFINITE_CARDINALITY):
            raise ConfigError(
                s.exactly_once_flag,
                f"the job's dataset_fn ({rt.job.name}) returns an endless dataset",
                "when ctx.one_pass is true, return one pass over the data (no repeat())",
            )
        start_dispatcher(self.address, journal_dir(self.address, s.checkpoints.checkpoint_dir))
        self.failures_seen = worker_failures()
        self.makeup_passes = 0
        self.function: Any = None
        self.iterator: Any = None
        self._old_iterators: list[Any] = []  # never collected (see ScheduledRunner.start)
        self._settle: Callable[[], None] = lambda: None

    def start(self, settle: Callable[[], None]) -> None:
        self._settle = settle
        self.function = make_epoch_train_fn(self.rt)
        self.iterator = self._make_iterator(self.rt.settings.data.epochs)

    def _make_iterator(self, epochs: int) -> Any:
        rt, ctx, dataset_fn = self.rt, self.context, self.rt.job.dataset_fn
        # One service job per iterator; a new coordinator starts new jobs too.
        job_name = f"psctl-epochs-{uuid.uuid4().hex[:12]}"
        service = f"grpc://{self.address}"

        def per_worker_dataset_fn() -> Any:
            def make(_: Any) -> Any:
                return (
                    dataset_fn(ctx)
                    .repeat(epochs)
                    .apply(
                        tf.data.experimental.service.distribute(
                            processing_mode="distributed_epoch", service=service, job_name=job_name
                        )
                    )
                    .prefetch(tf.data.AUTOTUNE)
                )

            return rt.strategy.distribute_datasets_from_function(make)

        log.info("%d pass(es) through the tf.data service (%s, job %s)", epochs, service, job_name)
        with options_read_while_tracing():  # by the service's distribute()
            return iter(rt.coordinator.create_per_worker_dataset(per_worker_dataset_fn))

    def wants_more(self, scheduled: int) -> bool:
        if self._unfinished():
            return True
        return self._start_makeup_passes()

    def _unfinished(self) -> bool:
        """Whether a worker has not reached the end of the data yet; RestartFromCheckpoint
        when such a worker trained nothing for --stall-timeout after another one did."""
        if len(self.finished_workers) >= self.rt.num_workers:
            return False
        if not self.finished_workers or not self.drain.expired:
            return True
        done = sorted(self.finished_workers)
        left = sorted(set(range(self.rt.num_workers)) - self.finished_workers)
        raise RestartFromCheckpoint(
            f"worker(s) {', '.join(map(str, left))} trained no example for "
            f"{self.drain.waited:.0f}s (--stall-timeout) while worker(s) "
            f"{', '.join(map(str, done))} are at the end of the data: their reads of the "
            "tf.data service do not end (a worker restarted or frozen mid-pass); a fresh "
            "training process trains the pass again from the latest checkpoint"
        )

    def _start_makeup_passes(self) -> bool:
        """At-least-once: a worker that failed lost the batches it held, so every worker
        failure seen (health checks) since the passes started earns one more full pass."""
        failures = self.worker_failures()
        if failures <= self.failures_seen:
            return False
        passes = failures - self.failures_seen
        self.failures_seen = failures
        self.makeup_passes += passes
        log.warning(
            "%d worker failure(s) during the epochs: the batches they held are lost; "
            "training %d make-up pass(es) so that every example is trained at least %d times",
            passes,
            passes,
            max(self.rt.settings.data.epochs, 1),  # follow mode: one pass a round
        )
        # Calls still in flight read the old iterator: let them end first, so that their
        # end-of-data reports don't count for the new one.
        self._settle()
        self._new_passes(passes)
        return True

    def _new_passes(self, passes: int) -> None:
        """A new iterator of ``passes`` passes (the old one kept, never collected): no
        worker has reached its end yet."""
        if self.iterator is not None:
            self._old_iterators.append(self.iterator)
        self.iterator = self._make_iterator(passes)
        self.finished_workers = set()
        self.drain.reset()

    def result(self, steps: int, value: Any) -> tuple[int, float]:
        ran, examples, worker, micros = (int(v) for v in value)
        self.examples += examples
        if ran < steps and worker not in self.finished_workers:
            self.finished_workers.add(worker)
            log.info(
                "worker %d: end of the data (%d of %d workers); %d examples trained so far",
                worker,
                len(self.finished_workers),
                self.rt.num_workers,
                self.examples,
            )
        self.drain.observe(examples, draining=bool(self.finished_workers))
        return ran, micros / 1e6

    def stopped_early(self, final_step: int) -> bool:
        return len(self.finished_workers) < self.rt.num_workers
