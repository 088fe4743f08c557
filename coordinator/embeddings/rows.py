"""A dynamic table's rows (coordinator/embeddings/dynamic.py) and the rules that change
them, for a shard on a ps (embeddings/dynamic_updates.py) and for a layer trained in one
process by Keras' own ``fit`` or a ``GradientTape`` loop (dynamic.py): one rule for both.

- **The update after a step** (``update_rows``): each id counted and stamped with the
  step; admitted ids get the optimizer's sparse rule (embeddings/sparse.py), ids that reach
  ``admit_after`` their first vector.
- **Eviction** (``evict``): ids not seen for ``ttl_steps`` steps (or ``ttl_seconds``:
  dynamic_updates.StepClock turns it into a step), then the least recently
  seen beyond the cap on rows.

A table here is anything with ``write(keys, vectors, slots, count, last_seen)``,
``slot_kinds``, ``sketch`` (None, or the admission sketch), ``counters`` (int64
``[admitted, evicted]``), ``last_seen()`` (every key, and the step it was last seen) and
``remove(keys)``; a layer anything with ``admit_after``, ``output_dim`` and
``initial_rows`` (and, for eviction, ``ttl_steps`` and ``max_rows_per_shard``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tensorflow as tf

META_WIDTH = 3  # a checkpoint's meta rows: count, last_seen, admitted
COUNT, LAST_SEEN, ADMITTED = 0, 1, 2
ABSENT = -1  # the last_seen a key without a row reads on a ps
COUNTER_CAP = 2**30  # counts and steps stop here: as int32 bits, a finite float


@dataclass(frozen=True)
class Merged:
    """A table's lookups in one step, one row per distinct key: how often it occurred, the
    vector, meta row and slots it read, and its gradient."""

    keys: Any
    counts: Any
    vectors: Any
    meta: Any
    slots: Any
    grads: Any

    def rows(self, where: Any) -> Merged:
        """The rows at positions ``where``."""

        def pick(t: Any) -> Any:
            return None if t is None else tf.gather(t, where)

        return Merged(*(pick(t) for t in (self.keys, self.counts, self.vectors, self.meta,
                                          self.slots, self.grads)))  # fmt: skip


def dense(grad: Any, like: Any) -> Any:
    """A lookup's gradient as a tensor (zeros where its features did not reach the loss)."""
    if grad is None:
        return tf.zeros_like(like)
    return tf.convert_to_tensor(grad)


def update_rows(
    rule: Any, layer: Any, table: Any, rows: Merged, *, stamp: Any, lr: Any, opt_step: Any
) -> None:
    """Apply one step's gradient to ``rows`` of ``table`` (``rule``: the optimizer's
    ``SparseRule``): counts, stamps, admission and the rule, written in one insert."""
    keys = rows.keys
    admitted = rows.meta[:, ADMITTED] > 0
    absent = tf.logical_not(admitted)
    # The ids without a row: counted (in the sketch when admission takes more than one
    # sighting), and given their first vector when the count reaches admit_after.
    keys_n = tf.boolean_mask(keys, absent)
    seen = tf.boolean_mask(rows.counts, absent)
    if table.sketch is not None:
        seen = table.sketch.add(keys_n, seen)
    new = seen >= layer.admit_after
    keys_n, seen = tf.boolean_mask(keys_n, new), tf.boolean_mask(seen, new)
    n = tf.size(keys_n)
    # The admitted ids: the optimizer's rule, on their vectors and slots.
    keys_a = tf.boolean_mask(keys, admitted)
    w = tf.boolean_mask(rows.vectors, admitted)
    g = tf.boolean_mask(rows.grads, admitted)
    kinds = table.slot_kinds
    before: dict[str, Any] = {}
    if kinds:
        stacked = tf.split(tf.boolean_mask(rows.slots, admitted), len(kinds), axis=1)
        before = dict(zip(kinds, stacked, strict=True))
    delta, after = rule(lambda: w, before, g, lr, opt_step)
    vectors = [w + delta, layer.initial_rows(n, layer.output_dim, w.dtype)]
    slots = None
    if kinds:
        fresh = tf.boolean_mask(tf.boolean_mask(rows.slots, absent), new)  # the defaults
        slots = tf.concat([tf.concat([after[kind] for kind in kinds], axis=1), fresh], 0)
    count_a = tf.boolean_mask(rows.meta[:, COUNT] + rows.counts, admitted)
    count = tf.concat([count_a, seen], 0)
    # One insert: each key's row, vector, slots and counts together.
    table.write(
        tf.concat([keys_a, keys_n], 0),
        tf.concat(vectors, 0),
        slots,
        count,
        tf.fill(tf.shape(count), stamp),
    )
    table.counters.assign_add(tf.stack([tf.cast(n, tf.int64), tf.constant(0, tf.int64)]))


def oldest_kept(step: Any, ttl_steps: int | None) -> Any:
    """The oldest last-seen step ``ttl_steps`` keeps at ``step`` (int64; its minimum
    where there is no ttl)."""
    if ttl_steps is None:
        return tf.constant(tf.int64.min, tf.int64)
    return tf.cast(step, tf.int64) - ttl_steps


def to_remove(last_seen: Any, oldest: Any, max_rows: int | None) -> Any:
    """Which rows (by their ``last_seen`` steps) an eviction pass removes: those last seen
    before step ``oldest`` (``oldest_kept``; with ``ttl_seconds``, the later of the two
    ttls' steps), then the least recently seen beyond ``max_rows``."""
    remove = last_seen < oldest
    if max_rows is not None:
        kept = tf.logical_not(remove)
        # int64: a cap beyond int32 (up to layers.MAX_SETTING) keeps every row.
        kept_count = tf.reduce_sum(tf.cast(kept, tf.int64))
        excess = tf.cast(tf.maximum(kept_count - max_rows, 0), tf.int32)
        age = tf.where(kept, -last_seen, tf.fill(tf.shape(last_seen), tf.int64.min))
        _, oldest = tf.math.top_k(age, k=excess)
        hits = tf.scatter_nd(oldest[:, None], tf.ones_like(oldest, tf.bool), tf.shape(kept))
        remove = tf.logical_or(remove, hits)
    return remove


def evict(layer: Any, table: Any, oldest: Any) -> Any:
    """Remove ``table``'s rows last seen before step ``oldest`` and beyond
    ``layer.max_rows_per_shard`` (``to_remove``), counted in ``table.counters``; how many
    were removed."""
    keys, last_seen = table.last_seen()
    remove = to_remove(last_seen, oldest, layer.max_rows_per_shard)
    table.remove(tf.boolean_mask(keys, remove))
    evicted = tf.reduce_sum(tf.cast(remove, tf.int64))
    table.counters.assign_add(tf.stack([tf.constant(0, tf.int64), evicted]))
    return evicted
