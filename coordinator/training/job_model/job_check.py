"""What psctl local checks of a job beside its starting servers (``psctl train
--check-job``): in one process, without a cluster, without allocating the model's variables.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf
from keras.src.backend.common import global_state  # no public way to drop deferred variables

from psctl.cluster.errors import ConfigError
from psctl.coordinator.data.context import DataContext
from psctl.coordinator.data.files import file_list
from psctl.coordinator.data.follow import PartitionWatcher
from psctl.coordinator.job import Job
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.job_model.features import (
    check_features,
    model_inputs,
    symbolic,
)
from psctl.coordinator.training.steps.programs import shard_for

UNINITIALIZED = "uninitialized_variables"  # Keras' list (keras/src/backend/common/variables.py)


def check_job(job: Job, settings: TrainSettings, *, num_workers: int) -> list[str]:
    """What a job can get wrong without a cluster, found in seconds: its functions
    (loading it checks that they exist), the training and eval datasets' features against
    the model's inputs (keys, dtypes, structure), and the optimizer. ConfigError (one line)
    where one does not fit. psctl local runs it beside its starting servers; what needs
    the model built (metrics against predictions) is left to the training process.

    The model's layer weights are never initialized (``weights_deferred``): no table is
    allocated here (a 10M-row one would take gigabytes in this process). A model that
    cannot be made so is left to the training process too.

    Returns warnings: a dataset that every worker reads alike (``same_data_warning``)."""
    ctx = DataContext.from_settings(
        settings, worker_index=0, num_workers=num_workers, batch_size=settings.loop.batch_size
    )
    if settings.data.follow:  # the first complete partition's files, if one is there yet
        watcher = PartitionWatcher(
            settings.data.train_data,
            marker=settings.data.follow_marker,
            settle_seconds=settings.data.settle_seconds,
        )
        ready = watcher.look(()).ready
        if not ready:  # the training process checks the first partition when it lands
            job.create_optimizer()
            return []
        ctx = dataclasses.replace(ctx, train_data=file_list(list(ready[0].files)))
    dataset = job.dataset_fn(ctx)
    x_spec = dataset.element_spec[0]
    warnings = []
    if num_workers > 1 and not settings.data_service:  # the tf.data service splits it
        second = DataContext.from_settings(
            settings, worker_index=1, num_workers=num_workers, batch_size=settings.loop.batch_size
        )
        warning = same_data_warning(
            job.name,
            shard_for(dataset, 0, num_workers),  # AutoShardPolicy.DATA: as psctl reads it
            shard_for(job.dataset_fn(second), 1, num_workers),
        )
        if warning:
            warnings.append(warning)
    job.create_optimizer()
    with weights_deferred():
        try:
            model = job.create_model()
        except ConfigError:
            raise
        except Exception:  # a model that reads its weights while it is made: left to training
            return warnings
        inputs = model_inputs(model)
        declared = inputs if inputs is not None else symbolic(x_spec)
        check_features(declared, x_spec, job=job.name, source="dataset_fn")
        if job.eval_dataset_fn is not None:
            eval_ctx = DataContext.from_settings(
                settings,
                worker_index=0,
                num_workers=1,
                batch_size=settings.evaluation.eval_batch_size,
            )
            eval_x = job.eval_dataset(eval_ctx).element_spec[0]
            check_features(declared, eval_x, job=job.name, source="eval_dataset_fn")
    return warnings


@contextlib.contextmanager
def weights_deferred() -> Iterator[None]:
    """Layer weights made meanwhile are never initialized: each ``Layer.add_weight`` runs
    in a Keras stateless scope, which defers a variable made from an initializer and
    leaves it so (``initialize_variables=False``). Other variables (an optimizer's step
    counter, made with a value in a compiled model's ``create_model``) are made as usual:
    a whole stateless scope refuses them. Only for this check's own process."""
    original = keras.layers.Layer.add_weight
    # Keras keeps the deferred variables in a list, and the next stateless scope anywhere
    # in the process that ends with initialize_variables=True (Keras' own symbolic calls
    # open one) would make them all: the list is put back as it was.
    pending = list(global_state.get_global_attribute(UNINITIALIZED, []) or [])

    def add_weight(self: Any, *args: Any, **kwargs: Any) -> Any:
        with keras.StatelessScope(initialize_variables=False):
            return original(self, *args, **kwargs)

    keras.layers.Layer.add_weight = add_weight
    try:
        yield
    finally:
        keras.layers.Layer.add_weight = original
        global_state.set_global_attribute(UNINITIALIZED, pending)


def same_data_warning(job: str, first: Any, second: Any) -> str | None:
    """One line when worker 0's and worker 1's datasets start with the same batch: each
    worker would train on every example (a dataset function that does not shard by
    ``ctx.worker_index``; ParameterServerStrategy never shards for the job). A dataset
    whose workers shuffle differently (seeds by worker) cannot be told from a sharded one
    this way, nor one whose workers should read the same examples on purpose."""
    batches = [next(iter(dataset.take(1))) for dataset in (first, second)]
    leaves = [tf.nest.flatten(batch) for batch in batches]
    if len(leaves[0]) != len(leaves[1]):
        return None
    for a, b in zip(*leaves, strict=True):
        if a.shape != b.shape or not bool(tf.reduce_all(tf.equal(a, b))):
            return None
    return (
        f"--job {job}: workers 0 and 1 read the same first batch: every worker may be "
        "training on every example; shard dataset_fn's data by worker, e.g. "
        "dataset.shard(ctx.num_workers, ctx.worker_index) (psctl's file readers do)"
    )
