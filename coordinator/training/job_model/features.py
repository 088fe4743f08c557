"""The job's features against its model's inputs.

Features are any ``tf.nest`` structure of tensors: one tensor, a tuple, a dict of named
features (a functional model over named ``keras.Input``s), nested. This module

- checks a dataset's features against the model's inputs before the first step, so that a
  renamed key, a missing one or a string where the model takes numbers is one line naming
  the key and what the model expects (a ``ConfigError``: exit 78), not a Keras traceback
  after the cluster started (an extra key even shifts Keras's matching of the others);
- builds an unbuilt model (a ``Sequential`` without ``Input``, a subclassed model) by a
  symbolic call on the features' structure, and gives the prediction's spec;
- names the features for the exported signature: ``features`` for one tensor, else one
  input per feature under its key (the ``keras.Input`` names).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import tensorflow as tf
from keras.src.models.functional import Functional  # a model over declared keras.Inputs

from psctl.cluster.errors import ConfigError

SINGLE_INPUT = "features"  # the exported signature's input when the features are one tensor


def symbolic(spec: Any) -> Any:
    """The features' spec as Keras symbolic tensors, batch dimension open."""

    def one(leaf: Any) -> Any:
        shape = tuple(leaf.shape)
        return keras.KerasTensor((None, *shape[1:]) if shape else (), dtype=leaf.dtype.name)

    return tf.nest.map_structure(one, spec)


def build_model(model: Any, x_spec: Any) -> Any:
    """Build ``model`` for ``x_spec`` if it is not built yet; the spec of its prediction.

    A symbolic call builds any model for any structure: ``Model.build(shape)`` builds no
    weights of a subclassed model, and takes no structure of shapes."""
    inputs = symbolic(x_spec)
    if not model.built:
        return model(inputs)
    return model.compute_output_spec(inputs)


def model_inputs(model: Any) -> Any:
    """The model's symbolic inputs in the structure its author gave them (a KerasTensor, a
    list, a dict), or None where the model has none: a subclassed model declares none, and
    the inputs Keras records when it is first called on symbolic tensors are its own
    (named "keras_tensor_N"), not the features' names."""
    if isinstance(model, keras.Model) and not isinstance(model, Functional | keras.Sequential):
        return None
    try:
        inputs = model.input
    except (AttributeError, ValueError):  # a Sequential has its Input's only in .inputs
        try:
            listed = model.inputs
        except (AttributeError, ValueError):
            return None
        if not isinstance(listed, list) or len(listed) != 1:
            return None
        inputs = listed[0]
    leaves = tf.nest.flatten(inputs)
    return inputs if leaves and all(isinstance(t, keras.KerasTensor) for t in leaves) else None


def leaf_shape(spec: Any) -> tuple[int | None, ...]:
    """The shape of a spec that is one tensor, or of its only leaf; () for a structure of
    several (no one shape fits the metrics that pick by shape)."""
    leaves = tf.nest.flatten(spec)
    return tuple(leaves[0].shape) if len(leaves) == 1 else ()


def _kind(dtype: Any) -> str:
    dtype = tf.as_dtype(dtype)
    if dtype == tf.string:
        return "string"
    if dtype.is_bool:
        return "bool"
    if dtype.is_integer:
        return "int"
    if dtype.is_floating:
        return "float"
    return str(dtype.name)


# What a model input of each kind can be fed (Keras casts between numeric dtypes): never a
# string for a number or the reverse, never a float for an int (it would truncate).
_FEEDS = {"string": {"string"}, "int": {"int", "bool"}, "float": {"float", "int", "bool"}}


def _what(tensor: Any) -> str:
    shape = tuple(None if d is None else int(d) for d in tensor.shape)
    return f"{tf.as_dtype(tensor.dtype).name} of shape {shape}"


def _names(expected: Mapping[str, Any]) -> str:
    return ", ".join(sorted(str(k) for k in expected))


def _path(prefix: str, key: object) -> str:
    return f"{prefix}/{key}" if prefix else str(key)


def _fail(job: str, source: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"--job {job}", f"{source}'s features {problem}", fix)


def _pairs(expected: Any, given: Any, *, job: str, source: str, at: str = "") -> list[Any]:
    """(name, model input, feature spec) for every model input, by key, Keras input name or
    position as Keras matches them; a structure that does not match raises ConfigError."""
    if isinstance(expected, keras.KerasTensor):
        leaves = tf.nest.flatten(given)
        if len(leaves) != 1:
            where = f"input {at!r}" if at else "one input"
            raise _fail(
                job,
                source,
                f"are {len(leaves)} tensors where the model takes {where} ({_what(expected)})",
                "yield the features as the model's inputs are declared",
            )
        return [(at or expected.name, expected, leaves[0])]
    if isinstance(expected, Sequence) and isinstance(given, Mapping):
        # Keras matches a dict to a list of inputs by the inputs' names.
        names = [t.name if isinstance(t, keras.KerasTensor) else None for t in expected]
        if None not in names:
            expected = dict(zip(names, expected, strict=True))
    if isinstance(expected, Mapping):
        if not isinstance(given, Mapping):
            raise _fail(
                job,
                source,
                f"are {structure_of(given)} where the model takes named inputs "
                f"({_names(expected)})",
                "yield (features, label) with features a dict of {input name: tensor}",
            )
        missing = [k for k in expected if k not in given]
        unknown = [k for k in given if k not in expected]
        if missing or unknown:
            raise _fail(job, source, _key_problem(expected, given, missing, unknown, at), _KEY_FIX)
        pairs = []
        for key in sorted(expected, key=str):
            pairs += _pairs(expected[key], given[key], job=job, source=source, at=_path(at, key))
        return pairs
    if isinstance(expected, Sequence):
        if not isinstance(given, Sequence) or isinstance(given, Mapping):
            raise _fail(
                job,
                source,
                f"are {structure_of(given)} where the model takes {len(expected)} inputs in order",
                "yield a tuple of features in the order of the model's inputs",
            )
        if len(given) != len(expected):
            raise _fail(
                job,
                source,
                f"are {len(given)} tensors where the model takes {len(expected)} inputs",
                "yield one feature per model input",
            )
        pairs = []
        for i, (e, g) in enumerate(zip(expected, given, strict=True)):
            name = e.name if isinstance(e, keras.KerasTensor) else f"[{i}]"
            pairs += _pairs(e, g, job=job, source=source, at=_path(at, name))
        return pairs
    return []  # a structure Keras does not declare: nothing to check


_KEY_FIX = "name dataset_fn's keys as the model's keras.Input names (or the inputs as the keys)"


def _key_problem(
    expected: Mapping[str, Any], given: Mapping[str, Any], missing: list[Any], unknown: list[Any],
    at: str,
) -> str:  # fmt: skip
    where = f" under {at!r}" if at else ""
    parts = []
    if missing:
        wanted = ", ".join(_declared(k, expected[k]) for k in missing)
        parts.append(f"lack {wanted}, an input of the model{where}")
    if unknown:
        keys = ", ".join(repr(k) for k in unknown)
        parts.append(f"have {keys}, which the model has no input for{where}")
    inputs, features = _names(expected), _names(given)
    return ", and ".join(parts) + f" (the model's inputs: {inputs}; the features: {features})"


def _declared(key: object, expected: Any) -> str:
    if isinstance(expected, keras.KerasTensor):
        return f"{key!r} ({_what(expected)})"
    return repr(key)


def structure_of(given: Any) -> str:
    """How a nest reads in an error line: a dict (its keys), a sequence of N, one tensor."""
    if isinstance(given, Mapping):
        return f"a dict ({_names(given)})"
    if isinstance(given, Sequence):
        return f"a sequence of {len(given)}"
    return "one tensor"


def _check_leaf(name: str, expected: Any, given: Any, *, job: str, source: str) -> None:
    dtype = getattr(given, "dtype", None)
    if dtype is None:
        return
    # An unnamed keras.Input is "keras_tensor_N": a name the user never wrote.
    unnamed = re.fullmatch(r"keras_tensor(_\d+)?", name) is not None
    have_it = "are" if unnamed else f"have {name!r}"  # "dataset_fn's features are ..."
    have_as = "are" if unnamed else f"have {name!r} as"
    feature = "them" if unnamed else repr(name)
    model_input = "the model's input" if unnamed else f"the model's input {name!r}"
    want, have = _kind(expected.dtype), _kind(dtype)
    if want in _FEEDS and have not in _FEEDS[want]:
        raise _fail(
            job,
            source,
            f"{have_as} {tf.as_dtype(dtype).name}, where {model_input} is {_what(expected)}",
            f"yield {feature} as {tf.as_dtype(expected.dtype).name} (or declare the keras.Input "
            f"with dtype={tf.as_dtype(dtype).name!r})",
        )
    shape = getattr(given, "shape", None)
    if shape is None or shape.rank is None:
        return
    want_dims, have_dims = tuple(expected.shape)[1:], tuple(shape.as_list())[1:]
    # Keras adds or drops a last axis of size 1 by itself.
    if len(have_dims) == len(want_dims) + 1 and have_dims[-1] == 1:
        have_dims = have_dims[:-1]
    elif len(want_dims) == len(have_dims) + 1 and want_dims[-1] == 1:
        want_dims = want_dims[:-1]
    fits = len(want_dims) == len(have_dims) and all(
        w is None or h is None or w == h for w, h in zip(want_dims, have_dims, strict=True)
    )
    if not fits:
        raise _fail(
            job,
            source,
            f"{have_it} of shape {tuple(shape.as_list())}, where {model_input} "
            f"is {_what(expected)}",
            "yield batches of the model's input shape (the first axis is the batch)",
        )


def check_features(model: Any, x_spec: Any, *, job: str, source: str) -> None:
    """Raise ConfigError (one line naming the key) where ``x_spec`` (what ``source``, a
    dataset function, yields as features) does not fit the model's declared inputs.
    ``model``: a Keras model, or the inputs to match (``symbolic(spec)`` of features)."""
    expected = model if _is_inputs(model) else model_inputs(model)
    if expected is None:
        return
    for name, want, have in _pairs(expected, x_spec, job=job, source=source):
        _check_leaf(name, want, have, job=job, source=source)


def _is_inputs(given: Any) -> bool:
    leaves = tf.nest.flatten(given) if given is not None else []
    return bool(leaves) and all(isinstance(t, keras.KerasTensor) for t in leaves)


def feature_names(model: Any, x_spec: Any, *, job: str) -> list[str]:
    """The exported signature's input names, one per leaf of ``x_spec`` in ``tf.nest``'s
    order: ``features`` for one tensor, else the name of the model input each feeds (its
    ``keras.Input`` name, which is the dict key), a nested one's path joined by "_"; for a
    model without declared inputs, the features' keys (``features_<i>`` for positions)."""
    if not tf.nest.is_nested(x_spec):
        return [SINGLE_INPUT]
    expected = model_inputs(model)
    if expected is not None:
        names = [name for name, _, _ in _pairs(expected, x_spec, job=job, source="the export")]
    else:
        names = [
            path if not path.split("/")[-1].isdigit() else f"{SINGLE_INPUT}/{path}"
            for path in _leaf_paths(x_spec)
        ]
    names = [name.replace("/", "_") for name in names]
    if len(names) != len(tf.nest.flatten(x_spec)) or len(set(names)) != len(names):
        names = [f"{SINGLE_INPUT}_{i}" for i in range(len(tf.nest.flatten(x_spec)))]
    return names


def _leaf_paths(spec: Any, prefix: str = "") -> list[str]:
    """Every leaf's path ("user/id", "0"), in ``tf.nest``'s order (dict keys sorted)."""
    if isinstance(spec, Mapping):
        items = [(str(k), spec[k]) for k in sorted(spec, key=str)]
    elif isinstance(spec, Sequence) and not isinstance(spec, str):
        items = [(str(i), v) for i, v in enumerate(spec)]
    else:
        return [prefix]
    return [path for key, value in items for path in _leaf_paths(value, _path(prefix, key))]
