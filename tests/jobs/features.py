"""A job with psctl's FeatureEmbedding: raw user ids (any int64) hashed into one table, and
two multi-valued item features (clicked, viewed: up to 3 ids each, -1 as padding) pooled by
"mean" from one table they share. For the sharded-table tests (--max-shards 2).

The label says whether the user's hidden score plus the mean of the clicked items' hidden
scores is above zero.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from psctl.job import DataContext, FeatureEmbedding

BUCKETS = 50_000
SLOTS = 3
EXAMPLES = 40_000
metrics = ["accuracy"]


def create_model() -> keras.Model:
    features = keras.Input((1 + 2 * SLOTS,), dtype="int64")
    users = FeatureEmbedding(BUCKETS, 8, hash_ids=True, combiner="sum", name="users")
    items = FeatureEmbedding(BUCKETS, 8, hash_ids=True, combiner="mean", name="items")
    user = users(features[:, :1])
    clicked = items(features[:, 1 : 1 + SLOTS])
    viewed = items(features[:, 1 + SLOTS :])
    joined = keras.layers.Concatenate()([user, clicked, viewed])
    hidden = keras.layers.Dense(16, activation="relu")(joined)
    return keras.Model(features, keras.layers.Dense(1)(hidden))


def create_optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adagrad(0.5)


def loss_fn(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    return keras.losses.binary_crossentropy(labels, logits, from_logits=True)


def _score(ids: tf.Tensor) -> tf.Tensor:
    return tf.sin(tf.cast(ids % 100_003, tf.float32) * 12.9898)


def _examples(first: int, count: int) -> tf.data.Dataset:
    def make(i: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        u = tf.random.stateless_uniform(
            [1 + 2 * SLOTS], seed=tf.stack([i, tf.constant(3, tf.int64)])
        )
        user = tf.cast(tf.floor(2_000 * u[:1] ** 2), tf.int64) * 1_000_003  # raw, large ids
        items = tf.cast(tf.floor(5_000 * u[1:] ** 3), tf.int64)
        used = tf.range(2 * SLOTS) % SLOTS < 1 + tf.cast(i % SLOTS, tf.int32)  # 1-3 values
        items = tf.where(used, items, tf.constant(-1, tf.int64))
        clicked = items[:SLOTS]
        mean_clicked = tf.reduce_sum(tf.where(clicked >= 0, _score(clicked), 0.0)) / tf.reduce_sum(
            tf.cast(clicked >= 0, tf.float32)
        )
        label = tf.cast(_score(user)[0] + mean_clicked > 0, tf.float32)[None]
        return tf.concat([user, items], 0), label

    return tf.data.Dataset.range(first, first + count).map(make)


def dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    data = _examples(0, EXAMPLES).shard(ctx.num_workers, ctx.worker_index)
    if not ctx.one_pass:
        data = data.shuffle(4096, seed=ctx.seed).repeat()
    return data.batch(ctx.batch_size, drop_remainder=True).prefetch(2)


def eval_dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    return _examples(EXAMPLES, 4_000).batch(ctx.batch_size)
