"""``check_job``: what psctl local checks of a job beside its starting servers, in one
process without a cluster, and without allocating the model's variables."""

from __future__ import annotations

import resource
from pathlib import Path

import keras
import pytest

from psctl.cluster.errors import ConfigError
from psctl.coordinator.job import load_job
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.job_model.job_check import check_job

pytestmark = pytest.mark.timeout(120)

RENAMED = """
from tests.jobs.named import *  # noqa: F403
from tests.jobs import named


def dataset_fn(ctx):
    rename = lambda x, y: ({("countri" if k == "country" else k): v for k, v in x.items()}, y)
    return named.dataset_fn(ctx).map(rename)
"""

# A 20M x 64 float32 table: 5.1 GB if its variable were made.
HUGE = """
import keras
import tensorflow as tf
from psctl.jobs.mlp import create_optimizer, loss_fn  # noqa: F401

def create_model():
    item = keras.Input((1,), dtype="int64", name="item")
    vectors = keras.layers.Embedding(20_000_000, 64)(item)
    return keras.Model(item, keras.layers.Dense(1)(keras.layers.Flatten()(vectors)))

def dataset_fn(ctx):
    ids = tf.data.Dataset.range(1000).map(lambda i: ({"item": tf.reshape(i, [1])}, 1.0))
    return ids.batch(ctx.batch_size)

metrics = []
"""


UNSHARDED = """
import tensorflow as tf
from psctl.jobs.mlp import create_model, create_optimizer, loss_fn, make_data, metrics  # noqa: F401

def dataset_fn(ctx):
    x, y, _, _ = make_data()
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(ctx.batch_size)
"""


def test_a_good_job_passes_and_a_renamed_key_is_one_line(tmp_path: Path):
    assert check_job(load_job("mlp"), TrainSettings.of(job="mlp"), num_workers=2) == []
    job = tmp_path / "renamed_job.py"
    job.write_text(RENAMED)
    with pytest.raises(ConfigError) as err:
        check_job(load_job(str(job)), TrainSettings.of(job=str(job)), num_workers=2)
    assert "'countri', which the model has no input for" in str(err.value)
    assert "\n" not in str(err.value)


def test_the_model_is_checked_without_its_variables(tmp_path: Path):
    job = tmp_path / "huge_job.py"
    job.write_text(HUGE)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    check_job(load_job(str(job)), TrainSettings.of(job=str(job)), num_workers=2)
    # Nor later: Keras makes every deferred variable when a stateless scope ends (its own
    # symbolic calls open one); the check leaves none of its own behind.
    with keras.StatelessScope():
        pass
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - before
    assert grown < 1 << 30, f"the check allocated {grown / 2**30:.1f} GiB"


def test_workers_reading_the_same_examples_get_one_warning(tmp_path: Path):
    job = tmp_path / "unsharded_job.py"
    job.write_text(UNSHARDED)
    settings = TrainSettings.of(job=str(job))
    (warning,) = check_job(load_job(str(job)), settings, num_workers=2)
    assert "workers 0 and 1 read the same first batch" in warning and "shard" in warning
    assert check_job(load_job(str(job)), settings, num_workers=1) == []  # one worker: fine
