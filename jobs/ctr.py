"""Click-through-rate prediction, DLRM-style, on Criteo-like data: 13 integer features and
26 categorical ids per example, a binary label, AUC and log loss.

Model: the 26 ids look up one shared ``keras.layers.Embedding(CTR_ROWS, 16)`` table (each
feature owns its own rows), the 13 counts go through ``log1p`` and a bottom MLP to a 16-vector;
the pairwise dot products of those 27 vectors (351) and the bottom vector feed a top MLP
(128 -> 64 -> 1 logit). Adam (or Adagrad: ``CTR_OPTIMIZER``). With ``--max-shards`` above 1,
psctl splits the table over the ps tasks and updates only the rows a batch touched
(coordinator/training/tables.py).

Data, by default: a deterministic synthetic stream. Each feature's ids are drawn from a
bounded Zipf distribution (exponent 1.1) over its own vocabulary; the vocabularies have the
relative sizes of the Criteo Kaggle set's columns and add up to ``CTR_ROWS`` rows. Counts
are log-normal. The label is Bernoulli(sigmoid(teacher)), where the hidden teacher adds a
weight per id, low-rank crosses of 10 pairs of categorical features, a linear term in the
log-counts, a cross of two counts, and a count-by-id cross: rare ids take thousands of
steps to learn, so eval AUC keeps improving long after the first few hundred steps. Examples
come in blocks of 512 made by counter-based random numbers from the block's number alone:
the same on every machine, whatever the batch size or the number of workers.

With ``--train-data`` / ``--eval-data`` it reads Criteo TSV files instead (label, 13
integers, 26 hexadecimal ids, tab-separated; empty cells allowed; see coordinator/criteo.py),
ids hashed into the table. Every file is checked in full on the coordinator, in the first
call of ``dataset_fn`` (which psctl makes there to read the element spec).

Settings (environment variables, read on the coordinator; unknown ``PSCTL_*`` variables are
errors, so these are not ``PSCTL_*``):

- ``CTR_ROWS`` (default 100000; ``10k``, ``1M``, ``10M`` also read): table rows, from 1,000
  to 1,000,000,000. Synthetic data: the sum of the vocabularies; files: the hash buckets.
- ``CTR_TRAIN_EXAMPLES`` (default 4194304): synthetic examples per pass (``--epochs``),
  rounded up to whole blocks of 512; training without ``--epochs`` repeats them.
- ``CTR_EVAL_EXAMPLES`` (default 51200): held-out synthetic examples, rounded up likewise.
- ``CTR_OPTIMIZER`` (default ``adam``): ``adam`` (Adam, 1e-3) or ``adagrad`` (Adagrad, 0.1).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from psctl.job import ConfigError, DataContext, criteo

NUM_DENSE = criteo.NUM_DENSE  # 13 integer features
NUM_SPARSE = criteo.NUM_SPARSE  # 26 categorical features
NUM_INPUTS = criteo.NUM_INPUTS  # the model input: int64 [batch, 39], counts then rows
EMBEDDING_DIM = 16
BLOCK = 512  # synthetic examples made together, from the block's number alone
EVAL_FIRST_BLOCK = 1 << 40  # held-out blocks: far from any training block
DATA_SEED = 1234
ZIPF_EXPONENT = 1.1
MIN_VOCABULARY = 4
OPTIMIZERS = ("adam", "adagrad")
MIN_ROWS, MAX_ROWS = 1_000, 1_000_000_000
DEFAULT_ROWS = 100_000
DEFAULT_TRAIN_EXAMPLES = 8192 * BLOCK  # 4,194,304
DEFAULT_EVAL_EXAMPLES = 100 * BLOCK  # 51,200
# Distinct values per column in the Criteo Kaggle set (C1-C26): the vocabularies' shape.
CRITEO_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
CROSS_PAIRS = 10  # pairs of categorical features the teacher crosses
CROSS_RANK = 4
PERMUTE = 2654435761  # a prime above any vocabulary: id -> id * PERMUTE mod V is a bijection
_P = 2_147_483_647  # 2**31 - 1, the hash's modulus


def log_loss(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Per-example binary cross-entropy of the click probability (the loss, shown by name)."""
    return keras.losses.binary_crossentropy(labels, logits, from_logits=True)


# AUC is not a mean: psctl keeps it as a Keras metric on the ps (training: cumulative since
# the training process started) and in the final evaluation.
metrics = [keras.metrics.AUC(name="auc", from_logits=True, num_thresholds=1000), log_loss]


# -- settings ---------------------------------------------------------------------------------


def _count(name: str, text: str) -> int:
    """``100000``, ``100_000``, ``100k``, ``1M``, ``1.5M`` -> an int; ConfigError otherwise."""
    cleaned = text.strip().replace("_", "").replace(",", "")
    scale = {"k": 1_000, "m": 1_000_000}.get(cleaned[-1:].lower(), 1)
    number = cleaned[:-1] if scale > 1 else cleaned
    try:
        value = float(number) * scale
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value != int(value):
        raise ConfigError(name, f"{text!r} is not a whole number", f"e.g. {name}=1M or 100000")
    return int(value)


@dataclass(frozen=True)
class CtrConfig:
    """The job's data settings (see the module docstring)."""

    rows: int = DEFAULT_ROWS
    train_examples: int = DEFAULT_TRAIN_EXAMPLES
    eval_examples: int = DEFAULT_EVAL_EXAMPLES
    optimizer: str = "adam"

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                "CTR_OPTIMIZER",
                f"{self.optimizer!r} is not known",
                f"use {' or '.join(OPTIMIZERS)}",
            )
        if not MIN_ROWS <= self.rows <= MAX_ROWS:
            raise ConfigError(
                "CTR_ROWS", f"{self.rows} rows", f"give {MIN_ROWS:,} to {MAX_ROWS:,} rows"
            )
        for name, value in (
            ("CTR_TRAIN_EXAMPLES", self.train_examples),
            ("CTR_EVAL_EXAMPLES", self.eval_examples),
        ):
            if value < 1:
                raise ConfigError(name, f"{value} examples", "give at least 1")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> CtrConfig:
        values = {}
        for field, name in (
            ("rows", "CTR_ROWS"),
            ("train_examples", "CTR_TRAIN_EXAMPLES"),
            ("eval_examples", "CTR_EVAL_EXAMPLES"),
        ):
            if environ.get(name, "").strip():
                values[field] = _count(name, environ[name])
        optimizer = environ.get("CTR_OPTIMIZER", "").strip().lower()
        return cls(**values, optimizer=optimizer or "adam")

    @property
    def train_blocks(self) -> int:
        return -(-self.train_examples // BLOCK)

    @property
    def eval_blocks(self) -> int:
        return -(-self.eval_examples // BLOCK)

    @cached_property
    def vocabularies(self) -> np.ndarray:
        """Ids per categorical feature (int64 [26]), Criteo-shaped, adding up to ``rows``."""
        shares = np.array(CRITEO_CARDINALITIES, np.float64) / sum(CRITEO_CARDINALITIES)
        small = np.zeros(NUM_SPARSE, bool)  # the features held at MIN_VOCABULARY ids
        while True:
            budget = self.rows - MIN_VOCABULARY * int(small.sum())  # for the other features
            scaled = np.floor(shares / shares[~small].sum() * budget)
            grown = small | (scaled < MIN_VOCABULARY)
            if np.array_equal(grown, small):
                break
            small = grown
        sizes = np.where(small, MIN_VOCABULARY, scaled).astype(np.int64)
        sizes[np.argmax(sizes)] += self.rows - int(sizes.sum())
        return sizes

    @cached_property
    def offsets(self) -> np.ndarray:
        """Each feature's first row (int64 [26])."""
        return np.concatenate([[0], np.cumsum(self.vocabularies)[:-1]]).astype(np.int64)


def config() -> CtrConfig:
    """The settings from this process's environment."""
    return CtrConfig.from_env(os.environ)


# -- the synthetic data -----------------------------------------------------------------------


def hash_uniform(keys: tf.Tensor, salt: int | tf.Tensor) -> tf.Tensor:
    """A fixed pseudo-random value in (0, 1) (float64) per non-negative int64 key below 2**31
    and ``salt`` (an int, or int64 values broadcast against the keys): integer arithmetic
    only, the same on every machine."""
    h = tf.math.floormod(tf.cast(keys, tf.int64), _P)
    salt = tf.cast(salt, tf.int64)
    for mult, add in ((48271, 12345), (69621, 54321), (16807, 99991)):
        h = tf.math.floormod(h * mult + (add + 7919 * salt), _P)
        h = tf.bitwise.bitwise_xor(h, tf.bitwise.right_shift(h, tf.constant(13, tf.int64)))
    h = tf.math.floormod(h, _P)
    return (tf.cast(h, tf.float64) + 0.5) / _P


def hash_normal(keys: tf.Tensor, salt: int | tf.Tensor) -> tf.Tensor:
    """A fixed standard-normal value (float32) per key and salt."""
    u = hash_uniform(keys, salt)
    return tf.cast(math.sqrt(2.0) * tf.math.erfinv(2.0 * u - 1.0), tf.float32)


def zipf_ids(u: tf.Tensor, vocabularies: tf.Tensor, exponent: float = ZIPF_EXPONENT) -> tf.Tensor:
    """Uniforms (float64) -> ids in ``[0, V)``: id 0 is the most frequent, P(id k) roughly
    proportional to (k + 1)**-exponent (the inverse CDF of the continuous law on [1, V + 1))."""
    v = tf.cast(vocabularies, tf.float64)
    power = 1.0 - exponent
    x = tf.pow(1.0 + u * (tf.pow(v + 1.0, power) - 1.0), 1.0 / power)
    ids = tf.cast(tf.floor(x), tf.int64) - 1
    return tf.clip_by_value(ids, 0, tf.cast(vocabularies, tf.int64) - 1)


class SyntheticData:
    """The synthetic examples of a config: ``block(i)`` -> (x int64 [512, 39], y float32
    [512, 1]), and the hidden teacher's logits of any x."""

    def __init__(self, cfg: CtrConfig) -> None:
        self.cfg = cfg
        rng = np.random.default_rng(DATA_SEED)
        self.vocabularies = tf.constant(cfg.vocabularies)
        self.offsets = tf.constant(cfg.offsets)
        self.inverses = tf.constant([pow(PERMUTE, -1, int(v)) for v in cfg.vocabularies], tf.int64)
        first = rng.standard_normal(NUM_SPARSE)
        self.first_order = tf.constant(first / np.linalg.norm(first), tf.float32)
        pairs = [(f, g) for f in range(NUM_SPARSE) for g in range(f + 1, NUM_SPARSE)]
        chosen = rng.choice(len(pairs), CROSS_PAIRS, replace=False)
        self.pairs = [pairs[i] for i in sorted(chosen)]
        self.mu = tf.constant(rng.uniform(0.0, 3.0, NUM_DENSE), tf.float32)
        self.sigma = tf.constant(rng.uniform(0.8, 1.5, NUM_DENSE), tf.float32)
        beta = rng.standard_normal(NUM_DENSE)
        self.beta = tf.constant(0.5 * beta / np.linalg.norm(beta), tf.float32)
        self.bias = -0.5  # a click rate of about 0.2-0.3 for any CTR_ROWS

    def rows(self, ids: tf.Tensor) -> tf.Tensor:
        """Per-feature ids [n, 26] -> table rows: the feature's offset plus a fixed
        permutation of its ids (frequent ids are spread over the table, as hashed ids are)."""
        return self.offsets + tf.math.floormod(ids * PERMUTE, self.vocabularies)

    def ids(self, rows: tf.Tensor) -> tf.Tensor:
        """The inverse of ``rows``."""
        return tf.math.floormod((rows - self.offsets) * self.inverses, self.vocabularies)

    def _hidden(self, ids: tf.Tensor, salt: int, feature: int | None = None) -> tf.Tensor:
        """The teacher's value of each id: keyed by the feature and the id (its rank), not
        the row, so the frequent ids weigh the same whatever CTR_ROWS is."""
        features = tf.range(NUM_SPARSE, dtype=tf.int64) if feature is None else feature
        return hash_normal(ids, salt * NUM_SPARSE + features)

    def teacher(self, x: tf.Tensor) -> tf.Tensor:
        """The hidden logit (float32 [n]) of inputs x (int64 [n, 39])."""
        counts = tf.cast(x[:, :NUM_DENSE], tf.float32)
        ids = self.ids(x[:, NUM_DENSE:])
        t = (tf.math.log1p(tf.maximum(counts, 0.0)) - self.mu) / self.sigma
        logit = self.bias + tf.linalg.matvec(t, self.beta) + 0.3 * t[:, 0] * t[:, 1]
        logit += 0.5 * t[:, 2] * self._hidden(ids[:, 3], salt=99, feature=3)
        logit += tf.linalg.matvec(self._hidden(ids, salt=1), self.first_order)
        latent = tf.stack([self._hidden(ids, salt=10 + k) for k in range(CROSS_RANK)], axis=-1)
        crosses = [tf.reduce_sum(latent[:, f] * latent[:, g], axis=-1) for f, g in self.pairs]
        scale = 1.0 / math.sqrt(CROSS_RANK * CROSS_PAIRS)
        return logit + scale * tf.add_n(crosses)

    def block(self, index: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """The 512 examples of block ``index`` (an int64 scalar)."""
        index = tf.cast(index, tf.int64)

        def seed(k: int) -> tf.Tensor:
            return tf.stack([index, tf.constant(DATA_SEED * 16 + k, tf.int64)])

        u = tf.random.stateless_uniform([BLOCK, NUM_SPARSE], seed(0), dtype=tf.float64)
        rows = self.rows(zipf_ids(u, self.vocabularies))
        z = tf.random.stateless_normal([BLOCK, NUM_DENSE], seed(1))
        counts = tf.floor(tf.math.expm1(tf.maximum(self.mu + self.sigma * z, 0.0)))
        x = tf.concat([tf.cast(counts, tf.int64), rows], axis=1)
        p = tf.sigmoid(self.teacher(x))
        clicked = tf.random.stateless_uniform([BLOCK], seed(2)) < p
        return x, tf.cast(clicked, tf.float32)[:, None]

    def dataset(self, blocks: tf.data.Dataset, batch_size: int, *, drop: bool) -> tf.data.Dataset:
        """Batches of the examples of ``blocks`` (a dataset of block numbers)."""
        return (
            blocks.map(self.block, num_parallel_calls=tf.data.AUTOTUNE)
            .unbatch()
            .batch(batch_size, drop_remainder=drop)
            .prefetch(tf.data.AUTOTUNE)
        )


def write_tsv(
    path: str | os.PathLike[str], cfg: CtrConfig, *, first_block: int, blocks: int
) -> int:
    """Synthetic examples as a Criteo TSV file (ids: the table rows in hexadecimal); returns
    the number of lines. For trying the file path, tests and benchmarks."""
    source = SyntheticData(cfg)
    lines = 0
    with Path(path).open("w") as out:
        for index in range(first_block, first_block + blocks):
            x, y = (t.numpy() for t in source.block(tf.constant(index, tf.int64)))
            for features, label in zip(x, y[:, 0], strict=True):
                ids = [f"{row:08x}" for row in features[NUM_DENSE:]]
                out.write(criteo.format_line(int(label), list(features[:NUM_DENSE]), ids) + "\n")
                lines += 1
    return lines


# -- the job ----------------------------------------------------------------------------------


def create_model() -> keras.Model:
    cfg = config()
    features = keras.Input((NUM_INPUTS,), dtype="int64", name="features")
    counts = keras.ops.cast(features[:, :NUM_DENSE], "float32")
    bottom = keras.ops.log1p(keras.ops.maximum(counts, 0.0))
    bottom = keras.layers.Dense(64, activation="relu", name="bottom_1")(bottom)
    bottom = keras.layers.Dense(EMBEDDING_DIM, activation="relu", name="bottom_2")(bottom)
    embedded = keras.layers.Embedding(cfg.rows, EMBEDDING_DIM, name="embedding")(
        features[:, NUM_DENSE:]
    )
    vectors = keras.ops.concatenate([bottom[:, None, :], embedded], axis=1)  # [batch, 27, 16]
    dots = keras.ops.matmul(vectors, keras.ops.transpose(vectors, (0, 2, 1)))
    n = NUM_SPARSE + 1
    upper = [i * n + j for i in range(n) for j in range(i + 1, n)]  # each pair once
    pairs = keras.ops.take(keras.ops.reshape(dots, (-1, n * n)), upper, axis=1)
    top = keras.ops.concatenate([bottom, pairs], axis=1)
    top = keras.layers.Dense(128, activation="relu", name="top_1")(top)
    top = keras.layers.Dense(64, activation="relu", name="top_2")(top)
    logit = keras.layers.Dense(1, name="logit")(top)
    return keras.Model(features, logit, name="ctr")


def serving_inputs() -> dict[str, tf.TensorSpec]:
    """What the exported model takes (docs/serving.md): a Criteo line's fields as they are,
    13 integer counts (a missing one: 0) and 26 hexadecimal ids (a missing one: "")."""
    return {
        "dense": tf.TensorSpec([None, NUM_DENSE], tf.int64, name="dense"),
        "categorical": tf.TensorSpec([None, NUM_SPARSE], tf.string, name="categorical"),
    }


def serving_features(inputs: dict[str, tf.Tensor]) -> tf.Tensor:
    """The raw fields as the model's features, in the graph: the ids hashed into the table's
    rows as the file reader and the generator do (CTR_ROWS must be the training run's)."""
    rows = criteo.hash_ids(inputs["categorical"], config().rows)
    return tf.concat([inputs["dense"], rows], axis=1)


def create_optimizer() -> keras.optimizers.Optimizer:
    if config().optimizer == "adagrad":
        return keras.optimizers.Adagrad(learning_rate=0.1)
    return keras.optimizers.Adam(learning_rate=1e-3)


def loss_fn(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    return log_loss(labels, logits)


def _files(pattern: str, field: str) -> criteo.TsvFiles:
    with tf.init_scope():  # eagerly, also when first called while a dataset fn is traced
        return criteo.check_files(pattern, field=field)


def dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    cfg = config()
    if ctx.eval_data:  # checked before training, not at the end
        _files(ctx.eval_data, "--eval-data")
    if ctx.train_data:
        info = _files(ctx.train_data, "--train-data")
        return criteo.make_dataset(info, ctx, rows=cfg.rows, training=True)
    source = SyntheticData(cfg)
    blocks = tf.data.Dataset.range(cfg.train_blocks)
    if ctx.one_pass:  # --epochs: one pass; the tf.data service hands out the blocks
        return source.dataset(blocks, ctx.batch_size, drop=False)
    blocks = blocks.shard(ctx.num_workers, ctx.worker_index).repeat()
    return source.dataset(blocks, ctx.batch_size, drop=True)


def eval_dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    cfg = config()
    if ctx.eval_data:
        info = _files(ctx.eval_data, "--eval-data")
        return criteo.make_dataset(info, ctx, rows=cfg.rows, training=False)
    blocks = tf.data.Dataset.range(EVAL_FIRST_BLOCK, EVAL_FIRST_BLOCK + cfg.eval_blocks)
    blocks = blocks.shard(ctx.num_workers, ctx.worker_index)
    return SyntheticData(cfg).dataset(blocks, ctx.batch_size, drop=False)
