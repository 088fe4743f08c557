"""CallSums: a call's training metrics summed on the worker and added once equal the same
metrics updated step by step (one process, the default strategy)."""

from __future__ import annotations

from types import SimpleNamespace

import keras
import numpy as np
import tensorflow as tf

from psctl.coordinator.training.steps.programs import CallSums


def _state(metrics: list) -> SimpleNamespace:
    sums = tf.Variable(tf.zeros([2, 2], tf.float64))
    return SimpleNamespace(mean_sums=sums, other_metrics=metrics)


def _batches(count: int) -> list[tuple[tf.Tensor, tf.Tensor]]:
    rng = np.random.default_rng(7)
    return [
        (
            tf.constant(rng.integers(0, 2, (32, 1)), tf.float32),
            tf.constant(rng.normal(size=(32, 1)), tf.float32),
        )
        for _ in range(count)
    ]


def test_summed_over_a_call_equals_updated_every_step():
    metrics = [
        keras.metrics.AUC(from_logits=True, num_thresholds=50),
        keras.metrics.Precision(thresholds=0.0),
        keras.metrics.MeanSquaredError(),  # not additive: still updated every step
    ]
    stepwise = [
        keras.metrics.AUC(from_logits=True, num_thresholds=50),
        keras.metrics.Precision(thresholds=0.0),
    ]
    state = _state(metrics)
    sums = CallSums(state)  # type: ignore[arg-type]
    assert [type(m) for m in sums.additive] == [keras.metrics.AUC, keras.metrics.Precision]
    assert [type(m) for m in sums.per_step] == [keras.metrics.MeanSquaredError]

    @tf.function
    def call(batches: list) -> list:
        total = sums.zeros()
        for y, logits in batches:
            row = tf.constant([[1.0, 1.0], [2.0, 1.0]], tf.float64)
            total = sums.add(total, row, y, logits)
        return sums.push(total)

    batches = _batches(5)
    call(batches)
    for metric in stepwise:
        for y, logits in batches:
            metric.update_state(y, logits)
    assert np.allclose(state.mean_sums.numpy(), [[5.0, 5.0], [10.0, 5.0]])
    for summed, updated in zip(metrics[:2], stepwise, strict=True):
        assert float(summed.result()) == float(updated.result()) > 0
    assert float(metrics[2].result()) > 0  # updated in the loop, step by step
