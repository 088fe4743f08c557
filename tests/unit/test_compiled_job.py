"""Jobs that leave the optimizer, loss and metrics to a compiled model (``compile()``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import keras
import numpy as np
import pytest
import tensorflow as tf

from psctl.cluster.errors import ConfigError
from psctl.coordinator.data.context import DataContext
from psctl.coordinator.job import load_job
from psctl.coordinator.training.job_model.metric_objects import metric_factories
from psctl.coordinator.training.job_model.model import JobModel
from psctl.coordinator.training.reporting.summary import accuracy_of
from tests.conftest import REPO

HEAD = """
import keras
import tensorflow as tf
built = []
def dataset_fn(ctx):
    x = tf.random.stateless_normal([8, 4], seed=[1, 2])
    return tf.data.Dataset.from_tensor_slices((x, tf.range(8) % 3)).batch(4)
def create_model():
    built.append(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
"""
OBJECTS = (
    HEAD
    + """
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=0.002),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(), "accuracy"],
    )
    return model
"""
)
STRINGS = (
    HEAD
    + """
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model
"""
)
NOT_COMPILED = HEAD + "    return model\n"

LABELS = tf.constant([0, 2])
LOGITS = tf.constant([[2.0, 0.0, -1.0], [0.5, 0.1, 3.0]])


def job_file(tmp_path: Path, text: str, name: str = "compiled_job") -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return str(path)


def test_optimizer_loss_and_metrics_come_from_compile_objects(tmp_path):
    job = load_job(job_file(tmp_path, OBJECTS))
    assert job.module.built == [], "loading must not build the model (sync mode's strategy first)"
    model = job.create_model()
    first, second = job.create_optimizer(), job.create_optimizer()
    assert isinstance(first, keras.optimizers.Adam)
    assert first is not second and first is not model.optimizer, "a fresh optimizer per call"
    assert float(first.learning_rate.numpy()) == pytest.approx(0.002)
    per_example = job.loss_fn(LABELS, LOGITS)
    assert per_example.shape == (2,), "loss_fn returns per-example losses"
    expected = keras.losses.sparse_categorical_crossentropy(LABELS, LOGITS, from_logits=True)
    np.testing.assert_allclose(per_example.numpy(), expected.numpy(), rtol=1e-6)
    assert model.loss.reduction == "sum_over_batch_size", "the job's own loss is left as it was"
    factories = metric_factories(job.metrics, label_shape=[None], pred_shape=[None, 3])
    made = [make() for make in factories]
    assert [m.name for m in made] == ["sparse_categorical_accuracy", "accuracy"]
    job_metric = model._compile_config.config["metrics"][0]
    assert made[0] is not job_metric and made[0] is not factories[0](), "fresh metric objects"
    made[0].update_state(LABELS, LOGITS)
    assert float(made[0].result()) == 1.0


def test_compile_strings_are_resolved(tmp_path):
    job = load_job(job_file(tmp_path, STRINGS, "strings_job"))
    job.create_model()
    assert isinstance(job.create_optimizer(), keras.optimizers.SGD)
    probabilities = tf.nn.softmax(LOGITS)
    assert job.loss_fn(LABELS, probabilities).shape == (2,)
    assert list(job.metrics) == ["accuracy"]


def test_what_the_job_defines_wins(tmp_path):
    text = OBJECTS + (
        "def create_optimizer(): return keras.optimizers.SGD(0.5)\n"
        "def loss_fn(labels, predictions): return tf.zeros([2])\n"
        "metrics = ['mae']\n"
    )
    job = load_job(job_file(tmp_path, text, "own_parts_job"))
    job.create_model()
    assert isinstance(job.create_optimizer(), keras.optimizers.SGD)
    assert float(tf.reduce_sum(job.loss_fn(LABELS, LOGITS))) == 0.0
    assert job.metrics == ["mae"]


def test_metrics_alone_from_compile(tmp_path):
    text = OBJECTS + (
        "def create_optimizer(): return keras.optimizers.SGD(0.5)\n"
        "def loss_fn(labels, predictions): return tf.zeros([2])\n"
    )
    job = load_job(job_file(tmp_path, text, "metrics_only_job"))
    job.create_model()
    assert [type(m).__name__ for m in job.metrics] == ["SparseCategoricalAccuracy", "str"]


def test_metrics_are_optional_for_an_uncompiled_model(tmp_path):
    text = NOT_COMPILED + (
        "def create_optimizer(): return keras.optimizers.SGD(0.5)\n"
        "def loss_fn(labels, predictions): return tf.zeros([2])\n"
    )
    job = load_job(job_file(tmp_path, text, "no_metrics_job"))
    job.create_model()
    assert list(job.metrics) == []


def test_uncompiled_model_without_optimizer_is_one_line_naming_what_to_add(tmp_path):
    job = load_job(job_file(tmp_path, NOT_COMPILED, "bare_job"))
    with pytest.raises(ConfigError) as err:
        job.create_model()
    message = str(err.value)
    assert err.value.exit_status == 78
    assert "\n" not in message
    assert "create_optimizer, loss_fn" in message and "not compiled" in message
    assert "model.compile(optimizer=..., loss=...)" in message


def test_a_misspelt_job_function_is_named_in_the_line(tmp_path):
    """A job's create_optimiser was told "does not define create_optimizer" and no more."""
    text = NOT_COMPILED + "def create_optimiser():\n    return keras.optimizers.Adam()\n"
    text += "def loss_fn(labels, logits):\n    return labels\n"
    job = load_job(job_file(tmp_path, text, "misspelt_job"))
    with pytest.raises(ConfigError) as err:
        job.create_model()
    assert "does not define create_optimizer (create_optimiser is there: a misspelling of " in (
        str(err.value)
    ), str(err.value)
    text = HEAD.replace("def dataset_fn(", "def datset_fn(") + "    return model\n"
    with pytest.raises(ConfigError, match=r"does not define dataset_fn \(datset_fn is there"):
        load_job(job_file(tmp_path, text, "misspelt_data_job"))
    with pytest.raises(ConfigError) as err:  # nothing near: no hint
        load_job(job_file(tmp_path, "def create_model():\n    pass\n", "bare_job2"))
    assert str(err.value).startswith("--job ") and "misspelling" not in str(err.value)


def test_compiled_without_loss_names_the_loss(tmp_path):
    text = HEAD + "    model.compile(optimizer='adam')\n    return model\n"
    job = load_job(job_file(tmp_path, text, "lossless_job"))
    with pytest.raises(ConfigError, match=r"no loss; pass compile\(loss=\.\.\.\)"):
        job.create_model()


def test_used_before_a_model_is_built_builds_one_to_read(tmp_path):
    job = load_job(job_file(tmp_path, OBJECTS, "eager_use_job"))
    assert isinstance(job.create_optimizer(), keras.optimizers.Adam)
    assert job.module.built == [1]


def test_job_model_trains_with_one_optimizer_in_its_checkpoint(tmp_path):
    job = load_job(job_file(tmp_path, OBJECTS, "checkpoint_job"))
    spec = tf.TensorSpec([None, 4], tf.float32), tf.TensorSpec([None], tf.int32)
    built = JobModel(job, *spec)
    assert built.model.optimizer is built.optimizer
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(job.loss_fn(LABELS, built.model(tf.ones([2, 4]))))
    grads = tape.gradient(loss, built.model.trainable_variables)
    built.optimizer.apply_gradients(zip(grads, built.model.trainable_variables, strict=True))
    step = tf.Variable(1, dtype=tf.int64)
    path = built.checkpoint(step).save(str(tmp_path / "ckpt" / "c"))
    names = [name for name, _ in tf.train.list_variables(path)]
    assert sum("iteration" in name for name in names) == 1, names
    again = JobModel(job, *spec)
    again.checkpoint(tf.Variable(0, dtype=tf.int64)).restore(path).assert_existing_objects_matched()
    assert int(again.optimizer.iterations.numpy()) == 1
    np.testing.assert_allclose(again.model.get_weights()[0], built.model.get_weights()[0])


def test_tutorial_job_loads_with_parts_from_compile():
    job = load_job(str(REPO / "tests" / "jobs" / "tutorial.py"))
    ctx = DataContext(worker_index=0, num_workers=2, batch_size=16, seed=1)
    x_spec, y_spec = job.dataset_fn(ctx).element_spec
    built = JobModel(job, x_spec, y_spec)
    assert isinstance(built.optimizer, keras.optimizers.Adam)
    assert [make().name for make in built.metric_factories] == ["sparse_categorical_accuracy"]
    options = job.dataset_fn(ctx).options().experimental_distribute
    assert options.auto_shard_policy == tf.data.experimental.AutoShardPolicy.DATA


def test_data_context_answers_input_context_questions():
    ctx = DataContext(worker_index=1, num_workers=2, batch_size=16, seed=1)
    assert (ctx.input_pipeline_id, ctx.num_input_pipelines) == (1, 2)
    assert ctx.get_per_replica_batch_size(64) == 32
    with pytest.raises(ValueError, match="not divisible"):
        ctx.get_per_replica_batch_size(63)


def test_summary_accuracy_is_the_one_accuracy_metric_under_any_keras_name():
    assert accuracy_of({"loss": 0.1, "accuracy": 0.9, "binary_accuracy": 0.5}) == 0.9
    assert accuracy_of({"loss": 0.1, "sparse_categorical_accuracy": 0.8}) == 0.8
    assert accuracy_of({"a_accuracy": 0.8, "b_accuracy": 0.7}) is None
    assert accuracy_of({"loss": 0.1}) is None


def test_an_endless_eval_dataset_is_one_line_not_a_hang(tmp_path: Path):
    """`.repeat()` copied from dataset_fn into eval_dataset_fn: every evaluation reads the
    eval split once, so an endless one is refused (exit 78) before it is read."""
    text = OBJECTS + ("def eval_dataset_fn(ctx):\n    return dataset_fn(ctx).repeat()\n")
    job = load_job(job_file(tmp_path, text, "endless_eval_job"))
    ctx = DataContext(worker_index=0, num_workers=1, batch_size=4, seed=1)
    with pytest.raises(ConfigError) as err:
        job.eval_dataset(ctx)
    assert err.value.exit_status == 78
    assert str(err.value) == (
        f"--job {job.name}: eval_dataset_fn returns an endless dataset (repeat() without a "
        "count?); return one pass over the eval split: drop repeat() from eval_dataset_fn"
    )
    finite = load_job(job_file(tmp_path, OBJECTS + "eval_dataset_fn = dataset_fn\n", "eval_ok"))
    assert int(finite.eval_dataset(ctx).cardinality()) == 2


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("acuracy", "metrics: 'acuracy' is not a Keras metric (did you mean 'accuracy'?); give"),
        ("no_such_metric", "metrics: 'no_such_metric' is not a Keras metric; give a name"),
        (42, "metrics: 42 is not a Keras metric; give a name keras.metrics.get knows"),
    ],
)
def test_a_metric_keras_does_not_know_is_one_line_naming_the_job(spec, said):
    with pytest.raises(ConfigError) as err:
        metric_factories(["auc", spec], label_shape=[None], pred_shape=[None, 1], job="j.py")
    assert str(err.value).startswith(f"--job j.py: {said}"), err.value


def test_a_training_auc_is_read_from_one_snapshot_of_its_counts():
    """The workers add a call's counts to the AUC's variables while the coordinator reads
    them: result() read the true positives for a denominator and again for the numerator,
    and a call landing between gave a training AUC of 1.05-1.07. consistent_result reads
    each variable once, so every ratio is of counts read together."""
    from psctl.coordinator.training.job_model.metric_objects import consistent_result

    auc = keras.metrics.AUC(name="auc")
    y = np.array([0, 1, 1, 0, 1, 0, 0, 1], np.float32)
    p = np.array([0.1, 0.9, 0.8, 0.3, 0.4, 0.6, 0.2, 0.7], np.float32)
    auc.update_state(y, p)
    before = [v.numpy() for v in auc.variables]
    later = keras.metrics.AUC(name="later")
    later.update_state(np.concatenate([y, y]), np.concatenate([p, p]))  # one more call
    after = [v.numpy() for v in later.variables]
    reads = []

    class Counted:
        def __init__(self, variable, value):
            self.variable, self.value = variable, value

        def numpy(self):
            reads.append(self.variable.path)
            return self.value

    # The counts a reader meets with one call's push between its reads.
    racing = SimpleNamespace(
        name="auc",
        variables=[
            Counted(v, a if "positives" in v.path else b)
            for v, a, b in zip(auc.variables, after, before, strict=True)
        ],
        stateless_result=auc.stateless_result,
    )

    value = float(consistent_result(racing))
    assert sorted(reads) == sorted(v.path for v in auc.variables), "each read once"
    assert 0.0 <= value <= 1.0, value
    # What the double read computed: a numerator one call newer than its denominator.
    tp_new, tp_old = after[0], before[0]
    fn_old = before[[v.path for v in auc.variables].index(auc.false_negatives.path)]
    assert (tp_new / np.maximum(tp_old + fn_old, 1)).max() > 1.0
