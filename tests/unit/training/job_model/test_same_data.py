"""``same_data_warning``: the training process's one warning for a job whose workers would
all read the same examples, from the first batch of worker 0's and worker 1's datasets."""

from __future__ import annotations

from pathlib import Path

import pytest

from psctl.coordinator.job import load_job
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.job_model.same_data import same_data_warning

pytestmark = pytest.mark.timeout(120)

UNSHARDED = """
import tensorflow as tf
from psctl.jobs.mlp import create_model, create_optimizer, loss_fn, make_data, metrics  # noqa: F401

def dataset_fn(ctx):
    x, y, _, _ = make_data()
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(ctx.batch_size)
"""

# The same, sharded by tf.data's DATA policy: psctl shards it by worker (shard_for).
DATA_POLICY = """
import tensorflow as tf
from psctl.jobs.mlp import create_model, create_optimizer, loss_fn, make_data, metrics  # noqa: F401

def dataset_fn(ctx):
    x, y, _, _ = make_data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(ctx.batch_size)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)
"""


def _job(tmp_path: Path, text: str) -> tuple[object, TrainSettings]:
    job = tmp_path / "a_job.py"
    job.write_text(text)
    return load_job(str(job)), TrainSettings.of(job=str(job))


def test_workers_reading_the_same_examples_get_one_warning(tmp_path: Path):
    job, settings = _job(tmp_path, UNSHARDED)
    warning = same_data_warning(job, settings, num_workers=2)
    assert warning is not None
    assert "workers 0 and 1 read the same first batch" in warning and "shard" in warning
    assert "\n" not in warning
    assert same_data_warning(job, settings, num_workers=1) is None  # one worker: fine
    epochs = TrainSettings.of(job=settings.job, epochs=1)  # the tf.data service splits it
    assert same_data_warning(job, epochs, num_workers=2) is None


def test_sharded_datasets_get_none(tmp_path: Path):
    assert same_data_warning(load_job("mlp"), TrainSettings.of(job="mlp"), num_workers=2) is None
    job, settings = _job(tmp_path, DATA_POLICY)
    assert same_data_warning(job, settings, num_workers=2) is None
