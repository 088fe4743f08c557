"""TensorFlow's multi-worker tutorial, as a psctl job: a compiled model and a dataset function.

The tutorial's pattern with no psctl-specific code besides the ``ctx`` argument: the
optimizer, loss and metrics come from ``compile()`` (no ``create_optimizer``, ``loss_fn`` or
``metrics``), and the dataset function batches an unsharded dataset and sets
``AutoShardPolicy.DATA``, as the tutorial does. The data is MNIST-like but generated (no
download): 28x28 images in [0, 1]-ish, one fixed random pattern per class plus noise,
labels 0-9; learnable to eval accuracy >= 0.90 in a few hundred steps.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from psctl.job import DataContext

TRAIN_EXAMPLES = 20_000
EVAL_EXAMPLES = 5_000
NUM_CLASSES = 10
DATA_SEED = 7
NOISE = 1.0


def create_model() -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input(shape=(28, 28)),
            keras.layers.Reshape(target_shape=(28, 28, 1)),
            keras.layers.Conv2D(8, 3, strides=2, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(NUM_CLASSES),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    return model


def _examples(first: int, count: int) -> tf.data.Dataset:
    """Example ``i``: class ``i % 10``, its pattern plus noise seeded by ``i`` (the same on
    every machine, made on the fly, so nothing large is put into the dataset's graph)."""
    patterns = tf.random.stateless_uniform([NUM_CLASSES, 28, 28], seed=[DATA_SEED, 0])

    def example(i: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        label = i % NUM_CLASSES
        noise = tf.random.stateless_normal([28, 28], seed=tf.stack([DATA_SEED + 1, i]))
        return patterns[label] + NOISE * noise, label

    return tf.data.Dataset.range(first, first + count).map(example)


def _auto_shard_data(dataset: tf.data.Dataset) -> tf.data.Dataset:
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)


def dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    dataset = _examples(0, TRAIN_EXAMPLES).shuffle(TRAIN_EXAMPLES)
    if not ctx.one_pass:  # --epochs: psctl wants one pass and repeats it itself
        dataset = dataset.repeat()
    return _auto_shard_data(dataset.batch(ctx.batch_size).prefetch(tf.data.AUTOTUNE))


def eval_dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    dataset = _examples(TRAIN_EXAMPLES, EVAL_EXAMPLES).batch(ctx.batch_size)
    return _auto_shard_data(dataset)
