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
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from psctl.cluster.spec import ClusterConfig
from psctl.coordinator.control.service import JobControl, State
from psctl.coordinator.job import DataContext, Job
from psctl.coordinator.launch.argv import psctl_argv
from psctl.coordinator.launch.supervisor import RestartFromCheckpoint
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.graph_ops import seconds_since, sum_count
from psctl.coordinator.training.local_step import make_local_train_fn
from psctl.coordinator.training.metric_objects import make_eval_step, metric_factories
from psctl.coordinator.training.packing import packer_for
from psctl.coordinator.training.progress import Progress

if TYPE_CHECKING:
    from psctl.coordinator.control.metrics import CoordinatorMetrics
    from psctl.coordinator.training.inline_eval import InlineEval

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
    stalls: int = 0
    restarts: int = 0  # training processes started again by the supervisor
    ps_failures: int = 0
    worker_failures: int = 0
    coordinator_failures: int = 0
    recoveries: int = 0  # restarts + tasks seen back to SERVING after a failure
    metrics: dict[str, float] = field(default_factory=dict)
    eval_metrics: dict[str, float] = field(default_factory=dict)


def install_stop_signals(control: JobControl) -> None:
    """SIGTERM/SIGINT: finish in-flight steps, checkpoint, evaluate, exit 0. A second one
    aborts."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handle(signum: int, _frame: FrameType | None) -> None:
        if control.stop_requested.is_set():
            raise KeyboardInterrupt
        log.warning(
            "%s: finishing in-flight steps, then checkpoint and exit", signal.Signals(signum).name
        )
        control.stop_requested.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


def _resolver(cluster: ClusterConfig) -> Any:
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster.as_dict()), task_type="chief", task_id=0, rpc_layer="grpc"
    )


def _scalar(value: Any) -> float:
    return float(keras.ops.convert_to_numpy(value))


class Trainer:
    """Builds the strategy, the model on the ps tasks, and runs the loop."""

    def __init__(
        self,
        *,
        job: Job,
        cluster: ClusterConfig,
        settings: TrainSettings,
        control: JobControl,
        metrics: CoordinatorMetrics | None = None,
        data_dispatcher: str | None = None,  # the tf.data service's, for --epochs
    ) -> None:
        self.job = job
        self.data_dispatcher = data_dispatcher
        self.cluster = cluster
        self.settings = settings
        self.control = control
        self.metrics = metrics
        self.iterator: Any = None
        self._save_lock = threading.Lock()
        self._saver: threading.Thread | None = None
        self.save_error: RestartFromCheckpoint | None = None
        partitioner = None
        if settings.max_shards > 1:
            partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
                min_shard_bytes=settings.min_shard_bytes, max_shards=settings.max_shards
            )
        self.strategy = tf.distribute.experimental.ParameterServerStrategy(
            _resolver(cluster), variable_partitioner=partitioner
        )
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(self.strategy)
        # TensorBoard scalars, written on the coordinator at the status cadence (created
        # after the strategy connected to the cluster, which resets the eager context).
        self.summaries = tf.summary.create_file_writer(settings.logdir) if settings.logdir else None
        self.num_workers = cluster.num_workers
        self._build_state()

    # -- construction -------------------------------------------------------------------

    def _data_context(self, worker_index: Any, batch_size: int) -> DataContext:
        return self._context(worker_index, self.num_workers, batch_size)

    def _context(self, worker_index: Any, num_workers: int, batch_size: int) -> DataContext:
        s = self.settings
        return DataContext(
            worker_index=worker_index,
            num_workers=num_workers,
            batch_size=batch_size,
            seed=s.seed,
            train_data=s.train_data,
            eval_data=s.eval_data,
            label_column=s.label_column,
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
        # Workers keep training while a checkpoint is written, so the ps's global step moves
        # during the save. The checkpoint stores the step read just before (ckpt-N holds
        # step N); the model may include a few in-flight steps more, as async training does.
        self.saved_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="saved_step")
        self.checkpoint = tf.train.Checkpoint(
            model=self.model, optimizer=self.optimizer, global_step=self.saved_step
        )
        self.manager = None
        if s.checkpoint_dir:
            # Saving variables spread over several tasks traces a new tf.function per save,
            # and registering it waits on EVERY worker: one frozen worker blocks the save
            # (seen). So the save goes through a mirror of the same objects on the
            # coordinator, filled by plain reads of the ps variables: same checkpoint
            # layout, no function, and faster.
            mirror_model = self.job.create_model()
            if not mirror_model.built:
                mirror_model.build(x_spec.shape)
            mirror_optimizer = self.job.create_optimizer()
            mirror_optimizer.build(mirror_model.trainable_variables)
            self._mirror_pairs = list(
                zip(
                    self.model.variables + self.optimizer.variables,
                    mirror_model.variables + mirror_optimizer.variables,
                    strict=True,
                )
            )
            mirror = tf.train.Checkpoint(
                model=mirror_model, optimizer=mirror_optimizer, global_step=self.saved_step
            )
            self.manager = tf.train.CheckpointManager(
                mirror, s.checkpoint_dir, max_to_keep=s.keep_checkpoints
            )

    def restore(self) -> int:
        """Restore the newest checkpoint, if any; returns the global step to start from."""
        if self.manager is None or self.manager.latest_checkpoint is None:
            return 0
        # Restored straight into the ps variables (every task is up at start).
        path = self.manager.latest_checkpoint
        started = time.monotonic()
        self.checkpoint.restore(path).assert_existing_objects_matched()
        step = int(self.saved_step.numpy())
        self.global_step.assign(step)
        log.info("restored %s (global step %d) in %.2fs", path, step, time.monotonic() - started)
        return step

    def _make_replica_step(self) -> Any:
        """One training step on one batch, run under ``strategy.run`` on a worker."""
        model, optimizer, loss_fn = self.model, self.optimizer, self.job.loss_fn
        mean_sums, mean_metrics, other_metrics = (
            self.mean_sums,
            self.mean_metrics,
            self.other_metrics,
        )

        def replica_step(batch: Any) -> None:
            x, y = batch[0], batch[1]
            with tf.GradientTape() as tape:
                predictions = model(x, training=True)
                loss = tf.reduce_mean(loss_fn(y, predictions))
                if model.losses:
                    loss += tf.add_n(model.losses)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            rows = [sum_count(loss)]
            rows += [sum_count(fn(y, predictions, **kw)) for _, fn, kw in mean_metrics]
            mean_sums.assign_add(tf.stack(rows))
            for metric in other_metrics:
                metric.update_state(y, predictions)

        return replica_step

    def _make_train_fn(self) -> Any:
        if self.settings.update_mode == "local":
            return make_local_train_fn(
                model=self.model,
                optimizer=self.optimizer,
                loss_fn=self.job.loss_fn,
                mean_sums=self.mean_sums,
                mean_metrics=self.mean_metrics,
                other_metrics=self.other_metrics,
                global_step=self.global_step,
                scale=self.settings.local_scale,
            )
        replica_step = self._make_replica_step()
        global_step, strategy = self.global_step, self.strategy

        # No autograph (see local_step.py): the loop is the tf.while_loop it would make.
        @tf.function(autograph=False)
        def train_fn(iterator: Any, num_steps: tf.Tensor) -> tf.Tensor:
            def step(ran: tf.Tensor) -> tf.Tensor:
                strategy.run(replica_step, args=(next(iterator),))
                return ran + 1

            started = tf.timestamp()
            with tf.control_dependencies([started]):
                (ran,) = tf.while_loop(
                    lambda ran: ran < num_steps, step, [tf.constant(0, num_steps.dtype)]
                )
            done = global_step.assign_add(ran)  # after the loop: it needs the loop's output
            # Seconds this call ran on its worker: the only value copied back per call.
            return seconds_since(started, after=done)

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
        """Write a checkpoint now, while the workers go on (ps variables are always
        readable); the step recorded is the global step read just before."""
        if self.manager is None:
            return None
        with self._save_lock:
            return self._save()

    def save_in_background(self) -> bool:
        """Start a periodic checkpoint on its own thread, so that the loop keeps the workers
        busy meanwhile: while a worker is frozen, reading the ps variables can wait until it
        thaws or gRPC gives up on it (seen: 120 s), and a save on the loop's thread held every
        worker idle that long. Skipped (False) while the previous one is still running."""
        if self._saver is not None and self._saver.is_alive():
            log.warning("checkpoint skipped: the previous save is still running (a frozen task?)")
            return False
        self._saver = threading.Thread(target=self._save_logged, name="checkpoint", daemon=True)
        self._saver.start()
        return True

    def _save_logged(self) -> None:
        try:
            self.save()
        except RestartFromCheckpoint as err:
            self.save_error = err  # the loop raises it
        except Exception as err:  # the next save or the final one tries again
            log.error("checkpoint failed: %s", err)

    def _save(self) -> str | None:
        assert self.manager is not None
        previous = self.control.state
        self.control.set_state(State.CHECKPOINTING)
        try:
            return self._write_checkpoint()
        finally:
            # Unless the loop moved on meanwhile (a background save): its state stands.
            if previous != State.CHECKPOINTING and self.control.state == State.CHECKPOINTING:
                self.control.set_state(previous)

    def _write_checkpoint(self) -> str:
        assert self.manager is not None
        started = time.monotonic()
        step = int(self.global_step.numpy())
        values = [source.numpy() for source, _ in self._mirror_pairs]
        for (source, _), value in zip(self._mirror_pairs, values, strict=True):
            if value.dtype.kind == "f" and not np.isfinite(value).all():
                # Never write it: with --keep-checkpoints the good ones would be deleted.
                raise RestartFromCheckpoint(
                    f"{source.name} is not finite at global step {step}: checkpoint refused"
                )
        self.saved_step.assign(step)
        for (_, copy), value in zip(self._mirror_pairs, values, strict=True):
            copy.assign(value)
        path: str = self.manager.save(checkpoint_number=step)
        seconds = time.monotonic() - started
        log.info("checkpoint %s (%.2fs)", path, seconds)
        now = time.time()
        self.control.update(checkpoint_path=path, checkpoint_step=step, checkpoint_time=now)
        if self.metrics is not None:
            self.metrics.observe_checkpoint(seconds=seconds, step=step, timestamp=now)
        return path

    def _serve_checkpoint_requests(self) -> None:
        for request in self.control.take_checkpoint_requests():
            try:
                path = self.save()
                request.future.set_result(
                    (path or "", self.control.snapshot().last_checkpoint.step)
                )
            except Exception as err:
                log.error("requested checkpoint failed: %s", err)
                request.future.set_exception(err)

    def evaluate(self) -> dict[str, float]:
        """Evaluate the held-out split once, on the coordinator, reading ps variables.

        Exact (every eval example once) and independent of worker failures.
        """
        if self.job.eval_dataset_fn is None:
            return {}
        # One reader sees the whole split: the context says worker 0 of 1.
        ctx = self._context(0, 1, self.settings.eval_batch_size)
        dataset = self.job.eval_dataset_fn(ctx)
        loss = keras.metrics.Mean(name="loss")
        metrics = [make() for make in self.metric_factories]
        # Eager on purpose: a new tf.function is registered on every worker, and a frozen
        # worker would block that registration (seen); the eval set is read once anyway.
        eval_step = make_eval_step(self.model, self.job.loss_fn, loss, metrics)

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
        s, control = self.settings, self.control
        wall_started = time.monotonic()
        start_step = self.restore()
        if s.epochs:
            from psctl.coordinator.training.epochs import EpochLoop

            loop: _Loop = EpochLoop(self, start_step)
        else:
            loop = _Loop(self, start_step)
        target = loop.target
        if start_step >= target:
            log.info(
                "global step %d already reaches --steps %d: nothing to train", start_step, target
            )
        control.update(global_step=start_step)
        if self.metrics is not None:
            self.metrics.set_global_step(start_step)
            self.metrics.set_target_steps(target if not s.epochs else 0)
            self.metrics.set_steps_per_execution(loop.packer.k)
        if start_step < target and not control.stop_requested.is_set():
            control.set_state(State.RUNNING)
            loop.run(target)
        control.set_state(State.STOPPING, "finishing in-flight steps, final checkpoint and eval")
        loop.drain()
        if loop.abandoned:
            # join() would wait for the calls given up on a frozen worker: not worth a hang.
            log.warning("finishing without %d call(s) stuck on a frozen task", loop.abandoned)
        else:
            self.coordinator.join()
        if loop.evals is not None:
            loop.evals.poll()  # an inline evaluation that finished with the last steps
        train_seconds = loop.train_seconds()
        final_step = int(self.global_step.numpy())
        trained = final_step - start_step
        values = self.read_train_metrics() if trained > 0 else {}
        values = values or loop.last_values
        rate = trained / train_seconds if trained > 0 and train_seconds > 0 else 0.0
        loop.progress.finish(final_step, rate * s.batch_size, values)
        self._publish(final_step, rate, values)
        if self.manager is not None:
            checkpoint = self.save() if trained > 0 else self.manager.latest_checkpoint
        else:
            checkpoint = None
        if loop.abandoned and checkpoint:
            eval_values = self.evaluate_elsewhere(checkpoint)
        else:
            eval_values = self.evaluate()
        if eval_values:
            self.report_eval(eval_values, step=final_step)
        extra = {k: v for k, v in values.items() if k not in ("loss", "accuracy")}
        return Summary(
            job=self.job.name,
            global_step=final_step,
            start_step=start_step,
            target_steps=target if not s.epochs else final_step,
            loss=values.get("loss"),
            accuracy=values.get("accuracy"),
            eval_accuracy=eval_values.get("accuracy"),
            eval_loss=eval_values.get("loss"),
            examples_per_sec=rate * s.batch_size,
            steps_per_sec=rate,
            wall_seconds=time.monotonic() - wall_started,
            train_seconds=train_seconds,
            num_workers=self.num_workers,
            num_ps=self.cluster.num_ps,
            batch_size=s.batch_size,
            steps_per_execution=loop.packer.k,
            checkpoint=checkpoint,
            stopped_early=loop.stopped_early(final_step),
            stalls=loop.stalls,
            metrics=extra,
            eval_metrics=eval_values,
        )

    def report_eval(self, values: dict[str, float], *, step: int) -> None:
        """Evaluation results to status, Prometheus and TensorBoard."""
        self.control.update(eval_metrics=values, eval_step=step)
        if self.metrics is not None:
            self.metrics.set_eval_values(values, step=step)
        self._summarize("eval", step, values)

    def evaluate_elsewhere(self, checkpoint: str) -> dict[str, float]:
        """Evaluate the final checkpoint in a fresh process (`psctl evaluate`).

        With a task frozen, this process can't create new functions or datasets: TensorFlow
        registers each on every worker and waits for the frozen one (seen)."""
        s = self.settings
        out = Path(checkpoint).parent / "final-eval.json"
        argv = psctl_argv(
            "evaluate",
            "--checkpoint-dir",
            str(Path(checkpoint).parent),
            "--max-evaluations",
            "1",
            "--job",
            s.job,
            "--eval-batch-size",
            str(s.eval_batch_size),
            "--seed",
            str(s.seed),
            "--label-column",
            s.label_column,
            "--summary-json",
            str(out),
        )
        if s.eval_data:
            argv += ["--eval-data", s.eval_data]
        log.info("a task is frozen: evaluating %s in a separate process", checkpoint)
        try:
            subprocess.run(argv, check=True, timeout=600, stdin=subprocess.DEVNULL)
            result = json.loads(out.read_text())
        except (subprocess.SubprocessError, OSError, ValueError) as err:
            log.error("final evaluation failed: %s", err)
            return {}
        values = {"loss": result["eval_loss"], **result.get("eval_metrics", {})}
        return {k: float(v) for k, v in values.items() if v is not None}

    def _publish(self, step: int, steps_per_sec: float, values: dict[str, float]) -> None:
        """Progress to the control API's status and to Prometheus."""
        self.control.update(
            global_step=step,
            steps_per_second=steps_per_sec,
            examples_per_second=steps_per_sec * self.settings.batch_size,
            loss=values.get("loss", float("nan")),
            metrics={k: v for k, v in values.items() if k != "loss"},
        )
        if self.metrics is not None:
            self.metrics.set_global_step(step)
            self.metrics.set_train_values(values)
        self._summarize("train", step, {**values, "steps_per_sec": steps_per_sec})

    def _summarize(self, prefix: str, step: int, values: dict[str, float]) -> None:
        if self.summaries is None:
            return
        with self.summaries.as_default(step=step):
            for name, value in values.items():
                if not math.isnan(value):
                    # What tf.summary.scalar writes, without needing the tensorboard package.
                    tf.summary.write(
                        f"{prefix}/{name}", tf.constant(value, tf.float32), metadata=_SCALAR
                    )
        self.summaries.flush()


@dataclass
class _InFlight:
    remote: Any  # the RemoteValue of one scheduled call
    steps: int
    scheduled_at: float
    # When a call scheduled after this one finished: ClusterCoordinator's queue is FIFO, so
    # from then on this one is surely running on a worker, not waiting in the queue.
    overtaken_at: float | None = None


def _only_workers_failed(err: BaseException) -> bool:
    text = str(err)
    return "/job:worker" in text and "/job:ps" not in text


def _is_done(remote: Any) -> bool:
    """Whether a scheduled call has finished (value or error), without blocking.

    RemoteValue has no public non-blocking check; its status event is what fetch() waits
    on (TF 2.21). Without it, report done so that fetch() decides (blocking).
    """
    event = getattr(remote, "_status_available_event", None)
    return bool(event.is_set()) if event is not None else True


def _wait_any(in_flight: collections.deque[_InFlight], timeout: float) -> None:
    event = getattr(in_flight[0].remote, "_status_available_event", None)
    if event is not None:
        event.wait(timeout)


class _Loop:
    """The scheduling loop: packs steps, bounds in-flight calls, honours control requests,
    publishes progress and checkpoints at their cadences."""

    STATUS_EVERY = 1.0  # seconds between status/metrics updates

    def __init__(self, trainer: Trainer, start_step: int) -> None:
        self.t = trainer
        s = trainer.settings
        self.start_step = start_step
        self.scheduled = self.completed = start_step
        self.in_flight: collections.deque[_InFlight] = collections.deque()
        self.last_progress = time.monotonic()
        self.stalled = False
        self.stalls = 0
        self.abandoned = 0  # calls given up by the stall watchdog
        self.max_in_flight = s.max_in_flight or 4 * trainer.num_workers
        self.target = s.steps
        self.packer = packer_for(s, trainer.num_workers)
        trainer.control.steps_per_execution = self.packer.k
        self.progress = Progress(total=s.steps, start=start_step, stream=sys.stderr)
        self.evals: InlineEval | None = None
        if s.eval_every:
            from psctl.coordinator.training.inline_eval import InlineEval

            self.evals = InlineEval(trainer, every=s.eval_every, start_step=start_step)
        self.last_values: dict[str, float] = {}
        self.started = time.monotonic()
        self.ended: float | None = None

    def train_seconds(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    # Hooks a loop over other data (coordinator/epochs.py) overrides.
    def _make_fn(self) -> Any:
        return self.t._make_train_fn()

    def _make_iterator(self) -> Any:
        return self.t._per_worker_iterator()

    def _wants_more(self, target: int) -> bool:
        return self.scheduled < target

    def _result(self, entry: _InFlight, value: Any) -> tuple[int, float]:
        """(steps run, seconds) from a finished call's value."""
        return entry.steps, float(value)

    def stopped_early(self, final_step: int) -> bool:
        return final_step < self.target

    def _retire(self, entry: _InFlight) -> None:
        try:
            value = entry.remote.fetch()  # done: returns at once, or raises
        except (tf.errors.UnavailableError, tf.errors.AbortedError) as err:
            if not _only_workers_failed(err):
                raise  # a ps: recovery needs a new coordinator
            # TensorFlow usually reruns a dead worker's call elsewhere; when it gives the
            # error back instead, schedule its steps again ourselves.
            log.warning(
                "a call failed with its worker (%s); its steps are scheduled again",
                type(err).__name__,
            )
            self.scheduled -= entry.steps
            return
        steps, seconds = self._result(entry, value)
        self.completed += steps
        self.last_progress = time.monotonic()
        self._repack(steps, seconds)
        if self.stalled:
            self.stalled = False
            log.warning("steps finish again: the stall is over")
            self.t.control.set_message("")
            if self.t.metrics is not None:
                self.t.metrics.set_stalled(False)
        if self.t.metrics is not None:
            self.t.metrics.observe_call(steps=steps, seconds=seconds)

    def _repack(self, steps: int, seconds: float) -> None:
        k = self.packer.observe(steps=steps, worker_seconds=seconds)
        if k is None:
            return
        m = self.packer.last
        log.info(
            "steps per call: %d (per call %.1f ms overhead vs %.2f ms/step)",
            k,
            1e3 * m.overhead_seconds if m else 0.0,
            1e3 * m.step_seconds if m else 0.0,
        )
        self.t.control.steps_per_execution = k
        if self.t.metrics is not None:
            self.t.metrics.set_steps_per_execution(k)

    def _retire_done(self) -> int:
        done = [entry for entry in self.in_flight if _is_done(entry.remote)]
        if done:
            newest = max(entry.scheduled_at for entry in done)
            now = time.monotonic()
            for entry in self.in_flight:
                if entry.overtaken_at is None and entry.scheduled_at < newest:
                    entry.overtaken_at = now
        for entry in done:
            self.in_flight.remove(entry)
            self._retire(entry)
        return len(done)

    def _wait(self, *, room_for: int) -> None:
        """Retire finished calls until at most ``room_for`` are in flight. Never blocks on
        one call: a frozen worker's call must not hold up the rest (stall watchdog)."""
        while len(self.in_flight) > room_for:
            if self._retire_done():
                continue
            self._watch_for_stall()
            if len(self.in_flight) > room_for:
                _wait_any(self.in_flight, 0.05)

    def _watch_for_stall(self) -> None:
        """The stall watchdog (--stall-timeout). A call still running that long after later
        calls finished sits on a frozen or cut-off worker: report it and give it up; its
        steps are scheduled again, so the job finishes without a worker that stays frozen
        (if it thaws, its call still lands). If no call at all finished that long, the whole
        job is stalled: say so, with the tasks that are not SERVING, until steps finish
        again."""
        timeout = self.t.settings.stall_timeout
        now = time.monotonic()
        stuck = [
            e
            for e in self.in_flight
            if e.overtaken_at is not None
            and now - e.overtaken_at >= timeout
            and not _is_done(e.remote)
        ]
        idle = bool(self.in_flight) and now - self.last_progress >= timeout
        if not stuck and not idle:
            return
        suspects = ", ".join(self.t.control.unhealthy_tasks()) or "none (a task is frozen?)"
        if idle and not self.stalled:
            self.stalled = True
            self.stalls += 1
            message = (
                f"stalled: no step finished for {now - self.last_progress:.0f}s; "
                f"tasks not SERVING: {suspects}"
            )
            log.warning("%s", message)
            self.t.control.set_message(message)
            if self.t.metrics is not None:
                self.t.metrics.set_stalled(True)
        if stuck:
            log.warning(
                "%d call(s) unfinished after %.0fs (tasks not SERVING: %s): given up, their "
                "steps scheduled again",
                len(stuck),
                timeout,
                suspects,
            )
        for entry in stuck:
            self.in_flight.remove(entry)
            self.scheduled -= entry.steps
            self.abandoned += 1
        if idle:
            self.last_progress = now  # the next report comes after another full timeout

    def drain(self) -> None:
        self._wait(room_for=0)
        if self.ended is None:
            self.ended = time.monotonic()

    def run(self, target: int) -> None:
        t, s, control = self.t, self.t.settings, self.t.control
        train_fn = self._make_fn()
        # Kept on the trainer, never collected: destroying per-worker iterators sends ops
        # to every worker, and one to a restarted worker can hold up all later eager work
        # (seen: the final evaluation hung after a worker and a ps restarted).
        t.iterator = self._make_iterator()
        constants: dict[int, tf.Tensor] = {}
        next_checkpoint = (self.start_step // s.checkpoint_every + 1) * s.checkpoint_every
        last_status = last_log = time.monotonic()
        status_step = self.start_step
        state = State.RUNNING
        while self._wants_more(target) and not control.stop_requested.is_set():
            if control.pause_requested:
                self.drain()  # in-flight steps finish; nothing new is scheduled
                if state != State.PAUSED:
                    state = State.PAUSED
                    control.set_state(state, "paused by request")
                    t._publish(int(t.global_step.numpy()), 0.0, self.last_values)
                    log.info("paused at global step %d", int(t.global_step.numpy()))
                t._serve_checkpoint_requests()
                control.stop_requested.wait(0.1)
                last_status, status_step = time.monotonic(), self.completed
                continue
            if state != State.RUNNING:
                state = State.RUNNING
                control.set_state(state)
                log.info("resumed at global step %d", self.completed)
                self.ended = None
            t._serve_checkpoint_requests()
            k = min(self.packer.k, target - self.scheduled)
            num = constants.get(k)
            if num is None:
                num = constants[k] = tf.constant(k, tf.int64)
            # t.iterator: --epochs may start a new one (make-up passes, coordinator/epochs.py)
            remote = t.coordinator.schedule(train_fn, args=(t.iterator, num))
            self.in_flight.append(_InFlight(remote, k, time.monotonic()))
            self.scheduled += k
            self._wait(room_for=self.max_in_flight)
            self._watch_for_stall()
            if t.metrics is not None:
                t.metrics.set_closures(in_flight=len(self.in_flight), queued=0)
            now = time.monotonic()
            if now - last_status >= min(self.STATUS_EVERY, s.log_every) and (
                self.completed > status_step
            ):
                rate = (self.completed - status_step) / (now - last_status)
                self.last_values = t.read_train_metrics()
                if self.completed > self.start_step:  # else the window has no step yet
                    _check_finite(self.last_values, self.completed)
                t._publish(self.completed, rate, self.last_values)
                last_status, status_step = now, self.completed
                if now - last_log >= s.log_every:
                    self.progress.report(self.completed, rate * s.batch_size, self.last_values)
                    last_log = now
            if t.save_error is not None:
                raise t.save_error
            if t.manager is not None and self.completed >= next_checkpoint:
                t.save_in_background()
                next_checkpoint = (self.completed // s.checkpoint_every + 1) * s.checkpoint_every
            if self.evals is not None:
                self.evals.tick(self.completed)
        self.drain()  # the loop ends when all is scheduled or a stop was requested


_SCALAR = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
)


def _check_finite(values: dict[str, float], step: int) -> None:
    """A NaN or infinite training loss ruins the model for good (seen: a worker frozen for a
    minute thawed, landed its stale optimizer update, and the loss went NaN).
    Only a fresh process restoring the last (finite) checkpoint can go on."""
    loss = values.get("loss")
    if loss is not None and not math.isfinite(loss):
        raise RestartFromCheckpoint(f"training loss is {loss} near global step {step}")


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
