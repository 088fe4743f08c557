"""docs/serving.md, as a user would follow it: each job's checkpoint exported by
`psctl export`'s code, loaded as TensorFlow Serving loads it, and sent the request bodies
the page shows (TensorFlow Serving's REST row format, "instances", turned into the
signature's inputs as it does); the answers are the checkpoint's model's. The ctr request
is built from the page's raw Criteo line by the page's own Python."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from psctl.cluster.errors import ConfigError
from psctl.coordinator.data import criteo
from psctl.coordinator.job import load_job
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.job_model.model import JobModel
from psctl.coordinator.training.saving.saved_model import export
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(180)

PAGE = (REPO / "docs" / "serving.md").read_text()


def blocks(kind: str) -> list[str]:
    """The page's fenced code blocks of language ``kind`` ("" for none), in order."""
    found, lang, lines = [], None, []
    for line in PAGE.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, lines = line[3:].strip(), []
            else:
                if lang == kind:
                    found.append("\n".join(lines))
                lang = None
        elif lang is not None:
            lines.append(line)
    return found


def bodies() -> list[dict[str, Any]]:
    return [json.loads(text) for text in blocks("json")]


def tf_serving_predict(signature: Any, body: dict[str, Any]) -> np.ndarray:
    """What TensorFlow Serving's REST predict does with a row-format body: every instance
    is the one input's value, or an object of every input by name; stacked per input."""
    inputs = signature.structured_input_signature[1]
    instances = body["instances"]
    if len(inputs) == 1:
        [name] = inputs
        columns = {name: list(instances)}
    else:
        columns = {name: [instance[name] for instance in instances] for name in inputs}
    tensors = {name: tf.constant(columns[name], inputs[name].dtype) for name in inputs}
    return signature(**tensors)["outputs"].numpy()


def exported(job_spec: str, tmp_path: Path) -> tuple[Any, Any]:
    """The job's freshly built model saved as a checkpoint and exported as the docs say;
    (the SavedModel's serving_default, the checkpoint's model)."""
    job = load_job(job_spec)
    ckpt = tmp_path / "checkpoints"
    settings = TrainSettings.of(job=job_spec, checkpoint_dir=str(ckpt))
    made = export_model(job, settings)
    step = tf.Variable(7, dtype=tf.int64)
    made.checkpoint(step).save(str(ckpt / "ckpt"))
    out = export(job, settings, checkpoint=None, out=str(tmp_path / "models"))
    assert out.path == tmp_path / "models" / "7"
    return tf.saved_model.load(str(out.path)).signatures["serving_default"], made


def export_model(job: Any, settings: TrainSettings) -> JobModel:
    from psctl.coordinator.data.context import DataContext

    ctx = DataContext.from_settings(settings, worker_index=0, num_workers=1, batch_size=4)
    make = job.eval_dataset_fn or job.dataset_fn
    x_spec, y_spec = make(ctx).element_spec[:2]
    return JobModel(job, x_spec, y_spec)


def test_the_mlp_request_answers_the_checkpoints_logits(tmp_path: Path):
    serve, made = exported("mlp", tmp_path)
    body = bodies()[0]
    got = tf_serving_predict(serve, body)
    want = made.model(tf.constant(body["instances"], tf.float32), training=False).numpy()
    assert got.shape == (1, 10)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_the_named_inputs_request_takes_raw_strings_and_ids(tmp_path: Path):
    serve, made = exported(str(REPO / "tests" / "jobs" / "named.py"), tmp_path)
    body = bodies()[1]
    assert sorted(serve.structured_input_signature[1]) == ["country", "item", "nums", "tags"]
    got = tf_serving_predict(serve, body)
    features = {
        "country": tf.constant([i["country"] for i in body["instances"]]),
        "tags": tf.constant([i["tags"] for i in body["instances"]]),
        "item": tf.constant([i["item"] for i in body["instances"]], tf.int64),
        "nums": tf.constant([i["nums"] for i in body["instances"]], tf.float32),
    }
    assert got.shape == (2, 1)
    np.testing.assert_allclose(got, made.model(features, training=False).numpy(), atol=1e-5)


def test_the_ctr_export_answers_a_raw_criteo_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CTR_ROWS", "10k")
    [line_block] = [b for b in blocks("") if "\\t" in b]
    line = line_block.strip().replace("\\t", "\t")
    # The page's line is a valid Criteo line, and its Python makes the page's request of it.
    path = tmp_path / "line.tsv"
    path.write_text(line + "\n")
    criteo.check_files(str(path))
    scope: dict[str, Any] = {"lines": [line + "\n"]}  # as read from a file
    exec(blocks("python")[0], scope)  # defines instance(line), makes body of the lines
    body = bodies()[2]
    assert scope["body"] == body

    serve, made = exported("ctr", tmp_path)
    assert sorted(serve.structured_input_signature[1]) == ["categorical", "dense"]
    got = tf_serving_predict(serve, body)
    # The file reader's parse of the same line: the model's features, hashed as in training.
    x, _ = criteo.parse_lines(tf.constant([line]), 10_000)
    assert got.shape == (1, 1)
    np.testing.assert_allclose(got, made.model(x, training=False).numpy(), atol=1e-5)


def test_a_job_with_one_of_the_serving_functions_is_refused(tmp_path: Path):
    path = tmp_path / "half_serving_job.py"
    path.write_text(
        "from psctl.jobs.mlp import *  # noqa: F403\ndef serving_inputs():\n    return {}\n"
    )
    with pytest.raises(ConfigError, match="needs both serving_inputs\\(\\) and serving_feat"):
        load_job(str(path))


def test_a_job_reading_eval_files_exports_with_the_training_files_alone(tmp_path: Path):
    """`psctl export --train-data F` for a job whose eval_dataset_fn reads --eval-data:
    the training files' features give the signature (was: --eval-data is required)."""
    from psctl.coordinator.training.saving.saved_model import features_spec

    (tmp_path / "train.csv").write_text(
        "a,b,label\n" + "".join(f"{i},{i % 3},{i % 2}\n" for i in range(32))
    )
    path = tmp_path / "files_job.py"
    path.write_text(
        (REPO / "jobs" / "mlp.py").read_text()
        + "\n\ndef dataset_fn(ctx):\n    return data.train_dataset(ctx, label_dtype=tf.int64)\n"
        + "\n\ndef eval_dataset_fn(ctx):\n    return data.eval_dataset(ctx, label_dtype=tf.int64)\n"
    )
    job = load_job(str(path))
    settings = TrainSettings.of(job=str(path), train_data=str(tmp_path / "train.csv"))
    x_spec, _, source = features_spec(job, settings)
    assert source == "dataset_fn" and x_spec.shape.as_list() == [None, 2], (source, x_spec)
    with pytest.raises(ConfigError, match="--eval-data"):  # neither: the eval data's error
        features_spec(job, TrainSettings.of(job=str(path)))
