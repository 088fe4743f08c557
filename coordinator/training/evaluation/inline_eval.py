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

Other Keras metrics (AUC, precision, recall, ...) go through Keras's stateless API: each
shard starts from zeroed metric state, returns it, and the coordinator adds the shards'
states and asks the metric for its result, so AUC is the whole eval set's (Keras's own
metrics keep additive state: confusion-matrix counts, sums). The evaluation function is
registered on every worker the first time it is scheduled: a worker frozen at that moment
holds that up (TensorFlow), as it would any new function.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import tensorflow as tf

from psctl.cluster.errors import ConfigError
from psctl.coordinator.failures import Decision, FailurePolicy, classify
from psctl.coordinator.training.evaluation.report import eval_line
from psctl.coordinator.training.inflight import remote_done
from psctl.coordinator.training.reporting.publish import Publisher
from psctl.coordinator.training.steps.graph_ops import sum_count
from psctl.coordinator.training.steps.programs import Runtime

log = logging.getLogger(__name__)


class InlineEval:
    def __init__(
        self,
        rt: Runtime,
        publisher: Publisher,
        policy: FailurePolicy,
        *,
        every: int,
        start_step: int,
    ) -> None:
        if rt.job.eval_dataset_fn is None:
            raise ConfigError(
                "--eval-every",
                f"the job {rt.job.name} has no eval_dataset_fn",
                "define eval_dataset_fn(ctx) in the job, or drop --eval-every",
            )
        self.rt = rt
        self.publisher = publisher
        self.policy = policy
        self.every = every
        self.num_shards = rt.num_workers
        self.next_step = (start_step // every + 1) * every
        self.names = rt.state.mean_names
        # The training state's other metrics, for their state's shapes and their stateless
        # update and result only: their own variables are never read or written here.
        self.others = rt.state.other_metrics
        self.fn: Any = None
        self.pending: dict[int, Any] = {}  # shard -> RemoteValue
        self.results: dict[int, Any] = {}  # shard -> [[sum, count], ...]
        self.step = 0
        self.started = 0.0
        self.last: dict[str, float] = {}

    def _make_fn(self) -> Any:
        rt, shards = self.rt, self.num_shards
        model, loss_fn, eval_dataset_fn = rt.state.model, rt.job.loss_fn, rt.job.eval_dataset_fn
        mean_metrics, batch_size = rt.state.mean_metrics, rt.settings.evaluation.eval_batch_size
        others = self.others
        assert eval_dataset_fn is not None  # checked in __init__

        def eval_step(carry: Any, batch: Any) -> Any:
            sums, states = carry
            x, y = batch[0], batch[1]
            predictions = model(x, training=False)
            rows = [sum_count(loss_fn(y, predictions))]
            rows += [sum_count(fn(y, predictions, **kw)) for _, fn, kw in mean_metrics]
            states = tuple(
                tuple(
                    tf.convert_to_tensor(v)
                    for v in metric.stateless_update_state(list(state), y, predictions)
                )
                for metric, state in zip(others, states, strict=True)
            )
            return sums + tf.stack(rows), states

        def eval_fn(shard: tf.Tensor) -> Any:
            dataset = eval_dataset_fn(rt.data_context(shard, shards, batch_size))
            sums = tf.zeros([1 + len(mean_metrics), 2], tf.float64)
            states = tuple(
                tuple(tf.zeros(v.shape, v.dtype) for v in metric.variables) for metric in others
            )
            return dataset.reduce((sums, states), eval_step)

        return tf.function(eval_fn)

    def _schedule(self, shard: int) -> None:
        index = tf.constant(shard, tf.int64)
        self.pending[shard] = self.rt.coordinator.schedule(self.fn, args=(index,))

    def tick(self, completed: int) -> None:
        """Called by the loop: collect finished shards; start an evaluation when due."""
        self.poll()
        if completed >= self.next_step and not self.pending:
            self.next_step = (completed // self.every + 1) * self.every
            if self.fn is None:
                self.fn = self._make_fn()
            self.step = self.rt.state.step()
            self.started = time.monotonic()
            self.results = {}
            for shard in range(self.num_shards):
                self._schedule(shard)

    def poll(self) -> None:
        for shard, remote in list(self.pending.items()):
            if not remote_done(remote):
                continue
            del self.pending[shard]
            try:
                self.results[shard] = remote.fetch()
            except BaseException as err:
                if self.policy.decide(classify(err)) is not Decision.RESCHEDULE:
                    raise
                log.warning("eval shard %d failed with its worker: scheduled again", shard)
                self._schedule(shard)
        if self.results and len(self.results) == self.num_shards and not self.pending:
            self._publish()

    def _publish(self) -> None:
        shards = [self.results[shard] for shard in range(self.num_shards)]
        self.results = {}
        totals = sum(sums for sums, _ in shards)
        values = {
            name: float(total / count) if count else float("nan")
            for name, (total, count) in zip(self.names, totals, strict=True)
        }
        for i, metric in enumerate(self.others):
            state = [
                sum(states[i][j] for _, states in shards) for j in range(len(metric.variables))
            ]
            values[metric.name] = float(metric.stateless_result(state))
        examples = int(totals[0][1])
        where = f"{self.num_shards} shards on the workers"
        seconds = time.monotonic() - self.started
        log.info(
            "%s", eval_line(self.step, values, examples=examples, seconds=seconds, where=where)
        )
        self.last = values
        self.publisher.evaluation(values, step=self.step)
