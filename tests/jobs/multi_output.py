"""A model of two outputs over one float input: ``c``, the probability that the first
feature is positive, and ``r``, a regression on the second. With ``MULTI_OUTPUT=list`` the
model returns ``[c, r]``, the labels are a tuple and the metrics a list per output;
otherwise (``dict``) the outputs, labels and metrics are dicts by output name.

For tests of multi-output evaluation (its metrics named per output, ``c_accuracy``) and
export (one signature output per model output) in both training modes.
"""

from __future__ import annotations

import os

import keras
import numpy as np
import tensorflow as tf

from psctl.job import DataContext

LIST = os.environ.get("MULTI_OUTPUT", "dict") == "list"
TRAIN, EVAL = 3072, 1024

_rng = np.random.default_rng(0)
X = _rng.standard_normal((TRAIN + EVAL, 4)).astype(np.float32)
Y_C = (X[:, :1] > 0).astype(np.float32)
Y_R = X[:, 1:2].copy()

if LIST:
    metrics: object = [["accuracy", keras.metrics.AUC(name="auc")], ["mae"]]
else:
    metrics = {"c": ["accuracy", keras.metrics.AUC(name="auc")], "r": "mae"}


def create_model() -> keras.Model:
    x = keras.Input((4,), name="x")
    hidden = keras.layers.Dense(16, activation="relu")(x)
    c = keras.layers.Dense(1, activation="sigmoid", name="c")(hidden)
    r = keras.layers.Dense(1, name="r")(hidden)
    return keras.Model(x, [c, r] if LIST else {"c": c, "r": r})


def create_optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(0.02)


def loss_fn(labels: object, predictions: object) -> tf.Tensor:
    if LIST:
        (yc, yr), (pc, pr) = labels, predictions  # type: ignore[misc]
    else:
        yc, yr = labels["c"], labels["r"]  # type: ignore[index]
        pc, pr = predictions["c"], predictions["r"]  # type: ignore[index]
    return keras.losses.binary_crossentropy(yc, pc) + tf.reduce_mean(tf.square(yr - pr), -1)


def _data(lo: int, hi: int) -> tf.data.Dataset:
    labels = (Y_C[lo:hi], Y_R[lo:hi]) if LIST else {"c": Y_C[lo:hi], "r": Y_R[lo:hi]}
    return tf.data.Dataset.from_tensor_slices((X[lo:hi], labels))


def dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    data = _data(0, TRAIN).shard(ctx.num_workers, ctx.worker_index)
    return data.repeat().batch(ctx.batch_size, drop_remainder=True)


def eval_dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    return _data(TRAIN, TRAIN + EVAL).shard(ctx.num_workers, ctx.worker_index).batch(ctx.batch_size)
