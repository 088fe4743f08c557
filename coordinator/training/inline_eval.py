"""``--eval-every N``: distributed evaluation while training, over the whole eval set once.

The eval set is split into S shards (one per worker): the job's ``eval_dataset_fn`` is
called with ``DataContext(worker_index=shard, num_workers=S)``, inside the scheduled
function, so each worker reads only its shard. Each shard's call returns
``[sum, count]`` rows for the loss and every mean metric to the coordinator, which keeps
ONE result per shard index: a call rerun after a worker failure (``schedule`` is
at-least-once) can't count a shard twice, and a call that fails back to us is scheduled
again, so every eval example counts exactly once. The calls queue behind the train calls
already scheduled and never block the loop; the result is published when every shard is
in, under the global step read when the evaluation started.

Metrics that are not means (e.g. AUC) are left to the final evaluation on the
coordinator. The evaluation function is registered on every worker the first time it is
scheduled: a worker frozen at that moment holds that up (TensorFlow), as it would any
new function.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from psctl.cluster.errors import ConfigError
from psctl.coordinator.training.graph_ops import sum_count
from psctl.coordinator.training.trainer import _is_done, _only_workers_failed

if TYPE_CHECKING:
    from psctl.coordinator.training.trainer import Trainer

log = logging.getLogger(__name__)


class InlineEval:
    def __init__(self, trainer: Trainer, *, every: int, start_step: int) -> None:
        if trainer.job.eval_dataset_fn is None:
            raise ConfigError(
                "--eval-every",
                f"the job {trainer.job.name} has no eval_dataset_fn",
                "define eval_dataset_fn(ctx) in the job, or drop --eval-every",
            )
        self.t = trainer
        self.every = every
        self.num_shards = trainer.num_workers
        self.next_step = (start_step // every + 1) * every
        self.names = ["loss"] + [name for name, _, _ in trainer.mean_metrics]
        self.fn: Any = None
        self.pending: dict[int, Any] = {}  # shard -> RemoteValue
        self.results: dict[int, Any] = {}  # shard -> [[sum, count], ...]
        self.step = 0
        self.started = 0.0
        self.last: dict[str, float] = {}

    def _make_fn(self) -> Any:
        t, shards = self.t, self.num_shards
        model, loss_fn, eval_dataset_fn = t.model, t.job.loss_fn, t.job.eval_dataset_fn
        mean_metrics, batch_size = t.mean_metrics, t.settings.eval_batch_size
        assert eval_dataset_fn is not None  # checked in __init__

        @tf.function
        def eval_fn(shard: tf.Tensor) -> tf.Tensor:
            dataset = eval_dataset_fn(t._context(shard, shards, batch_size))
            sums = tf.zeros([1 + len(mean_metrics), 2], tf.float64)
            for batch in dataset:
                x, y = batch[0], batch[1]
                predictions = model(x, training=False)
                rows = [sum_count(loss_fn(y, predictions))]
                rows += [sum_count(fn(y, predictions, **kw)) for _, fn, kw in mean_metrics]
                sums += tf.stack(rows)
            return sums

        return eval_fn

    def _schedule(self, shard: int) -> None:
        index = tf.constant(shard, tf.int64)
        self.pending[shard] = self.t.coordinator.schedule(self.fn, args=(index,))

    def tick(self, completed: int) -> None:
        """Called by the loop: collect finished shards; start an evaluation when due."""
        self.poll()
        if completed >= self.next_step and not self.pending:
            self.next_step = (completed // self.every + 1) * self.every
            if self.fn is None:
                self.fn = self._make_fn()
            self.step = int(self.t.global_step.numpy())
            self.started = time.monotonic()
            self.results = {}
            for shard in range(self.num_shards):
                self._schedule(shard)

    def poll(self) -> None:
        for shard, remote in list(self.pending.items()):
            if not _is_done(remote):
                continue
            del self.pending[shard]
            try:
                self.results[shard] = remote.fetch()
            except (tf.errors.UnavailableError, tf.errors.AbortedError) as err:
                if not _only_workers_failed(err):
                    raise
                log.warning("eval shard %d failed with its worker: scheduled again", shard)
                self._schedule(shard)
        if self.results and len(self.results) == self.num_shards and not self.pending:
            self._publish()

    def _publish(self) -> None:
        totals = sum(self.results[shard] for shard in range(self.num_shards))
        self.results = {}
        values = {
            name: float(total / count) if count else float("nan")
            for name, (total, count) in zip(self.names, totals, strict=True)
        }
        examples = int(totals[0][1])
        log.info(
            "eval | step: %6d | %s | %d examples in %.2fs (%d shards on the workers)",
            self.step,
            " | ".join(f"{k}: {v:.4f}" for k, v in values.items()),
            examples,
            time.monotonic() - self.started,
            self.num_shards,
        )
        self.last = values
        self.t.report_eval(values, step=self.step)
