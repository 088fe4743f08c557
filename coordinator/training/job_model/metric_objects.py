"""Turn a job's ``metrics`` list into fresh Keras metric objects."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import keras
import tensorflow as tf

from psctl.cluster.errors import ConfigError, echo
from psctl.coordinator.training.job_model.features import leaf_shape, structure_of
from psctl.coordinator.training.job_model.outputs import batch_size, output_keys

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


def structured_metric_factories(
    specs: Any, *, label_spec: Any, pred_spec: Any, job: str = ""
) -> list[Callable[[], Any]]:
    """``metric_factories`` for a model of any outputs. One output: the job's ``metrics`` as
    they are. Several (a dict or a list of outputs, labels of the same structure): as Keras's
    ``compile(metrics=...)`` takes them, a dict ``{output name: metric or [metrics]}`` or a
    list of one entry (a metric, a list, None) per output; each metric sees its output's
    labels and prediction only and is named ``<output>_<name>`` (``c_accuracy``; a list's
    outputs are ``output_0``, ``output_1``, ... as in ``outputs.output_keys``)."""
    outputs = output_keys(pred_spec)
    if not outputs and isinstance(specs, Mapping):
        raise ConfigError(
            f"--job {job}" if job else "metrics",
            f"metrics are a dict by output name ({', '.join(map(str, specs))}), but the model "
            "has one output",
            "give metrics as a list, e.g. metrics = ['accuracy']",
        )
    if not outputs:
        return metric_factories(
            specs, label_shape=leaf_shape(label_spec), pred_shape=leaf_shape(pred_spec), job=job
        )
    if not specs:
        return []
    names = [name for name, _ in outputs]
    where = f"--job {job}" if job else "metrics"
    if isinstance(specs, Mapping) and set(specs) <= {key for _, key in outputs}:
        per_output = [specs.get(key) for _, key in outputs]
    elif isinstance(specs, Sequence) and not isinstance(specs, str) and len(specs) == len(names):
        per_output = list(specs)
    else:
        raise ConfigError(
            where,
            f"metrics {echo(specs)} do not say which of the model's outputs "
            f"({', '.join(names)}) each one is for",
            "give metrics as a dict {output name: [metrics]} or a list of one entry per "
            "output, as keras.Model.compile(metrics=...) takes them",
        )
    if _label_keys(label_spec, outputs) is None:
        raise ConfigError(
            where,
            f"the labels are {structure_of(label_spec)} where the model has the outputs "
            f"{', '.join(names)}",
            "yield (features, labels) with labels of the outputs' structure (a dict of the "
            "same keys, or a tuple of one label per output)",
        )
    factories: list[Callable[[], Any]] = []
    for (name, key), spec in zip(outputs, per_output, strict=True):
        if spec is None:
            continue
        own = spec if isinstance(spec, list | tuple) else [spec]
        for make in metric_factories(
            own,
            label_shape=leaf_shape(label_spec[key]),
            pred_shape=leaf_shape(pred_spec[key]),
            job=job,
        ):
            factories.append(partial(_on_output, make, key, name))
    return factories


def _label_keys(label_spec: Any, outputs: list[tuple[str, Any]]) -> list[Any] | None:
    """The labels' keys when they have one entry per output, else None."""
    keys = [key for _, key in outputs]
    if isinstance(label_spec, Mapping):
        return keys if set(label_spec) == set(keys) else None
    if isinstance(label_spec, Sequence) and len(label_spec) == len(keys):
        return keys if all(isinstance(k, int) for k in keys) else None
    return None


def _pick(fn: Any, key: Any, y_true: Any, y_pred: Any, **kwargs: Any) -> Any:
    return fn(y_true[key], y_pred[key], **kwargs)


_PICKING: dict[type, Any] = {}


def _picking_class(cls: Any) -> Any:
    """``cls`` updated with one output's labels and prediction (``self.output_key``)."""
    if cls not in _PICKING:

        def update_state(self: Any, y_true: Any, y_pred: Any, sample_weight: Any = None) -> Any:
            key = self.output_key
            return cls.update_state(self, y_true[key], y_pred[key], sample_weight=sample_weight)

        _PICKING[cls] = type(cls.__name__, (cls,), {"update_state": update_state, "picks_for": cls})
    return _PICKING[cls]


def _on_output(make: Callable[[], Any], key: Any, name: str) -> Any:
    """A fresh ``make()`` that reads output ``key`` only, named ``<name>_<its name>``.

    A mean metric stays a MeanMetricWrapper (training sums its function's rows itself) over
    a function that picks the output; any other metric becomes its class's picking
    subclass, so its state (AUC's counts) is the class's own and adds up as it does."""
    metric = make()
    if isinstance(metric, keras.metrics.MeanMetricWrapper):
        return keras.metrics.MeanMetricWrapper(
            partial(_pick, metric._fn, key),
            name=f"{name}_{metric.name}",
            dtype=metric.dtype,
            **metric._fn_kwargs,
        )
    config = {**metric.get_config(), "name": f"{name}_{metric.name}"}
    picked = _picking_class(type(metric)).from_config(config)
    picked.output_key = key
    return picked


def metric_kind(metric: Any) -> type:
    """The metric's Keras class (the class an output's picking metric was made from)."""
    return getattr(type(metric), "picks_for", type(metric))


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
            sample_weight=tf.cast(batch_size(y), tf.float32),
        )
        for metric in metrics:
            metric.update_state(y, predictions)

    return eval_step
