"""The job's model and optimizer, and the training state that lives on the ps tasks.

Built in one place for every process that needs them: the coordinator (under the
strategy's scope, on the ps), its checkpoint's skeleton, and the sidecar evaluator.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from psctl.cluster.errors import ConfigError
from psctl.coordinator.data.context import DataContext
from psctl.coordinator.embeddings.dynamic import attach_slots, dynamic_layers, placed
from psctl.coordinator.embeddings.dynamic_updates import (
    DynamicUpdater,
    table_stats,
)
from psctl.coordinator.embeddings.sharded import building
from psctl.coordinator.embeddings.sparse import SparseRule, SparseUpdater
from psctl.coordinator.job import Job
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.job_model.features import (
    build_model,
    check_features,
    model_inputs,
    symbolic,
)
from psctl.coordinator.training.job_model.metric_objects import (
    consistent_result,
    structured_metric_factories,
)


def scalar(value: Any) -> float:
    return float(keras.ops.convert_to_numpy(value))


class JobModel:
    """The job's model (checked against and built for ``x_spec``: what ``source``, a dataset
    function of the job, yields as features), its optimizer (built over the model's
    trainable variables) and fresh-metric factories fitted to the label and output shapes."""

    def __init__(self, job: Job, x_spec: Any, y_spec: Any, *, source: str = "dataset_fn") -> None:
        self.job_name = job.name
        self.model = job.create_model()
        # The model's declared inputs, or None (a subclassed model): once built on x_spec it
        # has inputs Keras made and named ("keras_tensor_3"), never the ones the job wrote.
        self.inputs = model_inputs(self.model)
        self.x_spec = x_spec
        self.check(x_spec, source)
        predictions = build_model(self.model, x_spec)
        self.optimizer = job.create_optimizer()
        if getattr(self.model, "compiled", False):
            # compile()'s own optimizer is not the one that trains (psctl's is made fresh,
            # in this scope): the model points at psctl's, so a checkpoint holds one.
            self.model.optimizer = self.optimizer
        self.optimizer.build(self.model.trainable_variables)
        # Dynamic tables: their slots are hash tables of their own, made for this optimizer.
        self.dynamic_layers = dynamic_layers(self.model)
        if self.dynamic_layers:
            attach_slots(self.dynamic_layers, SparseRule(self.optimizer))
        self.metric_factories = structured_metric_factories(
            job.metrics, label_spec=y_spec, pred_spec=predictions, job=job.name
        )

    def check(self, x_spec: Any, source: str) -> None:
        """ConfigError (one line naming the key) where ``source``'s features do not fit the
        model's inputs: its declared ones, or for a model without (built by psctl on the
        training features), the training features' structure, keys and dtypes."""
        inputs = self.inputs if self.inputs is not None else symbolic(self.x_spec)
        check_features(inputs, x_spec, job=self.job_name, source=source)

    def check_eval(self, job: Job, settings: TrainSettings) -> None:
        """Check the eval dataset's features too, before training: the final evaluation
        would meet a mismatch only after the last step. The dataset is never iterated."""
        if job.eval_dataset_fn is None:
            return
        ctx = DataContext.from_settings(
            settings, worker_index=0, num_workers=1, batch_size=settings.evaluation.eval_batch_size
        )
        self.check(job.eval_dataset(ctx).element_spec[0], "eval_dataset_fn")

    def checkpoint(self, global_step: Any) -> Any:
        """The checkpoint every psctl process writes and reads: model, optimizer, step."""
        return tf.train.Checkpoint(
            model=self.model, optimizer=self.optimizer, global_step=global_step
        )


class TrainState(JobModel):
    """What training updates on the ps: the model, the optimizer, the global step and the
    training metrics.

    Means (loss, accuracy, ...) accumulate as rows of [sum, count] in ONE variable: one
    assign_add per step updates them together, so a read is a consistent snapshot and
    windows are exact. Other metrics stay Keras objects on the ps. Build it under the
    strategy's scope.

    With ``--max-shards`` above 1, large Embedding tables are psctl tables
    (embeddings/sharded.py): not Keras weights, updated by ``sparse`` with the job
    optimizer's rule. DynamicEmbedding tables get one shard on every ps task, updated by
    ``dynamic`` (embeddings/dynamic_updates.py).
    """

    def __init__(
        self,
        job: Job,
        x_spec: Any,
        y_spec: Any,
        *,
        settings: TrainSettings,
        strategy: Any,
        num_ps: int = 0,
    ) -> None:
        # num_ps: the parameter-server strategy's ps tasks (0: no ps, sync mode).
        with building(settings) as plan, placed(ps_devices(num_ps) if num_ps else None):
            super().__init__(job, x_spec, y_spec)
        self.num_ps = num_ps
        count_steps_atomically(self.optimizer)
        if num_ps:
            # Sync mode's replicas update in lock-step (no stale read): Keras's own step.
            apply_adam_atomically(self.optimizer)
        if self.dynamic_layers:
            _check_dynamic(settings)
        self.dynamic = (
            DynamicUpdater(self.optimizer, self.dynamic_layers) if self.dynamic_layers else None
        )
        self.check_eval(job, settings)
        self.tables = plan.tables
        self.sparse = SparseUpdater(self.optimizer, plan.tables, strategy) if plan.tables else None
        train_metrics = [make() for make in self.metric_factories]
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

    @property
    def mean_names(self) -> list[str]:
        """The rows of ``mean_sums``: the loss, then every mean metric."""
        return ["loss"] + [name for name, _, _ in self.mean_metrics]

    def step(self) -> int:
        return int(self.global_step.numpy())

    def table_stats(self) -> dict[str, dict[str, int]]:
        """Per dynamic table (by layer name): its live ``rows`` and the ``admitted`` and
        ``evicted`` totals; empty without dynamic tables."""
        return table_stats(self.dynamic_layers)

    def read_train_metrics(self) -> dict[str, float]:
        """Loss and metrics over the steps since the previous read.

        Nothing is reset on the ps: a reset races with the workers' updates (seen: accuracy
        above 1). Means are windowed by the change of their (sum, count) rows since the
        last read; any other metric reports its cumulative result.
        """
        snapshot = self.mean_sums.numpy()
        sums = {
            name: (float(t), float(c))
            for name, (t, c) in zip(self.mean_names, snapshot, strict=True)
        }
        values: dict[str, float] = {}
        for name, (total, count) in sums.items():
            prev_total, prev_count = self._last_sums.get(name, (0.0, 0.0))
            if count > prev_count:
                values[name] = (total - prev_total) / (count - prev_count)
            else:
                values[name] = total / count if count else float("nan")
        self._last_sums = sums
        for metric in self.other_metrics:
            values[metric.name] = scalar(consistent_result(metric))
        return values


def count_steps_atomically(optimizer: Any) -> None:
    """Make ``optimizer.iterations.assign_add(n)`` one atomic add on the variable's task.

    Keras 3 counts every ``apply_gradients`` with ``self._iterations.assign_add(1)``
    (keras/src/optimizers/base_optimizer.py), and a Keras variable's ``assign_add`` is
    ``assign(self + value)`` (keras/src/backend/common/variables.py): a read, then a write.
    Under the parameter-server strategy the workers' steps interleave between the two and
    increments are lost (seen: iterations 410 after 600 steps with 2 workers, so schedules
    and Adam's bias correction ran ~30% behind). The tf.Variable's own ``assign_add`` is one
    AssignAddVariableOp, which holds the variable's lock on the ps; local-step mode's
    ``+K`` per call goes through the same method."""
    counter = optimizer._iterations

    def assign_add(value: Any) -> Any:
        variable = counter.value  # the tf.Variable (on a ps, or mirrored in sync mode)
        return variable.assign_add(tf.cast(value, variable.dtype))

    counter.assign_add = assign_add


def apply_adam_atomically(optimizer: Any) -> None:
    """Make a plain Keras 3 Adam update each variable with one fused ResourceApplyAdam op,
    which reads the moments and writes them and the variable under their locks on the ps.

    Keras 3 Adam's ``update_step`` (keras/src/optimizers/adam.py) adds
    ``(g*g - v) * (1 - beta_2)`` to ``v`` with ``v`` read earlier: on the ps, the read can
    land long before the add (the ps runs it as soon as the step starts, the add waits for
    the worker's gradient). A worker frozen for 30 s between the two then adds
    ``-0.001 * v_old`` to a ``v`` that had decayed ~1000x meanwhile: ``v`` went negative,
    ``sqrt(v)`` NaN, and the training loss NaN (seen in 2 of 2 runs; none after this).
    The kernel's math is Keras's: ``m += (g - m)(1 - b1)``, ``v += (g^2 - v)(1 - b2)``,
    ``var -= lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)``, ``t = iterations + 1``.

    Only for ``type(optimizer) is keras.optimizers.Adam`` without amsgrad (no fused form),
    float32/float64 variables (the checked ones) and dense gradients; anything else keeps
    Keras's own step. A sparse gradient (an Embedding table's) does too: Keras squares its
    slices before summing repeated ids (v += 0.002 for an id seen twice with gradient 1, not
    0.004), which the dense kernel would not reproduce.
    Clipping, weight decay, EMA, gradient accumulation and loss scaling happen around
    ``update_step`` and are kept."""
    if type(optimizer) is not keras.optimizers.Adam or optimizer.amsgrad:
        return
    keras_update_step = optimizer.update_step

    def update_step(gradient: Any, variable: Any, learning_rate: Any) -> Any:
        dtype = tf.as_dtype(variable.dtype)
        if isinstance(gradient, tf.IndexedSlices) or dtype not in (tf.float32, tf.float64):
            return keras_update_step(gradient, variable, learning_rate)
        index = optimizer._get_variable_index(variable)
        m, v = optimizer._momentums[index], optimizer._velocities[index]
        step = tf.cast(optimizer.iterations + 1, dtype)
        beta_1 = tf.cast(optimizer.beta_1, dtype)
        beta_2 = tf.cast(optimizer.beta_2, dtype)
        return tf.raw_ops.ResourceApplyAdam(
            var=_handle(variable),
            m=_handle(m),
            v=_handle(v),
            beta1_power=tf.pow(beta_1, step),
            beta2_power=tf.pow(beta_2, step),
            lr=tf.cast(learning_rate, dtype),
            beta1=beta_1,
            beta2=beta_2,
            epsilon=tf.cast(optimizer.epsilon, dtype),
            grad=tf.cast(gradient, dtype),
            use_locking=True,
        )

    optimizer.update_step = update_step


def _handle(variable: Any) -> Any:
    """The resource handle of a Keras variable's tf.Variable, or of a tf.Variable."""
    return (variable.value if isinstance(variable, keras.Variable) else variable).handle


def ps_devices(num_ps: int) -> list[str]:
    """The ps tasks' devices, where dynamic tables put one shard each."""
    return [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(num_ps)]


def _check_dynamic(settings: TrainSettings) -> None:
    """Where dynamic tables cannot train: one line naming the alternative."""
    if settings.strategy == "sync":
        raise ConfigError(
            "--strategy",
            "DynamicEmbedding tables live on the ps tasks: sync mode has none",
            "use --strategy async, or FeatureEmbedding (a fixed hashed table) in sync mode",
        )
    if settings.loop.update_mode == "local":
        raise ConfigError(
            "--update-mode",
            "local steps keep a copy of the variables on the worker, which a dynamic table "
            "cannot have",
            "use --update-mode default with DynamicEmbedding tables",
        )
