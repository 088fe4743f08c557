"""One warning before training: a job whose workers would all read the same examples.

ParameterServerStrategy never shards a dataset function for the job, so a ``dataset_fn``
that ignores ``ctx.worker_index`` trains every worker on every example, silently. The
training process reads the first batch of worker 0's and worker 1's datasets (after the
DATA policy's sharding, as psctl reads them) before it builds the model, and says so once
when they are the same.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from psctl.coordinator.data.context import DataContext
from psctl.coordinator.job import Job
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.steps.programs import shard_for


def same_data_warning(job: Job, settings: TrainSettings, *, num_workers: int) -> str | None:
    """The warning line when workers 0 and 1 would start on the same batch, else None: one
    worker, and the tf.data service (``--epochs``, ``--follow``: it hands each worker its
    own part), have nothing to compare. A dataset whose workers shuffle differently (seeds
    by worker) cannot be told from a sharded one this way, nor one whose workers should
    read the same examples on purpose."""
    if num_workers < 2 or settings.data_service:
        return None
    contexts = [
        DataContext.from_settings(
            settings, worker_index=i, num_workers=num_workers, batch_size=settings.loop.batch_size
        )
        for i in (0, 1)
    ]
    first, second = (
        shard_for(job.dataset_fn(ctx), ctx.worker_index, num_workers) for ctx in contexts
    )
    if not same_first_batch(first, second):
        return None
    return (
        f"--job {job.name}: workers 0 and 1 read the same first batch: every worker may be "
        "training on every example; shard dataset_fn's data by worker, e.g. "
        "dataset.shard(ctx.num_workers, ctx.worker_index) (psctl's file readers do)"
    )


def same_first_batch(first: Any, second: Any) -> bool:
    """Whether two datasets start with equal batches (every tensor, shape and value)."""
    batches = [next(iter(dataset.take(1))) for dataset in (first, second)]
    leaves = [tf.nest.flatten(batch) for batch in batches]
    if len(leaves[0]) != len(leaves[1]):
        return False
    return all(
        a.shape == b.shape and bool(tf.reduce_all(tf.equal(a, b)))
        for a, b in zip(*leaves, strict=True)
    )
