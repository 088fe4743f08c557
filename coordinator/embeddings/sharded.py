"""Embedding tables sharded over the ps tasks, with sparse updates (``--max-shards N``).

A job writes a plain ``keras.layers.Embedding(V, d)``. With ``--max-shards`` above 1, psctl
builds every Embedding whose table holds at least ``--min-shard-bytes`` as a psctl table:
the rows are split into up to N contiguous shards, one variable each, placed round-robin
on the ps tasks (TensorFlow's ``ShardedVariable`` layout, "div" partitioning). Nothing else
is partitioned: Keras 3 variables over a ``ShardedVariable`` break ``tape.gradient``.

- A lookup (``tf.nn.embedding_lookup``) reads only the rows a batch needs, each distinct
  id once (``lookup_distinct``), from the ps that hold them; the gradient of each shard is
  ``IndexedSlices``.
- The job's Keras optimizer updates the dense variables exactly as before; the tables are
  updated by ``SparseUpdater`` with the same optimizer's hyper-parameters, on the touched
  rows only (see sparse.py for the math, "lazy" Adam included).
- Checkpoints hold each table in the layout of the same model without psctl
  (``embeddings`` and the optimizer's slots for it), written as row slices by the ps that
  hold them (training/saving/sharded_save.py): they restore into any number of ps tasks, and
  ``psctl evaluate`` or a plain Keras model read them as they are.

psctl intercepts ``Embedding.build``/``call`` while it builds the job's model on the
cluster (``building()``); layers built elsewhere, and the coordinator's own copies of the
model (evaluation), are plain Keras; the checkpoint's skeleton (``skeleton()``) is plain
Keras with one-row tables.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from psctl.coordinator.settings import TrainSettings

log = logging.getLogger(__name__)


@dataclass
class Table:
    """One psctl table: the layer, its variable (a ``ShardedVariable``, or one variable
    when the table is too small to split) and the optimizer's slots per shard."""

    layer: Any
    variable: Any
    slots: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def shards(self) -> list[Any]:
        return list(getattr(self.variable, "variables", [self.variable]))

    @property
    def rows(self) -> int:
        return int(self.variable.shape[0])


def lookup_distinct(lookup: Callable[[Any], Any], ids: Any) -> Any:
    """``lookup(ids)`` for any shape of ``ids``, calling ``lookup`` on each distinct id once.

    A batch repeats its frequent ids (the ``ctr`` job at 1M rows: 1,839 distinct ids of
    6,656 in a batch of 256), and every id a lookup reads is a row crossing the network from
    its ps, and its gradient crossing back. Reading each distinct id once sends the ps only
    those; the batch's rows are gathered from them on the worker, and the gradient of the
    gather sums the repeated ids' gradients there, before the table's update sees them.
    """
    flat = tf.reshape(ids, [-1])
    distinct, position = tf.unique(flat)
    rows = lookup(distinct)
    found = tf.gather(rows, position)
    shaped = tf.reshape(found, tf.concat([tf.shape(ids), tf.shape(rows)[1:]], 0))
    return tf.ensure_shape(shaped, ids.shape.concatenate(rows.shape[1:]))


def lookup_rows(shards: Sequence[Any], ids: Any) -> Any:
    """``ids``' rows of the table split into ``shards`` (contiguous, in order): one gather
    per shard, on its ps. Eager ``tf.nn.embedding_lookup`` over a ``ShardedVariable`` reads
    every shard whole first (measured: +2 shards of memory for a 3-id lookup)."""
    sizes = [int(shard.shape[0]) for shard in shards]
    starts = tf.constant(np.cumsum([0, *sizes[:-1]]), tf.int64)
    flat = tf.reshape(tf.cast(ids, tf.int64), [-1])
    part = tf.cast(tf.searchsorted(starts, flat, side="right") - 1, tf.int32)
    local = flat - tf.gather(starts, part)
    positions = tf.dynamic_partition(tf.range(tf.size(flat)), part, len(shards))
    rows = tf.dynamic_partition(local, part, len(shards))
    gathered = [tf.gather(shard, r) for shard, r in zip(shards, rows, strict=True)]
    found = tf.dynamic_stitch(positions, gathered)
    return tf.reshape(found, tf.concat([tf.shape(ids), tf.shape(found)[1:]], 0))


class _Building(threading.local):
    plan: TablePlan | None = None
    skeleton: TablePlan | None = None


_BUILDING = _Building()


@dataclass
class TablePlan:
    """Which Embedding layers become psctl tables, and the tables built so far."""

    min_shard_bytes: int
    max_shards: int
    tables: list[Table] = field(default_factory=list)

    @classmethod
    def of(cls, settings: TrainSettings) -> TablePlan:
        return cls(
            min_shard_bytes=settings.placement.min_shard_bytes,
            max_shards=settings.placement.max_shards,
        )

    def wants(self, layer: Any) -> bool:
        itemsize = np.dtype(keras.backend.standardize_dtype(layer.variable_dtype)).itemsize
        table_bytes = int(layer.input_dim) * int(layer.output_dim) * itemsize
        plain = not (layer.quantization_mode or layer.lora_rank)
        return plain and self.max_shards > 1 and table_bytes >= self.min_shard_bytes


def partitioner(settings: TrainSettings) -> Callable[..., list[int]] | None:
    """The strategy's ``variable_partitioner``: splits psctl tables only."""
    if settings.placement.max_shards <= 1:
        return None
    split = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=settings.placement.min_shard_bytes, max_shards=settings.placement.max_shards
    )

    def partition(shape: Any, dtype: Any, axis: int = 0) -> list[int]:
        if _BUILDING.plan is None or not getattr(_BUILDING, "table", False):
            return [1] * len(shape)
        return list(split(shape, dtype, axis))

    return partition


@contextlib.contextmanager
def building(settings: TrainSettings) -> Iterator[TablePlan]:
    """While the job's model is built under the strategy's scope: Embedding layers the plan
    wants are built as psctl tables (collected in the plan, in build order)."""
    plan = TablePlan.of(settings)
    _install()
    _BUILDING.plan = plan
    try:
        yield plan
    finally:
        _BUILDING.plan = None


@contextlib.contextmanager
def skeleton(settings: TrainSettings) -> Iterator[None]:
    """While the checkpoint's skeleton (the plain model, in the coordinator) is built: the
    Embedding layers that are psctl tables on the cluster get a one-row table, so that the
    skeleton has the plain model's variables, keys and slots at no cost in memory."""
    _install()
    _BUILDING.skeleton = TablePlan.of(settings)
    try:
        yield
    finally:
        _BUILDING.skeleton = None


def table_of(layer: Any) -> Table | None:
    table: Table | None = layer.__dict__.get("_psctl_table")
    return table


_ORIGINAL: dict[str, Any] = {}


def _install() -> None:
    """Wrap Embedding.build/call once: without a psctl table they do what Keras does."""
    if _ORIGINAL:
        return
    embedding = keras.layers.Embedding
    _ORIGINAL["build"], _ORIGINAL["call"] = embedding.build, embedding.call

    def build(self: Any, input_shape: Any = None) -> None:
        shrink = _BUILDING.skeleton
        if not self.built and shrink is not None and shrink.wants(self):
            rows, self.input_dim = self.input_dim, 1
            try:
                _ORIGINAL["build"](self, input_shape)
            finally:
                self.input_dim = rows
            return
        plan = _BUILDING.plan
        if self.built or plan is None or not plan.wants(self):
            _ORIGINAL["build"](self, input_shape)
            return
        _build_table(self, plan)

    def call(self: Any, inputs: Any) -> Any:
        table = table_of(self)
        if table is None:
            return _ORIGINAL["call"](self, inputs)
        if inputs.dtype not in (tf.int32, tf.int64):
            inputs = tf.cast(inputs, tf.int64)
        if tf.executing_eagerly():  # the coordinator's final evaluation
            read = functools.partial(lookup_rows, table.shards)
        else:
            read = functools.partial(tf.nn.embedding_lookup, table.variable)
        return tf.cast(lookup_distinct(read, inputs), self.compute_dtype)

    embedding.build = build
    embedding.call = call


def _build_table(layer: Any, plan: TablePlan) -> None:
    for what in ("embeddings_regularizer", "embeddings_constraint"):
        if getattr(layer, what, None) is not None:
            log.warning("%s: %s is not applied to a sharded table", layer.name, what)
    shape = (int(layer.input_dim), int(layer.output_dim))
    dtype = tf.as_dtype(keras.backend.standardize_dtype(layer.variable_dtype))
    initializer = layer.embeddings_initializer

    def initial_value(shard_info: Any = None) -> Any:
        # Each shard is initialized on its own: the whole table never exists at once. As one
        # graph function on the shard's ps, whose executor frees or reuses the intermediate
        # tensors as it goes: eager ops hold the random draw, its scaled copy and the result
        # at once (peak 3.2x the shard, measured in one process; 2.1x this way).
        part = tuple(shard_info.shape) if shard_info is not None else shape
        initialize = tf.function(lambda: initializer(part, dtype=dtype))
        # One function per shard, traced once each: not the retracing TensorFlow warns of
        # after 5 ("triggered tf.function retracing"), which it counts by the source line.
        initialize._omit_frequent_tracing_warning = True
        return initialize()

    _BUILDING.table = True
    try:
        variable = tf.Variable(
            initial_value=initial_value,
            shape=shape,
            dtype=dtype,
            trainable=True,
            name=f"{layer.name}/embeddings",
        )
    finally:
        _BUILDING.table = False
    table = Table(layer=layer, variable=variable)
    # Not a Keras weight and not tracked by the layer: checkpoints save it in the layout of
    # the plain model (training/saving/sharded_save.py).
    object.__setattr__(layer, "_psctl_table", table)
    layer.built = True
    plan.tables.append(table)
    log.info(
        "table %s: %d x %d in %d shard(s) over the ps tasks",
        layer.name,
        shape[0],
        shape[1],
        len(table.shards),
    )
