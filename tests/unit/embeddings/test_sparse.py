"""Sparse table updates (embeddings/sparse.py) against Keras 3's own dense updates: for a
batch that touches every row they are the same; rows a batch does not touch stay as they
were ("lazy"). One process, no cluster."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from psctl.cluster.errors import ConfigError
from psctl.coordinator.embeddings.sharded import Table, lookup_distinct, lookup_rows
from psctl.coordinator.embeddings.sparse import SparseUpdater, slot_kinds

pytestmark = pytest.mark.timeout(120)

ROWS, DIM = 6, 3
OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.05),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "ftrl": lambda: keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.01),
}


def initial() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(ROWS, DIM)).astype(np.float32)


def sparse_grad(step: int, rows: list[int]) -> tf.IndexedSlices:
    rng = np.random.default_rng(step + 1)
    values = rng.normal(size=(len(rows), DIM)).astype(np.float32)
    return tf.IndexedSlices(tf.constant(values), tf.constant(rows, tf.int64), (ROWS, DIM))


def run_sparse(make: object, grads: list[tf.IndexedSlices]) -> np.ndarray:
    optimizer = make()  # type: ignore[operator]
    table = Table(layer=None, variable=tf.Variable(initial()))
    updater = SparseUpdater(optimizer, [table], tf.distribute.get_strategy())
    for grad in grads:
        updater.apply([grad])
        optimizer.iterations.assign_add(1)  # what apply_gradients does for the dense ones
    return np.concatenate([shard.numpy() for shard in table.shards])


def run_dense(make: object, grads: list[tf.IndexedSlices]) -> np.ndarray:
    optimizer = make()  # type: ignore[operator]
    variable = keras.Variable(initial())
    optimizer.build([variable])
    for grad in grads:
        optimizer.apply_gradients([(tf.convert_to_tensor(grad), variable)])
    return np.asarray(variable.numpy())


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_batch_touching_every_row_matches_the_dense_update(name: str):
    # Every row, some twice (repeated ids are summed, as the dense gradient sums them).
    rows = [*range(ROWS), 0, 3]
    grads = [sparse_grad(step, rows) for step in range(3)]
    np.testing.assert_allclose(
        run_sparse(OPTIMIZERS[name], grads),
        run_dense(OPTIMIZERS[name], grads),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_rows_a_batch_does_not_touch_are_left_alone(name: str):
    grads = [sparse_grad(step, [1, 4]) for step in range(3)]
    after = run_sparse(OPTIMIZERS[name], grads)
    before = initial()
    untouched = [0, 2, 3, 5]
    np.testing.assert_array_equal(after[untouched], before[untouched])
    assert not np.allclose(after[[1, 4]], before[[1, 4]])


def test_slots_carry_the_names_keras_gives_them():
    assert slot_kinds(keras.optimizers.Adam()) == ("momentum", "velocity")
    assert slot_kinds(keras.optimizers.Adagrad()) == ("accumulator",)
    assert slot_kinds(keras.optimizers.SGD()) == ()
    assert slot_kinds(keras.optimizers.SGD(momentum=0.5)) == ("momentum",)
    assert slot_kinds(keras.optimizers.Ftrl()) == ("accumulator", "linear")
    # ... which is what Keras names the slots of a variable (checkpoints hold them so).
    for optimizer in (keras.optimizers.Adam(), keras.optimizers.Ftrl()):
        variable = keras.Variable(initial(), name="table")
        optimizer.build([variable])
        names = {v.name for v in optimizer.variables}
        for kind in slot_kinds(optimizer):
            assert f"{variable.path.replace('/', '_')}_{kind}" in names


def test_an_optimizer_without_a_sparse_form_is_one_clear_error():
    with pytest.raises(
        ConfigError,
        match=r"RMSprop cannot update sharded \(--max-shards\) or DynamicEmbedding tables",
    ):
        slot_kinds(keras.optimizers.RMSprop())
    with pytest.raises(ConfigError, match="amsgrad"):
        slot_kinds(keras.optimizers.Adam(amsgrad=True))


def test_eager_lookup_over_uneven_shards_matches_the_whole_table():
    """tables.lookup_rows: the coordinator's eager lookup, one gather per shard."""
    whole = np.arange(11 * 3, dtype=np.float32).reshape(11, 3)
    shards = [tf.Variable(whole[:4]), tf.Variable(whole[4:8]), tf.Variable(whole[8:])]
    ids = tf.constant([[10, 0, 4], [3, 8, 7]], tf.int64)
    got = lookup_rows(shards, ids).numpy()
    assert got.shape == (2, 3, 3)
    np.testing.assert_array_equal(got, whole[ids.numpy()])
    np.testing.assert_array_equal(lookup_rows(shards[:1], tf.constant([2, 1])), whole[[2, 1]])


def test_a_lookup_reads_each_distinct_id_once_and_sums_repeated_ids_gradients():
    """tables.lookup_distinct: the rows a batch reads from its ps are its distinct ids; the
    outputs and the table's gradient are those of a plain gather."""
    table = tf.Variable(initial())
    ids = tf.constant([[1, 4, 1], [4, 4, 0]], tf.int64)
    read: list[int] = []

    def lookup(distinct: tf.Tensor) -> tf.Tensor:
        read.extend(distinct.numpy().tolist())
        return tf.gather(table, distinct)

    with tf.GradientTape(persistent=True) as tape:
        got = lookup_distinct(lookup, ids)
        plain = tf.gather(table, ids)
        weights = tf.reshape(tf.range(18, dtype=tf.float32), (2, 3, 3))
        loss, plain_loss = tf.reduce_sum(got * weights), tf.reduce_sum(plain * weights)
    assert sorted(read) == [0, 1, 4]
    assert got.shape == (2, 3, DIM)
    np.testing.assert_array_equal(got, plain)
    np.testing.assert_allclose(
        tf.convert_to_tensor(tape.gradient(loss, table)),
        tf.convert_to_tensor(tape.gradient(plain_loss, table)),
    )


def test_a_traced_lookup_keeps_the_static_shape_keras_needs():
    table = tf.Variable(initial())

    def read(distinct: tf.Tensor) -> tf.Tensor:
        return tf.gather(table, distinct)

    @tf.function(input_signature=[tf.TensorSpec([None, 26], tf.int64)], autograph=False)
    def traced(ids: tf.Tensor) -> tf.Tensor:
        return lookup_distinct(read, ids)

    graph = traced.get_concrete_function()
    assert graph.structured_outputs.shape.as_list() == [None, 26, DIM]
    out = traced(tf.zeros([2, 26], tf.int64))
    np.testing.assert_array_equal(out[1, 5], initial()[0])
