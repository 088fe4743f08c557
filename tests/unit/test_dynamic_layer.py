"""Dynamic tables (coordinator/dynamic.py, training/dynamic_updates.py) in one process, no
cluster: the layer's shapes and padding, admission, the optimizer's rule against the fixed
tables' (the same numbers), eviction by ttl and by cap, several calls of one layer in a
step, and checkpoints re-split over another number of shards."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from psctl.cluster.errors import ConfigError
from psctl.coordinator.dynamic import (
    DynamicEmbedding,
    Lookup,
    Records,
    placed,
    recording,
    shard_of,
)
from psctl.coordinator.training.dynamic_updates import (
    DynamicUpdater,
    Evictor,
    table_stats,
)
from psctl.coordinator.training.sharded_save import Hashed, ShardedCheckpoint
from tests.unit.test_sparse import DIM, OPTIMIZERS, ROWS, initial, run_sparse, sparse_grad

pytestmark = pytest.mark.timeout(120)


def layer_of(**kwargs: object) -> DynamicEmbedding:
    layer = DynamicEmbedding(DIM, **kwargs)  # type: ignore[arg-type]
    layer.build(None)
    return layer


def rows_of(layer: DynamicEmbedding) -> dict[int, np.ndarray]:
    found = {}
    for shard in layer.shards:
        keys, values = shard.embeddings.export()
        found.update(zip(keys.numpy().tolist(), values.numpy(), strict=True))
    return found


def step_on(updater: DynamicUpdater, layer: DynamicEmbedding, keys: list[int], grads: np.ndarray,
            step: int) -> None:  # fmt: skip
    """One update as a training step makes it: the distinct keys, their counts, the vectors
    read, and the gradient of each."""
    distinct, index, counts = tf.unique_with_counts(tf.constant(keys, tf.int64))
    vectors, meta, slots = layer._lookup(distinct, with_state=True)
    summed = tf.math.unsorted_segment_sum(tf.constant(grads), index, tf.size(distinct))
    lookup = Lookup(layer, distinct, tf.cast(counts, tf.int64), vectors, meta, slots)
    records = Records(tape=None, lookups=[lookup])
    updater.apply(records, [summed], tf.constant(step, tf.int64))
    updater.optimizer.iterations.assign_add(1)


def test_the_layer_reads_zeros_for_padding_and_unknown_ids_and_pools_like_feature_embedding():
    layer = layer_of(combiner="mean")
    known = layer.shards[0]
    known.embeddings.insert(tf.constant([2**62, 7], tf.int64), tf.ones([2, DIM]) * [[1.0], [3.0]])
    ids = tf.constant([[2**62, 7, -1], [-1, -1, -1], [5, 2**62, -1]], tf.int64)
    out = layer(ids).numpy()
    np.testing.assert_allclose(out[0], np.full(DIM, 2.0))  # mean of 1 and 3, padding out
    np.testing.assert_allclose(out[1], np.zeros(DIM))  # all padding
    np.testing.assert_allclose(out[2], np.full(DIM, 0.5))  # unknown id 5 reads zeros
    plain = layer_of()
    strings = plain(tf.constant([["a", ""]]))
    assert strings.shape == (1, 2, DIM) and not np.any(strings.numpy())
    assert plain.compute_output_shape((None, 2)) == (None, 2, DIM)
    assert layer.compute_output_shape((None, 3)) == (None, DIM)


def test_ids_get_a_row_after_admit_after_sightings_and_their_counts_are_kept():
    layer = layer_of(admit_after=3)
    updater = DynamicUpdater(keras.optimizers.SGD(0.1), [layer])
    grads = np.ones((4, DIM), np.float32)
    step_on(updater, layer, [10, 10, 11, 12], grads, step=1)  # 10 seen twice
    assert rows_of(layer) == {}
    step_on(updater, layer, [10, 11, 12, 13], grads, step=2)  # 10: 3 times, admitted
    rows = rows_of(layer)
    assert set(rows) == {10}
    first = rows[10].copy()
    assert np.all(np.abs(first) <= 0.05)  # "uniform": Keras's RandomUniform(-0.05, 0.05)
    step_on(updater, layer, [10, 11, 11, 14], grads, step=3)  # 10 updated; 11 admitted
    rows = rows_of(layer)
    assert set(rows) == {10, 11}
    np.testing.assert_allclose(rows[10], first - 0.1, rtol=1e-6)  # SGD on the admitted row
    keys, meta = layer.shards[0].meta.export()
    counts = dict(zip(keys.numpy().tolist(), meta.numpy()[:, 0].tolist(), strict=True))
    assert counts == {10: 4, 11: 4, 12: 2, 13: 1, 14: 1}
    assert table_stats([layer])[layer.name] == {"rows": 2, "admitted": 2, "evicted": 0}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_rule_on_admitted_rows_is_the_fixed_tables_rule(name: str):
    """Keys 0..ROWS-1 hold the rows of initial(); the same sparse gradients give the same
    rows as a fixed table's sparse update (itself checked against Keras's dense one)."""
    layer = layer_of()
    updater = DynamicUpdater(OPTIMIZERS[name](), [layer])
    keys = tf.range(ROWS, dtype=tf.int64)
    layer.shards[0].embeddings.insert(keys, tf.constant(initial()))
    layer.shards[0].meta.insert(keys, tf.tile(tf.constant([[1, 0, 1]], tf.int64), [ROWS, 1]))
    grads = [sparse_grad(step, [*range(ROWS), 0, 3]) for step in range(3)]
    for step, grad in enumerate(grads):
        step_on(updater, layer, grad.indices.numpy().tolist(), grad.values.numpy(), step)
    rows = rows_of(layer)
    got = np.stack([rows[k] for k in range(ROWS)])
    np.testing.assert_allclose(got, run_sparse(OPTIMIZERS[name], grads), rtol=1e-5, atol=1e-6)


def test_ttl_and_cap_evict_the_stalest_rows_with_their_slots_and_counts():
    layer = layer_of(ttl_steps=10, max_rows_per_shard=2)
    updater = DynamicUpdater(keras.optimizers.Adam(0.01), [layer])
    grads = np.ones((1, DIM), np.float32)
    for step, key in [(100, 1), (101, 2), (102, 3), (103, 4), (80, 5)]:
        # Admitted, then updated (its slots written). 5: seen long ago, as a stale step stamps.
        step_on(updater, layer, [key], grads, step=step)
        step_on(updater, layer, [key], grads, step=step)
    assert set(rows_of(layer)) == {1, 2, 3, 4, 5}
    assert sorted(layer.shards[0].slots.export()[0].numpy().tolist()) == [1, 2, 3, 4, 5]
    evicted = Evictor([layer])(105)  # 5: 25 steps unseen (ttl 10); then the cap keeps 3, 4
    assert evicted == 3
    assert set(rows_of(layer)) == {3, 4}
    shard = layer.shards[0]
    assert sorted(shard.slots.export()[0].numpy().tolist()) == [3, 4]
    assert sorted(shard.meta.export()[0].numpy().tolist()) == [3, 4]
    assert table_stats([layer])[layer.name] == {"rows": 2, "admitted": 5, "evicted": 3}


def test_one_layer_called_on_two_features_updates_each_id_once_with_both_gradients():
    a = keras.Input((2,), dtype="int64")
    b = keras.Input((1,), dtype="int64")
    shared = DynamicEmbedding(DIM, combiner="sum")
    model = keras.Model([a, b], keras.layers.Concatenate()([shared(a), shared(b)]))
    shared.shards[0].embeddings.insert(tf.constant([1, 2], tf.int64), tf.zeros([2, DIM]))
    shared.shards[0].meta.insert(
        tf.constant([1, 2], tf.int64), tf.constant([[1, 0, 1]] * 2, tf.int64)
    )
    updater = DynamicUpdater(keras.optimizers.SGD(1.0), [shared])
    with tf.GradientTape() as tape, recording(tape) as records:
        out = model([tf.constant([[1, 2]], tf.int64), tf.constant([[1]], tf.int64)])
        loss = tf.reduce_sum(out)
    grads = tape.gradient(loss, records.vectors())
    assert len(records.lookups) == 2
    updater.apply(records, grads, tf.constant(1, tf.int64))
    rows = rows_of(shared)
    np.testing.assert_allclose(rows[1], np.full(DIM, -2.0))  # in both features: 2 gradients
    np.testing.assert_allclose(rows[2], np.full(DIM, -1.0))


def checkpoint_of(layer: DynamicEmbedding) -> ShardedCheckpoint:
    """The layer's tables as the training state's checkpoint holds them (sharded_save.py)."""
    hashed = [
        Hashed(f"{what}-keys", f"{what}-values", what, [(s.device, s.tables()[what])
                                                         for s in layer.shards])
        for what in layer.shards[0].tables()
    ]  # fmt: skip
    return ShardedCheckpoint(
        dense=[], rows=[], hashed=hashed, summed=[], step_key="step",
        saved_step=tf.Variable(0, dtype=tf.int64), object_graph=b"",
    )  # fmt: skip


def test_a_checkpoint_of_two_shards_restores_into_three_by_the_keys_hash(tmp_path):
    with placed(["/cpu:0", "/cpu:0"]):
        two = layer_of()
    with placed(["/cpu:0"] * 3):
        three = layer_of()
    for layer in (two, three):
        DynamicUpdater(keras.optimizers.Adagrad(0.1), [layer])
    keys = tf.constant(np.arange(-50, 950, 10) * 1_000_003, tf.int64)  # one stride
    values = tf.random.normal([keys.shape[0], DIM])
    positions_two = shard_of(keys, 2).numpy()
    assert 0.3 < positions_two.mean() < 0.7  # spread over both
    for index, shard in enumerate(two.shards):
        mine = positions_two == index
        shard.embeddings.insert(tf.boolean_mask(keys, mine), tf.boolean_mask(values, mine))
    # A shard already holding keys is emptied by a restore.
    three.shards[-1].embeddings.insert(tf.constant([5], tf.int64), tf.ones([1, DIM]))
    saved = checkpoint_of(two)
    saved._write(str(tmp_path / "ckpt-1"))
    checkpoint_of(three).load(str(tmp_path / "ckpt-1"))
    spread = [int(shard.embeddings.size()) for shard in three.shards]
    assert sum(spread) == keys.shape[0] and min(spread) > 0, spread
    for index, shard in enumerate(three.shards):
        held = shard.embeddings.export()[0]
        assert np.all(shard_of(held, 3).numpy() == index)
    np.testing.assert_allclose(three.lookup(keys).numpy(), values.numpy())


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"admit_after": 0}, "admit_after: 0 is not a whole number from 1 to"),
        ({"admit_after": 2.5}, "admit_after: 2.5 is not a whole number from 1 to"),
        ({"ttl_steps": -5}, "ttl_steps: -5 is not a whole number from 1 to"),
        ({"max_rows_per_shard": 10**30}, "max_rows_per_shard: 10000000000"),
        ({"combiner": "max"}, "combiner: 'max' is not a combiner; give one of 'sum', 'mean'"),
    ],
)
def test_bad_arguments_are_one_line_naming_the_layer_and_exit_78(kwargs, said):
    """A ConfigError (exit 78 under psctl: was exit 1, and 10**30 crashed the first
    eviction pass) that is still the ValueError Keras layers raise."""
    with pytest.raises(ConfigError) as err:
        DynamicEmbedding(4, name="users", **kwargs)
    assert isinstance(err.value, ValueError) and err.value.exit_status == 78
    assert str(err.value).startswith(f"DynamicEmbedding(name='users') {said}"), err.value
    with pytest.raises(ValueError, match="not supported for rows that appear"):
        DynamicEmbedding(4, embeddings_initializer="orthogonal")
    # The largest accepted: every row kept, no step ever past its time to live.
    big = DynamicEmbedding(4, ttl_steps=2**62, max_rows_per_shard=2**62, admit_after=np.int64(3))
    assert (big.ttl_steps, big.max_rows_per_shard, big.admit_after) == (2**62, 2**62, 3)


def test_a_subclassed_model_builds_its_tables_outside_the_symbolic_trace():
    from psctl.coordinator.training.features import build_model

    class Model(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.table = DynamicEmbedding(DIM, combiner="sum")
            self.out = keras.layers.Dense(1)

        def call(self, x: dict) -> tf.Tensor:
            return self.out(self.table(x["ids"]))

    model = Model()
    build_model(model, {"ids": tf.TensorSpec([None, 3], tf.int64)})  # traced symbolically
    shard = model.table.shards[0]
    shard.embeddings.insert(tf.constant([1], tf.int64), tf.ones([1, DIM]))  # eager, usable
    assert model({"ids": tf.constant([[1, 2, -1]], tf.int64)}).shape == (1, 1)
