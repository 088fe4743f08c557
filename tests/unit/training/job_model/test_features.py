"""Features of any structure (coordinator/training/job_model/features.py): a dict of named
inputs of three dtypes checked against the model before training, models of every kind built
for it, and the exported signature's inputs under the keras.Input names."""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from psctl.cluster.errors import EXIT_CONFIG, ConfigError
from psctl.coordinator.data.context import DataContext
from psctl.coordinator.job import load_job
from psctl.coordinator.training.job_model.features import check_features, feature_names
from psctl.coordinator.training.job_model.model import JobModel
from psctl.coordinator.training.saving.saved_model import serving_module
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)

NAMED = str(REPO / "tests" / "jobs" / "named.py")
CTX = DataContext(worker_index=0, num_workers=1, batch_size=8, seed=1)


def spec(**leaves: tuple[tuple[int | None, ...], tf.DType]) -> dict[str, tf.TensorSpec]:
    return {name: tf.TensorSpec(shape, dtype) for name, (shape, dtype) in leaves.items()}


GOOD = spec(
    country=((None, 1), tf.string),
    tags=((None, 4), tf.string),
    item=((None, 1), tf.int64),
    nums=((None, 3), tf.float32),
)


@pytest.fixture(scope="module")
def named():
    job = load_job(NAMED)
    x_spec, y_spec = job.dataset_fn(CTX).element_spec
    return job, JobModel(job, x_spec, y_spec)


def refused(model, x_spec, source="dataset_fn") -> str:
    with pytest.raises(ConfigError) as caught:
        check_features(model, x_spec, job="my_job.py", source=source)
    assert caught.value.exit_status == EXIT_CONFIG
    text = str(caught.value)
    assert "\n" not in text and text.startswith(f"--job my_job.py: {source}'s features")
    return text


def test_named_job_builds_with_binary_accuracy_and_its_dataset_fits(named):
    job, built = named
    assert sorted(built.model.input) == ["country", "item", "nums", "tags"]
    assert [type(make()).__name__ for make in built.metric_factories] == ["BinaryAccuracy", "AUC"]
    check_features(built.model, GOOD, job=job.name, source="dataset_fn")
    # Keras casts between numbers: float64 and int features feed float inputs.
    check_features(
        built.model, {**GOOD, "nums": tf.TensorSpec([None, 3], tf.float64)}, job="j", source="s"
    )
    check_features(
        built.model, {**GOOD, "nums": tf.TensorSpec([None, 3], tf.int32)}, job="j", source="s"
    )
    # A last axis of 1 added or dropped, as Keras does by itself; an unknown size passes.
    check_features(
        built.model, {**GOOD, "country": tf.TensorSpec([None], tf.string)}, job="j", source="s"
    )
    check_features(
        built.model, {**GOOD, "tags": tf.TensorSpec([None, None], tf.string)}, job="j", source="s"
    )


def test_a_renamed_key_names_both_keys_and_the_inputs(named):
    _, built = named
    renamed = {("countri" if k == "country" else k): v for k, v in GOOD.items()}
    text = refused(built.model, renamed)
    assert "lack 'country' (string of shape (None, 1))" in text
    assert "have 'countri', which the model has no input for" in text
    assert "the model's inputs: country, item, nums, tags" in text


def test_a_missing_or_an_extra_key_alone_is_refused(named):
    _, built = named
    missing = {k: v for k, v in GOOD.items() if k != "nums"}
    assert "lack 'nums' (float32 of shape (None, 3))" in refused(built.model, missing)
    extra = {**GOOD, "age": tf.TensorSpec([None, 1], tf.float32)}
    text = refused(built.model, extra, source="eval_dataset_fn")
    assert "have 'age', which the model has no input for" in text and "lack" not in text


@pytest.mark.parametrize(
    ("key", "given", "expect"),
    [
        ("item", tf.string, "have 'item' as string, where the model's input 'item' is int64"),
        ("country", tf.int64, "have 'country' as int64, where the model's input 'country' is "),
        ("item", tf.float32, "have 'item' as float32, where the model's input 'item' is int64"),
        ("nums", tf.string, "have 'nums' as string, where the model's input 'nums' is float32"),
    ],
)
def test_a_dtype_the_input_cannot_take_is_refused(named, key, given, expect):
    _, built = named
    text = refused(built.model, {**GOOD, key: tf.TensorSpec(GOOD[key].shape, given)})
    assert expect in text and f"yield {key!r} as" in text


def test_an_unnamed_input_is_not_called_by_its_internal_name():
    """keras.Input((1,), dtype="int64") unnamed is 'keras_tensor_N' inside Keras: the line
    says 'the model's input', as the user wrote no name."""
    model = keras.Sequential([keras.Input((2,), dtype="int64"), keras.layers.Dense(1)])
    text = refused(model, tf.TensorSpec([None, 2], tf.float32))
    assert "dataset_fn's features are float32, where the model's input is int64" in text
    assert "keras_tensor" not in text and "yield them as int64" in text, text


def test_a_shape_that_does_not_fit_is_refused(named):
    _, built = named
    text = refused(built.model, {**GOOD, "tags": tf.TensorSpec([8, 3], tf.string)})
    assert "have 'tags' of shape (8, 3), where the model's input 'tags' is string of shape" in text


def test_one_tensor_for_named_inputs_and_many_for_one_input_are_refused(named):
    _, built = named
    text = refused(built.model, tf.TensorSpec([None, 9], tf.float32))
    assert "are one tensor where the model takes named inputs" in text
    one = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    assert "are 2 tensors where the model takes one input" in refused(
        one, spec(a=((None, 4), tf.float32), b=((None, 4), tf.float32))
    )


def test_a_list_of_named_inputs_takes_a_dict_by_name_or_a_tuple_in_order():
    a, b = keras.Input((2,), name="a"), keras.Input((3,), dtype="int64", name="b")
    joined = keras.layers.Concatenate()([a, keras.ops.cast(b, "float32")])
    model = keras.Model([a, b], keras.layers.Dense(1)(joined))
    check_features(
        model, spec(a=((None, 2), tf.float32), b=((None, 3), tf.int64)), job="j", source="s"
    )
    check_features(
        model, (tf.TensorSpec([None, 2]), tf.TensorSpec([None, 3], tf.int64)), job="j", source="s"
    )
    assert "are 1 tensors where the model takes 2 inputs" in refused(
        model, (tf.TensorSpec([None, 2]),)
    )
    assert "lack 'b'" in refused(model, spec(a=((None, 2), tf.float32), c=((None, 3), tf.int64)))
    names = feature_names(
        model, (tf.TensorSpec([None, 2]), tf.TensorSpec([None, 3], tf.int64)), job="j"
    )
    assert names == ["a", "b"]


class DictModel(keras.Model):
    """A subclassed model over a dict: no declared inputs, built by psctl's symbolic call."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = keras.layers.Embedding(50, 3)
        self.dense = keras.layers.Dense(1)

    def call(self, x: dict) -> tf.Tensor:
        pooled = tf.reduce_sum(self.embed(x["ids"]), axis=1)
        return self.dense(tf.concat([pooled, x["nums"]], axis=-1))


SUBCLASSED = """
import keras
import tensorflow as tf
from tests.unit.training.job_model.test_features import DictModel
metrics = ["accuracy"]
def create_model():
    return DictModel()
def create_optimizer():
    return keras.optimizers.SGD(0.1)
def loss_fn(y, logits):
    return keras.losses.binary_crossentropy(y, logits, from_logits=True)
def dataset_fn(ctx):
    ids = tf.random.stateless_uniform([16, 2], [1, 2], maxval=50, dtype=tf.int64)
    x = {"ids": ids, "nums": tf.ones([16, 4])}
    return tf.data.Dataset.from_tensor_slices((x, tf.ones([16, 1]))).batch(ctx.batch_size)
"""


def test_a_subclassed_model_over_a_dict_is_built_with_its_weights(tmp_path: Path):
    path = tmp_path / "subclassed_job.py"
    path.write_text(SUBCLASSED)
    job = load_job(str(path))
    x_spec, y_spec = job.dataset_fn(CTX).element_spec
    built = JobModel(job, x_spec, y_spec)
    # Model.build((shapes)) would mark it built with no weights at all.
    assert len(built.model.trainable_variables) == 3
    assert len(built.optimizer.variables) > 1
    assert [type(make()).__name__ for make in built.metric_factories] == ["BinaryAccuracy"]


COMPILED = """
import keras
import tensorflow as tf
def create_model():
    word = keras.Input((2,), dtype="string", name="word")
    size = keras.Input((1,), name="size")
    hashed = keras.layers.Hashing(20, output_mode="count")(word)
    model = keras.Model({"word": word, "size": size}, keras.layers.Dense(3)(
        keras.layers.Concatenate()([hashed, size])))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer="adam", loss=loss, metrics=["accuracy"])
    return model
def dataset_fn(ctx):
    x = {"word": tf.constant([["a", "b"], ["c", "d"]] * 4), "size": tf.ones([8, 1])}
    return tf.data.Dataset.from_tensor_slices((x, tf.range(8) % 3)).batch(ctx.batch_size)
"""


def test_a_compiled_model_over_named_inputs_trains_a_step(tmp_path: Path):
    path = tmp_path / "compiled_named_job.py"
    path.write_text(COMPILED)
    job = load_job(str(path))
    dataset = job.dataset_fn(CTX)
    built = JobModel(job, *dataset.element_spec)
    assert [type(make()).__name__ for make in built.metric_factories] == [
        "SparseCategoricalAccuracy"
    ]
    x, y = next(iter(dataset))
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(job.loss_fn(y, built.model(x, training=True)))
    variables = built.model.trainable_variables
    built.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))
    assert int(built.optimizer.iterations.numpy()) == 1


def test_export_signature_takes_one_input_per_keras_input_and_predicts_the_same(
    named, tmp_path: Path
):
    job, built = named
    x_spec = {k: tf.TensorSpec([None, *v.shape[1:]], v.dtype) for k, v in GOOD.items()}
    names = feature_names(built.model, x_spec, job=job.name)
    assert names == ["country", "item", "nums", "tags"]  # tf.nest's order of the leaves
    module = serving_module(built.model, x_spec, names)
    tf.saved_model.save(module, str(tmp_path / "1"), signatures={"serving_default": module.serve})
    serve = tf.saved_model.load(str(tmp_path / "1")).signatures["serving_default"]
    assert sorted(serve.structured_input_signature[1]) == names
    request = {
        "country": tf.constant([["c3"], ["c150"]]),
        "tags": tf.constant([["t1", "t2", "", ""], ["t9", "", "", ""]]),
        "item": tf.constant([[3_000_009], [5]], tf.int64),
        "nums": tf.constant([[0.1, 0.2, 0.3], [-1.0, 0.0, 0.5]]),
    }
    got = serve(**request)["outputs"].numpy()
    want = built.model(request, training=False).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_one_tensor_keeps_the_features_input():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    assert feature_names(model, tf.TensorSpec([None, 4]), job="j") == ["features"]


def test_without_declared_inputs_the_names_are_the_features_paths():
    leaf = tf.TensorSpec([None, 2])
    assert feature_names(None, {"b": leaf, "a": {"x": leaf}}, job="j") == ["a_x", "b"]
    assert feature_names(None, (leaf, leaf), job="j") == ["features_0", "features_1"]
