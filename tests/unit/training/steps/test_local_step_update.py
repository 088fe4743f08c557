"""Local-step mode's scheduled function in one process (no cluster): the update it pushes,
the policy for non-trainable state and optimizer slots, and the metric rows."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from psctl.coordinator.embeddings.sharded import Table, building, table_of
from psctl.coordinator.embeddings.sparse import SparseUpdater
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.steps.local_step import make_local_train_fn


def loss_fn(labels: tf.Tensor, predictions: tf.Tensor) -> tf.Tensor:
    return keras.losses.sparse_categorical_crossentropy(labels, predictions, from_logits=True)


def make_model(batch_norm: bool) -> keras.Model:
    keras.utils.set_random_seed(3)
    layers = [keras.Input(shape=(4,)), keras.layers.Dense(8)]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization())
    layers.append(keras.layers.Dense(3))
    return keras.Sequential(layers)


def batches(count: int) -> tf.data.Dataset:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((count * 16, 4)).astype(np.float32) + 1.0
    y = rng.integers(0, 3, count * 16)
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(16)


def build(model: keras.Model, optimizer: keras.optimizers.Optimizer, scale: float = 1.0):
    optimizer.build(model.trainable_variables)
    mean_sums = tf.Variable(tf.zeros([1, 2], tf.float64))
    global_step = tf.Variable(0, dtype=tf.int64)
    fn = make_local_train_fn(
        model=model,
        optimizer=optimizer,
        loss_fn=loss_fn,
        mean_sums=mean_sums,
        mean_metrics=[],
        other_metrics=[],
        global_step=global_step,
        scale=scale,
    )
    return fn, mean_sums, global_step


@pytest.mark.timeout(120)
def test_local_steps_equal_the_optimizer_steps_and_push_the_change():
    steps = 4
    model, reference = make_model(False), make_model(False)
    fn, mean_sums, global_step = build(model, keras.optimizers.SGD(learning_rate=0.1))
    seconds = fn(iter(batches(steps)), tf.constant(steps, tf.int64))
    assert float(seconds) > 0
    # The same steps with the Keras optimizer, variable by variable.
    optimizer = keras.optimizers.SGD(learning_rate=0.1)
    for x, y in batches(steps):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(y, reference(x, training=True)))
        grads = tape.gradient(loss, reference.trainable_variables)
        optimizer.apply_gradients(zip(grads, reference.trainable_variables, strict=True))
    for ours, theirs in zip(model.trainable_variables, reference.trainable_variables, strict=True):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-4, atol=1e-5)
    assert int(global_step.numpy()) == steps
    total, count = mean_sums.numpy()[0]
    assert count == steps and total > 0  # one loss row per step, summed on the worker


@pytest.mark.timeout(120)
def test_scale_non_trainable_state_and_slots_policy():
    model = make_model(True)
    optimizer = keras.optimizers.Adam(learning_rate=0.01)
    fn, _, global_step = build(model, optimizer, scale=0.5)
    start = [v.numpy().copy() for v in model.trainable_variables]
    moving = [v for v in model.non_trainable_variables if "moving_mean" in v.path]
    assert moving and not moving[0].numpy().any()
    # The same call at scale 1, on a copy, tells what the local steps moved.
    full_model = make_model(True)
    full_fn, _, _ = build(full_model, keras.optimizers.Adam(learning_rate=0.01))
    fn(iter(batches(3)), tf.constant(3, tf.int64))
    full_fn(iter(batches(3)), tf.constant(3, tf.int64))
    for before, half, full in zip(
        start, model.trainable_variables, full_model.trainable_variables, strict=True
    ):
        np.testing.assert_allclose(half.numpy() - before, 0.5 * (full.numpy() - before), atol=1e-6)
    # Non-trainable state: the local final value is assigned (moved off zero by the batches).
    assert moving[0].numpy().any()
    # Optimizer slots on the ps stay untouched; the iteration count follows the steps.
    slots = [v for v in optimizer.variables if "momentum" in v.path or "velocity" in v.path]
    assert len(slots) == 2 * len(model.trainable_variables)
    assert all(not v.numpy().any() for v in slots)
    assert int(optimizer.iterations.numpy()) == 3
    assert int(global_step.numpy()) == 3


# -- psctl tables in local-step mode: sparse rows on the ps every step, dense pushed once ------

ROWS, DIM, IDS = 8, 3, 4


def table_model(table: bool) -> keras.Model:
    """Ids -> one Embedding -> Dense(1); built as a psctl table (``table``) or plain Keras."""
    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [
            keras.Input((IDS,), dtype="int64"),
            keras.layers.Embedding(ROWS, DIM),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ]
    )
    if not table:
        return model
    settings = TrainSettings.of(max_shards=2, min_shard_bytes=1)
    keras.utils.set_random_seed(5)
    with building(settings) as plan:
        psctl_model = keras.Sequential(
            [
                keras.Input((IDS,), dtype="int64"),
                keras.layers.Embedding(ROWS, DIM),
                keras.layers.Flatten(),
                keras.layers.Dense(1),
            ]
        )
    (tab,) = plan.tables
    write(tab, model.layers[0].embeddings.numpy())  # the plain model's initial values
    for ours, theirs in zip(psctl_model.trainable_variables, model.layers[-1].weights, strict=True):
        ours.assign(theirs)
    return psctl_model


def read(table: Table) -> np.ndarray:
    return np.concatenate([shard.numpy() for shard in table.shards])


def write(table: Table, value: np.ndarray) -> None:
    start = 0
    for shard in table.shards:
        shard.assign(value[start : start + shard.shape[0]])
        start += shard.shape[0]


def id_batches(count: int, rows: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(count):
        # Example k's first id is row k: a batch touches every one of the ``rows`` rows.
        x = np.stack([np.roll(rng.permutation(rows), -k)[:IDS] for k in range(rows)])
        x[:, 0] = np.arange(rows)
        x = x.astype(np.int64)
        out.append((x, rng.standard_normal((rows, 1)).astype(np.float32)))
    return out


def mse(labels: tf.Tensor, predictions: tf.Tensor) -> tf.Tensor:
    return tf.reduce_mean(tf.square(predictions - labels), axis=-1)


def table_fn(model: keras.Model, optimizer: keras.optimizers.Optimizer, scale: float):
    (tab,) = [t for layer in model.layers if (t := table_of(layer)) is not None]
    optimizer.build(model.trainable_variables)
    sparse = SparseUpdater(optimizer, [tab], tf.distribute.get_strategy())
    fn = make_local_train_fn(
        model=model,
        optimizer=optimizer,
        loss_fn=mse,
        mean_sums=tf.Variable(tf.zeros([1, 2], tf.float64)),
        mean_metrics=[],
        other_metrics=[],
        global_step=tf.Variable(0, dtype=tf.int64),
        scale=scale,
        sparse=sparse,
    )
    return fn, tab


def run_calls(fn, data: list, calls: int, steps: int) -> None:
    dataset = tf.data.Dataset.from_tensor_slices(
        (np.stack([x for x, _ in data]), np.stack([y for _, y in data]))
    )
    iterator = iter(dataset)
    for _ in range(calls):
        fn(iterator, tf.constant(steps, tf.int64))


def keras_steps(model: keras.Model, data: list) -> list[list[np.ndarray]]:
    """Keras Adam on the plain model, one step a batch: the variables after each step."""
    optimizer = keras.optimizers.Adam(0.05)
    after = []
    for x, y in data:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(mse(y, model(x, training=True)))
        variables = model.trainable_variables
        # Dense gradients: Keras 3 Adam given IndexedSlices is not its dense update.
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]
        optimizer.apply_gradients(zip(grads, variables, strict=True))
        after.append([v.numpy().copy() for v in variables])
    return after


@pytest.mark.timeout(120)
def test_tables_take_the_sparse_rule_every_local_step_with_the_global_step_count():
    # Every batch touches every row: lazy Adam is Keras's dense Adam, and one call of K local
    # steps (fresh local moments) is K Keras Adam steps for the dense variables too.
    steps, data = 3, id_batches(6, ROWS)
    model = table_model(table=True)
    optimizer = keras.optimizers.Adam(0.05)
    fn, tab = table_fn(model, optimizer, scale=1.0)
    after = keras_steps(table_model(table=False), data[:steps])  # [table, kernel, bias]
    run_calls(fn, data, calls=1, steps=steps)
    np.testing.assert_allclose(read(tab), after[-1][0], rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(model.trainable_variables, after[-1][1:], strict=True):
        np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-5, atol=1e-6)
    assert int(optimizer.iterations.numpy()) == steps

    # Over calls, the table keeps its moments in its slots on the ps and its steps count on
    # (bias correction of steps 4..6 in the second call). The dense layer frozen: its local
    # moments restart every call by design.
    model, reference = table_model(table=True), table_model(table=False)
    model.layers[-1].trainable = reference.layers[-1].trainable = False
    fn, tab = table_fn(model, keras.optimizers.Adam(0.05), scale=1.0)
    after = keras_steps(reference, data)
    run_calls(fn, data, calls=2, steps=steps)
    np.testing.assert_allclose(read(tab), after[-1][0], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_local_scale_is_for_dense_variables_and_untouched_rows_stay():
    data = id_batches(2, ROWS // 2)  # ids 0..3 only
    results = {}
    for scale in (1.0, 0.5):
        model = table_model(table=True)
        start = [v.numpy().copy() for v in model.trainable_variables]
        fn, tab = table_fn(model, keras.optimizers.Adagrad(0.1), scale=scale)
        before = read(tab).copy()
        run_calls(fn, data, calls=1, steps=2)
        table = read(tab)
        np.testing.assert_array_equal(table[ROWS // 2 :], before[ROWS // 2 :])
        assert not np.allclose(table[: ROWS // 2], before[: ROWS // 2])
        moved = [v.numpy() - s for v, s in zip(model.trainable_variables, start, strict=True)]
        results[scale] = table, moved
    np.testing.assert_allclose(results[0.5][0], results[1.0][0], rtol=1e-6)
    for half, full in zip(results[0.5][1], results[1.0][1], strict=True):
        np.testing.assert_allclose(half, 0.5 * full, rtol=1e-5, atol=1e-7)
