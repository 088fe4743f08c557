"""A training run's checkpoint as a TensorFlow SavedModel for serving (`psctl export`).

The job's model is built in this process (no cluster) and restored from the checkpoint:
checkpoints hold sharded tables whole (embeddings/sharded.py), so the exported model looks
every id up in one table inside the graph. The SavedModel is written to ``OUT/<global
step>/``, the versioned layout TensorFlow Serving watches, with a ``serving_default``
signature whose inputs are what the job's dataset yields as features (one input,
``features``, for one tensor; one per feature, under the ``keras.Input`` names, for named
inputs) and whose outputs are ``outputs`` for a model of one output, else one per output
(training/job_model/outputs.py: a dict's keys, ``output_0``, ``output_1``, ... for a list).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import tensorflow as tf

from psctl.cluster.errors import ConfigError
from psctl.coordinator.data.context import DataContext
from psctl.coordinator.job import Job
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.job_model.features import feature_names
from psctl.coordinator.training.job_model.model import JobModel
from psctl.coordinator.training.job_model.outputs import named_outputs
from psctl.coordinator.training.saving.checkpoint_files import (
    Unusable,
    load_checked,
    restore_newest,
)

log = logging.getLogger(__name__)


def features_spec(job: Job, settings: TrainSettings) -> tuple[Any, Any, str]:
    """The features' and labels' specs, batch dimension open, from the job's own data, and
    the dataset function they came from."""
    ctx = DataContext.from_settings(settings, worker_index=0, num_workers=1, batch_size=1)
    source, make = "dataset_fn", job.dataset_fn
    if job.eval_dataset_fn is not None:
        source, make = "eval_dataset_fn", job.eval_dataset_fn
    try:
        x_spec, y_spec = make(ctx).element_spec[:2]
    except ConfigError as err:
        if make is job.dataset_fn:
            raise
        # The eval data is not at hand (an export given --train-data alone): the training
        # data's features are the same ones (psctl checks that before training).
        try:
            x_spec, y_spec = job.dataset_fn(ctx).element_spec[:2]
        except ConfigError:
            raise err from None
        source = "dataset_fn"

    def open_batch(spec: Any) -> Any:
        return tf.TensorSpec([None, *spec.shape[1:]], spec.dtype, name=spec.name)

    return tf.nest.map_structure(open_batch, x_spec), y_spec, source


def serving_module(
    model: Any,
    features: Any,
    names: list[str],
    preprocess: Callable[[Any], Any] | None = None,
) -> Any:
    """A ``tf.Module`` holding the model and its ``serve`` function, traced for
    ``features``' spec: one input per leaf of the features, under ``names`` (``features``
    for a model of one input; the ``keras.Input`` names for named inputs), and
    ``{"outputs": ...}`` out (one per output under its name for several,
    ``outputs.named_outputs``). ``preprocess``: the job's ``serving_features``, when the
    request is the job's ``serving_inputs()`` rather than the dataset's features."""
    leaves = tf.nest.flatten(features)
    signature = [
        tf.TensorSpec([None, *leaf.shape[1:]], leaf.dtype, name=name)
        for leaf, name in zip(leaves, names, strict=True)
    ]

    def serve(*tensors: Any) -> dict[str, Any]:
        inputs = tf.nest.pack_sequence_as(features, list(tensors))
        if preprocess is not None:
            inputs = preprocess(inputs)
        return named_outputs(model(inputs, training=False))

    module = tf.Module()
    module.model = model
    module.serve = tf.function(serve, input_signature=signature)
    return module


READY = "ready"  # psctl export --requests: the model is built, checkpoints may come
# psctl export --requests' answer to a scoring request (--export-if-better): SCORED + JSON
# {checkpoint prefix: the metric's value over the request's files}.
SCORED = "scored "


class Exported(NamedTuple):
    checkpoint: str  # the checkpoint's prefix
    path: Path  # OUT/<global step>


def export(job: Job, settings: TrainSettings, *, checkpoint: str | None, out: str) -> Exported:
    """Restore ``checkpoint`` (None: the newest usable one in ``--checkpoint-dir``, a
    damaged newer one skipped with a line saying why) into the job's model and save it to
    ``out/<step>/``."""
    return Exporter(job, settings).export(checkpoint, out)


class Exporter:
    """The job's model built once, in this process: each ``export`` restores a checkpoint
    into it and saves it (``--export-every``'s exporter keeps one for the whole run, so a
    version costs a restore and a save, not TensorFlow's import and the model's build)."""

    def __init__(self, job: Job, settings: TrainSettings) -> None:
        self.job, self.settings = job, settings
        x_spec, y_spec, source = features_spec(job, settings)
        self.built = JobModel(job, x_spec, y_spec, source=source)
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        self.saved = self.built.checkpoint(self.step)
        if job.serving_inputs is not None:  # the raw request, its features made in the graph
            request = job.serving_inputs()
            self.names = feature_names(None, request, job=job.name)
            self.module = serving_module(
                self.built.model, request, self.names, job.serving_features
            )
        else:
            self.names = feature_names(self.built.model, x_spec, job=job.name)
            self.module = serving_module(self.built.model, x_spec, self.names)

    def load(self, prefix: str) -> None:
        load_checked(self.saved, prefix, self.built.model.variables, partial=True)

    def export(self, checkpoint: str | None, out: str) -> Exported:
        if checkpoint is not None:
            try:
                self.load(checkpoint)
            except Unusable as err:
                raise ConfigError(
                    "--checkpoint",
                    f"{checkpoint} cannot be exported: {err}",
                    "give a checkpoint the --job's training run wrote (its ckpt-<step> prefix)",
                ) from None
        else:
            found = restore_newest(
                self.settings.checkpoints.checkpoint_dir, self.load, repair_state=False
            )
            if found is None:
                raise ConfigError(
                    "--checkpoint-dir",
                    f"no checkpoint in {self.settings.checkpoints.checkpoint_dir}",
                    "give the directory a training run wrote its checkpoints to",
                )
            checkpoint = found.prefix
        target = Path(out) / str(int(self.step.numpy()))
        if target.exists():
            raise ConfigError(
                "--out", f"{target} exists already", "remove it, or export to another --out"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        # Written aside, then renamed: TensorFlow Serving loads integer directories only,
        # and never sees a half-written one (the rename is atomic on one file system).
        partial = target.parent / f".{target.name}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        module = self.module
        tf.saved_model.save(module, str(partial), signatures={"serving_default": module.serve})
        os.rename(partial, target)
        outputs = sorted(module.serve.get_concrete_function().structured_outputs)
        log.info(
            "exported %s (global step %d) to %s; serving_default takes %s and returns %s",
            checkpoint,
            int(self.step.numpy()),
            target,
            ", ".join(self.names),
            ", ".join(outputs),
        )
        return Exported(checkpoint, target)
