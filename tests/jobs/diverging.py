"""A small job whose model is NaN after its first step while the loss it reports stays
finite: only the check of every variable (at the last step, before a checkpoint) finds it,
whatever the timing (a NaN loss was found at the status cadence first on a slow machine).
Every training process diverges, so psctl restarts it until the budget is used up (70)."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from psctl.job import DataContext

_rng = np.random.default_rng(0)
X = _rng.standard_normal((1024, 6)).astype(np.float32)
Y = (X[:, 0] + X[:, 1] > 0).astype(np.int64)
_ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def create_model() -> keras.Model:
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(2)])


def create_optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(0.01)


@tf.custom_gradient
def _poisoned(loss: tf.Tensor) -> tuple[tf.Tensor, object]:
    def grad(upstream: tf.Tensor) -> tf.Tensor:
        return upstream * float("nan")  # every gradient NaN: the model goes NaN

    return tf.where(tf.math.is_finite(loss), loss, tf.zeros_like(loss)), grad  # finite


def loss_fn(labels: tf.Tensor, predictions: tf.Tensor) -> tf.Tensor:
    return _poisoned(_ce(labels, predictions))


def dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    dataset = tf.data.Dataset.from_tensor_slices((X, Y))
    return (
        dataset.shard(ctx.num_workers, ctx.worker_index)
        .repeat()
        .batch(ctx.batch_size, drop_remainder=True)
    )
