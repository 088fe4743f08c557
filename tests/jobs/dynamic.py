"""A recommender-style job over dynamic tables (``DynamicEmbedding``), the shape of what
docs/embeddings.md shows:

- ``user``: 3 raw int64 ids per example, up to 2**62, ``-1`` as padding (1-3 used), pooled
  by ``"mean"``; ids are seen twice before they get a row (``admit_after=2``) and leave the
  table after ``USER_TTL`` global steps unseen;
- ``item``: one string id per example, its own vector;
- ``nums``: 2 floats.

The label says whether the users' and the item's hidden scores and the first number add up
to more than zero. For tests of dynamic tables: training over 2 ps, restoring into 3,
evaluation, export with known and unknown ids.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from psctl.job import DataContext, DynamicEmbedding

USERS = 3
EXAMPLES = 40_000
USER_TTL = 200
metrics = ["accuracy", keras.metrics.AUC(name="auc")]


def create_model() -> keras.Model:
    user = keras.Input((USERS,), dtype="int64", name="user")
    item = keras.Input((1,), dtype="string", name="item")
    nums = keras.Input((2,), dtype="float32", name="nums")
    users = DynamicEmbedding(8, combiner="mean", admit_after=2, ttl_steps=USER_TTL, name="users")
    items = DynamicEmbedding(8, name="items")
    item_vector = keras.layers.Flatten()(items(item))
    joined = keras.layers.Concatenate()([users(user), item_vector, nums])
    hidden = keras.layers.Dense(32, activation="relu")(joined)
    return keras.Model({"user": user, "item": item, "nums": nums}, keras.layers.Dense(1)(hidden))


def create_optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adam(0.02)


def loss_fn(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    return keras.losses.binary_crossentropy(labels, logits, from_logits=True)


def _score(key: tf.Tensor) -> tf.Tensor:
    """A fixed hidden score in [-1, 1] per id."""
    bucket = tf.strings.to_hash_bucket_fast(tf.strings.as_string(key), 100_003)
    return tf.sin(tf.cast(bucket, tf.float32) * 12.9898)


def _example(i: tf.Tensor) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
    u = tf.random.stateless_uniform([USERS + 3], seed=tf.stack([i, tf.constant(11, tf.int64)]))
    # 2,000 users spread over the int64 range (ids near 2**62), 1-3 per example.
    users = tf.cast(2_000 * u[:USERS] ** 2, tf.int64) * 2_305_843_009_213_693 + 7
    used = tf.range(USERS) < 1 + tf.cast(i % USERS, tf.int32)
    users = tf.where(used, users, tf.constant(-1, tf.int64))
    item = tf.strings.join(["item-", tf.strings.as_string(tf.cast(800 * u[USERS] ** 2, tf.int64))])
    nums = u[USERS + 1 :] * 2.0 - 1.0
    user_score = tf.reduce_sum(tf.where(used, _score(users), 0.0)) / tf.reduce_sum(
        tf.cast(used, tf.float32)
    )
    total = user_score + tf.sin(tf.cast(tf.strings.to_hash_bucket_fast(item, 100_003), tf.float32))
    total += nums[0]
    features = {"user": users, "item": item[None], "nums": nums}
    return features, tf.cast(total > 0, tf.float32)[None]


def _examples(first: int, count: int) -> tf.data.Dataset:
    return tf.data.Dataset.range(first, first + count).map(_example)


def dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    data = _examples(0, EXAMPLES).shard(ctx.num_workers, ctx.worker_index)
    if not ctx.one_pass:
        data = data.shuffle(4096, seed=ctx.seed).repeat()
    return data.batch(ctx.batch_size, drop_remainder=True).prefetch(2)


def eval_dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    data = _examples(EXAMPLES, 4_000).shard(ctx.num_workers, ctx.worker_index)
    return data.batch(ctx.batch_size)
