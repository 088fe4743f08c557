"""A recommender-style job over named inputs: a functional model over a dict of features
of three dtypes, and a dataset of ``(dict, label)``.

- ``country``: one string per example, hashed by a ``FeatureEmbedding`` (its own table);
- ``tags``: 4 strings per example ("" = none), pooled by "mean" from a shared tags table;
- ``item``: one raw int64 id (any size), hashed (``hash_ids=True``);
- ``nums``: 3 floats.

The label says whether the country's, the mean tag's, the item's hidden scores and the
first number add up to more than zero. For tests of named inputs in both strategies,
sharded tables (--max-shards 2), evaluation and export.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from psctl.job import DataContext, FeatureEmbedding

TAGS = 4
EXAMPLES = 40_000
metrics = ["accuracy", keras.metrics.AUC(name="auc")]


def create_model() -> keras.Model:
    country = keras.Input((1,), dtype="string", name="country")
    tags = keras.Input((TAGS,), dtype="string", name="tags")
    item = keras.Input((1,), dtype="int64", name="item")
    nums = keras.Input((3,), dtype="float32", name="nums")
    countries = FeatureEmbedding(20_000, 8, combiner="sum", name="countries")
    tag_table = FeatureEmbedding(50_000, 8, combiner="mean", name="tag_table")
    items = FeatureEmbedding(50_000, 8, hash_ids=True, combiner="sum", name="items")
    joined = keras.layers.Concatenate()([countries(country), tag_table(tags), items(item), nums])
    hidden = keras.layers.Dense(32, activation="relu")(joined)
    logits = keras.layers.Dense(1)(hidden)
    return keras.Model({"country": country, "tags": tags, "item": item, "nums": nums}, logits)


def create_optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.Adagrad(0.3)


def loss_fn(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    return keras.losses.binary_crossentropy(labels, logits, from_logits=True)


def _score(key: tf.Tensor) -> tf.Tensor:
    """A fixed hidden score in [-1, 1] per string."""
    bucket = tf.strings.to_hash_bucket_fast(key, 100_003)
    return tf.sin(tf.cast(bucket, tf.float32) * 12.9898)


def _example(i: tf.Tensor) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
    u = tf.random.stateless_uniform([3 + TAGS + 3], seed=tf.stack([i, tf.constant(7, tf.int64)]))
    country = tf.strings.join(["c", tf.strings.as_string(tf.cast(200 * u[0] ** 2, tf.int64))])
    item_id = tf.cast(3_000 * u[1] ** 2, tf.int64) * 1_000_003  # raw ids, large
    used = tf.range(TAGS) < 1 + tf.cast(i % TAGS, tf.int32)  # 1-4 tags
    tag_ids = tf.strings.as_string(tf.cast(500 * u[3 : 3 + TAGS] ** 3, tf.int64))
    tags = tf.where(used, tf.strings.join(["t", tag_ids]), "")
    nums = u[3 + TAGS :] * 2.0 - 1.0
    tag_score = tf.reduce_sum(tf.where(used, _score(tags), 0.0)) / tf.reduce_sum(
        tf.cast(used, tf.float32)
    )
    total = _score(country) + tag_score + _score(tf.strings.as_string(item_id)) + nums[0]
    features = {"country": country[None], "tags": tags, "item": item_id[None], "nums": nums}
    return features, tf.cast(total > 0, tf.float32)[None]


def _examples(first: int, count: int) -> tf.data.Dataset:
    return tf.data.Dataset.range(first, first + count).map(_example)


def dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    data = _examples(0, EXAMPLES).shard(ctx.num_workers, ctx.worker_index)
    if not ctx.one_pass:
        data = data.shuffle(4096, seed=ctx.seed).repeat()
    return data.batch(ctx.batch_size, drop_remainder=True).prefetch(2)


def eval_dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    # Worker 0 of 1 for the final evaluation; a shard each with --eval-every.
    data = _examples(EXAMPLES, 4_000).shard(ctx.num_workers, ctx.worker_index)
    return data.batch(ctx.batch_size)
