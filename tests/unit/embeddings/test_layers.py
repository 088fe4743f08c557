"""FeatureEmbedding (psctl.job): hashing, padding, combiners, a table shared by features,
sparse gradients and its config, against the table's own rows."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from psctl.job import FeatureEmbedding


def table(layer: FeatureEmbedding) -> np.ndarray:
    return np.asarray(layer.table.embeddings.numpy())


def test_strings_are_hashed_stably_and_the_empty_string_is_padding():
    layer = FeatureEmbedding(1000, 4, name="tags")
    out = layer(tf.constant([["shoes", "", "hats"]])).numpy()
    rows = tf.strings.to_hash_bucket_fast(["shoes", "hats"], 1000).numpy()
    np.testing.assert_allclose(out[0, 0], table(layer)[rows[0]])
    np.testing.assert_allclose(out[0, 1], np.zeros(4))
    np.testing.assert_allclose(out[0, 2], table(layer)[rows[1]])


def test_mean_and_sqrtn_pool_the_values_without_padding():
    ids = tf.constant([[7, 12345678901234, -1], [-1, -1, -1]], tf.int64)
    mean = FeatureEmbedding(5000, 3, hash_ids=True, combiner="mean", name="m")
    out = mean(ids).numpy()
    rows = tf.strings.to_hash_bucket_fast(["7", "12345678901234"], 5000).numpy()
    expected = table(mean)[rows].mean(axis=0)
    np.testing.assert_allclose(out[0], expected, rtol=1e-6)
    np.testing.assert_allclose(out[1], np.zeros(3))  # all padding: zeros, not NaN
    sqrtn = FeatureEmbedding(5000, 3, hash_ids=True, combiner="sqrtn", name="s")
    got = sqrtn(ids).numpy()[0]
    np.testing.assert_allclose(got, table(sqrtn)[rows].sum(axis=0) / np.sqrt(2), rtol=1e-6)


def test_plain_ids_are_rows_and_sum_pools_them():
    layer = FeatureEmbedding(10, 2, combiner="sum", name="plain")
    out = layer(tf.constant([[1, 2, 2]])).numpy()
    np.testing.assert_allclose(out[0], table(layer)[[1, 2, 2]].sum(axis=0), rtol=1e-6)
    assert layer.compute_output_shape((None, 3)) == (None, 2)


def test_one_table_shared_by_two_features_has_sparse_gradients():
    shared = FeatureEmbedding(100_000, 4, hash_ids=True, combiner="mean", name="items")
    clicked = keras.Input((2,), dtype="int64")
    viewed = keras.Input((2,), dtype="int64")
    joined = keras.layers.Concatenate()([shared(clicked), shared(viewed)])
    model = keras.Model([clicked, viewed], keras.layers.Dense(1)(joined))
    tables = [v for v in model.trainable_variables if "items_table" in v.path]
    assert len(tables) == 1  # one table for both features
    x = [tf.constant([[1, 2]], tf.int64), tf.constant([[3, -1]], tf.int64)]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x))
    (grad,) = tape.gradient(loss, [tables[0].value])
    assert isinstance(grad, tf.IndexedSlices)  # only the rows the batch touched
    assert int(tf.size(grad.indices)) <= 4


def test_config_round_trips_and_bad_arguments_name_the_argument():
    layer = FeatureEmbedding(64, 8, combiner="sqrtn", hash_ids=True, name="x")
    again = FeatureEmbedding.from_config(layer.get_config())
    assert (again.num_buckets, again.output_dim, again.combiner, again.hash_ids) == (
        64, 8, "sqrtn", True
    )  # fmt: skip
    with pytest.raises(ValueError, match="combiner: 'max' is not a combiner; give one of 'sum'"):
        FeatureEmbedding(64, 8, combiner="max")
    with pytest.raises(ValueError, match="num_buckets: 0 is not a whole number from 1 to"):
        FeatureEmbedding(0, 8)
    with pytest.raises(ValueError, match="output_dim: 0 is not a whole number from 1 to"):
        FeatureEmbedding(8, 0)
