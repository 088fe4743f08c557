"""Local-step update mode (``--update-mode local``): K optimizer steps per variable round trip.

One scheduled call reads the trainable (and non-trainable) variables from the ps once, runs
``--local-steps`` K steps on a worker-local copy (Keras 3 ``model.stateless_call`` and a
functional optimizer on tensors), then pushes ``scale * (local - start)`` back to every
trainable variable with ``assign_add``. The default mode instead reads and updates the ps
variables on every step, so its cost is a round trip per step.

Policies (see docs/performance.md, "Local-step mode"):

- Optimizer state: each call starts a fresh worker-local state (Adam moments or SGD
  momentum at zero) with the job optimizer's hyper-parameters; the learning rate is read
  from the ps optimizer once per call (schedules follow ``optimizer.iterations``, which
  advances by K per call). The ps optimizer's slots are left untouched but stay in the
  checkpoint, so default and local mode restore each other's checkpoints.
- Other optimizers than Adam/SGD run plain SGD at their learning rate (logged once).
- Non-trainable state (e.g. BatchNorm statistics): the local final value is assigned
  (last writer wins), not summed: a sum of running-mean deltas over workers would count
  the same statistics several times.
- Loss and mean metrics are summed over the K steps on the worker and added to the ps
  rows once per call; other (non-mean) metrics update on the ps every step.
- Embedding tables sharded over the ps (embeddings/sharded.py) are never copied to the
  worker: each local step looks up the rows its batch needs on the ps and updates those rows
  there with ``SparseUpdater`` (the job optimizer's sparse rule, step count ``iterations + i + 1``),
  as the default mode does. ``scale`` applies to the dense variables only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from psctl.coordinator.training.steps.graph_ops import seconds_since, sum_count

log = logging.getLogger(__name__)


def _hyper(optimizer: Any, name: str, default: float) -> float:
    value = getattr(optimizer, name, default)
    return float(value() if callable(value) else value)


class LocalOptimizer:
    """Adam or SGD (with momentum) on tensors: ``update`` returns new params and state."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.kind = "sgd"
        if isinstance(optimizer, keras.optimizers.Adam):
            self.kind = "adam"
            self.beta_1 = _hyper(optimizer, "beta_1", 0.9)
            self.beta_2 = _hyper(optimizer, "beta_2", 0.999)
            self.epsilon = _hyper(optimizer, "epsilon", 1e-7)
        elif isinstance(optimizer, keras.optimizers.SGD):
            self.momentum = _hyper(optimizer, "momentum", 0.0)
        else:
            log.warning(
                "local-step mode: %s has no local form here; local steps use plain SGD at its "
                "learning rate",
                type(optimizer).__name__,
            )
            self.momentum = 0.0

    def learning_rate(self) -> tf.Tensor:
        """Read once per call (a ps variable, or a schedule of the ps iterations)."""
        return tf.cast(tf.convert_to_tensor(self.optimizer.learning_rate), tf.float32)

    def init_state(self, params: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        slots = 2 if self.kind == "adam" else 1
        return [tf.zeros_like(p) for p in params for _ in range(slots)]

    def update(
        self,
        step: tf.Tensor,
        lr: tf.Tensor,
        params: list[tf.Tensor],
        grads: list[tf.Tensor],
        state: list[tf.Tensor],
    ) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        new_params, new_state = [], []
        if self.kind == "adam":
            t = tf.cast(step + 1, tf.float32)
            correction = tf.sqrt(1.0 - self.beta_2**t) / (1.0 - self.beta_1**t)
            for i, (p, g) in enumerate(zip(params, grads, strict=True)):
                m = self.beta_1 * state[2 * i] + (1.0 - self.beta_1) * g
                v = self.beta_2 * state[2 * i + 1] + (1.0 - self.beta_2) * tf.square(g)
                new_params.append(p - lr * correction * m / (tf.sqrt(v) + self.epsilon))
                new_state += [m, v]
            return new_params, new_state
        for p, g, velocity in zip(params, grads, state, strict=True):
            velocity = self.momentum * velocity - lr * g
            new_params.append(p + velocity)
            new_state.append(velocity)
        return new_params, new_state


def make_local_train_fn(
    *,
    model: Any,
    optimizer: Any,
    loss_fn: Callable[[Any, Any], Any],
    mean_sums: Any,
    mean_metrics: Sequence[tuple[str, Any, dict[str, Any]]],
    other_metrics: Sequence[Any],
    global_step: Any,
    scale: float,
    sparse: Any = None,
) -> Any:
    """The scheduled function of local-step mode: ``train_fn(iterator, num_steps)`` runs
    ``num_steps`` local steps and returns the seconds it ran on its worker, like the default
    mode's. ``sparse`` (a ``SparseUpdater``) updates the psctl tables on the ps every step."""
    local = LocalOptimizer(optimizer)
    trainable, non_trainable = model.trainable_variables, model.non_trainable_variables
    iterations = optimizer.iterations
    shards = sparse.shards if sparse is not None else []

    def read(variables: Sequence[Any]) -> list[tf.Tensor]:
        return [tf.identity(v.value) for v in variables]

    # No autograph: its source transformation of this function and everything it calls
    # (Keras layers included) was ~80% of the first call's tracing (cProfile); the loop is
    # written as the tf.while_loop autograph would have made of it.
    def train_fn(iterator: Any, num_steps: tf.Tensor) -> tf.Tensor:
        started = tf.timestamp()
        with tf.control_dependencies([started]):  # timestamps are not ordered by themselves
            start = read(trainable)
            first = tf.cast(tf.identity(iterations.value), tf.float32)  # the tables' step count
        lr = local.learning_rate()

        def body(
            i: tf.Tensor, params: list[tf.Tensor], state: list[tf.Tensor],
            stats: list[tf.Tensor], sums: tf.Tensor,
        ) -> tuple[Any, ...]:  # fmt: skip
            with tf.control_dependencies([i]):  # after the previous step's table updates
                batch = next(iterator)
            x, y = batch[0], batch[1]
            with tf.GradientTape() as tape:
                tape.watch(params)
                predictions, new_stats, losses = model.stateless_call(
                    params, stats, x, training=True, return_losses=True
                )
                loss = tf.reduce_mean(loss_fn(y, predictions))
                if losses:
                    loss += tf.add_n(losses)
            grads = tape.gradient(loss, [*params, *shards])
            if sparse is not None:  # the tables' rows, on the ps, this step
                sparse.apply(
                    grads[len(params) :],
                    step=first + 1.0 + tf.cast(i, tf.float32),
                )
            params, state = local.update(i, lr, params, grads[: len(params)], state)
            rows = [sum_count(loss)]
            rows += [sum_count(fn(y, predictions, **kw)) for _, fn, kw in mean_metrics]
            for metric in other_metrics:
                metric.update_state(y, predictions)
            return i + 1, params, state, list(new_stats), sums + tf.stack(rows)

        _, params, _, stats, sums = tf.while_loop(
            lambda i, *_: i < num_steps,
            body,
            (
                tf.constant(0, num_steps.dtype),
                list(start),
                local.init_state(start),
                read(non_trainable),
                tf.zeros([1 + len(mean_metrics), 2], tf.float64),
            ),
        )
        updates = [
            variable.assign_add(scale * (after - before))
            for variable, before, after in zip(trainable, start, params, strict=True)
        ]
        updates += [
            variable.assign(value) for variable, value in zip(non_trainable, stats, strict=True)
        ]
        # One atomic add on the ps (model.count_steps_atomically): no call's K is lost.
        updates.append(iterations.assign_add(tf.cast(num_steps, iterations.dtype)))
        updates.append(mean_sums.assign_add(sums))
        with tf.control_dependencies(updates):
            done = global_step.assign_add(num_steps)
        return seconds_since(started, after=done)

    return tf.function(train_fn, autograph=False)
