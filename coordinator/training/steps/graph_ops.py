"""Small in-graph helpers shared by psctl's scheduled functions (default, local-step,
``--epochs`` and inline evaluation)."""

from __future__ import annotations

import tensorflow as tf


def seconds_since(started: tf.Tensor, *, after: tf.Tensor) -> tf.Tensor:
    """Seconds from ``started`` (a ``tf.timestamp()``) until ``after`` has run, in a
    scheduled function. tf.timestamp is not ordered with the other ops by itself (seen: ~3 us
    per 20-step call), so the caller also runs its steps under
    ``tf.control_dependencies([started])``."""
    with tf.control_dependencies([after]):
        return tf.timestamp() - started


def sum_count(values: tf.Tensor) -> tf.Tensor:
    """[sum, count] of a tensor's values, float64: a row of a mean metric's state."""
    values = tf.cast(values, tf.float64)
    return tf.stack([tf.reduce_sum(values), tf.cast(tf.size(values), tf.float64)])
