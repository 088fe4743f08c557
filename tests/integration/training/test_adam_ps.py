"""Adam as one fused op per variable (model.apply_adam_atomically) on a real ps: the op runs
where the variables live, and the variables equal those of Keras 3's own Adam."""

from __future__ import annotations

import pytest

from tests.conftest import run_python

pytestmark = pytest.mark.integration

# Same model, same batches, one step at a time: with Keras's own Adam, then the fused one.
COMPARE = """
import sys
import keras, numpy as np, tensorflow as tf
from psctl.cluster.spec import load_cluster_file
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.job_model.model import apply_adam_atomically
from psctl.coordinator.training.strategy import connect

strategy, coordinator = connect(load_cluster_file(sys.argv[1]), TrainSettings.of(job="mlp"))
rng = np.random.default_rng(0)
x = tf.constant(rng.normal(size=(32, 5)), tf.float32)
y = tf.constant(rng.normal(size=(32, 1)), tf.float32)

def train(fused):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        layers = [keras.Input((5,)), keras.layers.Dense(8, "relu"), keras.layers.Dense(1)]
        model = keras.Sequential(layers)
        optimizer = keras.optimizers.Adam(0.01)
        optimizer.build(model.trainable_variables)
    if fused:
        apply_adam_atomically(optimizer)

    @tf.function
    def step():
        def replica_step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(replica_step)

    ops = {op.type for op in step.get_concrete_function().graph.get_operations()}
    assert ("ResourceApplyAdam" in ops) == fused
    for _ in range(10):
        coordinator.schedule(step)
        coordinator.join()
    assert all("/job:ps" in v.value.device for v in model.trainable_variables + optimizer.variables)
    return [v.numpy() for v in model.trainable_variables + optimizer.variables]

keras_own, fused = train(False), train(True)
for ours, theirs in zip(fused, keras_own, strict=True):
    np.testing.assert_allclose(ours, theirs, rtol=2e-5, atol=1e-6)
print("equal")
"""


@pytest.mark.timeout(240)
def test_fused_adam_on_a_ps_equals_keras_adam(local_cluster):
    out = run_python(COMPARE, str(local_cluster.cluster_file), timeout=150)
    assert "equal" in out
