"""Keras layers for jobs with categorical features (``from psctl.job import FeatureEmbedding``).

``FeatureEmbedding`` is a ``keras.layers.Embedding`` table with what recommendation and ads
models put around it: raw ids or strings hashed into the table's rows, several values per
feature pooled into one vector (a combiner), and one table shared by several features (call
the same layer on each). Its table is a plain ``keras.layers.Embedding``: with
``--max-shards`` above 1 psctl shards it over the ps tasks and updates it sparsely like any
other (embeddings/sharded.py), checkpoints hold it in the plain layout, and ``psctl export``
writes the hashing and pooling into the SavedModel with it.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from psctl.cluster.errors import ConfigError, echo

COMBINERS = ("sum", "mean", "sqrtn")
# Where counts meet int64 tensors (global steps, row counts): larger would overflow them.
MAX_SETTING = 2**62


class LayerSettingError(ConfigError, ValueError):
    """A table layer's argument out of range: one line and exit 78 under psctl (a
    ValueError, as Keras layers raise, to code that catches those)."""


def count_setting(layer: str, name: str, what: str, value: Any, *, optional: bool = False) -> Any:
    """``value`` as an int in 1..MAX_SETTING (None too where ``optional``), or a
    LayerSettingError naming the layer and the argument."""
    if value is None and optional:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or not (1 <= int(value) <= MAX_SETTING)
    ):
        none = " or None" if optional else ""
        raise LayerSettingError(
            f"{layer}(name={name!r}) {what}",
            f"{echo(value)} is not a whole number from 1 to {MAX_SETTING:,}{none}",
            f"give {what} as such a number (see docs/embeddings.md)",
        )
    return int(value)


def seconds_setting(layer: str, name: str, what: str, value: Any) -> float | None:
    """``value`` as a number of seconds above 0 and at most a year, or None; else a
    LayerSettingError naming the layer and the argument."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, np.integer, np.floating))
        or not (0 < float(value) <= 366 * 86400)
    ):
        raise LayerSettingError(
            f"{layer}(name={name!r}) {what}",
            f"{echo(value)} is not a number of seconds above 0 and at most a year, or None",
            f"give {what} in seconds, e.g. 3600.0 (see docs/embeddings.md)",
        )
    return float(value)


def combiner_setting(layer: str, name: str, combiner: Any) -> str | None:
    if combiner is not None and combiner not in COMBINERS:
        raise LayerSettingError(
            f"{layer}(name={name!r}) combiner",
            f"{echo(combiner)} is not a combiner",
            f"give one of {', '.join(map(repr, COMBINERS))} or None",
        )
    return combiner  # type: ignore[no-any-return]


def pooled_shape(input_shape: Any, output_dim: int, combiner: str | None) -> tuple[Any, ...]:
    """The output shape of ids of ``input_shape`` looked up (and pooled by ``combiner``)."""
    shape = tuple(input_shape)
    if combiner is not None:
        shape = shape[:-1]
    return (*shape, output_dim)


def pool(vectors: Any, valid: Any, combiner: str | None) -> Any:
    """``vectors`` ``[..., n, d]`` (zeros where ``valid`` is False) pooled over ``n`` by
    ``combiner``, padding left out of the mean; as they are without a combiner. ``valid``
    None: no padding."""
    if combiner is None:
        return vectors
    pooled = tf.reduce_sum(vectors, axis=-2)
    if combiner == "sum":
        return pooled
    if valid is None:
        count = tf.cast(tf.shape(vectors)[-2], vectors.dtype) * tf.ones_like(pooled[..., :1])
    else:
        count = tf.reduce_sum(tf.cast(valid, vectors.dtype), axis=-1, keepdims=True)
    count = tf.maximum(count, 1.0)
    return pooled / (count if combiner == "mean" else tf.sqrt(count))


@keras.saving.register_keras_serializable(package="psctl")
class FeatureEmbedding(keras.layers.Layer):
    """One embedding table of ``num_buckets`` rows x ``output_dim``.

    Inputs: int or string ids of any shape ``[batch, ...]``.

    - Strings are always hashed into the rows (``tf.strings.to_hash_bucket_fast``: stable
      across processes and hosts; the empty string is padding). Integers are rows as they
      are (each in ``[0, num_buckets)``), or, with ``hash_ids=True``, raw ids of any size
      hashed the same way as their decimal strings (negative ids are padding).
    - ``combiner`` (``"sum"``, ``"mean"`` or ``"sqrtn"``) pools the last axis, the values of
      a multi-valued feature, into one vector, leaving padding out: ``[batch, n]`` ids give
      ``[batch, output_dim]``. Without a combiner every id gets its vector:
      ``[batch, ..., output_dim]``, padding as zeros (only where padding is defined: strings,
      or ``hash_ids=True``).
    """

    def __init__(
        self,
        num_buckets: int,
        output_dim: int,
        *,
        combiner: str | None = None,
        hash_ids: bool = False,
        embeddings_initializer: Any = "uniform",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        kind = "FeatureEmbedding"
        self.num_buckets = count_setting(kind, self.name, "num_buckets", num_buckets)
        self.output_dim = count_setting(kind, self.name, "output_dim", output_dim)
        self.combiner = combiner_setting(kind, self.name, combiner)
        self.hash_ids = bool(hash_ids)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.table = keras.layers.Embedding(
            self.num_buckets,
            self.output_dim,
            embeddings_initializer=self.embeddings_initializer,
            name=f"{self.name}_table",
        )

    def build(self, input_shape: Any = None) -> None:
        if not self.table.built:
            self.table.build(input_shape)
        self.built = True

    def rows(self, inputs: Any) -> tuple[tf.Tensor, tf.Tensor | None]:
        """The table rows of ``inputs`` (padding -> row 0) and where padding is (or None)."""
        inputs = tf.convert_to_tensor(inputs)
        if inputs.dtype == tf.string:
            valid = tf.not_equal(inputs, "")
            ids = tf.strings.to_hash_bucket_fast(inputs, self.num_buckets)
        elif self.hash_ids:
            ids64 = tf.cast(inputs, tf.int64)
            valid = tf.greater_equal(ids64, 0)
            ids = tf.strings.to_hash_bucket_fast(tf.strings.as_string(ids64), self.num_buckets)
        else:
            return tf.cast(inputs, tf.int64), None
        return tf.where(valid, ids, tf.zeros_like(ids)), valid

    def call(self, inputs: Any) -> Any:
        ids, valid = self.rows(inputs)
        vectors = self.table(ids)
        if valid is not None:
            vectors = vectors * tf.cast(valid, vectors.dtype)[..., None]
        return pool(vectors, valid, self.combiner)

    def compute_output_shape(self, input_shape: Any) -> tuple[Any, ...]:
        return pooled_shape(input_shape, self.output_dim, self.combiner)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config.update(
            num_buckets=self.num_buckets,
            output_dim=self.output_dim,
            combiner=self.combiner,
            hash_ids=self.hash_ids,
            embeddings_initializer=keras.initializers.serialize(self.embeddings_initializer),
        )
        return config
