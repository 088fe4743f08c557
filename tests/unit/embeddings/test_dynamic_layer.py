"""Dynamic tables (coordinator/embeddings/dynamic.py, embeddings/dynamic_updates.py) in one
process, no cluster (shards "placed" on this process's CPU): the layer's shapes and padding,
admission and its sketch, the optimizer's rule against the fixed tables' (the same numbers),
eviction by ttl and by cap, several calls of one layer in a step, the bytes a row takes, and
checkpoints re-split over another number of shards, also from the three-table layout of
before."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops import gen_io_ops

from psctl.cluster.errors import ConfigError
from psctl.coordinator.embeddings.dynamic import (
    DynamicEmbedding,
    Lookup,
    Records,
    placed,
    recording,
    shard_of,
)
from psctl.coordinator.embeddings.dynamic_updates import (
    DynamicUpdater,
    Evictor,
    table_stats,
)
from psctl.coordinator.embeddings.layers import LayerSettingError
from psctl.coordinator.training.saving.sharded_save import Column, Hashed, ShardedCheckpoint
from tests.unit.embeddings.test_sparse import (
    DIM,
    OPTIMIZERS,
    ROWS,
    initial,
    run_sparse,
    sparse_grad,
)

pytestmark = pytest.mark.timeout(120)


def layer_of(shards: int = 1, **kwargs: object) -> DynamicEmbedding:
    """A layer whose tables train: ``shards`` shards on this process's CPU."""
    with placed(["/cpu:0"] * shards):
        layer = DynamicEmbedding(DIM, **kwargs)  # type: ignore[arg-type]
        layer.build(None)
    return layer


def exported(layer: DynamicEmbedding) -> dict[int, tuple[np.ndarray, np.ndarray, object]]:
    """key -> (vector, meta [count, last_seen, admitted], slots or None)."""
    found = {}
    for shard in layer.packed:
        keys, values = shard.table.export()
        vectors, meta, slots = shard.unpack(values)
        for i, key in enumerate(keys.numpy().tolist()):
            found[key] = (vectors[i].numpy(), meta[i].numpy(),
                          None if slots is None else slots[i].numpy())  # fmt: skip
    return found


def rows_of(layer: DynamicEmbedding) -> dict[int, np.ndarray]:
    return {key: row[0] for key, row in exported(layer).items()}


def put(layer: DynamicEmbedding, keys: tf.Tensor, vectors: tf.Tensor) -> None:
    """Rows for ``keys`` (admitted, seen once at step 0) in the shards that hold them."""
    part = shard_of(keys, len(layer.packed)).numpy()
    for index, shard in enumerate(layer.packed):
        mine = part == index
        k = tf.boolean_mask(keys, mine)
        _, _, slots = shard.read(k)  # the optimizer's initial slots
        n = tf.size(k)
        shard.write(k, tf.boolean_mask(vectors, mine), slots, tf.ones([n], tf.int64),
                    tf.zeros([n], tf.int64))  # fmt: skip


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
    put(layer, tf.constant([2**62, 7], tf.int64), tf.ones([2, DIM]) * [[1.0], [3.0]])
    ids = tf.constant([[2**62, 7, -1], [-1, -1, -1], [5, 2**62, -1]], tf.int64)
    out = layer(ids).numpy()
    np.testing.assert_allclose(out[0], np.full(DIM, 2.0))  # mean of 1 and 3, padding out
    np.testing.assert_allclose(out[1], np.zeros(DIM))  # all padding
    np.testing.assert_allclose(out[2], np.full(DIM, 0.5))  # unknown id 5 reads zeros
    plain = DynamicEmbedding(DIM)  # built in one process: the serving layout
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
    counts = {key: int(row[1][0]) for key, row in exported(layer).items()}
    assert counts == {10: 4, 11: 4}
    # The ids not admitted are counted in the sketch only (exactly, this few of them).
    sketch = layer.packed[0].sketch
    seen = sketch.add(tf.constant([12, 13, 14], tf.int64), tf.zeros([3], tf.int64))
    assert seen.numpy().tolist() == [2, 1, 1]
    stats = table_stats([layer])[layer.name]
    assert {k: stats[k] for k in ("rows", "admitted", "evicted")} == {
        "rows": 2, "admitted": 2, "evicted": 0}  # fmt: skip
    assert stats["bytes"] == stats["bytes/ps:0"] == layer.packed[0].nbytes(2)
    assert stats["bytes"] >= sketch.nbytes + 2 * (DIM + 2) * 4


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_rule_on_admitted_rows_is_the_fixed_tables_rule(name: str):
    """Keys 0..ROWS-1 hold the rows of initial(); the same sparse gradients give the same
    rows as a fixed table's sparse update (itself checked against Keras's dense one)."""
    layer = layer_of()
    updater = DynamicUpdater(OPTIMIZERS[name](), [layer])
    put(layer, tf.range(ROWS, dtype=tf.int64), tf.constant(initial()))
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
    rows = exported(layer)
    assert set(rows) == {1, 2, 3, 4, 5}
    assert all(np.any(row[2] != 0) for row in rows.values())  # Adam's slots written
    evicted = Evictor([layer])(105)  # 5: 25 steps unseen (ttl 10); then the cap keeps 3, 4
    assert evicted == 3
    assert set(rows_of(layer)) == {3, 4}
    stats = table_stats([layer])[layer.name]
    assert {k: stats[k] for k in ("rows", "admitted", "evicted")} == {
        "rows": 2, "admitted": 5, "evicted": 3}  # fmt: skip


def test_ttl_seconds_evicts_rows_not_seen_for_that_long_by_the_step_clock():
    layer = layer_of(ttl_seconds=60.0)
    updater = DynamicUpdater(keras.optimizers.Adam(0.01), [layer])
    grads = np.ones((1, DIM), np.float32)
    for step, key in [(10, 1), (20, 2), (30, 3)]:
        step_on(updater, layer, [key], grads, step=step)
        step_on(updater, layer, [key], grads, step=step)
    evictor = Evictor([layer])
    # The process has not run 60 s yet: no step's time is known that far back.
    assert evictor(12, now=1000.0) == 0
    assert evictor(25, now=1030.0) == 0
    assert set(rows_of(layer)) == {1, 2, 3}
    # At 1075 s, step 12 was reached over 60 s ago: rows last seen before it go (key 1).
    assert evictor(40, now=1075.0) == 1
    assert set(rows_of(layer)) == {2, 3}
    # At 1091 s, step 25 (1030 s) is the newest step over 60 s old: key 2 (step 20) goes.
    assert evictor(45, now=1091.0) == 1
    assert set(rows_of(layer)) == {3}


def test_ttl_seconds_is_a_number_of_seconds():
    with pytest.raises(LayerSettingError, match="ttl_seconds: 0 is not a number of seconds"):
        DynamicEmbedding(DIM, ttl_seconds=0)
    assert DynamicEmbedding(DIM, ttl_seconds=90).get_config()["ttl_seconds"] == 90.0


def test_one_layer_called_on_two_features_updates_each_id_once_with_both_gradients():
    a = keras.Input((2,), dtype="int64")
    b = keras.Input((1,), dtype="int64")
    with placed(["/cpu:0"]):
        shared = DynamicEmbedding(DIM, combiner="sum")
        model = keras.Model([a, b], keras.layers.Concatenate()([shared(a), shared(b)]))
    put(shared, tf.constant([1, 2], tf.int64), tf.zeros([2, DIM]))
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


# The serving layout's tables with Adagrad (one slot), as the checkpoint names them here.
COLUMNS = [Column("embeddings", "e-keys", "e-values", (DIM,)),
           Column("meta", "m-keys", "m-values", (3,)),
           Column("slots", "s-keys", "s-values", (DIM,))]  # fmt: skip


def checkpoint_of(layer: DynamicEmbedding) -> ShardedCheckpoint:
    """The layer's tables as the training state's checkpoint holds them
    (training/saving/sharded_save.py)."""
    return ShardedCheckpoint(
        dense=[], rows=[], hashed=[Hashed(layer.name, COLUMNS, layer.packed)], summed=[],
        step_key="step", saved_step=tf.Variable(0, dtype=tf.int64), object_graph=b"",
    )  # fmt: skip


def adagrad_layer(shards: int) -> DynamicEmbedding:
    layer = layer_of(shards)
    DynamicUpdater(keras.optimizers.Adagrad(0.1), [layer])
    return layer


def test_a_checkpoint_of_two_shards_restores_into_three_by_the_keys_hash(tmp_path):
    two, three = adagrad_layer(2), adagrad_layer(3)
    keys = tf.constant(np.arange(-50, 950, 10) * 1_000_003, tf.int64)  # one stride
    values = tf.random.normal([keys.shape[0], DIM])
    positions_two = shard_of(keys, 2).numpy()
    assert 0.3 < positions_two.mean() < 0.7  # spread over both
    put(two, keys, values)
    # A shard already holding keys is emptied by a restore.
    put(three, tf.constant([5], tf.int64), tf.ones([1, DIM]))
    saved = checkpoint_of(two)
    saved._write(str(tmp_path / "ckpt-1"))
    checkpoint_of(three).load(str(tmp_path / "ckpt-1"))
    spread = [int(shard.size()) for shard in three.packed]
    assert sum(spread) == keys.shape[0] and min(spread) > 0, spread
    for index, shard in enumerate(three.packed):
        held = shard.table.export()[0]
        assert np.all(shard_of(held, 3).numpy() == index)
    np.testing.assert_allclose(three.lookup(keys).numpy(), values.numpy())
    before, after = exported(two), exported(three)
    for key, (vector, meta, slots) in before.items():
        np.testing.assert_array_equal(after[key][0], vector)
        np.testing.assert_array_equal(after[key][1], meta)
        np.testing.assert_array_equal(after[key][2], slots)


def test_a_checkpoint_of_three_tables_per_shard_restores_into_packed_rows(tmp_path):
    """The layout before rows were packed: vectors, counts and slots each a table of its
    own (exported in orders of their own), and counts of ids never admitted."""
    keys = np.array([11, 22, 33], np.int64)
    vectors = np.arange(3 * DIM, dtype=np.float32).reshape(3, DIM)
    slots = vectors + 100
    meta = np.array([[4, 40, 1], [9, 90, 0], [5, 50, 1], [6, 60, 1]], np.int64)
    meta_keys = np.array([33, 44, 11, 22], np.int64)  # 44: counted, never admitted
    order = [2, 0, 1]
    gen_io_ops.save_v2(
        str(tmp_path / "ckpt-1"),
        ["step", "e-keys", "e-values", "m-keys", "m-values", "s-keys", "s-values"],
        [""] * 7,
        [tf.constant(7, tf.int64), keys, vectors, meta_keys, meta, keys[order], slots[order]],
    )
    layer = adagrad_layer(2)
    checkpoint_of(layer).load(str(tmp_path / "ckpt-1"))
    rows = exported(layer)
    assert sorted(rows) == [11, 22, 33]
    counts = dict(zip(meta_keys.tolist(), meta.tolist(), strict=True))
    for i, key in enumerate(keys.tolist()):
        np.testing.assert_array_equal(rows[key][0], vectors[i])
        np.testing.assert_array_equal(rows[key][1], counts[key])
        np.testing.assert_array_equal(rows[key][2], slots[i])


def test_one_off_ids_cost_no_rows_and_the_sketch_rarely_admits_one_by_mistake():
    """A stream of ids each seen once, with admit_after=2: no row for any of them while the
    sketch is wide for the stream (a false admission needs all 4 of an id's counters taken
    by others); a sketch far too narrow admits most, which is what the docs warn of."""
    ids = np.arange(20_000, dtype=np.int64) * 7919 + 13

    def admitted(width: int) -> int:
        layer = layer_of(admit_after=2, admission_sketch_width=width)
        updater = DynamicUpdater(keras.optimizers.SGD(0.1), [layer])
        for batch in np.split(ids, 20):
            step_on(updater, layer, batch.tolist(), np.zeros((len(batch), DIM), np.float32), 1)
        return int(table_stats([layer])[layer.name]["rows"])

    assert admitted(2**18) <= 4  # expected (1 - e^(-20000/2^18))^4 * 20000 = 0.6
    assert admitted(2**10) > 15_000


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
    from psctl.coordinator.training.job_model.features import build_model

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
