"""A plain Keras job with one large embedding table (no psctl-specific code): for the
sharded-table tests. ``EMBEDDING_ROWS`` sets the vocabulary (default 200,000) and
``EMBEDDING_OPTIMIZER`` the optimizer (adam, adagrad, sgd, momentum, ftrl).

Each example is 4 ids drawn with a heavy head (as categorical features are); its label
says whether the hidden per-id scores of its ids add up to more than zero.
"""

from __future__ import annotations

import os

import keras
import tensorflow as tf

from psctl.job import DataContext

ROWS = int(os.environ.get("EMBEDDING_ROWS", "200000"))
IDS = 4
EXAMPLES = 50_000
metrics = ["accuracy"]


def create_model() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((IDS,), dtype="int64"),
            keras.layers.Embedding(ROWS, 8),
            keras.layers.Flatten(),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1),
        ]
    )


def create_optimizer() -> keras.optimizers.Optimizer:
    name = os.environ.get("EMBEDDING_OPTIMIZER", "adam")
    return {
        "adam": lambda: keras.optimizers.Adam(0.01),
        "adagrad": lambda: keras.optimizers.Adagrad(0.1),
        "sgd": lambda: keras.optimizers.SGD(0.1),
        "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        "ftrl": lambda: keras.optimizers.Ftrl(0.1),
    }[name]()


def loss_fn(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    return keras.losses.binary_crossentropy(labels, logits, from_logits=True)


def _examples(first: int, count: int) -> tf.data.Dataset:
    def make(i: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        u = tf.random.stateless_uniform([IDS], seed=tf.stack([i, tf.constant(7, tf.int64)]))
        ids = tf.cast(tf.floor(ROWS * u**3), tf.int64)  # a heavy head, a long tail
        score = tf.sin(tf.cast(ids, tf.float32) * 12.9898)
        label = tf.cast(tf.reduce_sum(score) > 0, tf.float32)[None]
        return ids, label

    return tf.data.Dataset.range(first, first + count).map(make)


def dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    data = _examples(0, EXAMPLES).shard(ctx.num_workers, ctx.worker_index)
    if not ctx.one_pass:
        data = data.shuffle(4096, seed=ctx.seed).repeat()
    return data.batch(ctx.batch_size, drop_remainder=True).prefetch(2)


def eval_dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    return _examples(EXAMPLES, 5_000).batch(ctx.batch_size)
