"""The seed article's MLP: Dense(64, relu) -> Dense(64, relu) -> Dense(10) on 32 features.

Its default data is a deterministic, learnable 10-class set: features are standard normal,
labels are the argmax of a fixed random linear teacher, and the quarter of examples nearest
a class boundary is dropped so that the classes are separable with a margin. Chance is
about 0.10 (the largest class is under 0.16); eval accuracy >= 0.90 means training worked.

With ``--train-data`` / ``--eval-data`` it reads CSV or TFRecord files instead (see
coordinator/data/readers.py): 32 float features and an integer label 0-9 per example. Both
globs are checked before training starts, in the first call of ``dataset_fn``.
"""

from __future__ import annotations

import functools

import keras
import numpy as np
import tensorflow as tf

from psctl.job import DataContext, data

NUM_FEATURES = 32
NUM_CLASSES = 10
TRAIN_EXAMPLES = 40_000
EVAL_EXAMPLES = 10_000
DATA_SEED = 1234
BOUNDARY_DROP = 0.25  # fraction of candidate examples (closest to a boundary) dropped

metrics = ["accuracy"]


@functools.cache
def make_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train_x, train_y, eval_x, eval_y), the same on every machine for DATA_SEED."""
    rng = np.random.default_rng(DATA_SEED)
    total = TRAIN_EXAMPLES + EVAL_EXAMPLES
    candidates = int(total / (1 - BOUNDARY_DROP)) + 1000
    x = rng.standard_normal((candidates, NUM_FEATURES)).astype(np.float32)
    teacher = rng.standard_normal((NUM_FEATURES, NUM_CLASSES)).astype(np.float32)
    logits = x @ teacher
    top2 = np.sort(logits, axis=1)[:, -2:]
    gap = top2[:, 1] - top2[:, 0]
    keep = gap > np.quantile(gap, BOUNDARY_DROP)
    x, y = x[keep][:total], logits[keep][:total].argmax(axis=1).astype(np.int64)
    return x[:TRAIN_EXAMPLES], y[:TRAIN_EXAMPLES], x[TRAIN_EXAMPLES:], y[TRAIN_EXAMPLES:]


def create_model() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input(shape=(NUM_FEATURES,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(NUM_CLASSES),
        ],
        name="mlp",
    )


def create_optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(learning_rate=1e-3)


_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def loss_fn(labels: tf.Tensor, predictions: tf.Tensor) -> tf.Tensor:
    return _loss(labels, predictions)


def check_files(ctx: DataContext, *, train: bool = True, evaluation: bool = True) -> None:
    """Fail before training on bad --train-data / --eval-data files (checked once, cached)."""
    wanted = [(ctx.train_data, "--train-data", train), (ctx.eval_data, "--eval-data", evaluation)]
    for pattern, field, wanted_here in wanted:
        if pattern and wanted_here:
            data.check_files(
                pattern,
                label_column=ctx.label_column,
                field=field,
                num_features=NUM_FEATURES,
                num_classes=NUM_CLASSES,
                job="the mlp job",
            )


def dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    check_files(ctx)
    if ctx.train_data:
        return data.train_dataset(ctx, label_dtype=tf.int64)
    x, y, _, _ = make_data()
    if ctx.one_pass:  # --epochs: psctl repeats it through the tf.data service
        return (
            _chunks(x, y)
            .shuffle(8192, seed=ctx.seed)
            .batch(ctx.batch_size)
            .prefetch(tf.data.AUTOTUNE)
        )
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shard(ctx.num_workers, ctx.worker_index)
        .shuffle(8192, seed=ctx.seed)
        .repeat()
        .batch(ctx.batch_size, drop_remainder=True)
        .prefetch(tf.data.AUTOTUNE)
    )


def _chunks(x: np.ndarray, y: np.ndarray, size: int = 1000) -> tf.data.Dataset:
    """The examples, as the tf.data service's pieces of ``size`` examples: its dynamic
    sharding splits the outer ``range``, one piece per start (a plain
    ``from_tensor_slices`` would be one piece, one dispatcher round trip, per example)."""
    xs, ys = tf.constant(x), tf.constant(y)
    return tf.data.Dataset.range(0, len(y), size).flat_map(
        lambda start: tf.data.Dataset.from_tensor_slices(
            (xs[start : start + size], ys[start : start + size])
        )
    )


def eval_dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    if ctx.eval_data:
        check_files(ctx, train=False)
        return data.eval_dataset(ctx, label_dtype=tf.int64)
    _, _, x, y = make_data()
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shard(ctx.num_workers, ctx.worker_index)
        .batch(ctx.batch_size)
        .prefetch(tf.data.AUTOTUNE)
    )
