"""Sparse optimizer updates for psctl tables: the job's own Keras optimizer's rule, on the
rows a batch touched only, on the ps that holds them.

Each shard's gradient arrives as ``IndexedSlices``; repeated ids are summed first. Per row,
the update is Keras 3's dense update for that optimizer (same hyper-parameters, same step
count ``optimizer.iterations + 1``), with one deliberate difference for optimizers with
moments: rows a batch does not touch are left alone, so their moments do not decay
("lazy" Adam, momentum SGD). For a batch that touches every row the update equals the
dense one (tests/unit/embeddings/test_sparse.py).

Supported: Adam, Adagrad, SGD (with or without momentum, Nesterov), Ftrl. Slots are
created next to each shard (same ps) under the names Keras gives them ("momentum",
"velocity", "accumulator", "linear"), so that checkpoints hold them as Keras would.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import keras
import tensorflow as tf

from psctl.cluster.errors import ConfigError
from psctl.coordinator.embeddings.sharded import Table

log = logging.getLogger(__name__)

SUPPORTED = "Adam, Adagrad, SGD (momentum, Nesterov) and Ftrl"


def _hyper(optimizer: Any, name: str) -> float:
    value = getattr(optimizer, name)
    return float(value() if callable(value) else value)


def slot_kinds(optimizer: Any) -> tuple[str, ...]:
    """The slots Keras keeps per variable for ``optimizer``; ConfigError if unsupported."""
    if type(optimizer) is keras.optimizers.Adam:
        if optimizer.amsgrad:
            raise ConfigError(
                "create_optimizer", "Adam(amsgrad=True) has no sparse form here", "drop amsgrad"
            )
        return ("momentum", "velocity")
    if type(optimizer) is keras.optimizers.Adagrad:
        return ("accumulator",)
    if type(optimizer) is keras.optimizers.SGD:
        return ("momentum",) if _hyper(optimizer, "momentum") else ()
    if type(optimizer) is keras.optimizers.Ftrl:
        return ("accumulator", "linear")
    raise ConfigError(
        "create_optimizer",
        f"{type(optimizer).__name__} cannot update sharded (--max-shards) or "
        "DynamicEmbedding tables",
        f"use one of {SUPPORTED} (or, for sharded tables only, run without --max-shards)",
    )


def warn_unapplied(optimizer: Any, what: str) -> None:
    for option in ("clipnorm", "clipvalue", "global_clipnorm", "weight_decay"):
        if getattr(optimizer, option, None):
            log.warning("%s is not applied to %s", option, what)


def initial_slot_value(optimizer: Any, kind: str) -> float:
    if kind == "accumulator":
        return _hyper(optimizer, "initial_accumulator_value")
    return 0.0


class SparseRule:
    """The job optimizer's update rule on some rows of a table, on tensors: used for the
    fixed tables here and for the dynamic tables (embeddings/dynamic_updates.py)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.kinds = slot_kinds(optimizer)
        self._rule = self._rules()[type(optimizer).__name__]

    def initial(self, kind: str) -> float:
        return initial_slot_value(self.optimizer, kind)

    def learning_rate(self) -> Any:
        return tf.cast(tf.convert_to_tensor(self.optimizer.learning_rate), tf.float32)

    def __call__(
        self, read_w: Callable[[], Any], slots: dict[str, Any], g: Any, lr: Any, step: Any
    ) -> tuple[Any, dict[str, Any]]:
        """(the change to add to the rows' values, their new slot values), from their
        gradient ``g``, their slot values and ``read_w()`` (the rows' values, read only by
        the rules that need them)."""
        return self._rule(read_w, slots, g, lr, step)

    # -- the rules: Keras 3's update_step, per row, on tensors ---------------------------

    def _rules(self) -> dict[str, Callable[..., tuple[Any, dict[str, Any]]]]:
        return {"Adam": self._adam, "Adagrad": self._adagrad, "SGD": self._sgd, "Ftrl": self._ftrl}

    def _adam(
        self, read_w: Callable[[], Any], slots: dict[str, Any], g: Any, lr: Any, step: Any
    ) -> tuple[Any, dict[str, Any]]:
        opt, dtype = self.optimizer, g.dtype
        beta_1 = tf.constant(_hyper(opt, "beta_1"), dtype)
        beta_2 = tf.constant(_hyper(opt, "beta_2"), dtype)
        epsilon = tf.constant(_hyper(opt, "epsilon"), dtype)
        step = tf.cast(step, dtype)
        alpha = lr * tf.sqrt(1 - tf.pow(beta_2, step)) / (1 - tf.pow(beta_1, step))
        m, v = slots["momentum"], slots["velocity"]
        m = m + (g - m) * (1 - beta_1)
        v = v + (tf.square(g) - v) * (1 - beta_2)
        return -m * alpha / (tf.sqrt(v) + epsilon), {"momentum": m, "velocity": v}

    def _adagrad(
        self, read_w: Callable[[], Any], slots: dict[str, Any], g: Any, lr: Any, step: Any
    ) -> tuple[Any, dict[str, Any]]:
        epsilon = tf.constant(_hyper(self.optimizer, "epsilon"), g.dtype)
        acc = slots["accumulator"] + tf.square(g)
        return -lr * g / tf.sqrt(acc + epsilon), {"accumulator": acc}

    def _sgd(
        self, read_w: Callable[[], Any], slots: dict[str, Any], g: Any, lr: Any, step: Any
    ) -> tuple[Any, dict[str, Any]]:
        if "momentum" not in slots:
            return -lr * g, {}
        momentum = tf.constant(_hyper(self.optimizer, "momentum"), g.dtype)
        m = -g * lr + slots["momentum"] * momentum
        delta = -g * lr + m * momentum if self.optimizer.nesterov else m
        return delta, {"momentum": m}

    def _ftrl(
        self, read_w: Callable[[], Any], slots: dict[str, Any], g: Any, lr: Any, step: Any
    ) -> tuple[Any, dict[str, Any]]:
        opt, dtype = self.optimizer, g.dtype
        lr_power = tf.constant(_hyper(opt, "learning_rate_power"), dtype)
        l1 = tf.constant(_hyper(opt, "l1_regularization_strength"), dtype)
        l2 = tf.constant(_hyper(opt, "l2_regularization_strength"), dtype)
        shrinkage = tf.constant(_hyper(opt, "l2_shrinkage_regularization_strength"), dtype)
        beta = tf.constant(_hyper(opt, "beta"), dtype)
        l2 = l2 + beta / (2.0 * lr)
        w = read_w()
        acc, lin = slots["accumulator"], slots["linear"]
        grad_to_use = g + 2 * shrinkage * w
        new_acc = acc + tf.square(g)
        lin = lin + grad_to_use - (tf.pow(new_acc, -lr_power) - tf.pow(acc, -lr_power)) / lr * w
        quadratic = tf.pow(new_acc, -lr_power) / lr + 2 * l2
        clipped = tf.clip_by_value(lin, -l1, l1)
        new_w = (clipped - lin) / quadratic
        return new_w - w, {"accumulator": new_acc, "linear": lin}


class SparseUpdater:
    """Updates every psctl table with the job optimizer's rule; build it under the
    strategy's scope (its slots land next to their shards)."""

    def __init__(self, optimizer: Any, tables: Sequence[Table], strategy: Any) -> None:
        self.optimizer = optimizer
        self.tables = list(tables)
        self.rule = SparseRule(optimizer)
        self.kinds = self.rule.kinds
        warn_unapplied(optimizer, "the sharded embedding tables")
        for table in self.tables:
            for kind in self.kinds:
                table.slots[kind] = [
                    self._slot(strategy, shard, kind, i) for i, shard in enumerate(table.shards)
                ]

    def _slot(self, strategy: Any, shard: Any, kind: str, index: int) -> Any:
        value = initial_slot_value(self.optimizer, kind)
        shape, dtype = shard.shape, shard.dtype
        with strategy.extended.colocate_vars_with(shard):
            return tf.Variable(
                initial_value=lambda: tf.fill(shape, tf.constant(value, dtype)),
                shape=shape,
                dtype=dtype,
                trainable=False,
                name=f"{shard.name.split(':')[0]}/{kind}",
            )

    @property
    def shards(self) -> list[Any]:
        """Every table's shards, in the order ``apply`` takes their gradients."""
        return [shard for table in self.tables for shard in table.shards]

    def apply(self, grads: Sequence[Any], step: Any = None) -> None:
        """One step on the rows in ``grads`` (one per shard, as ``shards``). ``step`` is the
        1-based step count of the update; by default the one the Keras optimizer's
        ``apply_gradients`` is about to use (call this before it)."""
        lr = self.rule.learning_rate()
        step = tf.cast(self.optimizer.iterations + 1 if step is None else step, tf.float32)
        grads = list(grads)
        for table in self.tables:
            for i, shard in enumerate(table.shards):
                grad = grads.pop(0)
                if grad is None:
                    continue
                rows, values = _dedupe(grad, shard)
                slots = {kind: table.slots[kind][i] for kind in self.kinds}
                # On the shard's ps, as Keras's own updates run there (the strategy's
                # update() colocates them with the variable): the rows and their summed
                # gradient cross once; the slots are read, changed and written where they
                # live. Measured: 5% more steps/s at 1M rows than with the rule on the
                # worker (docs/performance.md, "Round trips and the network").
                with tf.device(shard.device):
                    self._update(shard, slots, rows, values, tf.cast(lr, shard.dtype), step)

    def _update(
        self, shard: Any, slots: dict[str, Any], rows: Any, values: Any, lr: Any, step: Any
    ) -> None:
        before = {kind: tf.gather(slot, rows) for kind, slot in slots.items()}
        delta, after = self.rule(
            functools.partial(tf.gather, shard, rows), before, values, lr, step
        )
        for kind, value in after.items():
            slots[kind].scatter_update(tf.IndexedSlices(value, rows))
        shard.scatter_add(tf.IndexedSlices(delta, rows))


def _dedupe(grad: Any, shard: Any) -> tuple[Any, Any]:
    """(unique rows, summed values) of one shard's gradient."""
    if not isinstance(grad, tf.IndexedSlices):  # a dense gradient: every row
        rows = tf.range(tf.shape(grad)[0])
        return rows, tf.cast(grad, shard.dtype)
    rows, position = tf.unique(grad.indices)
    values = tf.math.unsorted_segment_sum(grad.values, position, tf.shape(rows)[0])
    return rows, tf.cast(values, shard.dtype)
