"""Local-step mode's scheduled function in one process (no cluster): the update it pushes,
the policy for non-trainable state and optimizer slots, and the metric rows."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from psctl.coordinator.training.local_step import make_local_train_fn


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
