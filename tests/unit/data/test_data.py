"""File inputs (coordinator/data/readers.py): CSV and TFRecord readers on real files, every
bad-file case, and per-worker sharding with a tensor worker index, as the trainer calls
it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from psctl.cluster.errors import ConfigError
from psctl.coordinator.data import readers as data
from psctl.coordinator.data.context import DataContext
from psctl.jobs import mlp


@pytest.fixture(autouse=True)
def _fresh_cache():
    data.clear_cache()
    yield
    data.clear_cache()


def ctx(
    *,
    train: str = "",
    evaluation: str = "",
    index: int | tf.Tensor = 0,
    workers: int = 1,
    batch: int = 8,
    label: str = "label",
) -> DataContext:
    return DataContext(
        worker_index=index,
        num_workers=workers,
        batch_size=batch,
        seed=7,
        train_data=train,
        eval_data=evaluation,
        label_column=label,
    )


def id_data(first: int, count: int, features: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Examples whose feature 0 is a unique id (exact in float32 up to 2**24)."""
    ids = np.arange(first, first + count, dtype=np.float32)
    rest = np.random.default_rng(first).standard_normal((count, features - 1)).astype(np.float32)
    return np.column_stack([ids, rest]), (ids.astype(np.int64) % 5)


def write_id_files(tmp_path: Path, sizes: list[int], fmt: str = "csv") -> tuple[str, set[int]]:
    first = 0
    for i, size in enumerate(sizes):
        x, y = id_data(first, size)
        path = tmp_path / f"part-{i:02d}.{fmt}"
        (data.write_csv if fmt == "csv" else data.write_tfrecord)(path, x, y)
        first += size
    return str(tmp_path / f"part-*.{fmt}"), set(range(first))


def read_all(dataset: tf.data.Dataset) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    for x, y in dataset:
        xs.append(x.numpy())
        ys.append(y.numpy())
    return np.concatenate(xs), np.concatenate(ys)


def config_error(pattern: str, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        data.check_files(pattern, field="--train-data", **kwargs)
    message = str(info.value)
    assert message.startswith("--train-data: ") and "\n" not in message, message
    return message


# -- readers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["csv", "tfrecord"])
def test_eval_reads_every_example_once_in_order(tmp_path: Path, fmt: str):
    x, y = id_data(0, 1000, features=5)
    path = tmp_path / f"eval.{fmt}"
    (data.write_csv if fmt == "csv" else data.write_tfrecord)(path, x, y)
    dataset = data.eval_dataset(ctx(evaluation=str(path), batch=64), label_dtype=tf.int64)
    assert dataset.element_spec[0].shape.as_list() == [None, 5]
    assert dataset.element_spec[1].dtype == tf.int64
    got_x, got_y = read_all(dataset)
    np.testing.assert_array_equal(got_x, x)  # exact: float32 written with enough digits
    np.testing.assert_array_equal(got_y, y)


def test_csv_label_anywhere_custom_name_and_quotes(tmp_path: Path):
    path = tmp_path / "d.csv"
    path.write_text('target,a,b\n1,0.5,"2"\n0, 3 ,-1e-3\r\n')
    info = data.inspect_files(str(path), label_column="target")
    assert info.feature_names == ("a", "b") and info.num_records == 2
    got_x, got_y = read_all(data.eval_dataset(ctx(evaluation=str(path), label="target")))
    np.testing.assert_allclose(got_x, [[0.5, 2.0], [3.0, -1e-3]])
    assert got_y.dtype == np.float32 and got_y.tolist() == [1.0, 0.0]


def test_tfrecord_scalar_features_are_concatenated_by_name(tmp_path: Path):
    path = tmp_path / "d.tfrecord"
    with tf.io.TFRecordWriter(str(path)) as writer:
        for i in range(3):
            feature = {
                "b": tf.train.Feature(float_list=tf.train.FloatList(value=[10.0 + i])),
                "a": tf.train.Feature(int64_list=tf.train.Int64List(value=[i, i])),
                "y": tf.train.Feature(float_list=tf.train.FloatList(value=[0.5 * i])),
            }
            example = tf.train.Example(features=tf.train.Features(feature=feature))
            writer.write(example.SerializeToString())
    info = data.inspect_files(str(path), label_column="y")
    assert info.feature_names == ("a", "b") and info.num_features == 3
    assert not info.integer_labels
    got_x, got_y = read_all(data.eval_dataset(ctx(evaluation=str(path), label="y")))
    np.testing.assert_array_equal(got_x, [[0, 0, 10], [1, 1, 11], [2, 2, 12]])
    assert got_x.dtype == np.float32  # with a float feature, all are float32
    np.testing.assert_array_equal(got_y, [0.0, 0.5, 1.0])


def test_tfrecord_int64_features_alone_stay_exact_int64_ids(tmp_path: Path):
    """Raw ids above 2**24 read as float32 collided without an error (2**53 + 1 too)."""
    path = tmp_path / "ids.tfrecord"
    ids = [2**62 + 1, 2**24 + 1, 7]
    with tf.io.TFRecordWriter(str(path)) as writer:
        for i, value in enumerate(ids):
            feature = {
                "user": tf.train.Feature(int64_list=tf.train.Int64List(value=[value])),
                "item": tf.train.Feature(int64_list=tf.train.Int64List(value=[value + 1])),
                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 2])),
            }
            example = tf.train.Example(features=tf.train.Features(feature=feature))
            writer.write(example.SerializeToString())
    dataset = data.eval_dataset(ctx(evaluation=str(path)), label_dtype=tf.int64)
    assert dataset.element_spec[0].dtype == tf.int64
    got_x, _ = read_all(dataset)
    assert got_x.tolist() == [[v + 1, v] for v in ids]  # by name: item, then user


def test_a_directory_means_every_file_in_it(tmp_path: Path):
    pattern, ids = write_id_files(tmp_path, [5, 6])
    info = data.inspect_files(str(tmp_path))
    assert info.num_records == len(ids) and info.records_per_file == (5, 6)
    assert pattern  # the glob form gives the same files
    assert data.inspect_files(pattern).files == info.files


def test_validation_runs_once_per_glob(tmp_path: Path):
    pattern, _ = write_id_files(tmp_path, [4])
    first = data.inspect_files(pattern)
    (tmp_path / "part-00.csv").write_text("garbage\n")  # not read again
    assert data.inspect_files(pattern) is first


# -- bad files: one line naming the file and the line -----------------------------------------


def test_missing_files(tmp_path: Path):
    message = config_error(str(tmp_path / "nope-*.csv"))
    assert "no files match" in message and "nope-*.csv" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "bad.csv is empty"),
        ("a,b,label\n", "bad.csv has a header but no data rows"),
        ("a,b,y\n1,2,3\n", "bad.csv line 1: no label column 'label' in [a, b, y]"),
        ("1,2,3\n1,2,3\n", "bad.csv line 1 holds numbers, not column names"),
        ("a,a,label\n1,2,3\n", "bad.csv line 1: column 'a' twice"),
        ("a,b,label\n1,2,3\n1,2\n", "bad.csv line 3: 2 cells, the header has 3"),
        ("a,b,label\n1,2,3\n1,x7,3\n", "bad.csv line 3, column 'b': 'x7' is not a number"),
        ("a,b,label\n1,2,3\n1,,3\n", "bad.csv line 3, column 'b': an empty cell"),
        ("a,b,label\n1,2,3\n\n1,2,3\n", "bad.csv line 3 is blank"),
        ("a,b,label\n1,2,3\n1,nan,3\n", "bad.csv line 3, column 'b': nan"),
        ("a,b,label\n1,2,3\n1,1_000,3\n", "bad.csv line 3, column 'b': '1_000' is not a number"),
    ],
)
def test_bad_csv(tmp_path: Path, text: str, expected: str):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    message = config_error(str(path))
    assert expected in message, message


def test_header_differs_between_files(tmp_path: Path):
    (tmp_path / "a.csv").write_text("x,label\n1,0\n")
    (tmp_path / "b.csv").write_text("z,label\n1,0\n")
    message = config_error(str(tmp_path / "*.csv"))
    assert "b.csv line 1: header [z, label] differs from" in message and "a.csv" in message


def test_eval_files_must_have_the_training_files_columns_in_order(tmp_path: Path):
    """A model reads CSV columns by position: eval files with two columns swapped would be
    scored on the wrong features with no error (seen: accuracy 0.92 instead of 0.98)."""
    (tmp_path / "train.csv").write_text("a,b,label\n1,2,0\n3,4,1\n")
    (tmp_path / "same.csv").write_text("a,b,label\n5,6,0\n")
    (tmp_path / "swapped.csv").write_text("b,a,label\n6,5,0\n")
    train = str(tmp_path / "train.csv")
    got_x, _ = read_all(data.eval_dataset(ctx(train=train, evaluation=str(tmp_path / "same.csv"))))
    np.testing.assert_array_equal(got_x, [[5, 6]])
    swapped = str(tmp_path / "swapped.csv")
    with pytest.raises(ConfigError) as err:
        data.eval_dataset(ctx(train=train, evaluation=swapped))
    assert str(err.value) == (
        f"--eval-data: {swapped} has the features b, a (in file order), where --train-data "
        "has a, b; give the eval files the training files' header, in the same order"
    )
    # psctl evaluate without --train-data: nothing to compare with.
    assert data.eval_dataset(ctx(evaluation=swapped)).element_spec[0].shape[-1] == 2


def test_unknown_and_mixed_formats(tmp_path: Path):
    (tmp_path / "a.txt").write_text("x,label\n1,0\n")
    assert "cannot tell the format of" in config_error(str(tmp_path / "a.txt"))
    x, y = id_data(0, 3)
    data.write_csv(tmp_path / "m.csv", x, y)
    data.write_tfrecord(tmp_path / "m.tfrecord", x, y)
    assert "both CSV and TFRecord" in config_error(str(tmp_path / "m.*"))


def test_mlp_needs_32_features_and_labels_0_to_9(tmp_path: Path):
    x, y = id_data(0, 10, features=31)
    data.write_csv(tmp_path / "narrow.csv", x, y)
    message = config_error(
        str(tmp_path / "narrow.csv"), num_features=32, num_classes=10, job="the mlp job"
    )
    assert "narrow.csv line 1: 31 feature columns besides 'label'; the mlp job needs 32" in message
    path = tmp_path / "labels.csv"
    path.write_text("a,label\n1,3\n2,12\n")
    message = config_error(str(path), num_features=1, num_classes=10, job="the mlp job")
    assert "labels.csv line 3: label 12 is outside 0-9 (the mlp job has 10 classes)" in message
    path.write_text("a,label\n1,3\n2,1.5\n")
    data.clear_cache()
    assert "not whole numbers" in config_error(str(path), num_classes=10)


def test_mlp_job_checks_eval_files_before_training(tmp_path: Path):
    x, y, _, _ = mlp.make_data()
    data.write_csv(tmp_path / "train.csv", x[:500], y[:500])
    (tmp_path / "eval.csv").write_text("only,three,columns\n1,2,3\n")
    bad = ctx(train=str(tmp_path / "train.csv"), evaluation=str(tmp_path / "eval.csv"))
    with pytest.raises(ConfigError, match=r"^--eval-data: .*eval\.csv line 1: no label column"):
        mlp.dataset_fn(bad)  # the trainer's first call, before any training


def _example(**features: tf.train.Feature) -> bytes:
    return tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString()


def _floats(*values: float) -> tf.train.Feature:
    return tf.train.Feature(float_list=tf.train.FloatList(value=values))


def _ints(*values: int) -> tf.train.Feature:
    return tf.train.Feature(int64_list=tf.train.Int64List(value=values))


@pytest.mark.parametrize(
    ("records", "expected"),
    [
        ([], "bad.tfrecord is empty"),
        (
            [_example(features=_floats(1, 2), label=_ints(1))] * 2
            + [_example(features=_floats(1), label=_ints(1))],
            "bad.tfrecord record 3: features {features: float[1], label: int64[1]} differ",
        ),
        ([_example(features=_floats(1, 2))], "bad.tfrecord record 1: no label feature 'label'"),
        (
            [_example(features=tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"x"])))],
            "bad.tfrecord record 1: feature 'features' holds bytes",
        ),
        ([_example(features=_floats(1), label=_ints(1, 2))], "label 'label' has 2 values"),
        ([b"\xff\xfe not a proto"], "bad.tfrecord record 1: not a tf.train.Example"),
    ],
)
def test_bad_tfrecord(tmp_path: Path, records: list[bytes], expected: str):
    path = tmp_path / "bad.tfrecord"
    if records:
        with tf.io.TFRecordWriter(str(path)) as writer:
            for record in records:
                writer.write(record)
    else:
        path.write_bytes(b"")
    message = config_error(str(path))
    assert expected in message, message


def test_truncated_tfrecord(tmp_path: Path):
    path = tmp_path / "cut.tfrecord"
    x, y = id_data(0, 10)
    data.write_tfrecord(path, x, y)
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) - 7])
    message = config_error(str(path))
    assert "cut.tfrecord after record 9: not a readable TFRecord file" in message, message


# -- sharding across workers ------------------------------------------------------------------


def worker_ids(
    pattern: str, workers: int, *, traced: bool, training: bool = True
) -> list[list[int]]:
    """Each worker's ids, from datasets built with a tensor worker index (in a tf.function
    when ``traced``, as per-worker datasets are): training, about 3 epochs of the repeated
    (shuffled, so batches come in any order) stream; else one pass in order."""
    info = data.inspect_files(pattern)
    out = []
    for index in range(workers):

        def build(i: tf.Tensor, _w: int = workers) -> tf.data.Dataset:
            return data.make_dataset(pattern, ctx(index=i, workers=_w, batch=1), training=training)

        make = tf.function(build, autograph=False) if traced else build
        dataset = make(tf.constant(index, tf.int64))
        if training:
            dataset = dataset.take(info.num_records * 3 // workers)
        out.append([int(x[0, 0]) for x, _ in dataset])
    return out


def assert_partition(pattern: str, workers: int, all_ids: set[int]) -> list[set[int]]:
    """Training streams hold disjoint ids that cover the data; one pass of each worker's
    part reads each of its ids exactly once."""
    streams = [set(ids) for ids in worker_ids(pattern, workers, traced=True)]
    passes = worker_ids(pattern, workers, traced=True, training=False)
    for a in range(workers):
        assert len(passes[a]) == len(set(passes[a])), f"worker {a} reads an id twice a pass"
        assert set(passes[a]) == streams[a], f"worker {a}: training and one pass differ"
        for b in range(a + 1, workers):
            assert not streams[a] & streams[b], f"workers {a} and {b} share ids"
    assert set().union(*streams) == all_ids
    return streams


@pytest.mark.parametrize(("sizes", "workers"), [([30, 20, 25, 40, 10], 3), ([7, 9], 2)])
def test_enough_files_each_worker_reads_its_own_files(tmp_path: Path, sizes, workers):
    pattern, all_ids = write_id_files(tmp_path, sizes)
    streams = assert_partition(pattern, workers, all_ids)
    starts = np.cumsum([0, *sizes])
    for index, ids in enumerate(streams):
        mine = [f for f in range(len(sizes)) if f % workers == index]  # whole files
        assert ids == set().union(*(range(starts[f], starts[f + 1]) for f in mine))


@pytest.mark.parametrize("fmt", ["csv", "tfrecord"])
def test_fewer_files_than_workers_shards_records(tmp_path: Path, fmt: str):
    pattern, all_ids = write_id_files(tmp_path, [50, 31], fmt=fmt)
    streams = assert_partition(pattern, 3, all_ids)
    assert sorted(len(ids) for ids in streams) == [27, 27, 27]


def test_eager_and_traced_give_the_same_shards(tmp_path: Path):
    pattern, _ = write_id_files(tmp_path, [12, 8, 5])
    eager = worker_ids(pattern, 2, traced=False)
    traced = worker_ids(pattern, 2, traced=True)
    assert [set(ids) for ids in eager] == [set(ids) for ids in traced]


@pytest.mark.parametrize("fmt", ["csv", "tfrecord"])
def test_first_check_may_happen_while_tracing(tmp_path: Path, fmt: str):
    # As in the trainer's per-worker dataset function (a tf.function, AutoGraph on): the files
    # are still read eagerly.
    pattern, _ = write_id_files(tmp_path, [6, 5], fmt=fmt)

    @tf.function
    def per_worker(index: tf.Tensor) -> tf.data.Dataset:
        return data.train_dataset(ctx(train=pattern, index=index, workers=2, batch=1))

    ids = {int(x[0, 0]) for x, _ in per_worker(tf.constant(1, tf.int64)).take(20)}
    assert ids == set(range(6, 11))


def test_fewer_examples_than_workers_is_an_error(tmp_path: Path):
    pattern, _ = write_id_files(tmp_path, [2])
    with pytest.raises(ConfigError, match=r"2 examples in .* for 3 workers"):
        data.train_dataset(ctx(train=pattern, index=tf.constant(0, tf.int64), workers=3))


def test_training_batches_are_full_and_repeat(tmp_path: Path):
    pattern, _ = write_id_files(tmp_path, [10])
    dataset = data.train_dataset(ctx(train=pattern, batch=4))
    assert dataset.element_spec[0].shape.as_list() == [4, 3]
    batches = list(dataset.take(6))  # 24 examples from 10: it repeats
    assert all(int(x.shape[0]) == 4 for x, _ in batches)


def test_mlp_trains_on_csv_shapes(tmp_path: Path):
    x, y, ex, ey = mlp.make_data()
    data.write_csv(tmp_path / "train.csv", x[:2000], y[:2000])
    data.write_csv(tmp_path / "eval.csv", ex[:300], ey[:300])
    train = ctx(train=str(tmp_path / "train.csv"), evaluation=str(tmp_path / "eval.csv"))
    spec = mlp.dataset_fn(train).element_spec
    assert spec[0].shape.as_list() == [8, 32] and spec[1].dtype == tf.int64
    got_x, got_y = read_all(mlp.eval_dataset_fn(train))
    np.testing.assert_array_equal(got_x, ex[:300])
    np.testing.assert_array_equal(got_y, ey[:300])


@pytest.mark.parametrize("fmt", ["csv", "tfrecord"])
def test_one_pass_reads_every_record_once_with_the_partial_batch(tmp_path: Path, fmt: str):
    """--epochs: one finite, shuffled pass; psctl repeats it and the tf.data service shards it."""
    pattern, ids = write_id_files(tmp_path, [7, 5, 9], fmt)
    one_pass = dataclasses.replace(ctx(train=pattern, batch=4), one_pass=True)
    dataset = data.train_dataset(one_pass, label_dtype=tf.int64)
    assert int(dataset.cardinality()) != int(tf.data.INFINITE_CARDINALITY)
    x, _ = read_all(dataset)
    assert sorted(x[:, 0].astype(int).tolist()) == sorted(ids)
    # One partial batch (the parallel parse may hand it out before the last full one).
    assert sorted(int(b[1].shape[0]) for b in dataset) == [21 % 4] + [4] * (21 // 4)


def test_mlp_one_pass_is_every_example_once():
    one_pass = dataclasses.replace(ctx(batch=1000), one_pass=True)
    x, y = read_all(mlp.dataset_fn(one_pass))
    assert len(y) == mlp.TRAIN_EXAMPLES == len(np.unique(x, axis=0))


# -- exactly what TensorFlow's CSV reader parses ----------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a,label\n\u0661,1\n", "line 2, column 'a': '\u0661' is not a number (it holds non-ASCII"),
        ("a,label\n\uff11,1\n", "line 2, column 'a': '\uff11' is not a number (it holds non-ASCII"),
        ("a,label\n1\xa0,1\n", "line 2, column 'a': '1\\xa0' is not a number (it holds non-ASCII"),
        ("a,label\r1,1\r", "bad.csv line 1 ends in a lone carriage return"),
        ("a,label\n1,1\r2,0\n", "bad.csv line 2 ends in a lone carriage return"),
        ("\ufeffa,label\n1,1\n", "bad.csv starts with a byte order mark (BOM, U+FEFF)"),
        ("a,label\n1e39,1\n", "line 2, column 'a': 1e+39 is beyond float32"),
        # Past float64 a number reads as inf: the cell is quoted as written (cut if long).
        ("a,label\n1e999,1\n", "line 2, column 'a': '1e999' is beyond float32"),
        ('a,label\n"-1e999",1\n', "line 2, column 'a': '-1e999' is beyond float32"),
        ("a,label\n" + "9" * 400 + ",1\n", "'99999999999999999999999"),
        ("a,label\n1,-Infinity\n", "line 2, column 'label': -Infinity is not a finite number"),
        ('a,label\n "1",1\n', "column 'a': ' \"1\"' is not a number in quotes that open and close"),
        ("a,label\n0x10,1\n", "column 'a': '0x10' is not a number"),
        ('a,label\n"",1\n', "column 'a': an empty cell"),
        ("a,label\n1,2\n \t\n", "bad.csv line 3 is blank"),
    ],
)
def test_csv_tensorflow_cannot_parse_is_refused(tmp_path: Path, text: str, expected: str):
    path = tmp_path / "bad.csv"
    path.write_bytes(text.encode("utf-8"))  # as written: no newline translation
    message = config_error(str(path))
    assert expected in message, message


def test_csv_error_lines_cut_a_huge_cell(tmp_path: Path):
    path = tmp_path / "bad.csv"
    path.write_text("a,label\n" + "x" * 20_000_000 + ",1\n")
    message = config_error(str(path))
    assert len(message) < 400, len(message)
    assert "'xxxx" in message and "... (20000000 characters) is not a number" in message
    path.write_text("a" * 10_000 + ",b\n1,2\n")
    message = config_error(str(path))
    assert len(message) < 400 and "no label column 'label'" in message
    path.write_text("a,label\n" + "9" * 20_000_000 + ",1\n")  # a number past float64
    message = config_error(str(path))
    assert len(message) < 400 and "... (20000000 characters) is beyond float32" in message


def test_csv_tensorflow_parses_is_accepted_and_read_the_same(tmp_path: Path):
    path = tmp_path / "ok.csv"
    rows = ['1,"2"', " 3\t, +.5e-1 ", '" -4 ",1E2', "5.,6", "1e38,7"]
    path.write_bytes(("a,label\r\n" + "\r\n".join(rows)).encode())  # CRLF, no final newline
    info = data.inspect_files(str(path))
    assert info.num_records == 5 and info.label_max.value == 100
    got_x, got_y = read_all(data.eval_dataset(ctx(evaluation=str(path), batch=2)))
    np.testing.assert_allclose(got_x[:, 0], np.float32([1, 3, -4, 5, 1e38]))
    assert got_y.tolist() == np.float32([2, 0.05, 100, 6, 7]).tolist()
