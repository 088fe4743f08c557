"""Dynamic embedding tables (``from psctl.job import DynamicEmbedding``): rows keyed by raw
ids, with no vocabulary size, that grow as ids are admitted and shrink as they are evicted.

On a cluster a table has one shard per ps task (``PackedShard``), and a key lives on shard
``shard_of(key)`` (a multiplicative hash of the key, so that ids in sequence or of one stride
spread evenly). A shard is one ``tf.lookup.experimental.MutableHashTable``, int64 key -> the
key's whole row ``[vector | optimizer slots | count, last_seen]``: one allocation per key,
about 1.35x the payload (measured: docs/embeddings.md); the three tables per shard before
it (vectors, counts, slots, each an allocation per key) took 2.9x. Ids not yet admitted are
counted in a count-min sketch of fixed size (``Sketch``), not in the table.

Anywhere else (the checkpoint's skeleton, ``psctl evaluate``, ``psctl export``, a model
Keras trains itself in one process: ``OneProcess``) a table is ``ServingTables``: the
layout checkpoints and SavedModels hold, three tables keyed by the ids (``embeddings``: the
vectors; ``meta``: ``[count, last_seen, admitted]``; ``slots``: the optimizer's, side by
side). Checkpoints hold each as the one-shard table's (keys, values),
saved in slices by the ps tasks and re-split over however many there are when they are
restored (training/saving/sharded_save.py).

Strings are keyed by their 63-bit fingerprint (``tf.strings.to_hash_bucket_fast`` over
2**63 - 1 buckets: stable across processes, and with 10^9 distinct strings two of them
share a key with probability about 5e-2 in all, not a collision per row as hashing into a
fixed table gives).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops

from psctl.cluster.errors import ConfigError
from psctl.coordinator.embeddings.layers import (
    LayerSettingError,
    combiner_setting,
    count_setting,
    pool,
    pooled_shape,
    seconds_setting,
)
from psctl.coordinator.embeddings.rows import (
    ABSENT,
    COUNTER_CAP,
    LAST_SEEN,
    META_WIDTH,
    Merged,
    dense,
    evict,
    oldest_kept,
    update_rows,
)
from psctl.coordinator.embeddings.sparse import SUPPORTED, SparseRule

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

    def last_seen(self) -> tuple[Any, Any]:
        """Every key, and the step it was last seen."""
        keys, values = self.table.export()
        return tf.reshape(keys, [-1]), self.unpack(values)[1][:, LAST_SEEN]

    def remove(self, keys: Any) -> None:
        self.table.remove(keys)

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
    ``psctl export``, a model trained by Keras itself): the layout checkpoints and
    SavedModels hold, three tables keyed by the ids: ``embeddings`` (the vectors), ``meta``
    (``[count, last_seen, admitted]``) and ``slots`` (the optimizer's, side by side; once
    ``ensure_slots`` knows them). ``read``/``write``/``last_seen``/``remove`` are a shard's
    (rows.py), for training in one process."""

    embeddings: Any
    meta: Any
    counters: Any  # int64 [admitted, evicted]: the totals
    dim: int
    slots: Any = None
    slot_kinds: tuple[str, ...] = ()
    sketch: Sketch | None = None  # ids not yet admitted, when trained in one process

    def tables(self) -> dict[str, Any]:
        found = {"embeddings": self.embeddings, "meta": self.meta}
        if self.slots is not None:
            found["slots"] = self.slots
        return found

    def vectors(self, keys: Any) -> Any:
        """The vectors of ``keys`` (zeros for keys without a row)."""
        return tf.reshape(self.embeddings.lookup(keys), [-1, self.dim])

    def read(self, keys: Any) -> tuple[Any, Any, Any]:
        """(vectors, meta, slots or None) of ``keys``."""
        slots = None
        if self.slots is not None:
            slots = tf.reshape(self.slots.lookup(keys), [-1, self.dim * len(self.slot_kinds)])
        meta = tf.reshape(self.meta.lookup(keys), [-1, META_WIDTH])
        return self.vectors(keys), meta, slots

    def write(self, keys: Any, vectors: Any, slots: Any, count: Any, last_seen: Any) -> None:
        """Give ``keys`` rows (admitted) with these values."""
        cap = tf.constant(COUNTER_CAP, tf.int64)
        count = tf.minimum(tf.cast(count, tf.int64), cap)
        last_seen = tf.minimum(tf.cast(last_seen, tf.int64), cap)
        self.embeddings.insert(keys, vectors)
        self.meta.insert(keys, tf.stack([count, last_seen, tf.ones_like(count)], axis=1))
        if slots is not None:
            self.slots.insert(keys, slots)

    def last_seen(self) -> tuple[Any, Any]:
        """Every key, and the step it was last seen."""
        keys, meta = self.meta.export()
        return tf.reshape(keys, [-1]), tf.reshape(meta, [-1, META_WIDTH])[:, LAST_SEEN]

    def remove(self, keys: Any) -> None:
        for table in self.tables().values():
            table.remove(keys)


class _Context(threading.local):
    devices: list[str] | None = None  # where shards go while psctl builds on a cluster
    records: Records | None = None  # lookups a training step records
    by_psctl: bool = False  # psctl builds the model: its own step trains the tables


@contextlib.contextmanager
def built_by_psctl() -> Iterator[None]:
    """DynamicEmbedding layers made in this block (the job's ``create_model()``, when psctl
    calls it) are trained by psctl's step, or not at all (evaluation, export), never by
    Keras: they get no ``OneProcess``."""
    previous, _CONTEXT.by_psctl = _CONTEXT.by_psctl, True
    try:
        yield
    finally:
        _CONTEXT.by_psctl = previous


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


class OneProcess:
    """A DynamicEmbedding trained in one process by Keras itself (``model.fit``, or a
    ``GradientTape`` loop), with no psctl: the same rules as psctl's step
    (rows.py: admission, the optimizer's sparse rule, eviction), on the layer's
    ``ServingTables``.

    A lookup in training passes through a custom gradient that applies the rule to the
    rows it read. Keras only asks for the gradients of its variables, so the lookup
    depends on one: ``anchor``, an empty trainable weight of the layer (its own gradient
    is empty too). The rule is the model's optimizer's (``model.compile(optimizer=...)``),
    each id stamped with the optimizer's step; a layer called on several features in one
    step updates an id once per call (psctl's step merges them). Eviction runs every
    ``EVICT_EVERY_STEPS`` steps (or every ``ttl_steps``, if fewer), where psctl evicts
    every few seconds; ``max_rows_per_shard`` caps the one table here."""

    EVICT_EVERY_STEPS = 100

    def __init__(self, layer: DynamicEmbedding, tables: ServingTables) -> None:
        self.layer = layer
        self.tables = tables
        self.anchor = layer.add_weight(
            shape=(0,), initializer="zeros", trainable=True, name="one_process_updates"
        )
        self.rules: dict[int, Any] = {}

    def vectors(self, keys: Any, counts: Any) -> Any:
        """The vectors of distinct ``keys`` (seen ``counts`` times in the batch), which
        the gradient of the step updates."""
        if self.layer.ttl_seconds is not None:
            raise ValueError(
                f"DynamicEmbedding {self.layer.name!r}: ttl_seconds evicts in psctl's "
                "training processes (psctl local, psctl train); trained in one process, give "
                "ttl_steps instead"
            )
        model = self.layer._get_call_context().entry_layer  # the model being trained
        tables = self.tables

        @tf.custom_gradient
        def looked_up(anchor: Any) -> Any:
            vectors = tables.vectors(keys)  # their meta and slots: read by the update

            def gradient(upstream: Any) -> Any:
                self.update(model, keys, counts, dense(upstream, vectors))
                return tf.zeros_like(anchor)

            return tf.identity(vectors), gradient

        return looked_up(tf.convert_to_tensor(self.anchor.value))

    def update(self, model: Any, keys: Any, counts: Any, grads: Any) -> None:
        optimizer = getattr(model, "optimizer", None)
        if optimizer is None:
            raise ValueError(
                f"DynamicEmbedding {self.layer.name!r} trains with the model's optimizer, and "
                "the model has none: call model.compile(optimizer=...) with the optimizer "
                "your loop applies"
            )
        rule = self.rules.get(id(optimizer))
        if rule is None:
            try:
                rule = self.rules[id(optimizer)] = SparseRule(optimizer)
            except ConfigError:
                raise ValueError(
                    f"DynamicEmbedding {self.layer.name!r}: {type(optimizer).__name__} has no "
                    f"sparse form for its rows; compile the model with one of {SUPPORTED}"
                ) from None
            attach_slots([self.layer], rule)
        step = tf.cast(optimizer.iterations, tf.int64) + 1
        vectors, meta, slots = self.tables.read(keys)  # now: an earlier call may have moved them
        update_rows(
            rule,
            self.layer,
            self.tables,
            Merged(keys, counts, vectors, meta, slots, grads),
            stamp=step,
            lr=tf.cast(rule.learning_rate(), vectors.dtype),
            opt_step=tf.cast(step, tf.float32),
        )
        self.evict_when_due(step)

    def evict_when_due(self, step: Any) -> None:
        layer, tables = self.layer, self.tables
        ttl, cap = layer.ttl_steps, layer.max_rows_per_shard
        if ttl is not None or cap is not None:
            every = min(self.EVICT_EVERY_STEPS, ttl or self.EVICT_EVERY_STEPS)
            _every(step, every, lambda: evict(layer, tables, oldest_kept(step, ttl)))
        if ttl is not None and tables.sketch is not None:
            sketch = tables.sketch
            _every(step, ttl, sketch.halve)


def _every(step: Any, period: int, action: Any) -> None:
    """Run ``action`` at the steps that are multiples of ``period`` (in a graph too)."""

    def run() -> Any:
        action()
        return tf.constant(True)

    tf.cond(tf.equal(step % period, 0), run, lambda: tf.constant(False))


def attach_slots(layers: Sequence[DynamicEmbedding], rule: Any) -> None:
    """Give every layer's shards the slot tables of the optimizer's ``SparseRule``."""
    initial = {kind: rule.initial(kind) for kind in rule.kinds}
    for layer in layers:
        layer.ensure_slots(rule.kinds, initial)


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
      steps, or ``ttl_seconds``). The sketch may count an id more often than it was seen (a false
      admission, docs/embeddings.md), never less. The step that admits an id still reads
      zeros.
    - Eviction: an id not seen for ``ttl_steps`` global steps, or for ``ttl_seconds`` of
      wall-clock time (psctl's training processes only: follow mode's drifting ids), is
      removed (its row: vector, slots and counts), and each shard keeps at most
      ``max_rows_per_shard`` rows, the least recently seen removed first. psctl evicts
      every few seconds while training.
    - Outside psctl (Keras' ``model.fit`` or a ``GradientTape`` loop in one process) the
      table trains by the same rules, with the model's optimizer (``OneProcess``).
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
        ttl_seconds: float | None = None,
        admission_sketch_width: int = DEFAULT_SKETCH_WIDTH,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        kind = "DynamicEmbedding"
        self.output_dim = count_setting(kind, self.name, "output_dim", output_dim)
        self.combiner = combiner_setting(kind, self.name, combiner)
        self.admit_after = count_setting(kind, self.name, "admit_after", admit_after)
        self.ttl_steps = count_setting(kind, self.name, "ttl_steps", ttl_steps, optional=True)
        self.ttl_seconds = seconds_setting(kind, self.name, "ttl_seconds", ttl_seconds)
        self.max_rows_per_shard = count_setting(
            kind, self.name, "max_rows_per_shard", max_rows_per_shard, optional=True
        )
        self.admission_sketch_width = count_setting(
            kind, self.name, "admission_sketch_width", admission_sketch_width
        )
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.initial_rows = _initializer(self.embeddings_initializer)
        self.supports_jit = False  # hash tables: no XLA in Keras' fit
        self.by_psctl = _CONTEXT.by_psctl  # made by psctl (job.py): psctl's step trains it
        self.one_process: OneProcess | None = None  # else trained by Keras itself

    # -- the tables ----------------------------------------------------------------------

    def build(self, input_shape: Any = None) -> None:
        if self.shards:
            return
        devices = _CONTEXT.devices
        if devices:
            # Not tracked by the layer: checkpoints save the shards in the serving layout
            # (training/saving/sharded_save.py).
            shards: list[Any] = [self._packed(device) for device in devices]
        else:
            tables = self._serving_tables()
            # Tracked, under these names: what checkpoints and SavedModels hold.
            self.embeddings_table = tables.embeddings
            self.meta_table = tables.meta
            self.counters = tables.counters
            shards = [tables]
            if not self.by_psctl:
                if self.admit_after > 1:
                    tables.sketch = Sketch(self.admission_sketch_width, None)
                self.one_process = OneProcess(self, tables)
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
                dim=self.output_dim,
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
        shards = self.shards
        if not kinds or not shards or tuple(kinds) == getattr(shards[0], "slot_kinds", None):
            return
        if isinstance(shards[0], ServingTables):
            if shards[0].slots is not None:
                return
            dtype = self.dtype_of_rows
            d = self.output_dim
            with tf.init_scope():  # out of any function being traced (Keras' fit)
                default = [tf.fill([d], tf.constant(initial[k], dtype)) for k in kinds]
                shards[0].slots = tf.lookup.experimental.MutableHashTable(
                    tf.int64, dtype, default_value=tf.concat(default, 0)
                )
            shards[0].slot_kinds = tuple(kinds)
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
                return [shard.vectors(part)]
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
        keys, valid = self.keys(inputs)
        shape = tf.shape(keys)
        flat_keys = tf.reshape(keys, [-1])
        flat_valid = tf.reshape(valid, [-1])
        where = tf.where(flat_valid)
        distinct, index, counts = tf.unique_with_counts(tf.gather_nd(flat_keys, where))
        records = _CONTEXT.records
        # Keras itself trains it (not psctl): the lookup takes the step's gradient, unless
        # the call says it is not training. A subclassed model whose call() takes no
        # ``training`` passes None to its layers, in fit too.
        if records is None and self.one_process is not None and training is not False:
            vectors = self.one_process.vectors(distinct, tf.cast(counts, tf.int64))
        else:
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

    # -- Keras' own files (model.save, save_weights) -------------------------------------

    def save_own_variables(self, store: Any) -> None:
        """Keras' weights, then the one-process tables (keys and values of each) and their
        counts and slot kinds: ``.keras`` and ``.weights.h5`` files hold the rows too."""
        super().save_own_variables(store)
        tables = self.shards[0] if self.shards else None
        if not isinstance(tables, ServingTables):
            return
        for name, table in tables.tables().items():
            keys, values = table.export()
            store[f"{name}_keys"], store[f"{name}_values"] = keys.numpy(), values.numpy()
        store["counters"] = tables.counters.numpy()
        if tables.slots is not None:
            store["slot_kinds"] = np.frombuffer(",".join(tables.slot_kinds).encode(), np.uint8)
            keys = tf.constant([-1], tf.int64)  # never a key: reads the new rows' slots
            store["slot_default"] = tables.slots.lookup(keys).numpy()[0]

    def load_own_variables(self, store: Any) -> None:
        # Not the base class's: it refuses a store holding more keys than the variables.
        variables = self._trainable_variables + self._non_trainable_variables
        for index, variable in enumerate(variables):
            variable.assign(store[f"{index}"])
        tables = self.shards[0] if self.shards else None
        if not isinstance(tables, ServingTables) or "embeddings_keys" not in store:
            return
        if "slot_kinds" in store and tables.slots is None:
            kinds = tuple(bytes(np.asarray(store["slot_kinds"], np.uint8)).decode().split(","))
            default = np.asarray(store["slot_default"])
            d = self.output_dim
            self.ensure_slots(kinds, {k: float(default[i * d]) for i, k in enumerate(kinds)})
        for name, table in tables.tables().items():
            if f"{name}_keys" in store:
                table.insert(store[f"{name}_keys"], store[f"{name}_values"])
        tables.counters.assign(store["counters"])

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config.update(
            output_dim=self.output_dim,
            combiner=self.combiner,
            admit_after=self.admit_after,
            ttl_steps=self.ttl_steps,
            ttl_seconds=self.ttl_seconds,
            max_rows_per_shard=self.max_rows_per_shard,
            admission_sketch_width=self.admission_sketch_width,
            embeddings_initializer=keras.initializers.serialize(self.embeddings_initializer),
        )
        return config


def dynamic_layers(model: Any) -> list[DynamicEmbedding]:
    """The model's DynamicEmbedding layers, in build order."""
    return [layer for layer in model._flatten_layers() if isinstance(layer, DynamicEmbedding)]
