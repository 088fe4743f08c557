"""Models of several outputs (a dict or a list of them) and a subclassed model over a dict:
the outputs' names, metrics per output, evaluation over structured labels, the exported
signature's outputs, and the eval features checked against the training features' keys
(coordinator/training/job_model/outputs.py, metric_objects.py and model.py,
training/evaluation/final_eval.py)."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from psctl.cluster.errors import EXIT_CONFIG, ConfigError
from psctl.coordinator.data.context import DataContext
from psctl.coordinator.job import load_job
from psctl.coordinator.training.evaluation.final_eval import DatasetEvaluator
from psctl.coordinator.training.job_model.features import feature_names
from psctl.coordinator.training.job_model.metric_objects import (
    metric_kind,
    structured_metric_factories,
)
from psctl.coordinator.training.job_model.model import JobModel
from psctl.coordinator.training.job_model.outputs import named_outputs, output_keys
from psctl.coordinator.training.saving.saved_model import serving_module
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)

MULTI = str(REPO / "tests" / "jobs" / "multi_output.py")
CTX = DataContext(worker_index=0, num_workers=1, batch_size=64, seed=1)
ONE = tf.TensorSpec([None, 1], tf.float32)
LABEL = {"c": ONE, "r": ONE}
PRED = {"c": ONE, "r": ONE}


def test_outputs_are_named_by_key_or_position():
    assert output_keys(PRED) == [("c", "c"), ("r", "r")]
    assert output_keys([ONE, ONE]) == [("output_0", 0), ("output_1", 1)]
    assert output_keys(ONE) == []
    a, b = tf.zeros([2, 1]), tf.ones([2, 3])
    assert named_outputs(a) == {"outputs": a}
    assert sorted(named_outputs({"r": b, "c": a})) == ["c", "r"]
    assert sorted(named_outputs([a, b])) == ["output_0", "output_1"]
    assert sorted(named_outputs({"x": {"p": a, "q": b}, "y": a})) == ["x_p", "x_q", "y"]


def test_metrics_per_output_are_named_and_read_their_output_only():
    specs = {"c": ["accuracy", keras.metrics.AUC(name="auc")], "r": "mae"}
    made = [m() for m in structured_metric_factories(specs, label_spec=LABEL, pred_spec=PRED)]
    assert [m.name for m in made] == ["c_accuracy", "c_auc", "r_mean_absolute_error"]
    assert [metric_kind(m).__name__ for m in made] == [
        "MeanMetricWrapper",
        "AUC",
        "MeanMetricWrapper",
    ]
    y = {"c": tf.constant([[1.0], [0.0]]), "r": tf.constant([[1.0], [2.0]])}
    p = {"c": tf.constant([[0.9], [0.8]]), "r": tf.constant([[1.5], [2.5]])}
    for metric in made:
        metric.update_state(y, p)
    assert [float(m.result()) for m in made] == pytest.approx([0.5, 1.0, 0.5])
    # A list of one entry per output, by position, as compile(metrics=[...]) takes it.
    made = [
        m()
        for m in structured_metric_factories(
            [None, ["mse"]], label_spec=(ONE, ONE), pred_spec=[ONE, ONE]
        )
    ]
    assert [m.name for m in made] == ["output_1_mean_squared_error"]


def test_metrics_that_do_not_say_their_output_or_labels_of_another_structure_are_refused():
    with pytest.raises(ConfigError) as caught:
        structured_metric_factories(["accuracy"], label_spec=LABEL, pred_spec=PRED, job="j.py")
    assert caught.value.exit_status == EXIT_CONFIG
    assert "which of the model's outputs (c, r)" in str(caught.value)
    with pytest.raises(ConfigError, match=r"the labels are one tensor where the model has"):
        structured_metric_factories({"c": "mae"}, label_spec=ONE, pred_spec=PRED, job="j.py")
    with pytest.raises(ConfigError, match=r"the model has one output"):
        structured_metric_factories({"c": "mae"}, label_spec=ONE, pred_spec=ONE, job="j.py")


@pytest.mark.parametrize("mode", ["dict", "list"])
def test_multi_output_job_evaluates_and_exports_one_output_per_model_output(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("MULTI_OUTPUT", mode)
    job = load_job(MULTI)  # the file runs again: its outputs are the mode's
    dataset = job.eval_dataset_fn(CTX)
    built = JobModel(job, *dataset.element_spec)
    evaluator = DatasetEvaluator(built.model, job.loss_fn, built.metric_factories, compiled=True)
    values, examples = evaluator.run(dataset)
    prefix = ["c", "r"] if mode == "dict" else ["output_0", "output_1"]
    assert examples == 1024
    assert sorted(values) == sorted(
        ["loss", f"{prefix[0]}_accuracy", f"{prefix[0]}_auc", f"{prefix[1]}_mean_absolute_error"]
    )
    x_spec = dataset.element_spec[0]
    names = feature_names(built.model, x_spec, job=job.name)
    module = serving_module(built.model, x_spec, names)
    tf.saved_model.save(module, str(tmp_path / "1"), signatures={"serving_default": module.serve})
    serve = tf.saved_model.load(str(tmp_path / "1")).signatures["serving_default"]
    features, _ = next(iter(dataset))
    got = serve(features=features)
    assert sorted(got) == prefix
    want = tf.nest.flatten(built.model(features, training=False))
    for name, value in zip(prefix, want, strict=True):
        np.testing.assert_allclose(got[name].numpy(), value.numpy(), atol=1e-5)


class _OverDict(keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x: dict[str, tf.Tensor]) -> tf.Tensor:
        return self.dense(tf.concat([x["a"], tf.cast(x["b"], tf.float32)], -1))


class _Job:
    name = "j.py"
    metrics = ("accuracy",)

    @staticmethod
    def create_model() -> keras.Model:
        return _OverDict()

    @staticmethod
    def create_optimizer() -> keras.optimizers.Optimizer:
        return keras.optimizers.SGD()


def test_a_subclassed_model_over_a_dict_is_checked_and_exported_by_the_features_keys():
    x_spec = {"a": tf.TensorSpec([None, 5], tf.float32), "b": tf.TensorSpec([None, 2], tf.int64)}
    built = JobModel(_Job(), x_spec, tf.TensorSpec([None], tf.int64))  # type: ignore[arg-type]
    built.check(x_spec, "eval_dataset_fn")  # was: lacks 'keras_tensor', has 'a', 'b'
    assert feature_names(built.model, x_spec, job="j.py") == ["a", "b"]
    renamed = {"a": x_spec["a"], "bb": x_spec["b"]}
    with pytest.raises(ConfigError) as caught:
        built.check(renamed, "eval_dataset_fn")
    assert "eval_dataset_fn's features lack 'b'" in str(caught.value)
    assert "have 'bb', which the model has no input for" in str(caught.value)
    assert "keras_tensor" not in str(caught.value)
