"""A job with a fixed Embedding table (a psctl table under ``--max-shards``) and a
``DynamicEmbedding`` side by side, trained with Adam: for the tests of checkpoints saved and
restored by shard (tests/integration/embeddings/test_sharded_checkpoints.py)."""

from __future__ import annotations

import keras
import tensorflow as tf

from psctl.job import DataContext, DynamicEmbedding

ROWS = 5000
metrics = ["accuracy"]


def create_model() -> keras.Model:
    ids = keras.Input((2,), dtype="int64", name="ids")
    fixed = keras.layers.Flatten()(keras.layers.Embedding(ROWS, 4, name="fixed")(ids))
    dynamic = DynamicEmbedding(4, combiner="sum", name="dynamic")(ids)
    joined = keras.layers.Concatenate()([fixed, dynamic])
    return keras.Model(ids, keras.layers.Dense(1)(joined))


def create_optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(0.01)


def loss_fn(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    return keras.losses.binary_crossentropy(labels, logits, from_logits=True)


def dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    ids = tf.data.Dataset.range(100_000).map(lambda i: tf.stack([i % ROWS, (i * 7919) % ROWS]))
    examples = ids.map(lambda x: (x, tf.cast(x[:1] % 2, tf.float32)))
    return examples.shard(ctx.num_workers, ctx.worker_index).batch(ctx.batch_size).repeat()
