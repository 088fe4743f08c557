"""Checkpoints written and read where the variables live: every ps saves and restores its
own shards, all at once, in the shared checkpoint directory; no process holds the model.

The files are TensorFlow's own (a V2 bundle: ``ckpt-N.index`` and ``ckpt-N.data-*``, with
the object graph), in the layout of the plain Keras model: what ``tf.train.Checkpoint``
writes for the same model without psctl, so ``psctl export``, ``psctl evaluate`` and a plain
Keras model read them as they are. A table is saved as row slices of its whole tensor, one
or more per ps; TensorFlow's reader joins the slices, and reads any row range of the table
from them, whatever the ps count that wrote it.

- **Save**: each ps runs ``SaveV2`` on its own variables (a fixed table's rows in blocks of
  ``BLOCK_BYTES``, so no shard is copied whole; a dynamic table's export), in a temporary
  bundle of its own; the coordinator writes the object graph and the step, then
  ``MergeV2Checkpoints`` joins the bundles' index files (the data files are renamed, never
  read). This is TensorFlow's ``MultiDeviceSaver``, done with eager ops placed on each ps:
  TensorFlow would trace it as a function, which registers on every worker, so one frozen
  worker blocked the save (seen). Eager ops on a ps involve no worker.
- **Restore**: each ps reads the rows of its shards (``RestoreV2`` with a slice), checks
  that they are finite, and assigns them; a dynamic table's shard takes, from every saved
  slice, the keys that hash to it. Any ps count restores any checkpoint (a resize).
- **Damage**: the index is read and checked first (every key, every shape, every data
  file present); each value read is checked by its CRC (TensorFlow's reader) or its length
  and must be finite. A damaged checkpoint raises ``Unusable`` and the caller falls back to
  the previous one, whose restore overwrites every value.

The checkpoint directory must be one that every ps host and the coordinator see at the same
path (on one host: any directory; across hosts: NFS, ``gs://``, ``hdfs://``, ...):
``check_shared`` says so in one line at start when a ps cannot read what the coordinator
wrote there, or the coordinator what a ps wrote.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import json
import logging
import os
import re
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.checkpoint import graph_view, save_util
from tensorflow.python.ops import gen_io_ops, gen_lookup_ops
from tensorflow.python.training.saving import saveable_object_util

from psctl.cluster.errors import ConfigError
from psctl.coordinator.embeddings.dynamic import PackedShard, shard_of
from psctl.coordinator.embeddings.rows import ADMITTED, COUNT, LAST_SEEN
from psctl.coordinator.failures import Failure, classify, describe
from psctl.coordinator.training.job_model.model import JobModel, TrainState
from psctl.coordinator.training.saving.checkpoint_files import ModelMismatch, Unusable, finite_there

log = logging.getLogger(__name__)

BLOCK_BYTES = 64 << 20  # the most a ps copies at once while saving or restoring a table
SLICES_KEY = "_PSCTL_SLICES"  # where each dynamic table's row slices are (JSON)
OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
_DATA = re.compile(r"\.data-(\d+)-of-(\d+)$")


class NotFinite(Exception):
    """A value to be saved holds NaN or infinity: the checkpoint is refused."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def ps_device(variable: Any) -> str | None:
    """The ps task device a variable (or table) lives on; None: this process."""
    device = str(getattr(variable, "device", "") or "")
    return device if "/job:ps/" in device else None


def task_of(device: str | None) -> str:
    """``ps:1`` for a ps device; ``chief`` for this process."""
    if device is None:
        return "chief"
    match = re.search(r"/job:(\w+)/replica:\d+/task:(\d+)", device)
    return f"{match.group(1)}:{match.group(2)}" if match else device


def _sync(device: str | None) -> None:
    """Wait for the ops sent to ``device`` so far, and raise the error of any that failed.
    Ops without outputs (SaveV2, writes, assigns, inserts) are only queued on a remote task:
    a value read back from it comes after them (measured: a file written by a ps was there
    0 of 20 times right after the call, 20 of 20 after a read)."""
    if device is not None:
        with tf.device(device):
            tf.constant(0).numpy()


def _tf_variable(variable: Any) -> Any:
    return variable.value if isinstance(variable, keras.Variable) else variable


def _spec(shape: Sequence[int], start: int, rows: int) -> str:
    """``shape_and_slice`` for rows ``[start, start + rows)`` of a tensor of ``shape``."""
    dims = " ".join(str(d) for d in shape)
    return f"{dims} {':'.join([f'{start},{rows}'] + ['-'] * (len(shape) - 1))}"


def _row_ranges(rows: int, row_bytes: int) -> list[tuple[int, int]]:
    step = max(1, BLOCK_BYTES // max(1, row_bytes))
    return [(start, min(step, rows - start)) for start in range(0, rows, step)]


# -- what a checkpoint holds -----------------------------------------------------------------


@dataclass(frozen=True)
class Dense:
    """A variable saved whole from its task (model weights, optimizer state, counters)."""

    key: str
    name: str
    variable: Any  # a Keras variable or a tf.Variable

    @property
    def device(self) -> str | None:
        return ps_device(_tf_variable(self.variable))


@dataclass(frozen=True)
class Rows:
    """A fixed table (or one of its optimizer slots): contiguous row shards on the ps, saved
    as row slices of the whole table."""

    key: str
    name: str
    shards: Sequence[Any]  # tf.Variables, in row order

    @property
    def shape(self) -> tuple[int, ...]:
        rows = sum(int(s.shape[0]) for s in self.shards)
        return (rows, *(int(d) for d in self.shards[0].shape[1:]))


@dataclass(frozen=True)
class Column:
    """One table of a dynamic layer's serving layout (``ServingTables``: ``embeddings``,
    ``meta`` or ``slots``): a (keys, values) pair in the checkpoint."""

    what: str
    keys_key: str
    values_key: str
    width: tuple[int, ...]


@dataclass(frozen=True)
class Hashed:
    """A dynamic layer over its ps shards (one row per key: ``PackedShard``), saved in the
    serving layout: each shard's rows are a row slice of every column's (keys, values)."""

    name: str
    columns: Sequence[Column]
    shards: Sequence[PackedShard]  # in shard order


@dataclass(frozen=True)
class Summed:
    """A dynamic layer's admitted and evicted totals: summed over its shards when saved,
    restored into the first shard."""

    key: str
    name: str
    variables: Sequence[Any]


@dataclass
class Written:
    """What one task wrote: its temporary bundles (in merge order) and their bytes."""

    prefixes: list[str] = field(default_factory=list)
    nbytes: int = 0


class ShardedCheckpoint:
    """The training state's checkpoint, saved and restored by the tasks that hold it.
    ``tf.train.CheckpointManager`` saves through ``_write`` (its rotation and state file
    are TensorFlow's)."""

    def __init__(
        self,
        *,
        dense: Sequence[Dense],
        rows: Sequence[Rows],
        hashed: Sequence[Hashed],
        summed: Sequence[Summed],
        step_key: str,
        saved_step: Any,
        object_graph: bytes,
        save_counter: Any = None,
    ) -> None:
        self.dense = list(dense)
        self.rows = list(rows)
        self.hashed = list(hashed)
        self.summed = list(summed)
        self.step_key = step_key
        self.saved_step = saved_step
        self.object_graph = object_graph
        self.save_counter = (
            tf.Variable(0, dtype=tf.int64, trainable=False)
            if save_counter is None
            else save_counter
        )
        self.last_report = ""

    # -- save --------------------------------------------------------------------------

    def _write(self, file_prefix: str, options: Any = None) -> str:
        """Write the checkpoint at ``file_prefix`` (the manager's hook); raises ``NotFinite``
        (nothing written) when a value is not finite."""
        prefix = _absolute(str(file_prefix))
        temp = f"{prefix}_temp_{uuid.uuid4().hex[:8]}"
        tf.io.gfile.makedirs(temp)
        try:
            written = self._save_all(temp)
            order = sorted(written)  # the chief, then the ps tasks in order
            prefixes = [p for task in order for p in written[task].prefixes]
            gen_io_ops.merge_v2_checkpoints(prefixes, prefix, delete_old_dirs=False)
        finally:
            # The merge moved the data files out; the parts' index files are left.
            if tf.io.gfile.exists(temp):
                tf.io.gfile.rmtree(temp)
        self.last_report = _report(order, written)
        for callback in getattr(options, "experimental_write_callbacks", None) or []:
            callback(str(file_prefix))
        return str(file_prefix)

    def _save_all(self, temp: str) -> dict[str, Written]:
        written: dict[str, Written] = defaultdict(Written)
        lock = threading.Lock()
        counter = itertools.count()

        def save(
            device: str | None, names: list[str], specs: list[str], tensors: list[Any]
        ) -> None:
            task = task_of(device)
            with lock:
                part = f"{temp}/{task.replace(':', '-')}-{next(counter):05d}"
            with tf.device(device):
                gen_io_ops.save_v2(part, names, specs, tensors)
            _sync(device)
            nbytes = sum(_nbytes(t) for t in tensors)
            with lock:
                written[task].prefixes.append(part)
                written[task].nbytes += nbytes

        slices: dict[str, list[list[int]]] = {}
        for item in self.hashed:
            # One table at a time: each ps holds one export of it until saved.
            slices.update(self._save_hashed(item, save))
        pieces: dict[str | None, list[Callable[[], Iterator[Piece]]]] = defaultdict(list)
        for dense in self.dense:
            pieces[dense.device].append(functools.partial(_dense_pieces, dense))
        for table in self.rows:
            for shard, start in zip(table.shards, _starts(table.shards), strict=True):
                pieces[ps_device(shard)].append(functools.partial(_row_pieces, table, shard, start))
        pieces[None].append(functools.partial(self._chief_pieces, slices))
        _parallel(
            {
                task_of(device): functools.partial(_save_in_blocks, device, found, save)
                for device, found in pieces.items()
            }
        )
        return written

    def _chief_pieces(self, slices: dict[str, list[list[int]]]) -> Iterator[Piece]:
        """The coordinator's part: the step, the dynamic counters, where the dynamic tables'
        slices are, the object graph."""
        yield self.step_key, "", tf.constant(int(self.saved_step.numpy()), tf.int64)
        yield SLICES_KEY, "", tf.constant(json.dumps(slices))
        yield OBJECT_GRAPH_KEY, "", tf.constant(self.object_graph)
        for summed in self.summed:
            yield summed.key, "", tf.add_n([tf.convert_to_tensor(v) for v in summed.variables])

    def _save_hashed(self, item: Hashed, save: Callable[..., None]) -> dict[str, list[list[int]]]:
        def export(shard: PackedShard) -> tuple[Any, Any, int]:
            with shard.placed():
                keys, values = shard.table.export()
                return keys, values, int(tf.shape(keys)[0])

        names = [f"{task_of(s.device)}#{i}" for i, s in enumerate(item.shards)]
        exports = _parallel(
            {name: functools.partial(export, s) for name, s in zip(names, item.shards, strict=True)}
        )
        parts = [exports[name] for name in names]
        total = sum(rows for _, _, rows in parts)
        columns = item.columns
        if total == 0:
            # An empty table still has its entries (a reader of the whole model wants them).
            empty: list[Any] = []
            for column in columns:
                dtype = tf.int64 if column.what == "meta" else item.shards[0].dtype
                empty += [tf.zeros([0], tf.int64), tf.zeros([0, *column.width], dtype)]
            save(None, [k for c in columns for k in (c.keys_key, c.values_key)],
                 [""] * len(empty), empty)  # fmt: skip
            return {c.keys_key: [] for c in columns}
        row_bytes = item.shards[0].width * item.shards[0].dtype.size + 8
        jobs: dict[str, Callable[[], None]] = {}
        where: list[list[int]] = []
        offset = 0
        for i, (shard, (keys, values, rows)) in enumerate(zip(item.shards, parts, strict=True)):
            ranges = [(offset + a, n, a) for a, n in _row_ranges(rows, row_bytes)]
            where += [[a, n] for a, n, _ in ranges]
            offset += rows

            def save_shard(
                shard: Any = shard, keys: Any = keys, values: Any = values, ranges: Any = ranges
            ) -> None:
                for start, n, local in ranges:
                    with shard.placed():
                        k = keys[local : local + n]
                        vectors, meta, slots = shard.unpack(values[local : local + n])
                        for found in (vectors, slots):
                            if found is not None and not finite_there(found):
                                raise NotFinite(item.name)
                    by_what = {"embeddings": vectors, "meta": meta, "slots": slots}
                    names, specs, tensors = [], [], []
                    for column in columns:
                        names += [column.keys_key, column.values_key]
                        specs += [
                            _spec([total], start, n),
                            _spec([total, *column.width], start, n),
                        ]
                        tensors += [k, by_what[column.what]]
                    save(shard.device, names, specs, tensors)

            jobs[f"{task_of(shard.device)}#{i}"] = save_shard
        _parallel(jobs)
        return {column.keys_key: where for column in columns}

    # -- restore -----------------------------------------------------------------------

    def load(self, prefix: str) -> None:
        """Restore ``prefix`` into the tasks' variables; ``Unusable`` (or ``ModelMismatch``)
        saying why it cannot be, before or while its values are read."""
        prefix = _absolute(prefix)
        try:
            reader = tf.train.load_checkpoint(prefix)
            shapes = reader.get_variable_to_shape_map()
        except Exception as err:
            raise Unusable(f"its index cannot be read: {_why(err)}") from None
        self._check_index(prefix, shapes)
        try:
            step = int(reader.get_tensor(self.step_key))
            slices: dict[str, list[list[int]]] = {}
            if SLICES_KEY in shapes:
                slices = json.loads(reader.get_tensor(SLICES_KEY))
            counts = {s.key: np.asarray(reader.get_tensor(s.key)) for s in self.summed}
        except Exception as err:
            raise Unusable(f"reading it failed: {_why(err)}") from None
        try:
            self._restore_tasks(prefix, shapes, reader, slices)
        except (Unusable, ConfigError):
            raise
        except Exception as err:
            if isinstance(err, tf.errors.OpError) and classify(err) in (
                Failure.PS_LOST,
                Failure.WORKER_LOST,
            ):
                raise
            raise Unusable(f"restoring it failed: {_why(err)}") from None
        for summed in self.summed:
            for i, variable in enumerate(summed.variables):
                value = counts[summed.key]
                variable.assign(value if i == 0 else np.zeros_like(value))
        self.saved_step.assign(step)

    def _check_index(self, prefix: str, shapes: dict[str, list[int]]) -> None:
        expected: dict[str, tuple[int, ...] | None] = {self.step_key: ()}
        for dense in self.dense:
            expected[dense.key] = tuple(int(d) for d in dense.variable.shape)
        for table in self.rows:
            expected[table.key] = table.shape
        for item in self.hashed:
            for column in item.columns:
                expected[column.keys_key] = None
                expected[column.values_key] = None
        for summed in self.summed:
            expected[summed.key] = None
        for key, shape in expected.items():
            if key not in shapes:
                raise ModelMismatch(f"it lacks variables the model has (another --job?): {key}")
            if shape is not None and tuple(shapes[key]) != shape:
                raise ModelMismatch(
                    f"the model does not match it: {key} is {tuple(shapes[key])} there, "
                    f"{shape} in the model"
                )
        for item in self.hashed:
            for column in item.columns:
                got = tuple(shapes[column.values_key][1:])
                if got != column.width:
                    raise ModelMismatch(
                        f"the model does not match it: {item.name}/{column.what} rows are "
                        f"{got} there, {column.width} in the model"
                    )
        _check_data_files(prefix)

    def _restore_tasks(
        self, prefix: str, shapes: dict[str, list[int]], reader: Any, slices: dict[str, Any]
    ) -> None:
        dtypes = reader.get_variable_to_dtype_map()
        by_device: dict[str | None, list[Callable[[], None]]] = defaultdict(list)
        for dense in self.dense:
            by_device[dense.device].append(_dense_loader(dense, prefix, dtypes[dense.key]))
        for table in self.rows:
            for shard, start in zip(table.shards, _starts(table.shards), strict=True):
                loader = _rows_loader(table, shard, start, prefix, dtypes[table.key])
                by_device[ps_device(shard)].append(loader)
        _parallel({task_of(d): _in_order(jobs, d) for d, jobs in by_device.items()})
        for item in self.hashed:
            columns = []
            for column in item.columns:
                total = int(shapes[column.values_key][0])
                pieces = slices.get(column.keys_key)
                if pieces is None:  # written whole (before psctl saved by shard): one piece
                    pieces = [[0, total]] if total else []
                columns.append((column, total, dtypes[column.values_key], pieces))
            _parallel(
                {
                    f"{task_of(shard.device)}#{i}": _hashed_loader(item, i, prefix, columns)
                    for i, shard in enumerate(item.shards)
                }
            )


# -- per task jobs ---------------------------------------------------------------------------


def _starts(shards: Sequence[Any]) -> list[int]:
    sizes = [int(s.shape[0]) for s in shards]
    return [int(x) for x in np.cumsum([0, *sizes[:-1]])]


Piece = tuple[str, str, Any]  # (key, shape_and_slice, tensor on its task)


def _save_in_blocks(
    device: str | None,
    sources: Sequence[Callable[[], Iterator[Piece]]],
    save: Callable[..., None],
) -> None:
    """Save a task's pieces, as they are read, in bundles of about ``BLOCK_BYTES``: few
    files, and at most a block more of the task's memory."""
    batch: list[Piece] = []
    size = 0
    for source in sources:
        for piece in source():
            batch.append(piece)
            size += _nbytes(piece[2])
            if size >= BLOCK_BYTES:
                save(device, *(list(x) for x in zip(*batch, strict=True)))
                batch, size = [], 0
    if batch:
        save(device, *(list(x) for x in zip(*batch, strict=True)))


def _nbytes(tensor: Any) -> int:
    return int(tensor.dtype.size) * int(np.prod(tensor.shape))


def _dense_pieces(dense: Dense) -> Iterator[Piece]:
    with tf.device(dense.device):
        value = tf.convert_to_tensor(_tf_variable(dense.variable))
        if not finite_there(value):
            raise NotFinite(dense.name)
    yield dense.key, "", value


def _shard_blocks(table: Rows, shard: Any, start: int) -> Iterator[tuple[int, int, str]]:
    """(first row in the shard, rows, the whole table's shape_and_slice) of each block of
    ``BLOCK_BYTES`` of a shard that starts at row ``start`` of ``table``."""
    row_bytes = int(np.prod(shard.shape[1:])) * shard.dtype.size
    for first, n in _row_ranges(int(shard.shape[0]), row_bytes):
        yield first, n, _spec(table.shape, start + first, n)


def _row_pieces(table: Rows, shard: Any, start: int) -> Iterator[Piece]:
    device = ps_device(shard)
    for first, n, spec in _shard_blocks(table, shard, start):
        with tf.device(device):
            # A gather, not a read of the whole shard: a variable that sparse updates
            # touched copies itself whole on a plain read (+340 MB per ps at 10M x 16).
            block = tf.gather(shard, tf.range(first, first + n))
            if not finite_there(block):
                raise NotFinite(table.name)
        yield table.key, spec, block


def _dense_loader(dense: Dense, prefix: str, dtype: Any) -> Callable[[], None]:
    def run() -> None:
        with tf.device(dense.device):
            (value,) = gen_io_ops.restore_v2(prefix, [dense.key], [""], [dtype])
            if not finite_there(value):
                raise Unusable(f"{dense.name} holds values that are not finite")
            _tf_variable(dense.variable).assign(value)

    return run


def _rows_loader(
    table: Rows, shard: Any, start: int, prefix: str, dtype: Any
) -> Callable[[], None]:
    def run() -> None:
        device = ps_device(shard)
        for first, n, spec in _shard_blocks(table, shard, start):
            with tf.device(device):
                (block,) = gen_io_ops.restore_v2(prefix, [table.key], [spec], [dtype])
                if not finite_there(block):
                    raise Unusable(f"{table.name} holds values that are not finite")
                shard.scatter_update(tf.IndexedSlices(block, tf.range(first, first + n)))

    return run


def _hashed_loader(
    item: Hashed,
    index: int,
    prefix: str,
    columns: Sequence[tuple[Column, int, Any, Sequence[Sequence[int]]]],
) -> Callable[[], None]:
    """Shard ``index`` takes, from every saved slice of each column, the keys that hash to
    it, and joins them into its rows by key: the vectors make the rows, then the counts and
    the slots of the keys that have one fill them in (a checkpoint written before the rows
    were packed holds the three tables in orders of their own, and counts of ids that were
    never admitted: those are left out)."""
    shard = item.shards[index]
    count = len(item.shards)

    def run() -> None:
        with shard.placed():
            # Empty it first: a fallback after a damaged checkpoint starts clean.
            gen_lookup_ops.lookup_table_import_v2(
                shard.table.resource_handle,
                tf.zeros([0], tf.int64),
                tf.zeros([0, shard.width], shard.dtype),
            )
            for column, total, dtype, pieces in columns:
                for start, n in pieces:
                    keys, values = gen_io_ops.restore_v2(
                        prefix,
                        [column.keys_key, column.values_key],
                        [_spec([total], start, n), _spec([total, *column.width], start, n)],
                        [tf.int64, dtype],
                    )
                    if column.what != "meta" and not finite_there(values):
                        raise Unusable(f"{item.name} holds values that are not finite")
                    mine = tf.equal(shard_of(keys, count), index)
                    _join(shard, column.what, tf.boolean_mask(keys, mine),
                          tf.boolean_mask(values, mine))  # fmt: skip
        _sync(shard.device)

    return run


def _join(shard: PackedShard, what: str, keys: Any, values: Any) -> None:
    """Write one column's ``values`` into the rows of ``keys``."""
    vectors, meta, slots = shard.read(keys)
    count, last = meta[:, COUNT], meta[:, LAST_SEEN]
    if what == "embeddings":
        shard.write(keys, values, slots, count, tf.maximum(last, 0))
        return
    present = meta[:, ADMITTED] > 0
    if what == "meta":
        present = tf.logical_and(present, values[:, ADMITTED] > 0)
        count, last = values[:, COUNT], values[:, LAST_SEEN]
    else:
        slots = values

    def kept(t: Any) -> Any:
        return None if t is None else tf.boolean_mask(t, present)

    shard.write(kept(keys), kept(vectors), kept(slots), kept(count), kept(last))


def _width(table: Any) -> tuple[int, ...]:
    default = table._default_value  # the row a missing key reads: its shape is a row's
    return tuple(int(d) for d in default.shape)


def _in_order(jobs: list[Callable[[], None]], device: str | None) -> Callable[[], None]:
    def run() -> None:
        for job in jobs:
            job()
        _sync(device)

    return run


def _parallel(jobs: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Run each task's job on a thread of its own (eager ops wait on the network with the
    GIL released); the first error, if any, is raised once all have ended."""
    if len(jobs) <= 1:
        return {name: job() for name, job in jobs.items()}
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        concurrent.futures.wait(futures.values())
    return {name: future.result() for name, future in futures.items()}


def _absolute(prefix: str) -> str:
    """The ps tasks run elsewhere (another working directory, another host): a local path
    must be absolute there."""
    return prefix if "://" in prefix else os.path.abspath(prefix)


def _why(err: BaseException) -> str:
    if isinstance(err, tf.errors.OpError):
        return describe(err)
    return f"{type(err).__name__}: {err}".split("\n")[0]


def _check_data_files(prefix: str) -> None:
    """Every data file the index names is there and not empty (a copy or save cut short
    leaves one missing or short; a short one is found by its length when read)."""
    directory, stem = os.path.split(prefix)
    try:
        names = tf.io.gfile.listdir(directory)
    except tf.errors.OpError as err:
        raise Unusable(f"cannot list {directory}: {describe(err)}") from None
    found: dict[int, int] = {}
    for name in names:
        if name.startswith(stem + ".data-"):
            match = _DATA.search(name)
            if match:
                found[int(match.group(1))] = int(match.group(2))
    counts = set(found.values())
    if len(counts) != 1:
        raise Unusable(f"its data files are missing or of two saves ({sorted(found)})")
    (total,) = counts
    missing = [i for i in range(total) if i not in found]
    if missing:
        names_missing = ", ".join(f"{stem}.data-{i:05d}-of-{total:05d}" for i in missing)
        raise Unusable(f"data file(s) missing: {names_missing}")


def _report(order: Sequence[str], written: dict[str, Written]) -> str:
    """``ps:0 3 file(s) 412 MB (data-00001..00003), ...``: what each task wrote, and which of
    the merged data files are its (they are numbered in ``order``)."""
    parts = []
    first = 0
    for task in order:
        w = written[task]
        n = len(w.prefixes)
        files = f"data-{first:05d}" + (f"..{first + n - 1:05d}" if n > 1 else "")
        parts.append(f"{task} {n} file(s) {w.nbytes / 1e6:.0f} MB ({files})")
        first += n
    return ", ".join(parts)


# -- the plan: which key each variable is saved under ----------------------------------------


def plan(state: TrainState, skeleton: JobModel, saved_step: Any) -> ShardedCheckpoint:
    """Pair every variable and table of the training ``state`` with its key in the
    checkpoint of the plain model: the ``skeleton``, the same ``create_model`` built in this
    process with every psctl table one row long, so that it costs nothing, and dynamic
    tables empty."""
    skeleton_checkpoint = skeleton.checkpoint(saved_step)
    # tf.train.CheckpointManager counts saves in the checkpoint's save_counter, which
    # every checkpoint it wrote holds (and every reader's tf.train.Checkpoint expects).
    save_counter = skeleton_checkpoint.save_counter
    serialized, _, _, proto = save_util.serialize_graph_view(
        graph_view.ObjectGraphView(skeleton_checkpoint)
    )
    keys: dict[int, list[str]] = {}
    for trackable, tensors in serialized.items():
        if trackable is None or not tensors:  # the object graph; objects with nothing saved
            continue
        if isinstance(trackable, saveable_object_util.SaveableCompatibilityConverter):
            trackable = trackable.obj
        keys.setdefault(id(trackable), []).extend(tensors)

    def key_of(obj: Any) -> str:
        (key,) = keys.pop(id(obj))
        return key

    def pair_of(table: Any) -> tuple[str, str]:
        found = sorted(keys.pop(id(table)))
        keys_key = next(k for k in found if k.endswith("-keys"))
        values_key = next(k for k in found if k.endswith("-values"))
        return keys_key, values_key

    ps_layers = _embeddings(state.model)
    skeleton_layers = _embeddings(skeleton.model)
    rows: list[Rows] = []
    skip: set[int] = set()
    slots = {v.name: v for v in skeleton.optimizer.variables}
    for table in state.tables:
        copy = skeleton_layers[next(i for i, lay in enumerate(ps_layers) if lay is table.layer)]
        var = copy.embeddings
        skip.add(id(var))
        rows.append(Rows(key_of(var), var.path, table.shards))
        for kind in table.slots:
            slot = slots[f"{var.path.replace('/', '_')}_{kind}"]
            skip.add(id(slot))
            rows.append(Rows(key_of(slot), slot.path, table.slots[kind]))
    sources = list(state.model.variables) + list(state.optimizer.variables)
    copies = [
        v
        for v in list(skeleton.model.variables) + list(skeleton.optimizer.variables)
        if id(v) not in skip
    ]
    dense = [
        Dense(key_of(copy), source.path if hasattr(source, "path") else source.name, source)
        for source, copy in zip(sources, copies, strict=True)
    ]
    hashed: list[Hashed] = []
    summed: list[Summed] = []
    for layer, copy in zip(state.dynamic_layers, skeleton.dynamic_layers, strict=True):
        local = copy.shards[0]
        columns = []
        for what, table in local.tables().items():
            keys_key, values_key = pair_of(table)
            columns.append(Column(what, keys_key, values_key, _width(table)))
        hashed.append(Hashed(layer.name, columns, layer.packed))
        summed.append(
            Summed(
                key_of(local.counters), f"{layer.name}/counters", [s.counters for s in layer.packed]
            )
        )
    step_key = key_of(saved_step)
    dense.append(Dense(key_of(save_counter), "save_counter", save_counter))
    if keys:
        left = sorted(k for ks in keys.values() for k in ks)
        raise RuntimeError(f"psctl cannot place these checkpoint keys: {left}")
    return ShardedCheckpoint(
        dense=dense,
        rows=rows,
        hashed=hashed,
        summed=summed,
        step_key=step_key,
        saved_step=saved_step,
        object_graph=proto.SerializeToString(),
        save_counter=save_counter,
    )


def _embeddings(model: Any) -> list[Any]:
    """The model's Embedding layers, in build order (both models list them alike)."""
    return [layer for layer in model._flatten_layers() if isinstance(layer, keras.layers.Embedding)]


def check_shared(
    directory: str, devices: Iterable[str], *, names: Sequence[str] | None = None
) -> None:
    """Every ps reads a file the coordinator just wrote in ``directory``, and writes one the
    coordinator reads: else one line (exit 78) saying what is wrong. A checkpoint is written
    by every ps and joined by the coordinator, in one directory."""
    devices = list(devices)
    if not devices:
        return
    names = list(names or [task_of(d) for d in devices])
    stem = os.path.join(_absolute(directory), f".psctl-shared-{uuid.uuid4().hex[:12]}")
    token = uuid.uuid4().hex
    fix = (
        "give a directory every ps host and the coordinator share at the same path, "
        "writable by the ps tasks' user (NFS, gs://, hdfs://; on one host any directory)"
    )
    with tf.io.gfile.GFile(stem, "w") as f:
        f.write(token)
    written = []
    try:
        for device, name in zip(devices, names, strict=True):
            try:
                with tf.device(device):
                    seen = tf.io.read_file(stem)
                ok = seen.numpy().decode() == token
            except tf.errors.NotFoundError:
                ok = False
            if not ok:
                raise ConfigError(
                    "--checkpoint-dir",
                    f"{name} does not see {directory} as this process does "
                    f"(it cannot read {os.path.basename(stem)}, written here)",
                    fix,
                )
            theirs = f"{stem}-{name.replace(':', '-')}"
            try:
                with tf.device(device):
                    tf.io.write_file(theirs, token)
                _sync(device)
                written.append(theirs)
            except tf.errors.OpError as err:
                raise ConfigError(
                    "--checkpoint-dir",
                    f"{name} cannot write to {directory} ({describe(err)})",
                    fix,
                ) from None
            with tf.io.gfile.GFile(theirs) as f:
                if f.read() != token:
                    raise ConfigError(
                        "--checkpoint-dir", f"{name} wrote {theirs}, read back otherwise", fix
                    )
    finally:
        for path in [stem, *written]:
            if tf.io.gfile.exists(path):
                tf.io.gfile.remove(path)
