"""The coordinator's training loop over ParameterServerStrategy + ClusterCoordinator.

The outer loop (progress, checkpoints, evaluation, summary) is kept apart from the step
that gets scheduled: one scheduled function runs K packed steps on a worker, updates loss
and metric objects that live on the ps tasks, and the loop reads those at a cadence
instead of fetching values every step.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import keras
import tensorflow as tf

from cluster.spec import ClusterConfig
from coordinator.job import DataContext, Job
from coordinator.metric_objects import metric_factories
from coordinator.progress import Progress
from coordinator.settings import TrainSettings

log = logging.getLogger(__name__)


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
    wall_seconds: float
    train_seconds: float
    num_workers: int
    num_ps: int
    batch_size: int
    steps_per_execution: int
    checkpoint: str | None
    stopped_early: bool
    metrics: dict[str, float] = field(default_factory=dict)
    eval_metrics: dict[str, float] = field(default_factory=dict)


class StopRequest:
    """Set by SIGTERM/SIGINT: finish in-flight steps, checkpoint, evaluate, exit 0."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._handle)
            signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.event.is_set():  # a second signal: the operator insists
            raise KeyboardInterrupt
        log.warning(
            "%s: finishing in-flight steps, then checkpoint and exit", signal.Signals(signum).name
        )
        self.event.set()


def _resolver(cluster: ClusterConfig) -> Any:
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster.as_dict()), task_type="chief", task_id=0, rpc_layer="grpc"
    )


def _scalar(value: Any) -> float:
    return float(keras.ops.convert_to_numpy(value))


class Trainer:
    """Builds the strategy, the model on the ps tasks, and runs the loop."""

    def __init__(self, *, job: Job, cluster: ClusterConfig, settings: TrainSettings) -> None:
        self.job = job
        self.cluster = cluster
        self.settings = settings
        self.stop = StopRequest()
        partitioner = None
        if settings.max_shards > 1:
            partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
                min_shard_bytes=settings.min_shard_bytes, max_shards=settings.max_shards
            )
        self.strategy = tf.distribute.experimental.ParameterServerStrategy(
            _resolver(cluster), variable_partitioner=partitioner
        )
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(self.strategy)
        self.num_workers = cluster.num_workers
        self._build_state()

    # -- construction -------------------------------------------------------------------

    def _data_context(self, worker_index: Any, batch_size: int) -> DataContext:
        return DataContext(
            worker_index=worker_index,
            num_workers=self.num_workers,
            batch_size=batch_size,
            seed=self.settings.seed,
        )

    def _build_state(self) -> None:
        s = self.settings
        # The element spec, from a dataset built here but never iterated, tells the
        # model's input shape and which accuracy fits the labels.
        spec = self.job.dataset_fn(self._data_context(0, s.batch_size)).element_spec
        x_spec, y_spec = spec[0], spec[1]
        with self.strategy.scope():
            self.model = self.job.create_model()
            if not self.model.built:
                self.model.build(x_spec.shape)
            self.optimizer = self.job.create_optimizer()
            self.optimizer.build(self.model.trainable_variables)
            pred_shape = self.model.compute_output_spec(
                keras.KerasTensor(x_spec.shape, dtype=x_spec.dtype)
            ).shape
            self.metric_factories = metric_factories(
                self.job.metrics, label_shape=y_spec.shape, pred_shape=pred_shape
            )
            train_metrics = [make() for make in self.metric_factories]
            # Means (loss, accuracy, ...) accumulate as rows of [sum, count] in ONE variable:
            # one assign_add per step updates them together, so a read is a consistent
            # snapshot and windows are exact. Other metrics stay Keras objects on the ps.
            self.mean_metrics = [
                (m.name, m._fn, dict(m._fn_kwargs))
                for m in train_metrics
                if isinstance(m, keras.metrics.MeanMetricWrapper)
            ]
            self.other_metrics = [
                m for m in train_metrics if not isinstance(m, keras.metrics.MeanMetricWrapper)
            ]
            self.mean_sums = tf.Variable(
                tf.zeros([1 + len(self.mean_metrics), 2], tf.float64),
                trainable=False,
                name="train_mean_sums",
            )
            self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        self._last_sums: dict[str, tuple[float, float]] = {}
        self.checkpoint = tf.train.Checkpoint(
            model=self.model, optimizer=self.optimizer, global_step=self.global_step
        )
        self.manager = None
        if s.checkpoint_dir:
            self.manager = tf.train.CheckpointManager(
                self.checkpoint,
                s.checkpoint_dir,
                max_to_keep=s.keep_checkpoints,
                step_counter=self.global_step,
            )

    def restore(self) -> int:
        """Restore the newest checkpoint, if any; returns the global step to start from."""
        if self.manager is None or self.manager.latest_checkpoint is None:
            return 0
        path = self.manager.latest_checkpoint
        started = time.monotonic()
        self.checkpoint.restore(path).assert_existing_objects_matched()
        step = int(self.global_step.numpy())
        log.info("restored %s (global step %d) in %.2fs", path, step, time.monotonic() - started)
        return step

    def _make_train_fn(self) -> Any:
        model, optimizer, loss_fn = self.model, self.optimizer, self.job.loss_fn
        mean_sums, mean_metrics, other_metrics = (
            self.mean_sums,
            self.mean_metrics,
            self.other_metrics,
        )
        global_step, strategy = self.global_step, self.strategy

        def row(values: tf.Tensor) -> tf.Tensor:
            values = tf.cast(values, tf.float64)
            return tf.stack([tf.reduce_sum(values), tf.cast(tf.size(values), tf.float64)])

        def replica_step(batch: Any) -> None:
            x, y = batch[0], batch[1]
            with tf.GradientTape() as tape:
                predictions = model(x, training=True)
                loss = tf.reduce_mean(loss_fn(y, predictions))
                if model.losses:
                    loss += tf.add_n(model.losses)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            rows = [row(loss)] + [row(fn(y, predictions, **kw)) for _, fn, kw in mean_metrics]
            mean_sums.assign_add(tf.stack(rows))
            for metric in other_metrics:
                metric.update_state(y, predictions)

        @tf.function
        def train_fn(iterator: Any, num_steps: tf.Tensor) -> tf.Tensor:
            for _ in tf.range(num_steps):
                strategy.run(replica_step, args=(next(iterator),))
            global_step.assign_add(num_steps)
            return num_steps

        return train_fn

    def _per_worker_iterator(self) -> Any:
        batch_size = self.settings.batch_size
        dataset_fn = self.job.dataset_fn

        def per_worker_dataset_fn() -> Any:
            # Traced once for all workers: the worker's index is a tensor, not a Python int.
            index = tf.distribute.coordinator.experimental_get_current_worker_index()
            ctx = self._data_context(tf.cast(index, tf.int64), batch_size)
            return self.strategy.distribute_datasets_from_function(lambda _: dataset_fn(ctx))

        dataset = self.coordinator.create_per_worker_dataset(per_worker_dataset_fn)
        return iter(dataset)

    # -- reading state --------------------------------------------------------------------

    def read_train_metrics(self) -> dict[str, float]:
        """Loss and metrics over the steps since the previous read.

        Nothing is reset on the ps: a reset races with the workers' updates (seen: accuracy
        above 1). Means are windowed by the change of their (sum, count) rows since the
        last read; any other metric reports its cumulative result.
        """
        snapshot = self.mean_sums.numpy()
        names = ["loss"] + [name for name, _, _ in self.mean_metrics]
        sums = {name: (float(t), float(c)) for name, (t, c) in zip(names, snapshot, strict=True)}
        values: dict[str, float] = {}
        for name, (total, count) in sums.items():
            prev_total, prev_count = self._last_sums.get(name, (0.0, 0.0))
            if count > prev_count:
                values[name] = (total - prev_total) / (count - prev_count)
            else:
                values[name] = total / count if count else float("nan")
        self._last_sums = sums
        for metric in self.other_metrics:
            values[metric.name] = _scalar(metric.result())
        return values

    def save(self) -> str | None:
        if self.manager is None:
            return None
        started = time.monotonic()
        path = self.manager.save(checkpoint_number=int(self.global_step.numpy()))
        log.info("checkpoint %s (%.2fs)", path, time.monotonic() - started)
        return path

    def evaluate(self) -> dict[str, float]:
        """Evaluate the held-out split once, on the coordinator, reading ps variables.

        Exact (every eval example once) and independent of worker failures.
        """
        if self.job.eval_dataset_fn is None:
            return {}
        # One reader sees the whole split: the context says worker 0 of 1.
        ctx = DataContext(
            worker_index=0,
            num_workers=1,
            batch_size=self.settings.eval_batch_size,
            seed=self.settings.seed,
        )
        dataset = self.job.eval_dataset_fn(ctx)
        loss = keras.metrics.Mean(name="loss")
        metrics = [make() for make in self.metric_factories]
        model, loss_fn = self.model, self.job.loss_fn

        @tf.function
        def eval_step(x: Any, y: Any) -> None:
            predictions = model(x, training=False)
            loss.update_state(
                tf.reduce_mean(loss_fn(y, predictions)),
                sample_weight=tf.cast(tf.shape(y)[0], tf.float32),
            )
            for metric in metrics:
                metric.update_state(y, predictions)

        started = time.monotonic()
        examples = 0
        for batch in dataset:
            eval_step(batch[0], batch[1])
            examples += int(batch[1].shape[0])
        values = {"loss": _scalar(loss.result())}
        values.update({m.name: _scalar(m.result()) for m in metrics})
        log.info(
            "eval | step: %6d | %s | %d examples in %.2fs",
            int(self.global_step.numpy()),
            _fmt(values),
            examples,
            time.monotonic() - started,
        )
        return values

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> Summary:
        s = self.settings
        wall_started = time.monotonic()
        self.stop.install()
        start_step = self.restore()
        target = s.steps
        if start_step >= target:
            log.info(
                "global step %d already reaches --steps %d: nothing to train", start_step, target
            )
        train_fn = self._make_train_fn()
        iterator = self._per_worker_iterator() if start_step < target else None
        k_full = tf.constant(s.steps_per_execution, tf.int64)
        max_in_flight = s.max_in_flight or 4 * self.num_workers
        in_flight: collections.deque[tuple[Any, int]] = collections.deque()
        progress = Progress(total=target, start=start_step, stream=sys.stderr)
        scheduled = completed = start_step
        next_checkpoint = (start_step // s.checkpoint_every + 1) * s.checkpoint_every
        last_report = train_started = time.monotonic()
        last_report_step = start_step
        last_values: dict[str, float] = {}

        while scheduled < target and not self.stop.event.is_set():
            k = min(s.steps_per_execution, target - scheduled)
            num = k_full if k == s.steps_per_execution else tf.constant(k, tf.int64)
            in_flight.append((self.coordinator.schedule(train_fn, args=(iterator, num)), k))
            scheduled += k
            while len(in_flight) > max_in_flight:
                remote, done = in_flight.popleft()
                remote.fetch()  # raises the closure's error, if any
                completed += done
            now = time.monotonic()
            if now - last_report >= s.log_every and completed > last_report_step:
                last_values = self.read_train_metrics()
                rate = (completed - last_report_step) / (now - last_report)
                progress.report(completed, rate * s.batch_size, last_values)
                last_report, last_report_step = now, completed
            if self.manager is not None and completed >= next_checkpoint:
                self.save()
                next_checkpoint = (completed // s.checkpoint_every + 1) * s.checkpoint_every

        self.coordinator.join()
        train_seconds = time.monotonic() - train_started
        final_step = int(self.global_step.numpy())
        trained = final_step - start_step
        if trained > 0:
            last_values = self.read_train_metrics() or last_values
        progress.finish(final_step, trained * s.batch_size / max(train_seconds, 1e-9), last_values)
        checkpoint = (
            self.save()
            if trained > 0 or self.manager is None
            else (self.manager.latest_checkpoint if self.manager else None)
        )
        eval_values = self.evaluate()
        steps_per_sec = trained / train_seconds if trained > 0 else 0.0
        extra = {k: v for k, v in last_values.items() if k not in ("loss", "accuracy")}
        return Summary(
            job=self.job.name,
            global_step=final_step,
            start_step=start_step,
            target_steps=target,
            loss=last_values.get("loss"),
            accuracy=last_values.get("accuracy"),
            eval_accuracy=eval_values.get("accuracy"),
            eval_loss=eval_values.get("loss"),
            examples_per_sec=steps_per_sec * s.batch_size,
            steps_per_sec=steps_per_sec,
            wall_seconds=time.monotonic() - wall_started,
            train_seconds=train_seconds,
            num_workers=self.num_workers,
            num_ps=self.cluster.num_ps,
            batch_size=s.batch_size,
            steps_per_execution=s.steps_per_execution,
            checkpoint=checkpoint,
            stopped_early=final_step < target,
            metrics=extra,
            eval_metrics=eval_values,
        )


def _fmt(values: dict[str, float]) -> str:
    return " | ".join(f"{k}: {v:.4f}" for k, v in values.items())


def write_summary(summary: Summary, path: str) -> None:
    """Write atomically, so a reader never sees half a file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(asdict(summary), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, target)


def print_summary(summary: Summary) -> None:
    def show(v: float | None) -> str:
        return "n/a" if v is None or math.isnan(v) else f"{v:.4f}"

    print(
        f"done | step: {summary.global_step} | loss: {show(summary.loss)} | "
        f"accuracy: {show(summary.accuracy)} | eval_accuracy: {show(summary.eval_accuracy)} | "
        f"{summary.examples_per_sec:.0f} ex/s | {summary.steps_per_sec:.1f} steps/s | "
        f"wall {summary.wall_seconds:.1f}s",
        flush=True,
    )
