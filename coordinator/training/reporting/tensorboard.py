"""TensorBoard scalars, written by the coordinator and the sidecar evaluator alike."""

from __future__ import annotations

import math

import tensorflow as tf
from tensorflow.core.framework import summary_pb2

# What tf.summary.scalar writes, without needing the tensorboard package.
_SCALAR = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
)


class ScalarWriter:
    """``prefix/name`` scalars at a step in ``logdir``; NaNs are left out."""

    def __init__(self, logdir: str) -> None:
        self.writer = tf.summary.create_file_writer(logdir)

    def write(self, prefix: str, step: int, values: dict[str, float]) -> None:
        with self.writer.as_default(step=step):
            for name, value in values.items():
                if not math.isnan(value):
                    tf.summary.write(
                        f"{prefix}/{name}", tf.constant(value, tf.float32), metadata=_SCALAR
                    )
        self.writer.flush()
