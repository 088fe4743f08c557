"""Step programs: what one scheduled call runs on a worker, what it reads, how its result
reads. The controller runs any of them the same way (``StepProgram``); ``--update-mode``
and ``--epochs`` pick one (default here, local-step here, epochs in epochs.py).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import keras
import tensorflow as tf

from psctl.coordinator.data.context import DataContext
from psctl.coordinator.embeddings.dynamic import recording
from psctl.coordinator.job import Job
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.job_model.metric_objects import metric_kind
from psctl.coordinator.training.job_model.model import TrainState
from psctl.coordinator.training.steps.graph_ops import seconds_since, sum_count
from psctl.coordinator.training.steps.local_step import make_local_train_fn


@dataclass(frozen=True)
class Runtime:
    """What a step program runs with: the job, its settings, the cluster's strategy and
    coordinator, and the training state on the ps."""

    job: Job
    settings: TrainSettings
    strategy: Any
    coordinator: Any  # tf.distribute.coordinator.ClusterCoordinator
    num_workers: int
    state: TrainState

    def data_context(self, worker_index: Any, num_workers: int, batch_size: int) -> DataContext:
        return DataContext.from_settings(
            self.settings, worker_index=worker_index, num_workers=num_workers, batch_size=batch_size
        )


class StepProgram(Protocol):
    """What the controller schedules. ``start`` builds the function and the per-worker
    iterator; the controller schedules ``function(iterator, num_steps)`` while
    ``wants_more`` says so, and reads each finished call's value through ``result``."""

    target: int  # the global step that completes training (2**62: the data decides)
    progress_total: int  # the progress line's total; 0 when not known in advance
    function: Any
    iterator: Any  # the per-worker iterator the next call reads

    def start(self, settle: Callable[[], None]) -> None:
        """Build; ``settle()`` waits until every call in flight has finished."""
        ...

    def wants_more(self, scheduled: int) -> bool: ...

    def result(self, steps: int, value: Any) -> tuple[int, float]:
        """(steps run, seconds on the worker) of a finished call of ``steps`` steps."""
        ...

    def stopped_early(self, final_step: int) -> bool: ...


# Training metrics whose state is counts that each batch adds to (Keras's confusion-matrix
# metrics): summed on the worker over a call's steps, added to the ps once per call.
ADDITIVE_METRICS: tuple[type, ...] = (
    keras.metrics.AUC,
    keras.metrics.Precision,
    keras.metrics.Recall,
    keras.metrics.PrecisionAtRecall,
    keras.metrics.RecallAtPrecision,
    keras.metrics.SensitivityAtSpecificity,
    keras.metrics.SpecificityAtSensitivity,
    keras.metrics.TruePositives,
    keras.metrics.TrueNegatives,
    keras.metrics.FalsePositives,
    keras.metrics.FalseNegatives,
)


class CallSums:
    """A call's training metrics, summed on the worker and added to the ps once per call
    instead of once per step: the mean metrics' [sum, count] rows and the counts of the
    additive metrics (``ADDITIVE_METRICS``; any other metric still updates its ps state
    every step). Each one a step used to send is one tensor fewer crossing per step, and a
    call that fails part-way adds nothing (its steps run again elsewhere)."""

    def __init__(self, state: TrainState) -> None:
        self.mean_sums = state.mean_sums
        self.additive = [m for m in state.other_metrics if metric_kind(m) in ADDITIVE_METRICS]
        self.per_step = [m for m in state.other_metrics if metric_kind(m) not in ADDITIVE_METRICS]

    def zeros(self) -> list[Any]:
        sums = [tf.zeros(self.mean_sums.shape, self.mean_sums.dtype)]
        return sums + [tf.zeros(v.shape, v.dtype) for m in self.additive for v in m.variables]

    def add(self, sums: Sequence[Any], rows: Any, y: Any, predictions: Any) -> list[Any]:
        """``sums`` plus one step's: its mean rows, and every additive metric's counts."""
        out = [sums[0] + rows]
        at = 1
        for metric in self.additive:
            mine = list(sums[at : at + len(metric.variables)])
            new = metric.stateless_update_state(mine, y, predictions)
            # A variable the update left alone comes back as the variable: keep the sum.
            out += [
                m if isinstance(n, keras.Variable) else n for m, n in zip(mine, new, strict=True)
            ]
            at += len(metric.variables)
        for metric in self.per_step:
            metric.update_state(y, predictions)
        return out

    def push(self, sums: Sequence[Any]) -> list[Any]:
        """The assign_adds of a call's sums to the ps."""
        variables = [self.mean_sums] + [v for m in self.additive for v in m.variables]
        return [v.assign_add(s) for v, s in zip(variables, sums, strict=True)]


def make_replica_step(
    state: TrainState,
    loss_fn: Callable[[Any, Any], Any],
    *,
    replicas: int = 1,
    sums: CallSums | None = None,
) -> Any:
    """One training step on one batch, run under ``strategy.run`` on a worker. With
    ``replicas`` above 1 (sync mode) the optimizer sums the replicas' gradients: each
    replica's is scaled by 1/replicas, so that the update is that of their mean. With
    ``sums`` the step takes the call's metric sums so far and returns them with its own
    added (``CallSums``); without, it updates the metrics on the ps itself."""
    model, optimizer, sparse, dynamic = state.model, state.optimizer, state.sparse, state.dynamic
    global_step = state.global_step
    mean_sums, mean_metrics, other_metrics = (
        state.mean_sums,
        state.mean_metrics,
        state.other_metrics,
    )

    def replica_step(batch: Any, so_far: Sequence[Any] = ()) -> Any:
        x, y = batch[0], batch[1]
        with tf.GradientTape() as tape, recording(tape) as records:
            predictions = model(x, training=True)
            loss = tf.reduce_mean(loss_fn(y, predictions))
            if model.losses:
                loss += tf.add_n(model.losses)
            objective = loss / replicas if replicas > 1 else loss
        dense = model.trainable_variables
        shards = sparse.shards if sparse else []
        looked_up = records.vectors()
        grads = tape.gradient(objective, dense + shards + looked_up)
        # Tables first: the step count is the one Keras will use.
        if sparse is not None:
            sparse.apply(grads[len(dense) : len(dense) + len(shards)])
        if dynamic is not None and looked_up:
            dynamic.apply(records, grads[len(dense) + len(shards) :], global_step)
        optimizer.apply_gradients(zip(grads[: len(dense)], dense, strict=True))
        rows = [sum_count(loss)]
        rows += [sum_count(fn(y, predictions, **kw)) for _, fn, kw in mean_metrics]
        if sums is not None:
            return sums.add(so_far, tf.stack(rows), y, predictions)
        mean_sums.assign_add(tf.stack(rows))
        for metric in other_metrics:
            metric.update_state(y, predictions)
        return None

    return replica_step


@contextlib.contextmanager
def options_read_while_tracing() -> Iterator[None]:
    """Around a dataset's ``options()`` read while a per-worker function is traced (psctl's
    own, or the tf.data service's ``distribute``): TensorFlow warns that options() is read
    the legacy way there, which is right for a dataset made in the same function
    (tests/unit/training/test_sync_mode.py). Without the warning on the run's stderr."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="To make it possible to preserve tf.data")
        yield


def shard_for(dataset: Any, index: int, num_workers: int) -> Any:
    """``AutoShardPolicy.DATA`` on the job's dataset: this worker's share of its elements
    (every num_workers-th batch, from ``index``: an int, or a tensor in the parameter-server
    mode's per-worker function), as tf.distribute's DATA policy reads.
    ``distribute_datasets_from_function`` never shards by itself, in either mode."""
    with options_read_while_tracing():
        policy = dataset.options().experimental_distribute.auto_shard_policy
    if num_workers > 1 and policy == tf.data.experimental.AutoShardPolicy.DATA:
        return dataset.shard(num_workers, index)
    return dataset


class DefaultProgram:
    """``--steps N``: K steps a call, each reading and updating the ps variables, over the
    job's per-worker datasets (each worker reads its own shard)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.target = rt.settings.loop.steps
        self.progress_total = rt.settings.loop.steps
        self.function: Any = None
        self.iterator: Any = None

    def start(self, settle: Callable[[], None]) -> None:
        self.function = self.make_function()
        self.iterator = self.make_iterator()

    def make_function(self) -> Any:
        # 1 under ParameterServerStrategy on CPU workers; the worker count in sync mode.
        replicas = int(self.rt.strategy.num_replicas_in_sync)
        # Parameter-server mode: the metrics are summed over the call on the worker. Sync
        # mode keeps its per-step updates (all-reduced across the replicas), with one
        # worker too: the mode decides, not the replica count.
        async_mode = self.rt.settings.strategy == "async"
        sums = CallSums(self.rt.state) if async_mode else None
        replica_step = make_replica_step(
            self.rt.state, self.rt.job.loss_fn, replicas=replicas, sums=sums
        )
        global_step, strategy = self.rt.state.global_step, self.rt.strategy

        # No autograph (see local_step.py): the loop is the tf.while_loop it would make.
        def train_fn(iterator: Any, num_steps: tf.Tensor) -> tf.Tensor:
            def step(ran: tf.Tensor, *so_far: Any) -> Any:
                if sums is None:
                    strategy.run(replica_step, args=(next(iterator),))
                    return ran + 1
                return (ran + 1, *strategy.run(replica_step, args=(next(iterator), so_far)))

            started = tf.timestamp()
            first = [tf.constant(0, num_steps.dtype)] + (sums.zeros() if sums else [])
            with tf.control_dependencies([started]):
                ran, *total = tf.while_loop(lambda ran, *_: ran < num_steps, step, first)
            pushed = sums.push(total) if sums else []
            with tf.control_dependencies(pushed):
                done = global_step.assign_add(ran)  # after the loop: it needs its output
            # Seconds this call ran on its worker: the only value copied back per call.
            return seconds_since(started, after=done)

        return tf.function(train_fn, autograph=False)

    def make_iterator(self) -> Any:
        rt = self.rt
        batch_size, dataset_fn = rt.settings.loop.batch_size, rt.job.dataset_fn

        def worker_dataset(_input_context: Any) -> Any:
            # Traced once for all workers: the worker's index is a tensor, not a Python int.
            index = tf.cast(
                tf.distribute.coordinator.experimental_get_current_worker_index(), tf.int64
            )
            ctx = rt.data_context(index, rt.num_workers, batch_size)
            return shard_for(dataset_fn(ctx), index, rt.num_workers)

        # As TensorFlow's tutorial writes it: the traced body only hands worker_dataset to
        # the strategy, which calls it as it is. Called from the body, it and everything it
        # calls (the job's dataset_fn, psctl's context and sharding) went through
        # autograph's source conversion: 0.8 s more before the first step of every run.
        def per_worker_dataset_fn() -> Any:
            return rt.strategy.distribute_datasets_from_function(worker_dataset)

        traced = tf.function(per_worker_dataset_fn)
        return iter(rt.coordinator.create_per_worker_dataset(traced))

    def wants_more(self, scheduled: int) -> bool:
        return scheduled < self.target

    def result(self, steps: int, value: Any) -> tuple[int, float]:
        return steps, float(value)

    def stopped_early(self, final_step: int) -> bool:
        return final_step < self.target


class LocalStepProgram(DefaultProgram):
    """``--update-mode local``: each call runs its K steps on a worker-local copy of the
    dense variables and pushes the change to the ps once; psctl tables are updated on the
    ps every step (local_step.py)."""

    def make_function(self) -> Any:
        state = self.rt.state
        return make_local_train_fn(
            model=state.model,
            optimizer=state.optimizer,
            loss_fn=self.rt.job.loss_fn,
            mean_sums=state.mean_sums,
            mean_metrics=state.mean_metrics,
            other_metrics=state.other_metrics,
            global_step=state.global_step,
            scale=self.rt.settings.loop.local_scale,
            sparse=state.sparse,
        )
