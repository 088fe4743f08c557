"""A DynamicEmbedding trained by Keras itself in one process (``model.fit``, a
``GradientTape`` loop; coordinator/embeddings/dynamic.py ``OneProcess``): the optimizers'
sparse rules give the rows psctl's fixed tables give, ids learn, admission and eviction
hold, and the layers psctl makes get none of it."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from psctl.coordinator.embeddings.dynamic import DynamicEmbedding, attach_slots, built_by_psctl
from psctl.coordinator.embeddings.sparse import SparseRule
from tests.unit.embeddings.test_sparse import (
    DIM,
    OPTIMIZERS,
    ROWS,
    initial,
    run_sparse,
    sparse_grad,
)

pytestmark = pytest.mark.timeout(120)


def one_process(optimizer: keras.optimizers.Optimizer, **kwargs: object) -> keras.Model:
    """ids [n] -> their vectors [n, DIM], compiled with ``optimizer``."""
    ids = keras.Input((), dtype="int64", batch_size=None)
    layer = DynamicEmbedding(DIM, name="table", **kwargs)  # type: ignore[arg-type]
    model = keras.Model(ids, layer(ids))
    model.compile(optimizer=optimizer)
    return model


def table_rows(model: keras.Model) -> dict[int, np.ndarray]:
    tables = model.get_layer("table").shards[0]
    keys, vectors = tables.embeddings.export()
    return dict(zip(keys.numpy().tolist(), vectors.numpy(), strict=True))


def tape_step(model: keras.Model, ids: tf.Tensor, upstream: tf.Tensor) -> None:
    """One step of a GradientTape loop whose loss has gradient ``upstream`` at each id."""
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(ids, training=True) * upstream)
    grads = tape.gradient(loss, model.trainable_variables)
    model.optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_gradient_tape_loop_applies_the_fixed_tables_sparse_rule(name: str):
    """Rows 0..ROWS-1 hold initial(); the same sparse gradients give the rows a fixed table's
    sparse update gives (itself checked against Keras's dense one, test_sparse.py)."""
    model = one_process(OPTIMIZERS[name]())
    layer = model.get_layer("table")
    tables = layer.shards[0]
    attach_slots([layer], SparseRule(model.optimizer))
    keys = tf.range(ROWS, dtype=tf.int64)
    slots = tables.read(keys)[2]  # the optimizer's initial slots
    tables.write(keys, tf.constant(initial()), slots, tf.ones([ROWS], tf.int64),
                 tf.zeros([ROWS], tf.int64))  # fmt: skip
    grads = [sparse_grad(step, [*range(ROWS), 0, 3]) for step in range(3)]
    for grad in grads:
        tape_step(model, grad.indices, grad.values)
    rows = table_rows(model)
    got = np.stack([rows[k] for k in range(ROWS)])
    np.testing.assert_allclose(got, run_sparse(OPTIMIZERS[name], grads), rtol=1e-5, atol=1e-6)
    meta = tables.meta.lookup(tf.constant([0, 1], tf.int64)).numpy()
    np.testing.assert_array_equal(meta, [[1 + 3 * 2, 3, 1], [1 + 3, 3, 1]])  # count, step


def test_rows_a_step_does_not_touch_keep_their_values_with_adam():
    """Lazy Adam, as on the cluster: a row out of the batch does not move on its momentum
    (Keras's dense Adam would move it)."""
    model = one_process(keras.optimizers.Adam(0.1), embeddings_initializer="zeros")
    ones = tf.ones([2, DIM])
    tape_step(model, tf.constant([1, 2], tf.int64), ones)  # admits both (they read zeros)
    assert {k: v.tolist() for k, v in table_rows(model).items()} == {1: [0.0] * DIM,
                                                                     2: [0.0] * DIM}  # fmt: skip
    tape_step(model, tf.constant([1, 2], tf.int64), ones)  # both move
    moved = table_rows(model)[2].copy()
    assert np.all(moved < 0)
    tape_step(model, tf.constant([1], tf.int64), ones[:1])
    tape_step(model, tf.constant([1], tf.int64), ones[:1])
    np.testing.assert_array_equal(table_rows(model)[2], moved)
    assert model.optimizer.iterations.numpy() == 4


def test_model_fit_learns_each_ids_own_vector():
    """The label is the id's parity: only the table can learn it."""
    ids = keras.Input((1,), dtype="int64")
    layer = DynamicEmbedding(4, combiner="sum", name="ids")
    model = keras.Model(ids, keras.layers.Dense(1)(layer(ids)))
    model.compile(optimizer=keras.optimizers.Adam(0.05), metrics=["accuracy"],
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))  # fmt: skip
    x = (np.arange(400) % 50 * 7_919 + 2**40).reshape(-1, 1).astype(np.int64)
    y = (x % 2).astype(np.float32)
    model.fit(x, y, epochs=20, batch_size=20, verbose=0)
    assert model.evaluate(x, y, verbose=0, return_dict=True)["accuracy"] > 0.95
    assert int(layer.embeddings_table.size()) == 50
    assert layer.counters.numpy().tolist() == [50, 0]
    # The one trainable weight it adds is empty: the rows are the hash table's.
    assert [tuple(w.shape) for w in layer.trainable_weights] == [(0,)]


def test_admission_and_eviction_by_ttl_and_cap_in_one_process():
    model = one_process(keras.optimizers.SGD(0.1), admit_after=2, ttl_steps=5)
    layer = model.get_layer("table")
    one = tf.ones([1, DIM])
    tape_step(model, tf.constant([7], tf.int64), one)  # seen once: counted, no row
    assert table_rows(model) == {}
    tape_step(model, tf.constant([7], tf.int64), one)  # twice: admitted
    assert set(table_rows(model)) == {7}
    for _ in range(8):  # steps 3..10; eviction every 5 steps: 7, last seen at 2, goes at 10
        tape_step(model, tf.constant([8], tf.int64), one)
    assert set(table_rows(model)) == {8}
    assert layer.counters.numpy().tolist() == [2, 1]
    capped = one_process(keras.optimizers.SGD(0.1), max_rows_per_shard=3)
    for step in range(100):
        tape_step(capped, tf.constant([step], tf.int64), one)
    assert set(table_rows(capped)) == {97, 98, 99}  # at step 100: the 3 seen last


def test_a_subclassed_model_whose_call_takes_no_training_flag_learns_too():
    """Keras passes training=None to the layers of such a model, in fit too."""

    class Model(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.table = DynamicEmbedding(4, combiner="sum")
            self.out = keras.layers.Dense(1)

        def call(self, ids: tf.Tensor) -> tf.Tensor:
            return self.out(self.table(ids))

    model = Model()
    model.compile(optimizer="adam", metrics=["accuracy"],
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))  # fmt: skip
    x = (np.arange(400) % 50).reshape(-1, 1).astype(np.int64)
    model.fit(x, (x % 2).astype(np.float32), epochs=20, batch_size=20, verbose=0)
    assert model.evaluate(x, x % 2, verbose=0, return_dict=True)["accuracy"] > 0.95
    rows = int(model.table.embeddings_table.size())
    model.predict(x + 1000, verbose=0)  # not training: reads, admits nothing
    assert int(model.table.embeddings_table.size()) == rows == 50
    unsupported = Model()
    unsupported.compile(optimizer="rmsprop", loss="mse")
    with pytest.raises(ValueError, match=r"RMSprop has no sparse form.*compile the model"):
        unsupported.fit(x, x % 2, epochs=1, verbose=0)


def test_a_loop_without_a_compiled_optimizer_is_told_to_compile():
    ids = keras.Input((), dtype="int64")
    model = keras.Model(ids, DynamicEmbedding(DIM, name="users")(ids))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(tf.constant([1], tf.int64), training=True))
    with pytest.raises(ValueError, match=r"'users'.*model.compile\(optimizer=\.\.\.\)"):
        tape.gradient(loss, model.trainable_variables)


def test_the_layers_psctl_makes_have_no_keras_weight():
    """psctl's own step trains them (a checkpoint's skeleton must match the cluster's)."""
    with built_by_psctl():
        layer = DynamicEmbedding(DIM)
    layer.build(None)
    assert layer.one_process is None and not layer.weights


def test_keras_files_hold_the_rows_their_counts_and_slots(tmp_path):
    """model.save / load_model, and save_weights / load_weights: the same predictions, and
    training goes on from the same optimizer state."""
    ids = keras.Input((2,), dtype="int64")
    model = keras.Model(ids, DynamicEmbedding(DIM, combiner="sum", name="table")(ids))
    model.compile(optimizer=keras.optimizers.Adagrad(0.1), loss="mse")
    x = np.array([[1, 2], [3, -1], [2**62, 5]] * 4, np.int64)
    y = np.ones((12, DIM), np.float32)
    model.fit(x, y, epochs=3, batch_size=3, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    before, after = model.get_layer("table").shards[0], loaded.get_layer("table").shards[0]
    keys = tf.constant([1, 2, 3, 5, 2**62], tf.int64)
    for old, new in zip(before.read(keys), after.read(keys), strict=True):
        np.testing.assert_array_equal(old.numpy(), new.numpy())  # vectors, meta, slots
    assert after.slot_kinds == ("accumulator",)
    assert after.counters.numpy().tolist() == [5, 0]
    model.fit(x, y, epochs=1, batch_size=3, verbose=0, shuffle=False)
    loaded.fit(x, y, epochs=1, batch_size=3, verbose=0, shuffle=False)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-6)  # fmt: skip
    model.save_weights(tmp_path / "w.weights.h5")
    fresh = keras.Model(ids, DynamicEmbedding(DIM, combiner="sum", name="table")(ids))
    fresh.load_weights(tmp_path / "w.weights.h5")
    np.testing.assert_allclose(fresh.predict(x, verbose=0), model.predict(x, verbose=0))
