"""Dynamic embedding tables (``from psctl.job import DynamicEmbedding``): rows keyed by raw
ids, with no vocabulary size, that grow as ids are admitted and shrink as they are evicted.

A table is one ``tf.lookup.experimental.MutableHashTable`` per shard, keyed by int64:

- ``embeddings``: key -> its vector (``output_dim`` floats), admitted keys only;
- ``meta``: key -> ``[count, last_seen, admitted]`` (int64): how often the id was seen, the
  global step it was last seen at, and whether it has its own vector yet;
- ``slots``: key -> the optimizer's slots for the key's vector, side by side (Adam's
  momentum and velocity, Adagrad's accumulator, ...), admitted keys only.

On a cluster there is one shard per ps task, and a key lives on shard ``shard_of(key)``
(a multiplicative hash of the key, so that ids in sequence or of one stride spread evenly).
Anywhere else (the checkpoint's skeleton, ``psctl evaluate``, ``psctl export``) a table is
one local shard; checkpoints hold each table as the one-shard table's (keys, values), saved
in slices by the ps tasks and re-split over however many there are when they are restored
(training/sharded_save.py).

Strings are keyed by their 63-bit fingerprint (``tf.strings.to_hash_bucket_fast`` over
2**63 - 1 buckets: stable across processes, and with 10^9 distinct strings two of them
share a key with probability about 5e-2 in all, not a collision per row as hashing into a
fixed table gives).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import keras
import tensorflow as tf

from psctl.coordinator.layers import (
    LayerSettingError,
    combiner_setting,
    count_setting,
    pool,
    pooled_shape,
)

KEY_SPACE = 2**63 - 1  # string fingerprints: [0, 2**63 - 1)
_MIX = 0x9E3779B97F4A7C15  # 2**64 / golden ratio (Fibonacci hashing)


def shard_of(keys: Any, num_shards: int) -> Any:
    """The shard (int32, in ``[0, num_shards)``) of every int64 key: stable across
    processes, spread evenly whatever the ids' pattern."""
    if num_shards == 1:
        return tf.zeros_like(keys, tf.int32)
    u = tf.bitcast(tf.cast(keys, tf.int64), tf.uint64)
    u = tf.bitwise.bitwise_xor(u, tf.bitwise.right_shift(u, tf.constant(31, tf.uint64)))
    u = tf.bitwise.right_shift(u * tf.constant(_MIX, tf.uint64), tf.constant(32, tf.uint64))
    return tf.cast(tf.math.floormod(u, tf.constant(num_shards, tf.uint64)), tf.int32)


def split_by_shard(keys: Any, num_shards: int) -> tuple[list[Any], list[Any]]:
    """(positions, keys) of every shard, in shard order (``tf.dynamic_partition``)."""
    part = shard_of(keys, num_shards)
    positions = tf.dynamic_partition(tf.range(tf.size(keys)), part, num_shards)
    return positions, tf.dynamic_partition(keys, part, num_shards)


META_WIDTH = 3  # count, last_seen, admitted
COUNT, LAST_SEEN, ADMITTED = 0, 1, 2


@dataclass
class Shard:
    """One shard of a dynamic table, on ``device`` (a ps task; None: this process)."""

    device: str | None
    embeddings: Any
    meta: Any
    counters: Any  # int64 [admitted, evicted]: this shard's totals
    slots: Any = None  # a table once the optimizer's slots are known (``ensure_slots``)
    slot_kinds: tuple[str, ...] = field(default_factory=tuple)

    def tables(self) -> dict[str, Any]:
        found = {"embeddings": self.embeddings, "meta": self.meta}
        if self.slots is not None:
            found["slots"] = self.slots
        return found


class _Context(threading.local):
    devices: list[str] | None = None  # where shards go while psctl builds on a cluster
    records: Records | None = None  # lookups a training step records


_CONTEXT = _Context()


@contextlib.contextmanager
def placed(devices: list[str] | None) -> Iterator[None]:
    """DynamicEmbedding layers built in this block put one shard on each of ``devices``."""
    previous, _CONTEXT.devices = _CONTEXT.devices, devices
    try:
        yield
    finally:
        _CONTEXT.devices = previous


@dataclass
class Lookup:
    """One call's lookup in a training step: its distinct keys, how often each occurred,
    the vectors read (watched by the step's tape), and the keys' ``meta`` rows and slots
    (None without slots) read with them."""

    layer: DynamicEmbedding
    keys: Any
    counts: Any
    vectors: Any
    meta: Any
    slots: Any = None


@dataclass
class Records:
    """What a training step's forward pass looked up in dynamic tables."""

    tape: Any
    lookups: list[Lookup] = field(default_factory=list)

    def vectors(self) -> list[Any]:
        return [lookup.vectors for lookup in self.lookups]


@contextlib.contextmanager
def recording(tape: Any) -> Iterator[Records]:
    """The training step's forward pass: calls of DynamicEmbedding layers record their
    lookups (to be updated after the gradient) and have ``tape`` watch the vectors."""
    previous, _CONTEXT.records = _CONTEXT.records, Records(tape)
    try:
        yield _CONTEXT.records
    finally:
        _CONTEXT.records = previous


def _initializer(spec: Any) -> Any:
    """A function (n, d, dtype) -> the initial vectors of ``n`` new rows, drawn on the
    worker that admits them. Keras's initializers keep their seed state in a variable;
    these are the same distributions from TensorFlow's stateful random ops."""
    init = keras.initializers.get(spec)
    config = init.get_config()
    name = type(init).__name__
    if name == "RandomUniform":
        low, high = float(config["minval"]), float(config["maxval"])
        return lambda n, d, dtype: tf.random.uniform([n, d], low, high, dtype)
    if name in ("RandomNormal", "TruncatedNormal"):
        mean, stddev = float(config["mean"]), float(config["stddev"])
        draw = tf.random.normal if name == "RandomNormal" else tf.random.truncated_normal
        return lambda n, d, dtype: draw([n, d], mean, stddev, dtype)
    if name == "Zeros":
        return lambda n, d, dtype: tf.zeros([n, d], dtype)
    if name == "Constant":
        value = float(config["value"])
        return lambda n, d, dtype: tf.fill([n, d], tf.constant(value, dtype))
    raise LayerSettingError(
        "DynamicEmbedding embeddings_initializer",
        f"{name} is not supported for rows that appear while training",
        "use uniform, normal, truncated_normal, zeros or a constant",
    )


@keras.saving.register_keras_serializable(package="psctl")
class DynamicEmbedding(keras.layers.Layer):
    """An embedding table keyed by raw ids, with no vocabulary size.

    Inputs: int ids of any size (negative ids are padding) or strings (``""`` is padding),
    of any shape ``[batch, ...]``. ``combiner`` (``"sum"``, ``"mean"``, ``"sqrtn"``) pools
    the last axis, leaving padding out; without one every id gets its vector
    (``[batch, ..., output_dim]``, padding as zeros). One layer called on several features
    shares its table.

    - Admission: an id gets its own vector (drawn from ``embeddings_initializer``) once it
      has been seen ``admit_after`` times; until then it reads zeros and is not updated,
      and its count is kept. The step that admits an id still reads zeros.
    - Eviction: an id not seen for ``ttl_steps`` global steps is removed (its vector, its
      slots and its count), and each shard keeps at most ``max_rows_per_shard`` rows, the
      least recently seen removed first. psctl evicts every few seconds while training.
    """

    def __init__(
        self,
        output_dim: int,
        *,
        combiner: str | None = None,
        admit_after: int = 1,
        ttl_steps: int | None = None,
        max_rows_per_shard: int | None = None,
        embeddings_initializer: Any = "uniform",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        kind = "DynamicEmbedding"
        self.output_dim = count_setting(kind, self.name, "output_dim", output_dim)
        self.combiner = combiner_setting(kind, self.name, combiner)
        self.admit_after = count_setting(kind, self.name, "admit_after", admit_after)
        self.ttl_steps = count_setting(kind, self.name, "ttl_steps", ttl_steps, optional=True)
        self.max_rows_per_shard = count_setting(
            kind, self.name, "max_rows_per_shard", max_rows_per_shard, optional=True
        )
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.initial_rows = _initializer(self.embeddings_initializer)

    # -- the tables ----------------------------------------------------------------------

    def build(self, input_shape: Any = None) -> None:
        if self.shards:
            return
        devices = _CONTEXT.devices
        if devices:
            # Not tracked by the layer: checkpoints save the shards in the one-shard
            # layout below (training/sharded_save.py).
            shards = [self._make_shard(device) for device in devices]
            object.__setattr__(self, "_psctl_shards", shards)
        else:
            shard = self._make_shard(None)
            # Tracked, under these names: what checkpoints and SavedModels hold.
            self.embeddings_table = shard.embeddings
            self.meta_table = shard.meta
            self.counters = shard.counters
            object.__setattr__(self, "_psctl_shards", [shard])
        self.built = True

    def _make_shard(self, device: str | None) -> Shard:
        dtype = tf.as_dtype(keras.backend.standardize_dtype(self.variable_dtype))
        # Out of any graph being traced: a subclassed model is first built by a symbolic
        # call, which Keras traces in a scratch graph.
        with tf.init_scope(), tf.device(device) if device else contextlib.nullcontext():
            return Shard(
                device=device,
                embeddings=tf.lookup.experimental.MutableHashTable(
                    tf.int64, dtype, default_value=tf.zeros([self.output_dim], dtype)
                ),
                meta=tf.lookup.experimental.MutableHashTable(
                    tf.int64, tf.int64, default_value=tf.zeros([META_WIDTH], tf.int64)
                ),
                counters=tf.Variable(tf.zeros([2], tf.int64), trainable=False),
            )

    @property
    def shards(self) -> list[Shard]:
        shards: list[Shard] = self.__dict__.get("_psctl_shards", [])
        return shards

    def ensure_slots(self, kinds: tuple[str, ...], initial: dict[str, float]) -> None:
        """Create every shard's slot table for an optimizer keeping ``kinds`` per row
        (``initial``: each kind's value for a new row)."""
        if not kinds or not self.shards or self.shards[0].slots is not None:
            return
        dtype = self.shards[0].embeddings.value_dtype
        d = self.output_dim
        default = tf.concat([tf.fill([d], tf.constant(initial[k], dtype)) for k in kinds], 0)
        for shard in self.shards:
            place = tf.device(shard.device) if shard.device else contextlib.nullcontext()
            with tf.init_scope(), place:
                shard.slots = tf.lookup.experimental.MutableHashTable(
                    tf.int64, dtype, default_value=default
                )
            shard.slot_kinds = tuple(kinds)
        if self.shards[0].device is None:
            self.slot_table = self.shards[0].slots

    # -- the lookup ----------------------------------------------------------------------

    def keys(self, inputs: Any) -> tuple[Any, Any]:
        """(int64 keys, where an input is not padding) of ``inputs``."""
        inputs = tf.convert_to_tensor(inputs)
        if inputs.dtype == tf.string:
            return (
                tf.strings.to_hash_bucket_fast(inputs, KEY_SPACE),
                tf.not_equal(inputs, ""),
            )
        if not inputs.dtype.is_integer:
            raise TypeError(
                f"{self.name}: DynamicEmbedding takes integer ids or strings, got {inputs.dtype}"
            )
        keys = tf.cast(inputs, tf.int64)
        return keys, tf.greater_equal(keys, 0)

    def lookup(self, keys: Any) -> Any:
        """The vectors of distinct int64 ``keys`` (zeros for ids without a row), each from
        the shard that holds it."""
        return self._lookup(keys, with_state=False)[0]

    def _lookup(self, keys: Any, *, with_state: bool) -> tuple[Any, Any, Any]:
        """(vectors, meta, slots) of distinct ``keys``; ``with_state``: also their counts
        and slots (else None), read in the same round trip to each ps as the vectors, so
        that the update after the step needs none of its own before it writes."""
        shards, d = self.shards, self.output_dim
        width = d * len(shards[0].slot_kinds)

        def read(shard: Shard, part: Any) -> list[Any]:
            found = [tf.reshape(shard.embeddings.lookup(part), [-1, d])]
            if with_state:
                found.append(tf.reshape(shard.meta.lookup(part), [-1, META_WIDTH]))
                if width:
                    found.append(tf.reshape(shard.slots.lookup(part), [-1, width]))
            return found

        if len(shards) == 1:
            found = read(shards[0], keys)
        else:
            positions, parts = split_by_shard(keys, len(shards))
            per_shard = [read(shard, part) for shard, part in zip(shards, parts, strict=True)]
            found = [
                tf.dynamic_stitch(positions, [reads[i] for reads in per_shard])
                for i in range(len(per_shard[0]))
            ]
        found += [None] * (3 - len(found))
        return found[0], found[1], found[2]

    def call(self, inputs: Any) -> Any:
        keys, valid = self.keys(inputs)
        shape = tf.shape(keys)
        flat_keys = tf.reshape(keys, [-1])
        flat_valid = tf.reshape(valid, [-1])
        where = tf.where(flat_valid)
        distinct, index, counts = tf.unique_with_counts(tf.gather_nd(flat_keys, where))
        records = _CONTEXT.records
        vectors, meta, slots = self._lookup(distinct, with_state=records is not None)
        if records is not None:
            records.tape.watch(vectors)
            counts = tf.cast(counts, tf.int64)
            records.lookups.append(Lookup(self, distinct, counts, vectors, meta, slots))
        found = tf.gather(vectors, index)
        size = tf.size(flat_keys, out_type=tf.int64)
        flat = tf.scatter_nd(where, found, tf.stack([size, tf.constant(self.output_dim, tf.int64)]))
        outputs = tf.reshape(flat, tf.concat([shape, [self.output_dim]], 0))
        outputs = tf.cast(outputs, self.compute_dtype)
        return pool(outputs, valid, self.combiner)

    def compute_output_shape(self, input_shape: Any) -> tuple[Any, ...]:
        return pooled_shape(input_shape, self.output_dim, self.combiner)

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config.update(
            output_dim=self.output_dim,
            combiner=self.combiner,
            admit_after=self.admit_after,
            ttl_steps=self.ttl_steps,
            max_rows_per_shard=self.max_rows_per_shard,
            embeddings_initializer=keras.initializers.serialize(self.embeddings_initializer),
        )
        return config


def dynamic_layers(model: Any) -> list[DynamicEmbedding]:
    """The model's DynamicEmbedding layers, in build order."""
    return [layer for layer in model._flatten_layers() if isinstance(layer, DynamicEmbedding)]
