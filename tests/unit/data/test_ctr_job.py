"""The built-in ctr job (jobs/ctr.py) and the Criteo TSV format
(coordinator/data/criteo.py): its settings, the synthetic generator's determinism and
distribution, parsing lines with empty cells, and one-line errors naming the file and line
of a malformed one."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import keras
import numpy as np
import pytest
import tensorflow as tf

from psctl.cluster.errors import ConfigError
from psctl.coordinator.data import criteo
from psctl.coordinator.data.context import DataContext
from psctl.coordinator.training.job_model.metric_objects import metric_factories
from psctl.coordinator.training.reporting.summary import Summary, print_summary, write_summary
from psctl.jobs import ctr

pytestmark = pytest.mark.timeout(120)

CFG = ctr.CtrConfig(rows=10_000, train_examples=4 * ctr.BLOCK, eval_examples=2 * ctr.BLOCK)


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch):
    for name in (
        "CTR_ROWS",
        "CTR_TRAIN_EXAMPLES",
        "CTR_EVAL_EXAMPLES",
        "CTR_OPTIMIZER",
        "CTR_TABLE",
        "CTR_VOCABULARY",
        "CTR_DRIFT",
        *ctr.DYNAMIC_SETTINGS,
    ):
        monkeypatch.delenv(name, raising=False)
    criteo.clear_cache()
    yield
    criteo.clear_cache()


def ctx(*, index: int | tf.Tensor = 0, workers: int = 1, batch: int = 64, **kw) -> DataContext:
    return DataContext(worker_index=index, num_workers=workers, batch_size=batch, seed=7, **kw)


def one_line(err: pytest.ExceptionInfo[ConfigError], field: str) -> str:
    message = str(err.value)
    assert message.startswith(f"{field}: ") and "\n" not in message, message
    return message


def read_all(dataset: tf.data.Dataset) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = zip(*((x.numpy(), y.numpy()) for x, y in dataset), strict=True)
    return np.concatenate(xs), np.concatenate(ys)


# -- settings ---------------------------------------------------------------------------------


def test_settings_from_the_environment():
    assert ctr.CtrConfig.from_env({}) == ctr.CtrConfig()
    cfg = ctr.CtrConfig.from_env(
        {"CTR_ROWS": "10M", "CTR_TRAIN_EXAMPLES": "1_000", "CTR_OPTIMIZER": "Adagrad"}
    )
    assert (cfg.rows, cfg.train_examples, cfg.optimizer) == (10_000_000, 1000, "adagrad")
    assert cfg.train_blocks == 2  # 1000 examples: two blocks of 512
    assert ctr.CtrConfig.from_env({"CTR_ROWS": "2.5k"}).rows == 2500
    assert ctr.CtrConfig.from_env({"CTR_ROWS": "100,000"}).rows == 100_000


@pytest.mark.parametrize(
    ("env", "field", "text"),
    [
        ({"CTR_ROWS": "lots"}, "CTR_ROWS", "'lots' is not a whole number"),
        ({"CTR_ROWS": "1.5"}, "CTR_ROWS", "is not a whole number"),
        ({"CTR_ROWS": "500"}, "CTR_ROWS", "500 rows; give 1,000 to 1,000,000,000 rows"),
        ({"CTR_ROWS": "2000M"}, "CTR_ROWS", "2000000000 rows"),
        ({"CTR_EVAL_EXAMPLES": "0"}, "CTR_EVAL_EXAMPLES", "0 examples"),
        ({"CTR_OPTIMIZER": "sgd"}, "CTR_OPTIMIZER", "'sgd' is not known; use adam or adagrad"),
    ],
)
def test_bad_settings_are_one_line_config_errors(env, field, text):
    with pytest.raises(ConfigError) as err:
        ctr.CtrConfig.from_env(env)
    assert text in one_line(err, field)


def test_table_drift_and_dynamic_settings_from_the_environment():
    default = ctr.CtrConfig.from_env({})
    assert (default.table, default.vocabulary, default.drift) == ("fixed", 100_000, None)
    assert default.exact_rows and default.buckets == 100_000
    cfg = ctr.CtrConfig.from_env(
        {
            "CTR_TABLE": " Dynamic",
            "CTR_VOCABULARY": "1M",
            "CTR_DRIFT": "200k",
            "CTR_ADMIT_AFTER": "3",
            "CTR_TTL_STEPS": "500",
            "CTR_MAX_ROWS_PER_SHARD": "none",
        }
    )
    assert (cfg.table, cfg.vocabulary, cfg.drift) == ("dynamic", 1_000_000, 200_000)
    assert (cfg.admit_after, cfg.ttl_steps, cfg.max_rows_per_shard) == (3, 500, None)
    assert cfg.buckets == criteo.KEY_SPACE == 2**63 - 1 and not cfg.exact_rows
    assert int(cfg.vocabularies.sum()) == 1_000_000  # the live ids, whatever CTR_ROWS is
    assert ctr.CtrConfig.from_env({"CTR_TABLE": "dynamic"}).admit_after == 2
    # The fixed table over a vocabulary of another size, or drifting: ids hashed into it.
    assert not ctr.CtrConfig.from_env({"CTR_VOCABULARY": "1M"}).exact_rows
    assert not ctr.CtrConfig.from_env({"CTR_DRIFT": "100k"}).exact_rows


@pytest.mark.parametrize(
    ("env", "field", "text"),
    [
        ({"CTR_TABLE": "hashmap"}, "CTR_TABLE", "'hashmap' is not known; use fixed or dynamic"),
        ({"CTR_TABLE": "dynamic", "CTR_DRIFT": "0"}, "CTR_DRIFT", "0 examples"),
        ({"CTR_DRIFT": "soon"}, "CTR_DRIFT", "'soon' is not a whole number"),
        ({"CTR_VOCABULARY": "10"}, "CTR_VOCABULARY", "10 rows; give 1,000 to"),
        ({"CTR_TABLE": "dynamic", "CTR_ADMIT_AFTER": "0"}, "CTR_ADMIT_AFTER", "got 0"),
        ({"CTR_TABLE": "dynamic", "CTR_TTL_STEPS": "-5"}, "CTR_TTL_STEPS", "got -5"),
        ({"CTR_TTL_STEPS": "500"}, "CTR_TTL_STEPS", "is a setting of dynamic tables; set CTR_"),
        ({"CTR_MAX_ROWS_PER_SHARD": "1M"}, "CTR_MAX_ROWS_PER_SHARD", "set CTR_TABLE=dynamic"),
    ],
)
def test_bad_table_and_drift_settings_are_one_line_config_errors(env, field, text):
    with pytest.raises(ConfigError) as err:
        ctr.CtrConfig.from_env(env)
    assert text in one_line(err, field)


@pytest.mark.parametrize("rows", [1_000, 10_000, 100_000, 1_000_000, 10_000_000, 1_000_000_000])
def test_vocabularies_fill_the_table_exactly(rows: int):
    cfg = ctr.CtrConfig(rows=rows)
    sizes = cfg.vocabularies
    assert sizes.shape == (26,) and int(sizes.sum()) == rows
    assert sizes.min() >= ctr.MIN_VOCABULARY
    assert np.array_equal(cfg.offsets, np.concatenate([[0], np.cumsum(sizes)[:-1]]))
    # Criteo-shaped: C3 (10M distinct values in the Kaggle set) is the largest.
    assert int(np.argmax(sizes)) == 2


# -- the synthetic generator ------------------------------------------------------------------


def test_blocks_are_deterministic_and_differ_from_each_other():
    a = ctr.SyntheticData(CFG).block(tf.constant(5, tf.int64))
    b = ctr.SyntheticData(ctr.CtrConfig(rows=10_000)).block(tf.constant(5, tf.int64))
    c = ctr.SyntheticData(CFG).block(tf.constant(6, tf.int64))
    assert a[0].shape == (512, 39) and a[0].dtype == tf.int64
    assert a[1].shape == (512, 1) and a[1].dtype == tf.float32
    for mine, same in zip(a, b, strict=True):
        np.testing.assert_array_equal(mine.numpy(), same.numpy())
    assert not np.array_equal(a[0].numpy(), c[0].numpy())


def test_the_stream_does_not_depend_on_the_batch_size_or_the_number_of_workers(monkeypatch):
    monkeypatch.setenv("CTR_ROWS", "10000")
    monkeypatch.setenv("CTR_TRAIN_EXAMPLES", str(4 * ctr.BLOCK))
    whole = ctr.dataset_fn(ctx(batch=256, one_pass=True))
    x_all, _ = read_all(whole)
    assert x_all.shape == (4 * ctr.BLOCK, 39)
    # Two workers (a tensor index, as psctl traces it) read alternate blocks.
    parts = []
    for index in (0, 1):
        it = iter(ctr.dataset_fn(ctx(index=tf.constant(index, tf.int64), workers=2, batch=128)))
        x, _ = read_all(next(it) for _ in range(8))  # 1024 examples: two blocks, then repeats
        np.testing.assert_array_equal(x[: ctr.BLOCK], x_all[index * 512 : index * 512 + 512])
        np.testing.assert_array_equal(x[ctr.BLOCK :], x_all[(index + 2) * 512 : (index + 3) * 512])
        parts.append(x)
    assert not np.array_equal(parts[0], parts[1])


def test_zipf_ids_follow_the_power_law():
    u = tf.constant((np.arange(400_000) + 0.5) / 400_000, tf.float64)  # an even grid
    vocabulary = tf.constant([1_000_000] * 400_000, tf.int64)
    ids = ctr.zipf_ids(u, vocabulary).numpy()
    assert ids.min() == 0 and ids.max() < 1_000_000
    s = ctr.ZIPF_EXPONENT
    norm = (1_000_001 ** (1 - s) - 1) / (1 - s)
    for k in range(5):  # P(id k) = integral of x**-s from k + 1 to k + 2, normalized
        expected = ((k + 2) ** (1 - s) - (k + 1) ** (1 - s)) / (1 - s) / norm
        assert abs(np.mean(ids == k) / expected - 1) < 0.01, k
    assert np.mean(ids < 1000) == pytest.approx(((1001 ** (1 - s) - 1) / (1 - s)) / norm, rel=0.01)


def test_synthetic_examples_are_criteo_like_and_learnable():
    source = ctr.SyntheticData(CFG)
    blocks = [source.block(tf.constant(ctr.EVAL_FIRST_BLOCK + i, tf.int64)) for i in range(40)]
    x = np.concatenate([b[0].numpy() for b in blocks])
    y = np.concatenate([b[1].numpy() for b in blocks])[:, 0]
    counts, rows = x[:, :13], x[:, 13:]
    assert counts.min() >= 0 and np.mean(counts == 0) > 0.1  # counts, many of them zero
    assert set(np.unique(y)) == {0.0, 1.0} and 0.15 < y.mean() < 0.35  # a click rate
    low, sizes = CFG.offsets, CFG.vocabularies
    assert np.all(rows >= low) and np.all(rows < low + sizes)  # each feature in its own rows
    # Zipf-like: the head id (row = the feature's offset) is the most frequent, and the big
    # features have a long tail of ids seen once.
    big = int(np.argmax(sizes))
    values, seen = np.unique(rows[:, big], return_counts=True)
    assert values[np.argmax(seen)] == low[big]
    assert np.mean(seen == 1) > 0.25
    s, v = ctr.ZIPF_EXPONENT, int(sizes[big])
    head = (2 ** (1 - s) - 1) / ((v + 1) ** (1 - s) - 1)  # P(id 0)
    assert seen.max() / len(rows) == pytest.approx(head, rel=0.05)
    np.testing.assert_array_equal(source.rows(source.ids(tf.constant(rows))), rows)
    # The hidden teacher: its own AUC is the ceiling, far above chance.
    auc = keras.metrics.AUC(num_thresholds=1000)
    auc.update_state(y, tf.sigmoid(source.teacher(tf.constant(x))))
    assert 0.75 < float(auc.result()) < 0.9


def test_hashed_teacher_values_are_standard_normal():
    keys = tf.range(200_000, dtype=tf.int64)
    values = ctr.hash_normal(keys, salt=1).numpy()
    assert abs(values.mean()) < 0.01 and abs(values.std() - 1) < 0.01
    assert np.all(np.isfinite(values))
    assert abs(np.corrcoef(values, ctr.hash_normal(keys, salt=2).numpy())[0, 1]) < 0.01
    assert abs(np.corrcoef(values[:-1], values[1:])[0, 1]) < 0.01  # neighbours unrelated


def test_hex_ids_write_ids_as_python_does():
    values = [0, 1, 255, 0x68FD1E64, 2**32 - 1, 2**32, 0xABCDEF012345, 2**62 + 12345, 2**63 - 1]
    got = ctr.hex_ids(tf.constant(values, tf.int64)).numpy().tolist()
    assert [g.decode() for g in got] == [f"{v:08x}" for v in values]


def test_dynamic_keys_are_the_fingerprints_of_the_raw_feature_and_id():
    cfg = ctr.CtrConfig(rows=10_000, table="dynamic")
    cells = tf.constant([IDS, [""] * 26])
    keys = ctr.table_inputs(cells, cfg).numpy()
    names = [[f"C{j + 1}:{cell}" for j, cell in enumerate(row)] for row in (IDS, [""] * 26)]
    expected = tf.strings.to_hash_bucket_fast(names, 2**63 - 1).numpy()
    np.testing.assert_array_equal(keys, expected)
    # What a DynamicEmbedding keys the string by: one key space for strings and these ids.
    layer = ctr.DynamicEmbedding(4)
    np.testing.assert_array_equal(layer.keys(tf.constant(names))[0].numpy(), keys)
    assert len(set(keys[0].tolist())) == 26 and np.all(keys >= 0)  # same id, other feature
    # The fixed table hashes the same strings into its rows, as it always has.
    rows = ctr.table_inputs(cells, ctr.CtrConfig(rows=10_000)).numpy()
    np.testing.assert_array_equal(rows, tf.strings.to_hash_bucket_fast(names, 10_000).numpy())


@pytest.mark.parametrize("drift", [None, 3_000])
def test_synthetic_keys_match_the_file_and_the_serving_path(tmp_path: Path, monkeypatch, drift):
    cfg = ctr.CtrConfig(rows=10_000, table="dynamic", drift=drift)
    ctr.write_tsv(tmp_path / "two.tsv", cfg, first_block=0, blocks=2)
    info = criteo.check_files(str(tmp_path / "two.tsv"), field="--train-data")
    from_file, y_file = read_all(
        criteo.make_dataset(info, ctx(batch=256), rows=cfg.buckets, training=False)
    )
    source = ctr.SyntheticData(cfg)
    blocks = [source.block(tf.constant(i, tf.int64)) for i in range(2)]
    x = np.concatenate([b[0].numpy() for b in blocks])
    np.testing.assert_array_equal(from_file, x)
    np.testing.assert_array_equal(y_file, np.concatenate([b[1].numpy() for b in blocks]))
    # The export's raw request: the same hex cells, hashed in the graph to the same keys.
    monkeypatch.setenv("CTR_TABLE", "dynamic")
    if drift:
        monkeypatch.setenv("CTR_DRIFT", str(drift))
    monkeypatch.setenv("CTR_ROWS", "10000")
    drawn = source.draw(tf.constant(0, tf.int64))
    served = ctr.serving_features({"dense": drawn.counts, "categorical": ctr.hex_ids(drawn.raw)})
    np.testing.assert_array_equal(served.numpy(), x[:512])


def test_the_fixed_table_without_drift_still_reads_exact_rows():
    x, _ = ctr.SyntheticData(CFG).block(tf.constant(3, tf.int64))
    drawn = ctr.SyntheticData(CFG).draw(tf.constant(3, tf.int64))
    np.testing.assert_array_equal(x.numpy()[:, 13:], drawn.raw.numpy())  # rows, no hashing
    np.testing.assert_array_equal(x.numpy()[:, :13], drawn.counts.numpy())


def _window(source: ctr.SyntheticData, first: int, blocks: int, **kw) -> list[set[int]]:
    """The distinct raw ids of each feature over ``blocks`` blocks from ``first``."""
    raw = np.concatenate(
        [source.draw(tf.constant(first + i, tf.int64), **kw).raw.numpy() for i in range(blocks)]
    )
    return [set(raw[:, j].tolist()) for j in range(26)]


def test_drift_moves_the_live_ids_and_stays_learnable():
    cfg = ctr.CtrConfig(rows=10_000, table="dynamic", drift=20 * ctr.BLOCK, train_examples=10**6)
    source = ctr.SyntheticData(cfg)
    early, also_early, late = (_window(source, b, 4) for b in (0, 4, 200))
    big = int(np.argmax(cfg.vocabularies))

    def overlap(a: set[int], b: set[int]) -> float:
        return len(a & b) / len(a | b)

    # Nearby windows share most ids; far apart, hardly any: the vocabulary moved, and a
    # small feature's few ids (its head) were replaced too.
    assert overlap(early[big], also_early[big]) > 0.1
    assert overlap(early[big], late[big]) < 0.02
    small = int(np.argmin(cfg.vocabularies))
    assert not early[small] & late[small]
    # Without drift the same stream keeps its ids.
    still = ctr.SyntheticData(ctr.CtrConfig(rows=10_000, table="dynamic"))
    assert overlap(_window(still, 0, 4)[small], _window(still, 200, 4)[small]) == 1.0
    # The teacher scores each id (its rank and generation): its own AUC on drifting data,
    # the ceiling, is as without drift; new ids come with new scores.
    auc = keras.metrics.AUC(num_thresholds=1000)
    labels = []
    for i in range(40):
        drawn = source.draw(tf.constant(ctr.EVAL_FIRST_BLOCK + i, tf.int64), 500 + i)
        auc.update_state(drawn.labels, tf.sigmoid(source.logit(drawn.counts, drawn.ids)))
        labels.append(drawn.labels.numpy())
    assert 0.75 < float(auc.result()) < 0.9
    assert 0.15 < np.concatenate(labels).mean() < 0.4


def test_drifting_eval_data_is_held_out_from_the_streams_last_window(monkeypatch):
    monkeypatch.setenv("CTR_TABLE", "dynamic")
    monkeypatch.setenv("CTR_DRIFT", str(10 * ctr.BLOCK))
    monkeypatch.setenv("CTR_TRAIN_EXAMPLES", str(100 * ctr.BLOCK))
    monkeypatch.setenv("CTR_EVAL_EXAMPLES", str(4 * ctr.BLOCK))
    cfg = ctr.config()
    assert cfg.eval_time_block == 96
    x_eval, _ = read_all(ctr.eval_dataset_fn(ctx(batch=512)))
    assert x_eval.shape == (4 * ctr.BLOCK, 39)
    source = ctr.SyntheticData(cfg)
    last = np.concatenate(
        [source.block(tf.constant(96 + i, tf.int64))[0].numpy() for i in range(4)]
    )
    first = np.concatenate([source.block(tf.constant(i, tf.int64))[0].numpy() for i in range(4)])
    assert not np.array_equal(x_eval, last)  # other draws than training's

    def shared(a: np.ndarray, b: np.ndarray) -> float:
        return len(set(a[:, 13:].ravel()) & set(b[:, 13:].ravel())) / len(set(a[:, 13:].ravel()))

    assert shared(x_eval, last) > 0.3 > 0.05 > shared(x_eval, first)  # measured 0.40, 0.0
    # Training goes on forward in time: past CTR_TRAIN_EXAMPLES, no block comes again.
    it = iter(ctr.dataset_fn(ctx(index=tf.constant(1, tf.int64), workers=2, batch=512)))
    reads = [next(it)[0].numpy() for _ in range(52)]
    np.testing.assert_array_equal(reads[0], source.block(tf.constant(1, tf.int64))[0].numpy())
    np.testing.assert_array_equal(reads[51], source.block(tf.constant(103, tf.int64))[0].numpy())


# -- the job ----------------------------------------------------------------------------------


def test_job_datasets_model_and_metrics(monkeypatch):
    monkeypatch.setenv("CTR_ROWS", "10k")
    monkeypatch.setenv("CTR_EVAL_EXAMPLES", "1000")
    train = ctr.dataset_fn(ctx(index=tf.constant(0, tf.int64), workers=2))
    x_spec, y_spec = train.element_spec
    assert (x_spec.shape.as_list(), x_spec.dtype) == ([64, 39], tf.int64)
    assert (y_spec.shape.as_list(), y_spec.dtype) == ([64, 1], tf.float32)
    evaluation = ctr.eval_dataset_fn(ctx(batch=300))
    x, y = read_all(evaluation)
    assert x.shape == (1024, 39)  # 1000 examples: rounded up to two blocks

    model = ctr.create_model()
    embedding = model.get_layer("embedding")
    assert isinstance(embedding, keras.layers.Embedding) and embedding.input_dim == 10_000
    logits = model(tf.constant(x[:8]))
    assert logits.shape == (8, 1)
    assert isinstance(ctr.create_optimizer(), keras.optimizers.Adam)
    monkeypatch.setenv("CTR_OPTIMIZER", "adagrad")
    assert isinstance(ctr.create_optimizer(), keras.optimizers.Adagrad)
    losses = ctr.loss_fn(tf.constant(y[:8]), logits)
    assert losses.shape == (8,)

    auc, log_loss = (
        make()
        for make in metric_factories(ctr.metrics, label_shape=[None, 1], pred_shape=[None, 1])
    )
    # AUC is kept as a Keras metric (not a mean) and reads logits; log loss is a mean.
    assert isinstance(auc, keras.metrics.AUC) and auc.name == "auc"
    assert auc.get_config()["from_logits"] and auc.num_thresholds == 1000
    assert isinstance(log_loss, keras.metrics.MeanMetricWrapper) and log_loss.name == "log_loss"
    auc.update_state(tf.constant([[1.0], [0.0]]), tf.constant([[3.0], [-3.0]]))
    assert float(auc.result()) == pytest.approx(1.0)


def test_the_dynamic_table_model(monkeypatch):
    monkeypatch.setenv("CTR_TABLE", "dynamic")
    monkeypatch.setenv("CTR_TTL_STEPS", "700")
    monkeypatch.setenv("CTR_ROWS", "10k")
    monkeypatch.setenv("CTR_EVAL_EXAMPLES", "512")
    model = ctr.create_model()
    table = model.get_layer("embedding")
    assert isinstance(table, ctr.DynamicEmbedding)
    assert (table.output_dim, table.admit_after, table.ttl_steps) == (16, 2, 700)
    assert table.max_rows_per_shard is None and table.combiner is None
    x, _ = read_all(ctr.eval_dataset_fn(ctx(batch=512)))
    assert x[:, 13:].min() >= 0 and x[:, 13:].max() > 2**40  # keys, not rows
    assert model(tf.constant(x[:8])).shape == (8, 1)


class DynamicExport(NamedTuple):
    job: Any
    settings: Any
    made: Any  # the model built for export, its table on this process
    drawn: Any  # block 0's raw fields
    x: Any  # block 0's features


def dynamic_export(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DynamicExport:
    """The ctr job with a dynamic table, its model built as export builds it, and block 0
    of its synthetic stream (raw fields and features)."""
    from psctl.coordinator.job import load_job
    from psctl.coordinator.settings import TrainSettings
    from tests.unit.training.saving.test_serving import export_model

    monkeypatch.setenv("CTR_TABLE", "dynamic")
    monkeypatch.setenv("CTR_ROWS", "10k")
    job = load_job("ctr")
    settings = TrainSettings.of(job="ctr", checkpoint_dir=str(tmp_path / "checkpoints"))
    made = export_model(job, settings)
    source = ctr.SyntheticData(ctr.config())
    drawn = source.draw(tf.constant(0, tf.int64))
    x, _ = source.block(tf.constant(0, tf.int64))
    return DynamicExport(job, settings, made, drawn, x)


def test_the_dynamic_export_answers_raw_criteo_fields(tmp_path: Path, monkeypatch):
    from psctl.coordinator.training.saving.saved_model import export

    job, settings, made, drawn, x = dynamic_export(tmp_path, monkeypatch)
    ckpt = tmp_path / "checkpoints"
    # Rows for the first half of the examples' ids; the rest are unknown (zeros).
    shard = made.model.get_layer("embedding").shards[0]
    keys = tf.reshape(x[:256, 13:], [-1])
    shard.embeddings.insert(keys, tf.random.stateless_normal([keys.shape[0], 16], seed=[1, 2]))
    made.checkpoint(tf.Variable(5, dtype=tf.int64)).save(str(ckpt / "ckpt"))
    out = export(job, settings, checkpoint=None, out=str(tmp_path / "models"))
    serve = tf.saved_model.load(str(out.path)).signatures["serving_default"]
    got = serve(dense=drawn.counts, categorical=ctr.hex_ids(drawn.raw))["outputs"].numpy()
    want = made.model(x, training=False).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5)
    # Ids the table never saw read zeros: other answers than the known ids'.
    unknown = ctr.hex_ids(drawn.raw + 2**40)
    other = serve(dense=drawn.counts, categorical=unknown)["outputs"].numpy()
    assert np.abs(other[:256] - got[:256]).min() > 0, (other[:4], got[:4])


def test_one_exporter_serves_each_checkpoint_as_a_fresh_export_would(tmp_path: Path, monkeypatch):
    """--export-every's exporter keeps its model between versions: a row evicted between
    two checkpoints must not linger in the second version."""
    from psctl.coordinator.training.saving.saved_model import Exporter, export

    job, settings, made, drawn, x = dynamic_export(tmp_path, monkeypatch)
    ckpt = tmp_path / "checkpoints"
    shard = made.model.get_layer("embedding").shards[0]
    first, second = tf.reshape(x[:256, 13:], [-1]), tf.reshape(x[256:, 13:], [-1])
    shard.embeddings.insert(first, tf.random.stateless_normal([first.shape[0], 16], seed=[1, 2]))
    a = made.checkpoint(tf.Variable(5, dtype=tf.int64)).save(str(ckpt / "a"))
    shard.embeddings.remove(first)  # evicted
    shard.embeddings.insert(second, tf.random.stateless_normal([second.shape[0], 16], seed=[3, 4]))
    b = made.checkpoint(tf.Variable(9, dtype=tf.int64)).save(str(ckpt / "b"))
    exporter = Exporter(job, settings)
    assert exporter.export(a, str(tmp_path / "kept")).path.name == "5"
    kept = exporter.export(b, str(tmp_path / "kept"))
    fresh = export(job, settings, checkpoint=b, out=str(tmp_path / "fresh"))
    request = dict(dense=drawn.counts, categorical=ctr.hex_ids(drawn.raw))

    def answer(path: Path) -> np.ndarray:
        serve = tf.saved_model.load(str(path)).signatures["serving_default"]
        return serve(**request)["outputs"].numpy()

    np.testing.assert_allclose(answer(kept.path), answer(fresh.path), atol=1e-6)
    np.testing.assert_allclose(answer(kept.path), made.model(x, training=False).numpy(), atol=1e-5)


def test_summary_has_eval_auc(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    common = dict(
        job="ctr",
        global_step=10,
        start_step=0,
        target_steps=10,
        loss=0.5,
        accuracy=None,
        eval_accuracy=None,
        eval_loss=0.45,
        examples_per_sec=1.0,
        steps_per_sec=1.0,
        wall_seconds=1.0,
        train_seconds=1.0,
        num_workers=2,
        num_ps=2,
        batch_size=64,
        steps_per_execution=1,
        checkpoint=None,
        stopped_early=False,
    )
    path = tmp_path / "s.json"
    write_summary(Summary(**common), str(path))
    assert json.loads(path.read_text())["eval_auc"] is None  # the job has no AUC
    write_summary(Summary(**common, eval_auc=0.71, eval_metrics={"auc": 0.71}), str(path))
    assert json.loads(path.read_text())["eval_auc"] == 0.71
    print_summary(Summary(**common, eval_auc=0.71))
    assert "| eval_auc: 0.7100 |" in capsys.readouterr().out


# -- the Criteo TSV format --------------------------------------------------------------------

IDS = [f"{i:08x}" for i in range(26)]


def line(label: int | str = 1, dense=None, ids=None) -> str:
    """A line of cells written as given (``None``: empty), to build bad lines too."""
    dense = list(range(13)) if dense is None else dense
    cells = [label, *dense, *(IDS if ids is None else ids)]
    return "\t".join("" if cell is None else str(cell) for cell in cells)


def write(path: Path, *lines: str) -> str:
    path.write_text("".join(f"{text}\n" for text in lines))
    return str(path)


def test_format_line_writes_empty_cells():
    text = criteo.format_line(1, [3, None, *range(11)], [None, *IDS[1:]])
    assert text == line(1, [3, None, *range(11)], [None, *IDS[1:]])
    assert text.startswith("1\t3\t\t0\t") and "\t\t00000001\t" in text
    with pytest.raises(ValueError, match="12 integers and 26 ids"):
        criteo.format_line(0, [0] * 12, IDS)


def test_parse_lines_with_empty_cells():
    full = line(1, [5, -1, *range(11)], IDS)
    empty = line(0, [None] * 13, [None] * 26)
    mixed = "0\t\t7" + "\t" * 11 + "\t" + "\t".join(["a1B2", *[""] * 25])
    x, y = (t.numpy() for t in criteo.parse_lines(tf.constant([full, empty, mixed]), 1000))
    assert x.shape == (3, 39) and x.dtype == np.int64 and y.tolist() == [[1.0], [0.0], [0.0]]
    assert x[0, :13].tolist() == [5, -1, *range(11)]
    assert x[1, :13].tolist() == [0] * 13  # an empty integer is 0
    assert x[2, :13].tolist() == [0, 7] + [0] * 11
    keys = [f"C{j + 1}:{IDS[j]}" for j in range(26)]
    expected = tf.strings.to_hash_bucket_fast(keys, 1000).numpy()
    np.testing.assert_array_equal(x[0, 13:], expected)
    # An empty id is each feature's own "missing" row; the same id differs between features.
    missing = tf.strings.to_hash_bucket_fast([f"C{j + 1}:" for j in range(26)], 1000).numpy()
    np.testing.assert_array_equal(x[1, 13:], missing)
    assert x[2, 13] == tf.strings.to_hash_bucket_fast("C1:a1B2", 1000).numpy()
    same = criteo.parse_lines(tf.constant([line(ids=["abc"] * 26)]), 10**9)[0].numpy()
    assert len(set(same[0, 13:].tolist())) == 26
    assert np.all((x[:, 13:] >= 0) & (x[:, 13:] < 1000))


def test_check_files_accepts_criteo_lines(tmp_path: Path):
    path = write(
        tmp_path / "day_0.tsv",
        line(1),
        line(0, [None] * 13, [None] * 26),
        line(0, [-2, 10**17, *range(11)], ["FFFFFFFFFFFFFFFF", *IDS[1:]]),
    )
    (tmp_path / "day_1.tsv").write_bytes(line(1).encode() + b"\r\n")  # CRLF too
    info = criteo.check_files(str(tmp_path / "day_*.tsv"), field="--train-data")
    assert info.records_per_file == (3, 1) and info.num_records == 4 and info.positives == 2
    assert info.paths == (path, str(tmp_path / "day_1.tsv"))
    x, y = read_all(criteo.make_dataset(info, ctx(), rows=100, training=False))
    assert x.shape == (4, 39) and sorted(y[:, 0].tolist()) == [0, 0, 1, 1]
    assert [-2, 10**17] in x[:, :2].tolist()


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (line(label=2), "line 2, column label: '2' is not 0 or 1"),
        (line(label=""), "line 2, column label: '' is not 0 or 1"),
        (line(dense=[1.5, *range(12)]), "line 2, column I1: '1.5' is not an integer (or empty)"),
        (line(dense=[*range(12), "x"]), "line 2, column I13: 'x' is not an integer"),
        (
            line(dense=[10**19, *range(12)]),
            "line 2, column I1: '10000000000000000000' is not an integer of at most 18 digits",
        ),
        (line(ids=[*IDS[:25], "zz"]), "line 2, column C26: 'zz' is not a hexadecimal id"),
        (line(ids=[" 1f", *IDS[1:]]), "line 2, column C1: ' 1f' is not a hexadecimal id"),
        (line() + "\t", "line 2: 41 tab-separated cells, the Criteo format has 40"),
        (
            line().replace("\t", ","),
            "line 2, column label: '1,0,1,2,3,4,5,6,7,8,9,10,11,12,00000000,...' is not 0 or 1 "
            "(in a line of 1 tab-separated cells of 40)",
        ),
        ("1\t2\tx", "line 2, column I2: 'x' is not an integer (or empty) (in a line of 3 "),
        ("", "line 2 is blank"),
    ],
)
def test_a_malformed_line_is_one_error_naming_file_and_line(tmp_path: Path, text, problem):
    path = write(tmp_path / "train.tsv", line(), text, line())
    with pytest.raises(ConfigError) as err:
        criteo.check_files(path, field="--train-data")
    message = one_line(err, "--train-data")
    assert f"{path} {problem}" in message, message
    assert message.endswith(criteo.FIX)


def test_the_test_files_without_labels_are_named(tmp_path: Path):
    # Without the label every cell moves left one column: C1, a hexadecimal id (with letters
    # in real files), is read as I13.
    test_line = "\t".join(line(ids=["68fd1e64", *IDS[1:]]).split("\t")[1:])
    path = write(tmp_path / "test.txt", test_line)
    with pytest.raises(ConfigError) as err:
        criteo.check_files(path, field="--eval-data")
    message = one_line(err, "--eval-data")
    assert "line 1, column I13: '68fd1e64' is not an integer (or empty)" in message
    assert "(in a line of 39 tab-separated cells of 40; the Criteo challenge's test files " in (
        message
    )


def test_trimmed_trailing_empty_cells_read_as_empty(tmp_path: Path, caplog):
    # As in a circulating sample of the Kaggle file: 37 or 38 cells on some lines.
    full = line(1, [5, *range(12)], [*IDS[:23], None, None, None])
    trimmed = [full.rsplit("\t", 2)[0], full.rsplit("\t", 3)[0], "0\t7"]
    path = write(tmp_path / "sample.tsv", full, *trimmed, line(0))
    with caplog.at_level("WARNING"):
        info = criteo.check_files(path, field="--train-data")
    assert info.num_records == 5 and info.trimmed == 3 and info.positives == 3
    warnings = [r.getMessage() for r in caplog.records if "trailing" in r.getMessage()]
    assert warnings == [
        f"--train-data: 3 line(s) with fewer than 40 cells (the first: {path} line 2): their "
        "missing trailing cells read as empty"
    ]
    x, y = read_all(criteo.make_dataset(info, ctx(), rows=100, training=False))
    assert y[:, 0].tolist() == [1, 1, 1, 0, 0]
    np.testing.assert_array_equal(x[1], x[0])  # trimmed empty cells == written empty cells
    np.testing.assert_array_equal(x[2], x[0])
    empty = criteo.parse_lines(tf.constant([line(0, [7] + [None] * 12, [None] * 26)]), 100)
    np.testing.assert_array_equal(x[3], empty[0].numpy()[0])
    with pytest.raises(tf.errors.InvalidArgumentError, match="more than 40"):
        criteo.parse_lines(tf.constant([line() + "\t1"]), 100)


def test_missing_empty_and_mixed_files(tmp_path: Path):
    with pytest.raises(ConfigError) as err:
        criteo.check_files(str(tmp_path / "nothing-*.tsv"), field="--train-data")
    assert "no files match" in one_line(err, "--train-data")
    (tmp_path / "empty.tsv").write_text("")
    with pytest.raises(ConfigError) as err:
        criteo.check_files(str(tmp_path / "empty.tsv"), field="--train-data")
    assert f"{tmp_path / 'empty.tsv'} is empty" in one_line(err, "--train-data")
    (tmp_path / "mix").mkdir()
    write(tmp_path / "mix" / "a.tsv", line())
    (tmp_path / "mix" / "b.tsv.gz").write_bytes(gzip.compress(line().encode() + b"\n"))
    with pytest.raises(ConfigError) as err:
        criteo.check_files(str(tmp_path / "mix"), field="--train-data")
    assert "gzipped and plain" in one_line(err, "--train-data")


def test_gzipped_files_are_checked_and_read(tmp_path: Path):
    good = tmp_path / "day.tsv.gz"
    good.write_bytes(gzip.compress(f"{line(1)}\n{line(0)}\n".encode()))
    info = criteo.check_files(str(good), field="--train-data")
    _, y = read_all(criteo.make_dataset(info, ctx(), rows=100, training=False))
    assert y[:, 0].tolist() == [1, 0]
    bad = tmp_path / "bad.tsv.gz"
    bad.write_bytes(gzip.compress(f"{line(1)}\n{line(dense=['q', *range(12)])}\n".encode()))
    with pytest.raises(ConfigError) as err:
        criteo.check_files(str(bad), field="--train-data")
    assert f"{bad} line 2, column I1: 'q'" in one_line(err, "--train-data")


def test_workers_read_disjoint_parts_of_the_files(tmp_path: Path):
    # write_tsv: synthetic examples as Criteo lines; ids as the table rows in hexadecimal.
    assert ctr.write_tsv(tmp_path / "one.tsv", CFG, first_block=0, blocks=1) == 512
    info = criteo.check_files(str(tmp_path / "one.tsv"), field="--train-data")
    x_all, y_all = read_all(criteo.make_dataset(info, ctx(batch=100), rows=50, training=False))
    expected = ctr.SyntheticData(CFG).block(tf.constant(0, tf.int64))
    np.testing.assert_array_equal(y_all, expected[1].numpy())
    np.testing.assert_array_equal(x_all[:, :13], expected[0].numpy()[:, :13])
    seen = []
    for index in (0, 1):  # one file, two workers: alternate lines
        c = ctx(index=tf.constant(index, tf.int64), workers=2, batch=16, one_pass=True)
        x, _ = read_all(criteo.make_dataset(info, c, rows=50, training=True))
        assert len(x) == 256
        seen += [tuple(row) for row in x]
    assert sorted(seen) == sorted(tuple(row) for row in x_all)


def test_dataset_fn_checks_both_files_before_training(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("CTR_ROWS", "1000")
    train = write(tmp_path / "train.tsv", *[line(i % 2) for i in range(100)])
    bad_eval = write(tmp_path / "eval.tsv", line(), line(), line(ids=["g" * 8, *IDS[1:]]))
    with pytest.raises(ConfigError) as err:
        ctr.dataset_fn(ctx(train_data=train, eval_data=bad_eval))
    assert f"{bad_eval} line 3, column C1: 'gggggggg'" in one_line(err, "--eval-data")
    good_eval = write(tmp_path / "good.tsv", line(1), line(0))
    dataset = ctr.dataset_fn(ctx(train_data=train, eval_data=good_eval, batch=32))
    x, y = next(iter(dataset))
    assert x.shape == (32, 39) and y.shape == (32, 1)
    assert np.all(x.numpy()[:, 13:] < 1000)
    x, y = read_all(ctr.eval_dataset_fn(ctx(eval_data=good_eval)))
    assert y[:, 0].tolist() == [1.0, 0.0]
    assert math.isclose(float(np.mean(x[:, :13])), 6.0)
