"""The model's outputs by name: one output is ``outputs``; a dict of outputs is named by its
keys, a list or tuple of them ``output_0``, ``output_1``, ... The same names prefix the
metrics of each output (``c_accuracy``, as Keras names them) and name the exported
signature's outputs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import tensorflow as tf

SINGLE_OUTPUT = "outputs"  # the exported signature's output for a model of one output


def output_keys(spec: Any) -> list[tuple[str, Any]]:
    """(name, key) of every output of a prediction (a spec or tensors) of several outputs,
    in ``tf.nest``'s order (dict keys sorted); ``key`` picks it from the prediction, and from
    the labels, which have the prediction's structure. [] for one output."""
    if isinstance(spec, Mapping):
        return [(str(key), key) for key in sorted(spec, key=str)]
    if isinstance(spec, Sequence) and not isinstance(spec, str | bytes):
        return [(f"output_{i}", i) for i in range(len(spec))]
    return []


def named_outputs(predictions: Any) -> dict[str, Any]:
    """The exported signature's outputs: ``{"outputs": prediction}`` for one output, else one
    entry per output under its name (a nested output's path joined by "_")."""
    if not tf.nest.is_nested(predictions):
        return {SINGLE_OUTPUT: predictions}
    named: dict[str, Any] = {}
    for name, key in output_keys(predictions):
        inner = named_outputs(predictions[key])
        for sub, value in inner.items():
            named[name if sub == SINGLE_OUTPUT and len(inner) == 1 else f"{name}_{sub}"] = value
    return named


def batch_size(labels: Any) -> Any:
    """The batch's size from its labels (one tensor, or a structure of them per output)."""
    return tf.shape(tf.nest.flatten(labels)[0])[0]
