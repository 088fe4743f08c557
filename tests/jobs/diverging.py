"""A small job whose loss is NaN from the first step: every training process diverges, so
the NaN guard restarts it until the restart budget is used up (exit 70)."""

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


def loss_fn(labels: tf.Tensor, predictions: tf.Tensor) -> tf.Tensor:
    return _ce(labels, predictions) * tf.math.log(-1.0)  # NaN


def dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    dataset = tf.data.Dataset.from_tensor_slices((X, Y))
    return (
        dataset.shard(ctx.num_workers, ctx.worker_index)
        .repeat()
        .batch(ctx.batch_size, drop_remainder=True)
    )
