"""Dynamic embedding tables (``from psctl.job import DynamicEmbedding``): rows keyed by raw
ids, with no vocabulary size, that grow as ids are admitted and shrink as they are evicted.

On a cluster a table has one shard per ps task (``PackedShard``), and a key lives on shard
``shard_of(key)`` (a multiplicative hash of the key, so that ids in sequence or of one stride
spread evenly). A shard is one ``tf.lookup.experimental.MutableHashTable``, int64 key -> the
key's whole row ``[vector | optimizer slots | count, last_seen]``: one allocation per key,
about 1.35x the payload (measured: docs/embeddings.md); the three tables per shard before
it (vectors, counts, slots, each an allocation per key) took 2.9x. Ids not yet admitted are
counted in a count-min sketch of fixed size (``Sketch``), not in the table.

Anywhere else (the checkpoint's skeleton, ``psctl evaluate``, ``psctl export``) a table is
``ServingTables``: the layout checkpoints and SavedModels hold, three tables keyed by the
ids (``embeddings``: the vectors; ``meta``: ``[count, last_seen, admitted]``; ``slots``: the
optimizer's, side by side). Checkpoints hold each as the one-shard table's (keys, values),
saved in slices by the ps tasks and re-split over however many there are when they are
restored (training/sharded_save.py).

Strings are keyed by their 63-bit fingerprint (``tf.strings.to_hash_bucket_fast`` over
2**63 - 1 buckets: stable across processes, and with 10^9 distinct strings two of them
share a key with probability about 5e-2 in all, not a collision per row as hashing into a
fixed table gives).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import keras
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from psctl.coordinator.layers import (
    LayerSettingError,
    combiner_setting,
    count_setting,
    pool,
    pooled_shape,
)

log = logging.getLogger(__name__)
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


META_WIDTH = 3  # a checkpoint's meta rows: count, last_seen, admitted
COUNT, LAST_SEEN, ADMITTED = 0, 1, 2
ABSENT = -1  # the last_seen a key without a row reads on a ps
COUNTER_CAP = 2**30  # counts and steps stop here: as int32 bits, a finite float
SKETCH_DEPTH = 4
DEFAULT_SKETCH_WIDTH = 2**21  # counters per row: 32 MB per shard at depth 4
_SKETCH_MIX = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)


class Sketch:
    """How often each id not yet admitted was seen, in a fixed-size count-min sketch (one
    int32 variable on the shard's ps): ids that never reach ``admit_after`` cost no memory
    of their own. It never counts an id short; an id counts more than it was seen when each
    of its ``SKETCH_DEPTH`` counters is shared with others (the false admissions
    docs/embeddings.md measures)."""

    def __init__(self, width: int, device: str | None) -> None:
        self.bits = max(4, int(width - 1).bit_length())
        self.width = 1 << self.bits
        self.counts = variable_on(device, tf.zeros([SKETCH_DEPTH * self.width], tf.int32))

    @property
    def nbytes(self) -> int:
        return SKETCH_DEPTH * self.width * 4

    def _cells(self, keys: Any) -> Any:
        u = tf.bitcast(tf.cast(keys, tf.int64), tf.uint64)
        u = tf.bitwise.bitwise_xor(u, tf.bitwise.right_shift(u, tf.constant(29, tf.uint64)))
        shift = tf.constant(64 - self.bits, tf.uint64)
        rows = [
            tf.cast(tf.bitwise.right_shift(u * tf.constant(mix, tf.uint64), shift), tf.int64)
            + row * self.width
            for row, mix in enumerate(_SKETCH_MIX[:SKETCH_DEPTH])
        ]
        return tf.stack(rows, axis=1)  # [n, depth]

    def add(self, keys: Any, counts: Any) -> Any:
        """Count ``keys`` (distinct) ``counts`` times more; each key's estimate after."""
        cells = self._cells(keys)
        adds = tf.tile(tf.cast(counts, tf.int32)[:, None], [1, SKETCH_DEPTH])
        self.counts.scatter_add(tf.IndexedSlices(tf.reshape(adds, [-1]), tf.reshape(cells, [-1])))
        return tf.cast(tf.reduce_min(tf.gather(self.counts, cells), axis=1), tf.int64)

    def halve(self) -> None:
        """Age every count (ids seen long ago stop counting toward admission)."""
        with tf.device(self.counts.device):
            self.counts.assign(tf.bitwise.right_shift(self.counts, 1))


def variable_on(device: str | None, initial: Any) -> Any:
    """A variable on ``device`` itself. ``tf.Variable`` under the parameter-server strategy
    goes where the strategy's round robin says, whatever the device scope, and one ps cannot
    reach another: a shard's eviction function on its ps failed on a counter placed on the
    other one ("unknown device"). A ``ResourceVariable`` made directly skips the strategy's
    creator, as the hash tables do."""
    with tf.init_scope(), tf.device(device) if device else contextlib.nullcontext():
        return resource_variable_ops.ResourceVariable(initial, trainable=False)


def _meta_columns(dtype: Any) -> int:
    return 2 * 4 // dtype.size  # count and last_seen, int32 each, as ``dtype`` bits


class PackedShard:
    """A dynamic table's shard on a ps: one ``MutableHashTable`` whose value is the key's
    whole row, ``[vector | optimizer slots | count, last_seen]`` (the two counters as int32
    bits), one allocation per key; ids not yet admitted only counted in ``sketch``."""

    def __init__(
        self,
        device: str | None,
        dim: int,
        dtype: Any,
        *,
        sketch_width: int | None,
    ) -> None:
        self.device = device
        self.dim = dim
        self.dtype = dtype
        self.meta_width = _meta_columns(dtype)
        self.counters = variable_on(device, tf.zeros([2], tf.int64))
        self.sketch = Sketch(sketch_width, device) if sketch_width else None
        self.set_slots((), {})

    def set_slots(self, kinds: tuple[str, ...], initial: dict[str, float]) -> None:
        """Rows with room for an optimizer keeping ``kinds`` (``initial``: each kind's value
        in a new row): a new, empty table (this runs before training)."""
        self.slot_kinds = tuple(kinds)
        self.slot_width = self.dim * len(kinds)
        self.width = self.dim + self.slot_width + self.meta_width
        dim, dtype = self.dim, self.dtype
        # Out of any graph being traced: a subclassed model is first built by a symbolic
        # call, which Keras traces in a scratch graph.
        with tf.init_scope(), self.placed():
            default = [tf.zeros([dim], dtype)]
            default += [tf.fill([dim], tf.constant(initial[k], dtype)) for k in kinds]
            default.append(self._meta_bits(tf.constant([[0, ABSENT]], tf.int32))[0])
            self.table = tf.lookup.experimental.MutableHashTable(
                tf.int64, dtype, default_value=tf.concat(default, 0)
            )

    def placed(self) -> Any:
        return tf.device(self.device) if self.device else contextlib.nullcontext()

    def _meta_bits(self, meta: Any) -> Any:
        """int32 ``[n, 2]`` -> ``[n, meta_width]`` of the table's dtype, the same bits."""
        size = self.dtype.size
        if size == 8:
            meta = tf.reshape(meta, [-1, 1, 2])
        return tf.reshape(tf.bitcast(meta, self.dtype), [-1, self.meta_width])

    def _meta_of(self, columns: Any) -> Any:
        size = self.dtype.size
        if size == 2:
            columns = tf.reshape(columns, [-1, 2, 2])
        return tf.reshape(tf.bitcast(columns, tf.int32), [-1, 2])

    def unpack(self, values: Any) -> tuple[Any, Any, Any]:
        """(vectors, meta int64 ``[n, META_WIDTH]``, slots or None) of packed rows."""
        d, s = self.dim, self.slot_width
        values = tf.reshape(values, [-1, self.width])
        bits = tf.cast(self._meta_of(values[:, d + s :]), tf.int64)
        admitted = tf.cast(bits[:, 1] != ABSENT, tf.int64)
        meta = tf.stack([bits[:, 0], bits[:, 1], admitted], axis=1)
        return values[:, :d], meta, (values[:, d : d + s] if s else None)

    def pack(self, vectors: Any, slots: Any, count: Any, last_seen: Any) -> Any:
        cap = tf.constant(COUNTER_CAP, tf.int64)
        meta = tf.stack([tf.minimum(count, cap), tf.minimum(last_seen, cap)], axis=1)
        parts = [tf.cast(vectors, self.dtype)]
        if self.slot_width:
            parts.append(tf.cast(slots, self.dtype))
        parts.append(self._meta_bits(tf.cast(meta, tf.int32)))
        return tf.concat(parts, axis=1)

    def read(self, keys: Any) -> tuple[Any, Any, Any]:
        return self.unpack(self.table.lookup(keys))

    def write(self, keys: Any, vectors: Any, slots: Any, count: Any, last_seen: Any) -> None:
        self.table.insert(keys, self.pack(vectors, slots, count, last_seen))

    def size(self) -> Any:
        return self.table.size()

    def nbytes(self, rows: int) -> int:
        """This shard's memory with ``rows`` rows: each key's row and map node as glibc
        allocates them, the map's buckets (16 bytes a key on average), and the sketch
        (docs/embeddings.md compares it with the capacity bench's measured bytes)."""
        row = self.width * self.dtype.size
        per_key = _malloc_chunk(row) + _malloc_chunk(8 + 8 + 24) + 16
        return rows * per_key + (self.sketch.nbytes if self.sketch else 0)


def _malloc_chunk(request: int) -> int:
    """glibc's chunk for a request of ``request`` bytes (8 of header, 16-byte steps)."""
    return max(32, (request + 8 + 15) // 16 * 16)


@dataclass
class ServingTables:
    """A dynamic table in one process (the checkpoint's skeleton, ``psctl evaluate``,
    ``psctl export``): the layout checkpoints and SavedModels hold, three tables keyed by
    the ids: ``embeddings`` (the vectors), ``meta`` (``[count, last_seen, admitted]``) and
    ``slots`` (the optimizer's, side by side; once ``ensure_slots`` knows them)."""

    embeddings: Any
    meta: Any
    counters: Any  # int64 [admitted, evicted]: the totals
    slots: Any = None

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
      and it is counted in a fixed-size sketch on its ps (``admission_sketch_width``
      counters in each of 4 rows, 16 bytes per column: ids that are never admitted cost
      no memory of their own; with ``ttl_steps`` the counts halve every ``ttl_steps``
      steps). The sketch may count an id more often than it was seen (a false
      admission, docs/embeddings.md), never less. The step that admits an id still reads
      zeros.
    - Eviction: an id not seen for ``ttl_steps`` global steps is removed (its row: vector,
      slots and counts), and each shard keeps at most ``max_rows_per_shard`` rows, the
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
        admission_sketch_width: int = DEFAULT_SKETCH_WIDTH,
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
        self.admission_sketch_width = count_setting(
            kind, self.name, "admission_sketch_width", admission_sketch_width
        )
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.initial_rows = _initializer(self.embeddings_initializer)
        # psctl's training step updates the tables (``ensure_slots`` says it will); Keras'
        # own fit or a GradientTape loop cannot: it sees no variable to train.
        self.updated_by_psctl = False
        self._warned_untrained = False

    # -- the tables ----------------------------------------------------------------------

    def build(self, input_shape: Any = None) -> None:
        if self.shards:
            return
        devices = _CONTEXT.devices
        if devices:
            # Not tracked by the layer: checkpoints save the shards in the serving layout
            # (training/sharded_save.py).
            shards: list[Any] = [self._packed(device) for device in devices]
        else:
            tables = self._serving_tables()
            # Tracked, under these names: what checkpoints and SavedModels hold.
            self.embeddings_table = tables.embeddings
            self.meta_table = tables.meta
            self.counters = tables.counters
            shards = [tables]
        object.__setattr__(self, "_psctl_shards", shards)
        self.built = True

    @property
    def dtype_of_rows(self) -> Any:
        return tf.as_dtype(keras.backend.standardize_dtype(self.variable_dtype))

    def _packed(self, device: str) -> PackedShard:
        return PackedShard(
            device,
            self.output_dim,
            self.dtype_of_rows,
            sketch_width=self.admission_sketch_width if self.admit_after > 1 else None,
        )

    def _serving_tables(self) -> ServingTables:
        dtype = self.dtype_of_rows
        with tf.init_scope():
            return ServingTables(
                embeddings=tf.lookup.experimental.MutableHashTable(
                    tf.int64, dtype, default_value=tf.zeros([self.output_dim], dtype)
                ),
                meta=tf.lookup.experimental.MutableHashTable(
                    tf.int64, tf.int64, default_value=tf.zeros([META_WIDTH], tf.int64)
                ),
                counters=tf.Variable(tf.zeros([2], tf.int64), trainable=False),
            )

    @property
    def shards(self) -> list[Any]:
        """The ps shards (``PackedShard``) on a cluster; else one ``ServingTables``."""
        shards: list[Any] = self.__dict__.get("_psctl_shards", [])
        return shards

    @property
    def packed(self) -> list[PackedShard]:
        """The shards that train; a layer built outside psctl's cluster has none."""
        return [s for s in self.shards if isinstance(s, PackedShard)]

    def ensure_slots(self, kinds: tuple[str, ...], initial: dict[str, float]) -> None:
        """Give every shard room for an optimizer keeping ``kinds`` per row (``initial``:
        each kind's value for a new row)."""
        self.updated_by_psctl = True
        shards = self.shards
        if not kinds or not shards or tuple(kinds) == getattr(shards[0], "slot_kinds", None):
            return
        if isinstance(shards[0], ServingTables):
            if shards[0].slots is not None:
                return
            dtype = self.dtype_of_rows
            d = self.output_dim
            default = tf.concat([tf.fill([d], tf.constant(initial[k], dtype)) for k in kinds], 0)
            with tf.init_scope():
                shards[0].slots = tf.lookup.experimental.MutableHashTable(
                    tf.int64, dtype, default_value=default
                )
            self.slot_table = shards[0].slots
            return
        for shard in shards:
            shard.set_slots(tuple(kinds), initial)

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
        and slots (else None), read in the same round trip to each ps as the vectors (one
        row each), so that the update after the step needs none of its own."""
        shards = self.shards

        def read(shard: Any, part: Any) -> list[Any]:
            if isinstance(shard, ServingTables):
                return [tf.reshape(shard.embeddings.lookup(part), [-1, self.output_dim])]
            vectors, meta, slots = shard.read(part)
            if not with_state:
                return [vectors]
            return [vectors, meta] + ([slots] if slots is not None else [])

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

    def call(self, inputs: Any, training: Any = None) -> Any:
        if training and not self.updated_by_psctl and not self._warned_untrained:
            self._warned_untrained = True  # once per layer (a trace runs this once)
            log.warning(
                "DynamicEmbedding %r is training outside psctl (Keras' fit or a GradientTape "
                "loop): its table has no Keras variable and is updated only by psctl's "
                "training step, so here every id reads zeros and nothing is learned; train "
                "the model with psctl local or psctl train (docs/embeddings.md)",
                self.name,
            )
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
            admission_sketch_width=self.admission_sketch_width,
            embeddings_initializer=keras.initializers.serialize(self.embeddings_initializer),
        )
        return config


def dynamic_layers(model: Any) -> list[DynamicEmbedding]:
    """The model's DynamicEmbedding layers, in build order."""
    return [layer for layer in model._flatten_layers() if isinstance(layer, DynamicEmbedding)]
