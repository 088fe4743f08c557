"""A visitation job for tests: unique ids, and a counter on the ps of how often each was trained.

Examples are the ids ``0 .. NUM_IDS - 1`` (``$VISIT_IDS``, default 1001: batches do not divide
it). The model holds a non-trainable ``visits`` vector (shape [NUM_IDS], on a ps like every
model variable) that every training step adds the ids of its batch to, so after a run the
checkpoint tells how many times each example was trained on. Evaluation (training=False)
counts nothing.
"""

from __future__ import annotations

import os

import keras
import tensorflow as tf

from psctl.job import DataContext

NUM_IDS = int(os.environ.get("VISIT_IDS", "1001"))
BLOCK = 1000  # ids per piece of a pass (--epochs)
SHUFFLE = 10_000  # ids a data worker shuffles at once (--epochs)
VISITS = "visits"


def label_mean(labels: tf.Tensor, predictions: tf.Tensor) -> tf.Tensor:
    """Labels are id / NUM_IDS: over every id once, the mean is exactly (NUM_IDS - 1) / 2 /
    NUM_IDS; a repeated or missing id moves it."""
    return labels


metrics = [label_mean]


class VisitModel(keras.Model):
    def __init__(self) -> None:
        super().__init__(name="visit")
        self.dense = keras.layers.Dense(1)

    def build(self, input_shape: tuple[int | None, ...]) -> None:
        self.visits = self.add_weight(
            name=VISITS, shape=(NUM_IDS,), initializer="zeros", trainable=False
        )
        self.dense.build(input_shape)

    def call(self, x: tf.Tensor, training: bool = False) -> tf.Tensor:
        if training:
            ids = tf.cast(x[:, 0], tf.int32)
            # TensorFlow's scatter_add runs on the ps and adds in place: only the batch's
            # ids travel, so a pass of millions of ids costs what its batches do (the dense
            # bincount of the first version sent the whole vector every step). Not Keras's
            # assign_add: keras.Variable.assign_add is a read then an assign (seen: counts
            # lost with 2 workers), hence .value, the tf.Variable.
            self.visits.value.scatter_add(tf.IndexedSlices(tf.ones_like(ids, tf.float32), ids))
        return self.dense(x / NUM_IDS)


def create_model() -> keras.Model:
    return VisitModel()


def create_optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(learning_rate=0.01)


def loss_fn(labels: tf.Tensor, predictions: tf.Tensor) -> tf.Tensor:
    return tf.square(predictions[:, 0] - labels)


def _examples(ids: tf.data.Dataset) -> tf.data.Dataset:
    return ids.map(lambda i: (tf.cast(i, tf.float32)[None], tf.cast(i, tf.float32) / NUM_IDS))


def dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    ids = tf.data.Dataset.range(NUM_IDS).shard(ctx.num_workers, ctx.worker_index)
    if ctx.one_pass:
        # The tf.data service hands out the pieces of the source: blocks of BLOCK ids, not
        # single ids (one dispatcher round trip each: a pass of 588,000 ids took 85 s to
        # its first step, as every data worker filled a whole-pass shuffle buffer id by id).
        blocks = tf.data.Dataset.range(0, NUM_IDS, BLOCK)
        ids = blocks.flat_map(lambda i: tf.data.Dataset.range(i, tf.minimum(i + BLOCK, NUM_IDS)))
        return _examples(ids.shuffle(SHUFFLE, seed=ctx.seed)).batch(ctx.batch_size)
    return _examples(ids.repeat()).batch(ctx.batch_size, drop_remainder=True)


def eval_dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    ids = tf.data.Dataset.range(NUM_IDS).shard(ctx.num_workers, ctx.worker_index)
    return _examples(ids).batch(ctx.batch_size)
