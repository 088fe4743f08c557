"""Training dynamic tables (coordinator/embeddings/dynamic.py): the update after each step,
eviction while training, the counts an operator sees, and the checkpoint transfers.

- **A step** (``DynamicUpdater.apply``, in the scheduled function on a worker): the ids a
  batch looked up, grouped per table (one layer called on several features counts each id
  once), go to the shard that holds them; each shard's ``meta`` counts them and stamps the
  global step; admitted ids get the job optimizer's sparse rule (sparse.py: lazy Adam,
  Adagrad, SGD with momentum/Nesterov, Ftrl; slots per key next to it) and ids that reach
  ``admit_after`` get their first vector (the rule: ``embeddings/rows.update_rows``, which a
  layer trained in one process uses too).
- **Concurrency**: a worker reads a key's row, and writes back the result of its update
  (``insert``). Two workers updating one key at once: the last write wins (one
  update of that key is lost), where the fixed tables add both changes (``scatter_add``).
  Either is the asynchronous parameter server's usual staleness, and a key hot enough for
  this to matter is updated again at once.
- **Eviction** (``Evict``, every ``EVICT_EVERY`` seconds from the coordinator, run on each
  ps by a function placed there: nothing leaves the ps but the counts): ids not seen for
  ``ttl_steps`` global steps, then the least recently seen beyond ``max_rows_per_shard``.
- **Checkpoints** (training/saving/sharded_save.py): each shard's ``export()`` is saved by
  its ps as a row slice of the one-shard table's (keys, values); restoring, each shard takes
  the keys that ``shard_of`` gives it, over the shards there are now.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from psctl.coordinator.embeddings.dynamic import (
    DynamicEmbedding,
    Lookup,
    PackedShard,
    Records,
    attach_slots,
    split_by_shard,
)
from psctl.coordinator.embeddings.rows import Merged, dense, evict, oldest_kept, update_rows
from psctl.coordinator.embeddings.sparse import SparseRule

log = logging.getLogger(__name__)

EVICT_EVERY = 5.0  # seconds between eviction passes while training
PUBLISH_EVERY = 2.0  # seconds between reads of the tables' counts (status, metrics)


class DynamicUpdater:
    """Updates the dynamic tables after a step's gradient; build it under the strategy's
    scope, after the optimizer."""

    def __init__(self, optimizer: Any, layers: Sequence[DynamicEmbedding]) -> None:
        self.optimizer = optimizer
        self.layers = list(layers)
        self.rule = SparseRule(optimizer)
        attach_slots(self.layers, self.rule)

    def apply(self, records: Records, grads: Sequence[Any], global_step: Any) -> None:
        """Update the tables ``records`` looked up, with ``grads`` (one per lookup, as
        ``records.vectors()``); ``global_step`` is the step the ids are stamped with."""
        lr = self.rule.learning_rate()
        opt_step = tf.cast(self.optimizer.iterations + 1, tf.float32)
        stamp = tf.cast(tf.convert_to_tensor(global_step), tf.int64)
        by_layer: dict[int, list[tuple[Lookup, Any]]] = defaultdict(list)
        for lookup, grad in zip(records.lookups, grads, strict=True):
            by_layer[id(lookup.layer)].append((lookup, grad))
        for pairs in by_layer.values():
            layer = pairs[0][0].layer
            merged = _merge(pairs)
            positions, _ = split_by_shard(merged.keys, len(layer.packed))
            for shard, where in zip(layer.packed, positions, strict=True):
                update_rows(
                    self.rule,
                    layer,
                    shard,
                    merged.rows(where),
                    stamp=stamp,
                    lr=tf.cast(lr, merged.vectors.dtype),
                    opt_step=opt_step,
                )


def _merge(pairs: list[tuple[Lookup, Any]]) -> Merged:
    """One table's lookups in a step as one: distinct keys, summed counts and gradients,
    and what each key read (the same in every lookup of the step: the first is kept)."""
    if len(pairs) == 1:
        one, grad = pairs[0]
        return Merged(
            one.keys, one.counts, one.vectors, one.meta, one.slots, dense(grad, one.vectors)
        )
    lookups = [lookup for lookup, _ in pairs]

    def joined(field: str) -> Any:
        parts = [getattr(lookup, field) for lookup in lookups]
        return None if parts[0] is None else tf.concat(parts, 0)

    keys = joined("keys")
    grads = tf.concat([dense(grad, lookup.vectors) for lookup, grad in pairs], 0)
    distinct, position = tf.unique(keys)
    n = tf.size(distinct)
    first = tf.math.unsorted_segment_min(tf.range(tf.size(keys)), position, n)

    def firsts(field: str) -> Any:
        value = joined(field)
        return None if value is None else tf.gather(value, first)

    return Merged(
        distinct,
        tf.math.unsorted_segment_sum(joined("counts"), position, n),
        firsts("vectors"),
        firsts("meta"),
        firsts("slots"),
        tf.math.unsorted_segment_sum(grads, position, n),
    )


# -- eviction and counts -------------------------------------------------------------------


class StepClock:
    """When each global step was reached, as eviction passes saw it: turns ``ttl_seconds``
    into the oldest step it keeps. A row last seen at a step reached before ``now -
    ttl_seconds`` has not been seen since then. Samples older than ``horizon`` seconds
    (the longest ttl) are dropped. A fresh training process knows no step's time before
    its own start, so it evicts by seconds only once it has run ``ttl_seconds``: never too
    early."""

    def __init__(self, horizon: float) -> None:
        self.horizon = horizon
        self.samples: list[tuple[float, int]] = []  # (monotonic time, step), oldest first

    def record(self, now: float, step: int) -> None:
        self.samples.append((now, step))
        while len(self.samples) > 1 and self.samples[1][0] <= now - self.horizon:
            self.samples.pop(0)

    def step_at(self, when: float) -> int | None:
        """The latest step recorded at or before ``when``; None if none was."""
        found = None
        for at, step in self.samples:
            if at > when:
                break
            found = step
        return found


class Evictor:
    """Eviction passes over every table with a ttl or a cap, one function per shard, run
    on its ps (the keys and counts never leave it); with a ttl, the admission sketch's
    counts halve every ``ttl_steps`` steps (or ``ttl_seconds``)."""

    def __init__(self, layers: Sequence[DynamicEmbedding]) -> None:
        self.passes: list[tuple[DynamicEmbedding, PackedShard, Any]] = []
        self.aging: list[tuple[DynamicEmbedding, PackedShard]] = []
        self.aged_at: dict[int, tuple[float, int]] = {}
        horizon = max((layer.ttl_seconds or 0.0 for layer in layers), default=0.0)
        self.clock = StepClock(horizon)
        for layer in layers:
            if not (layer.ttl_steps or layer.ttl_seconds or layer.max_rows_per_shard):
                continue
            for shard in layer.packed:
                fn = tf.function(
                    functools.partial(evict, layer, shard),
                    input_signature=[tf.TensorSpec([], tf.int64)],
                )
                self.passes.append((layer, shard, fn))
                if (layer.ttl_steps or layer.ttl_seconds) and shard.sketch is not None:
                    self.aging.append((layer, shard))

    def oldest(self, layer: DynamicEmbedding, step: int, now: float) -> int:
        """The oldest last-seen step ``layer``'s ttls keep at ``step``, ``now``."""
        oldest = int(oldest_kept(step, layer.ttl_steps))
        if layer.ttl_seconds is not None:
            reached = self.clock.step_at(now - layer.ttl_seconds)
            if reached is not None:
                oldest = max(oldest, reached)
        return oldest

    def __call__(self, step: int, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        self.clock.record(now, step)
        evicted = 0
        for layer, shard, fn in self.passes:
            with shard.placed():
                evicted += int(fn(tf.constant(self.oldest(layer, step, now), tf.int64)))
        for layer, shard in self.aging:
            since_time, since_step = self.aged_at.setdefault(id(shard), (now, step))
            due = (layer.ttl_steps is not None and step - since_step >= layer.ttl_steps) or (
                layer.ttl_seconds is not None and now - since_time >= layer.ttl_seconds
            )
            if due:
                shard.sketch.halve()  # type: ignore[union-attr]
                self.aged_at[id(shard)] = (now, step)
        return evicted


def table_stats(layers: Sequence[DynamicEmbedding]) -> dict[str, dict[str, int]]:
    """Per table: live ``rows``, the ``admitted`` and ``evicted`` totals, its ``bytes`` on
    the ps tasks, and ``bytes/ps:N`` for each (shard N is on ps N), read from every ps."""
    stats: dict[str, dict[str, int]] = {}
    for layer in layers:
        found = {"rows": 0, "admitted": 0, "evicted": 0, "bytes": 0}
        for index, shard in enumerate(layer.packed):
            with shard.placed():
                rows = int(shard.size())
            admitted, evicted = (int(v) for v in shard.counters.numpy())
            nbytes = shard.nbytes(rows)
            found["rows"] += rows
            found["admitted"] += admitted
            found["evicted"] += evicted
            found["bytes"] += nbytes
            found[f"bytes/ps:{index}"] = nbytes
        stats[layer.name] = found
    return stats


class Evict:
    """The loop's action: the tables' counts published every ``publish_every`` seconds (the
    first at once), and an eviction pass every ``evict_every`` seconds."""

    def __init__(
        self,
        layers: Sequence[DynamicEmbedding],
        *,
        step: Any,
        publish: Any,
        evict_every: float = EVICT_EVERY,
        publish_every: float = PUBLISH_EVERY,
    ) -> None:
        self.layers = list(layers)
        self.evictor = Evictor(self.layers)
        self.step = step  # () -> the global step
        self.publish = publish  # (step, stats) -> None
        self.evict_every = evict_every
        self.publish_every = publish_every
        self.last_evict = time.monotonic()
        self.last_publish = -math.inf

    def __call__(self, loop: Any) -> None:
        now = time.monotonic()
        if self.evictor.passes and now - self.last_evict >= self.evict_every:
            self.last_evict = now
            step = self.step()
            evicted = self.evictor(step)
            if evicted:  # status and /metrics count them; a line every 5 s drowned the log
                log.debug("evicted %d rows at global step %d", evicted, step)
            self.last_publish = -math.inf  # the counts after it, now
        if now - self.last_publish >= self.publish_every:
            self.last_publish = now
            self.publish(self.step(), table_stats(self.layers))
