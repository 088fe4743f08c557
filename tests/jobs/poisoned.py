"""The mlp job with one poisoned batch (NaN features) in the FIRST training process only.

The NaN guard must refuse to checkpoint the ruined model and restart from the last finite
checkpoint; the fresh process reads clean data and finishes. The process that poisons its
data writes its pid into $PSCTL_TEST_POISON_MARKER (the job builds its dataset twice per
process: once for the element spec, once for the workers). A marker that says ``every``
poisons every training process instead: the job restarts in a loop.
"""

from __future__ import annotations

import os
from pathlib import Path

import tensorflow as tf

from psctl.job import DataContext
from psctl.jobs import mlp
from psctl.jobs.mlp import create_model, create_optimizer, eval_dataset_fn, loss_fn, metrics

__all__ = [
    "create_model",
    "create_optimizer",
    "dataset_fn",
    "eval_dataset_fn",
    "loss_fn",
    "metrics",
]

POISON_AT = 400  # the batch, in each worker's stream, whose features are NaN
EVERY = "every"  # the marker's text that poisons every training process


def _poisons() -> bool:
    marker = Path(os.environ["PSCTL_TEST_POISON_MARKER"])
    if marker.exists() and marker.read_text() == EVERY:
        return True
    if not marker.exists():
        marker.write_text(str(os.getpid()))
    return marker.read_text() == str(os.getpid())


def dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    dataset = mlp.dataset_fn(ctx)
    if not _poisons():
        return dataset

    def poison(index: tf.Tensor, batch: tuple[tf.Tensor, tf.Tensor]) -> tuple[tf.Tensor, tf.Tensor]:
        x, y = batch
        nan = tf.fill(tf.shape(x), tf.constant(float("nan"), x.dtype))
        return tf.where(tf.equal(index, POISON_AT), nan, x), y

    return dataset.enumerate().map(poison)
