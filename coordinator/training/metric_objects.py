"""Turn a job's ``metrics`` list into fresh Keras metric objects."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import keras
import tensorflow as tf

from psctl.cluster.errors import ConfigError, echo

# Names a misspelling is matched against (keras.metrics.get takes these and class names).
_METRIC_NAMES = (
    "accuracy", "auc", "binary_accuracy", "binary_crossentropy", "categorical_accuracy",
    "categorical_crossentropy", "mae", "mape", "mse", "msle", "precision", "recall",
    "sparse_categorical_accuracy", "sparse_categorical_crossentropy",
    "sparse_top_k_categorical_accuracy", "top_k_categorical_accuracy", "AUC", "Precision",
    "Recall", "MeanSquaredError", "MeanAbsoluteError", "BinaryAccuracy",
)  # fmt: skip


def _accuracy_for(label_rank: int, label_dim: int | None, pred_dim: int | None) -> Any:
    if pred_dim == 1:
        return keras.metrics.BinaryAccuracy(name="accuracy")
    if label_rank == 1 or label_dim == 1:
        return keras.metrics.SparseCategoricalAccuracy(name="accuracy")
    return keras.metrics.CategoricalAccuracy(name="accuracy")


def metric_factories(
    specs: Sequence[Any],
    *,
    label_shape: Sequence[int | None],
    pred_shape: Sequence[int | None],
    job: str = "",
) -> list[Callable[[], Any]]:
    """One factory per metric, so training and evaluation each get their own state.

    "accuracy"/"acc" picks sparse, categorical or binary accuracy from the shapes, as
    Keras's compile does; other strings go through keras.metrics.get; Metric instances are
    cloned from their config; plain functions ``fn(labels, predictions)`` are averaged.
    A name Keras does not know, or anything else, is a ConfigError naming ``job``.
    """
    label_rank = len(label_shape)
    label_dim = label_shape[-1] if label_shape else None
    pred_dim = pred_shape[-1] if pred_shape else None
    factories: list[Callable[[], Any]] = []
    for spec in specs:
        if spec in ("accuracy", "acc"):
            factories.append(partial(_accuracy_for, label_rank, label_dim, pred_dim))
            continue
        try:
            found = keras.metrics.get(spec) if isinstance(spec, str) else spec
        except ValueError:
            found = None
        if isinstance(found, type) and issubclass(found, keras.metrics.Metric):
            factories.append(found)
        elif isinstance(found, keras.metrics.Metric):
            factories.append(partial(_clone, found))
        elif callable(found):
            name = spec if isinstance(spec, str) else getattr(found, "__name__", "metric")
            factories.append(partial(keras.metrics.MeanMetricWrapper, found, name))
        else:
            close = difflib.get_close_matches(str(spec), _METRIC_NAMES, n=1)
            raise ConfigError(
                f"--job {job}" if job else "metrics",
                f"{'metrics: ' if job else ''}{echo(spec)} is not a Keras metric"
                + (f" (did you mean {close[0]!r}?)" if close else ""),
                "give a name keras.metrics.get knows (e.g. 'accuracy', 'auc'), a "
                "keras.metrics.Metric or a function fn(labels, predictions)",
            )
    return factories


def consistent_result(metric: Any) -> Any:
    """``metric.result()`` from one read of each of its variables. ``result()`` reads some
    twice while the workers add to them: AUC reads its true positives for a ratio's
    denominator, then again for its numerator, so a call's counts landing in between gave
    a recall above 1, and a training AUC of 1.05-1.07 early in a run."""
    return metric.stateless_result([variable.numpy() for variable in metric.variables])


def _clone(metric: Any) -> Any:
    return type(metric).from_config(metric.get_config())


def make_eval_step(
    model: Any, loss_fn: Callable[[Any, Any], Any], loss: Any, metrics: Sequence[Any]
) -> Callable[[Any, Any], None]:
    """One evaluation batch: the mean loss weighted by batch size, and every metric."""

    def eval_step(x: Any, y: Any) -> None:
        predictions = model(x, training=False)
        loss.update_state(
            tf.reduce_mean(loss_fn(y, predictions)),
            sample_weight=tf.cast(tf.shape(y)[0], tf.float32),
        )
        for metric in metrics:
            metric.update_state(y, predictions)

    return eval_step
