"""Adam as one fused ResourceApplyAdam op per variable (model.apply_adam_atomically): the
same variables as Keras 3's own Adam, and no stale read of the moments when a gradient
lands late (a frozen worker's). One process, no cluster (tests/integration/training/test_adam_ps.py
runs it on a ps)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from psctl.coordinator.training.job_model.model import apply_adam_atomically

pytestmark = pytest.mark.timeout(120)

OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "default": lambda: keras.optimizers.Adam(0.01),
    "hyper": lambda: keras.optimizers.Adam(0.02, beta_1=0.8, beta_2=0.95, epsilon=1e-3),
    "schedule+clip+decay": lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(0.01, 10, 0.5),
        clipnorm=0.5,
        weight_decay=0.01,
    ),
}


def model_and_data() -> tuple[keras.Model, Any, Any]:
    """A Dense stack over an Embedding (whose gradient is IndexedSlices: Keras's own step
    updates it, with its repeated ids), and a batch."""
    keras.utils.set_random_seed(0)
    ids = keras.Input((3,), dtype="int32")
    x = keras.layers.Flatten()(keras.layers.Embedding(20, 4)(ids))
    x = keras.layers.Dense(8, activation="relu")(x)
    model = keras.Model(ids, keras.layers.Dense(1)(x))
    rng = np.random.default_rng(1)
    return (
        model,
        tf.constant(rng.integers(0, 20, (16, 3)), tf.int32),
        tf.constant(rng.normal(size=(16, 1)), tf.float32),
    )


def train(make: Callable[[], Any], *, fused: bool, steps: int = 20) -> list[np.ndarray]:
    model, x, y = model_and_data()
    optimizer = make()
    optimizer.build(model.trainable_variables)
    if fused:
        apply_adam_atomically(optimizer)

    @tf.function
    def step() -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    ops = {op.type for op in step.get_concrete_function().graph.get_operations()}
    assert ("ResourceApplyAdam" in ops) == fused
    for _ in range(steps):
        step()
    return [np.asarray(v.numpy()) for v in model.trainable_variables + optimizer.variables]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_adam_gives_keras_adams_variables(name: str):
    keras_own, fused = train(OPTIMIZERS[name], fused=False), train(OPTIMIZERS[name], fused=True)
    for ours, theirs in zip(fused, keras_own, strict=True):
        np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=1e-6)
    assert not np.allclose(fused[0], train(OPTIMIZERS[name], fused=True, steps=0)[0])


def test_optimizers_without_a_fused_form_keep_keras_step():
    class MyAdam(keras.optimizers.Adam):
        pass

    for optimizer in (
        keras.optimizers.Adam(amsgrad=True),
        MyAdam(),
        keras.optimizers.AdamW(),
        keras.optimizers.SGD(),
    ):
        apply_adam_atomically(optimizer)
        assert "update_step" not in vars(optimizer), type(optimizer).__name__


def late_apply(*, fused: bool) -> tuple[float, float]:
    """One step whose gradient arrives after 50 other steps ran (a worker frozen between
    the start of its step and its gradient): (v after the late step, the variable)."""
    variable = keras.Variable(np.ones([4], np.float32))
    optimizer = keras.optimizers.Adam(1e-3, beta_2=0.9)  # v decays 10x in 22 steps, not 2300
    optimizer.build([variable])
    if fused:
        apply_adam_atomically(optimizer)
    step = tf.function(lambda g: optimizer.apply([g], [variable]))
    step(tf.fill([4], 10.0))  # v = 10
    gradient = tf.queue.FIFOQueue(1, tf.float32, shapes=[[4]])
    late = threading.Thread(
        target=tf.function(lambda: optimizer.apply([gradient.dequeue()], [variable]))
    )
    late.start()
    time.sleep(1.0)  # the late step has started: it waits for its gradient
    for _ in range(50):
        step(tf.zeros([4]))  # v: 10 * 0.9^50 = 0.05
    gradient.enqueue(tf.zeros([4]))
    late.join(timeout=30)
    assert not late.is_alive()
    return float(optimizer._velocities[0].numpy()[0]), float(variable.numpy()[0])


def test_a_late_gradient_reads_the_moments_when_it_lands():
    # Keras's own step read v = 10 when it started and adds 0.1 * (0 - 10) to v = 0.05:
    # v -0.95 and the variable NaN, as a thawed worker made the mlp job's loss NaN.
    v, value = late_apply(fused=False)
    assert v < 0 and np.isnan(value), "the stale read no longer shows: check Keras's Adam"
    v, value = late_apply(fused=True)
    assert v == pytest.approx(0.9 * 10 * 0.9**50, rel=1e-3)
    assert np.isfinite(value)
