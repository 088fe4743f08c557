"""Click-through-rate prediction, DLRM-style, on Criteo-like data: 13 integer features and
26 categorical ids per example, a binary label, AUC and log loss.

Model: the 26 ids look up one shared ``keras.layers.Embedding(CTR_ROWS, 16)`` table (each
feature owns its own rows), the 13 counts go through ``log1p`` and a bottom MLP to a 16-vector;
the pairwise dot products of those 27 vectors (351) and the bottom vector feed a top MLP
(128 -> 64 -> 1 logit). Adam (or Adagrad: ``CTR_OPTIMIZER``). With ``--max-shards`` above 1,
psctl splits the table over the ps tasks and updates only the rows a batch touched
(coordinator/embeddings/sharded.py). With ``CTR_TABLE=dynamic`` the table is one shared
``DynamicEmbedding(16)`` instead, keyed by the raw (feature, id) pairs: no size, no
collisions, a row per id seen ``CTR_ADMIT_AFTER`` times, one shard per ps.

Keys: the model's 26 id columns are int64. The fixed table takes rows: a file's id is hashed
into them, ``to_hash_bucket_fast("C<j>:" + id, CTR_ROWS)``. The dynamic table takes keys: the
same string's 63-bit fingerprint, ``to_hash_bucket_fast("C<j>:" + id, 2**63 - 1)`` (the key
``DynamicEmbedding`` gives that string itself; any length of hexadecimal id, one key per
feature and id, two of 10^9 distinct ids sharing a key with probability about 5%), so the
reader, the generator and the export (``serving_features``: the raw Criteo fields in) agree.

Data, by default: a deterministic synthetic stream. Each feature's ids are drawn from a
bounded Zipf distribution (exponent 1.1) over its own vocabulary; the vocabularies have the
relative sizes of the Criteo Kaggle set's columns and add up to ``CTR_VOCABULARY`` (default
``CTR_ROWS``). Counts are log-normal. The label is Bernoulli(sigmoid(teacher)), where the
hidden teacher adds a weight per id, low-rank crosses of 10 pairs of categorical features, a
linear term in the log-counts, a cross of two counts, and a count-by-id cross: rare ids take
thousands of steps to learn, so eval AUC keeps improving long after the first few hundred
steps. Examples come in blocks of 512 made by counter-based random numbers from the block's
number alone: the same on every machine, whatever the batch size or the number of workers.
The fixed table with ``CTR_VOCABULARY = CTR_ROWS`` and no drift reads the ids as rows, each
feature its own (no collisions); otherwise the ids are hexadecimal cells hashed as a file's.

Drift (``CTR_DRIFT=N``): each (feature, popularity rank) is held by one id for N examples,
then by a new id (a fixed phase per rank staggers the changes), so new ids keep appearing at
every rank, head included, and old ones stop; the teacher keys its values by the id (rank
and generation), so every id is learnable and a new one must be learned afresh. Training
reads the stream forward (worker i of n: blocks i, i + n, ...; never back to the start) and
the held-out examples are other draws from its last ``CTR_EVAL_EXAMPLES`` of
``CTR_TRAIN_EXAMPLES``, the window a production model is judged on: set
``CTR_TRAIN_EXAMPLES`` to what the run reads (steps x batch size per worker).

With ``--train-data`` / ``--eval-data`` it reads Criteo TSV files instead (label, 13
integers, 26 hexadecimal ids, tab-separated; empty cells allowed, an empty id is its
feature's own "missing" id; see coordinator/data/criteo.py). Every file is checked in full
on the coordinator, in the first call of ``dataset_fn`` (which psctl makes there to read the
element spec).

Settings (environment variables, read on the coordinator; unknown ``PSCTL_*`` variables are
errors, so these are not ``PSCTL_*``; set the same ones for ``psctl evaluate`` and
``psctl export``):

- ``CTR_TABLE`` (default ``fixed``): ``fixed`` (a ``CTR_ROWS``-row table, ids hashed into
  it) or ``dynamic`` (a ``DynamicEmbedding`` keyed by the raw (feature, id) pairs).
- ``CTR_ROWS`` (default 100000; ``10k``, ``1M``, ``10M`` also read): the fixed table's rows,
  from 1,000 to 1,000,000,000: the hash buckets of file ids.
- ``CTR_VOCABULARY`` (default ``CTR_ROWS``): synthetic ids live at a time (the sum of the
  vocabularies), 1,000 to 1,000,000,000.
- ``CTR_DRIFT`` (default none): synthetic ids' lifetime in examples (``200k``); none: the
  same ids forever.
- ``CTR_TRAIN_EXAMPLES`` (default 4194304): synthetic examples per pass (``--epochs``),
  rounded up to whole blocks of 512; training without ``--epochs`` repeats them (with drift:
  goes on forward).
- ``CTR_EVAL_EXAMPLES`` (default 51200): held-out synthetic examples, rounded up likewise.
- ``CTR_OPTIMIZER`` (default ``adam``): ``adam`` (Adam, 1e-3) or ``adagrad`` (Adagrad, 0.1).
- Dynamic tables only (an error with ``CTR_TABLE=fixed``): ``CTR_ADMIT_AFTER`` (default 2:
  an id seen once, most of a Zipf tail, gets no row), ``CTR_TTL_STEPS`` (default none: an id
  is evicted after that many global steps unseen), ``CTR_TTL_SECONDS`` (default none: after
  that many seconds unseen; follow mode's drifting ids) and ``CTR_MAX_ROWS_PER_SHARD`` (default
  none: each ps keeps at most that many rows, the least recently seen evicted first).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

import keras
import numpy as np
import tensorflow as tf

from psctl.job import ConfigError, DataContext, DynamicEmbedding, criteo

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
TABLES = ("fixed", "dynamic")
DEFAULT_ADMIT_AFTER = 2  # an id seen once (most of a Zipf tail) gets no row
DYNAMIC_SETTINGS = (
    "CTR_ADMIT_AFTER",
    "CTR_TTL_STEPS",
    "CTR_TTL_SECONDS",
    "CTR_MAX_ROWS_PER_SHARD",
)
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
DRIFT_SALT = 1000  # the salt of the drift's phases
HEX_DIGITS = 16  # int64 ids as hexadecimal


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


def _optional_count(name: str, text: str) -> int | None:
    """Like ``_count``; ``none`` / ``off`` (or nothing) -> None."""
    if text.strip().lower() in ("", "none", "off"):
        return None
    return _count(name, text)


@dataclass(frozen=True)
class CtrConfig:
    """The job's data settings (see the module docstring)."""

    rows: int = DEFAULT_ROWS
    train_examples: int = DEFAULT_TRAIN_EXAMPLES
    eval_examples: int = DEFAULT_EVAL_EXAMPLES
    optimizer: str = "adam"
    table: str = "fixed"
    vocabulary: int = 0  # the synthetic ids live at a time; 0: ``rows``
    drift: int | None = None  # examples an id lives; None: no drift
    admit_after: int = DEFAULT_ADMIT_AFTER
    ttl_steps: int | None = None
    max_rows_per_shard: int | None = None
    ttl_seconds: int | None = None

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                "CTR_OPTIMIZER",
                f"{self.optimizer!r} is not known",
                f"use {' or '.join(OPTIMIZERS)}",
            )
        if self.table not in TABLES:
            raise ConfigError(
                "CTR_TABLE", f"{self.table!r} is not known", f"use {' or '.join(TABLES)}"
            )
        if not self.vocabulary:
            object.__setattr__(self, "vocabulary", self.rows)
        for name, rows in (("CTR_ROWS", self.rows), ("CTR_VOCABULARY", self.vocabulary)):
            if not MIN_ROWS <= rows <= MAX_ROWS:
                raise ConfigError(name, f"{rows} rows", f"give {MIN_ROWS:,} to {MAX_ROWS:,} rows")
        for name, value in (
            ("CTR_TRAIN_EXAMPLES", self.train_examples),
            ("CTR_EVAL_EXAMPLES", self.eval_examples),
        ):
            if value < 1:
                raise ConfigError(name, f"{value} examples", "give at least 1")
        if self.drift is not None and self.drift < 1:
            raise ConfigError(
                "CTR_DRIFT", f"{self.drift} examples", "give an id lifetime of at least 1 example"
            )
        for name, count in (
            ("CTR_ADMIT_AFTER", self.admit_after),
            ("CTR_TTL_STEPS", self.ttl_steps),
            ("CTR_TTL_SECONDS", self.ttl_seconds),
            ("CTR_MAX_ROWS_PER_SHARD", self.max_rows_per_shard),
        ):
            if count is not None and count < 1:
                raise ConfigError(name, f"got {count}", "give at least 1 (or leave it unset)")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> CtrConfig:
        values: dict[str, int | None] = {}
        for field, name in (
            ("rows", "CTR_ROWS"),
            ("train_examples", "CTR_TRAIN_EXAMPLES"),
            ("eval_examples", "CTR_EVAL_EXAMPLES"),
            ("vocabulary", "CTR_VOCABULARY"),
            ("admit_after", "CTR_ADMIT_AFTER"),
        ):
            if environ.get(name, "").strip():
                values[field] = _count(name, environ[name])
        for field, name in (
            ("drift", "CTR_DRIFT"),
            ("ttl_steps", "CTR_TTL_STEPS"),
            ("ttl_seconds", "CTR_TTL_SECONDS"),
            ("max_rows_per_shard", "CTR_MAX_ROWS_PER_SHARD"),
        ):
            values[field] = _optional_count(name, environ.get(name, ""))
        table = environ.get("CTR_TABLE", "").strip().lower() or "fixed"
        if table == "fixed":  # the dynamic table's settings would be silently ignored
            for name in DYNAMIC_SETTINGS:
                if environ.get(name, "").strip():
                    raise ConfigError(
                        name, "is a setting of dynamic tables", "set CTR_TABLE=dynamic or unset it"
                    )
        optimizer = environ.get("CTR_OPTIMIZER", "").strip().lower()
        return cls(**values, optimizer=optimizer or "adam", table=table)  # type: ignore[arg-type]

    @property
    def buckets(self) -> int:
        """What a file's ids (``"C<j>:" + id``) are hashed into: the fixed table's rows, or
        the dynamic table's 63-bit keys."""
        return criteo.KEY_SPACE if self.table == "dynamic" else self.rows

    @property
    def eval_time_block(self) -> int:
        """Where the held-out examples sit in a drifting stream: its last
        ``eval_examples`` of ``train_examples`` (what a production model is judged on)."""
        return max(self.train_blocks - self.eval_blocks, 0)

    @property
    def exact_rows(self) -> bool:
        """Synthetic ids are table rows as they are (each feature its own rows, no
        collisions): the fixed table, its vocabularies adding up to its rows, no drift."""
        return self.table == "fixed" and self.vocabulary == self.rows and self.drift is None

    @property
    def train_blocks(self) -> int:
        return -(-self.train_examples // BLOCK)

    @property
    def eval_blocks(self) -> int:
        return -(-self.eval_examples // BLOCK)

    @cached_property
    def vocabularies(self) -> np.ndarray:
        """Ids per categorical feature (int64 [26]), Criteo-shaped, adding up to
        ``vocabulary`` (with drift: the ids live at any one time)."""
        total = self.vocabulary
        shares = np.array(CRITEO_CARDINALITIES, np.float64) / sum(CRITEO_CARDINALITIES)
        small = np.zeros(NUM_SPARSE, bool)  # the features held at MIN_VOCABULARY ids
        while True:
            budget = total - MIN_VOCABULARY * int(small.sum())  # for the other features
            scaled = np.floor(shares / shares[~small].sum() * budget)
            grown = small | (scaled < MIN_VOCABULARY)
            if np.array_equal(grown, small):
                break
            small = grown
        sizes = np.where(small, MIN_VOCABULARY, scaled).astype(np.int64)
        sizes[np.argmax(sizes)] += total - int(sizes.sum())
        return sizes

    @cached_property
    def offsets(self) -> np.ndarray:
        """Each feature's first row, or first raw id (int64 [26])."""
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


def hex_ids(values: tf.Tensor) -> tf.Tensor:
    """Non-negative int64 ids -> lowercase hexadecimal strings of at least 8 digits (as
    Python's ``f"{id:08x}"``): the cells of a Criteo file."""
    v = tf.cast(values, tf.int64)
    shifts = tf.constant([4 * (HEX_DIGITS - 1 - i) for i in range(HEX_DIGITS)], tf.int64)
    nibbles = tf.bitwise.bitwise_and(tf.bitwise.right_shift(v[..., None], shifts), 15)
    text = tf.strings.reduce_join(tf.gather(tf.constant(list("0123456789abcdef")), nibbles), -1)
    width = tf.fill(tf.shape(v), 8)
    for digits in range(8, HEX_DIGITS):
        width += tf.cast(v >= 16**digits, tf.int32)
    return tf.strings.substr(text, HEX_DIGITS - width, width)


def table_inputs(ids: tf.Tensor, cfg: CtrConfig) -> tf.Tensor:
    """Raw categorical cells (strings ``[batch, 26]``) -> what the model's table takes: rows
    of the fixed table (hashed into ``CTR_ROWS``), or the keys of the dynamic one (the
    63-bit fingerprint of ``"C<j>:" + id``)."""
    return criteo.hash_ids(ids, cfg.buckets)


class Draw(NamedTuple):
    """A block of synthetic examples as a file holds them, and the ids' identities."""

    counts: tf.Tensor  # int64 [512, 13]
    raw: tf.Tensor  # int64 [512, 26]: the ids a file writes (hexadecimal)
    ids: tf.Tensor  # int64 [512, 26]: what the teacher keys its values by (rank, generation)
    labels: tf.Tensor  # float32 [512, 1]


class SyntheticData:
    """The synthetic examples of a config: ``block(i)`` -> (x int64 [512, 39], y float32
    [512, 1]), and the hidden teacher's logits."""

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
        """The teacher's value of each id: keyed by the feature and the id (its rank, and
        with drift its generation), not the row, so the frequent ids weigh the same
        whatever CTR_ROWS is."""
        features = tf.range(NUM_SPARSE, dtype=tf.int64) if feature is None else feature
        return hash_normal(ids, salt * NUM_SPARSE + features)

    def teacher(self, x: tf.Tensor) -> tf.Tensor:
        """The hidden logit (float32 [n]) of inputs x (int64 [n, 39]) of exact rows
        (``CtrConfig.exact_rows``; otherwise rows do not tell the ids: see ``logit``)."""
        return self.logit(x[:, :NUM_DENSE], self.ids(x[:, NUM_DENSE:]))

    def logit(self, counts: tf.Tensor, ids: tf.Tensor) -> tf.Tensor:
        """The hidden logit (float32 [n]) of counts [n, 13] and the ids' identities [n, 26]."""
        t = (tf.math.log1p(tf.maximum(tf.cast(counts, tf.float32), 0.0)) - self.mu) / self.sigma
        logit = self.bias + tf.linalg.matvec(t, self.beta) + 0.3 * t[:, 0] * t[:, 1]
        logit += 0.5 * t[:, 2] * self._hidden(ids[:, 3], salt=99, feature=3)
        logit += tf.linalg.matvec(self._hidden(ids, salt=1), self.first_order)
        latent = tf.stack([self._hidden(ids, salt=10 + k) for k in range(CROSS_RANK)], axis=-1)
        crosses = [tf.reduce_sum(latent[:, f] * latent[:, g], axis=-1) for f, g in self.pairs]
        scale = 1.0 / math.sqrt(CROSS_RANK * CROSS_PAIRS)
        return logit + scale * tf.add_n(crosses)

    def draw(self, index: tf.Tensor, time: tf.Tensor | None = None) -> Draw:
        """The 512 examples of block ``index`` (an int64 scalar) as a file holds them, and
        their ids' identities. ``time``: the block's place in the drifting stream (default:
        ``index``)."""
        index = tf.cast(index, tf.int64)

        def seed(k: int) -> tf.Tensor:
            return tf.stack([index, tf.constant(DATA_SEED * 16 + k, tf.int64)])

        u = tf.random.stateless_uniform([BLOCK, NUM_SPARSE], seed(0), dtype=tf.float64)
        ranks = zipf_ids(u, self.vocabularies)
        raw, identity = self.rows(ranks), ranks
        if self.cfg.drift is not None:
            # Each (feature, rank) is held by one id at a time, for CTR_DRIFT examples, then
            # by a new one; the changes are staggered by a fixed phase per rank.
            lifetime = tf.constant(self.cfg.drift, tf.int64)
            start = (index if time is None else tf.cast(time, tf.int64)) * BLOCK
            when = start + tf.range(BLOCK, dtype=tf.int64)[:, None]
            features = tf.range(NUM_SPARSE, dtype=tf.int64)
            phase = tf.cast(
                tf.floor(hash_uniform(ranks, DRIFT_SALT + features) * self.cfg.drift), tf.int64
            )
            generation = (when + phase) // lifetime
            identity = ranks + self.vocabularies * generation
            raw = raw + self.cfg.vocabulary * generation
        z = tf.random.stateless_normal([BLOCK, NUM_DENSE], seed(1))
        counts = tf.cast(
            tf.floor(tf.math.expm1(tf.maximum(self.mu + self.sigma * z, 0.0))), tf.int64
        )
        p = tf.sigmoid(self.logit(counts, identity))
        clicked = tf.random.stateless_uniform([BLOCK], seed(2)) < p
        return Draw(counts, raw, identity, tf.cast(clicked, tf.float32)[:, None])

    def block(self, index: tf.Tensor, time: tf.Tensor | None = None) -> tuple[tf.Tensor, tf.Tensor]:
        """The 512 examples of block ``index`` (an int64 scalar) as model inputs: the raw ids
        as they are (``CtrConfig.exact_rows``) or hashed as a file's cells are."""
        drawn = self.draw(index, time)
        ids = drawn.raw if self.cfg.exact_rows else table_inputs(hex_ids(drawn.raw), self.cfg)
        return tf.concat([drawn.counts, ids], axis=1), drawn.labels

    def dataset(
        self, blocks: tf.data.Dataset, batch_size: int, *, drop: bool, time_offset: int = 0
    ) -> tf.data.Dataset:
        """Batches of the examples of ``blocks`` (a dataset of block numbers); block ``i``
        sits at ``i + time_offset`` in the drifting stream."""
        return (
            blocks.map(
                lambda i: self.block(i, i + time_offset), num_parallel_calls=tf.data.AUTOTUNE
            )
            .unbatch()
            .batch(batch_size, drop_remainder=drop)
            .prefetch(tf.data.AUTOTUNE)
        )


def write_tsv(
    path: str | os.PathLike[str], cfg: CtrConfig, *, first_block: int, blocks: int
) -> int:
    """Synthetic examples as a Criteo TSV file (ids: the raw ids in hexadecimal, which are the
    table rows for exact rows); returns the number of lines. For trying the file path,
    tests and benchmarks."""
    source = SyntheticData(cfg)
    lines = 0
    with Path(path).open("w") as out:
        for index in range(first_block, first_block + blocks):
            drawn = source.draw(tf.constant(index, tf.int64))
            counts, raw, y = drawn.counts.numpy(), drawn.raw.numpy(), drawn.labels.numpy()
            for dense, ids, label in zip(counts, raw, y[:, 0], strict=True):
                cells = [f"{int(v):08x}" for v in ids]
                out.write(criteo.format_line(int(label), list(dense), cells) + "\n")
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
    table: keras.layers.Layer
    if cfg.table == "dynamic":
        table = DynamicEmbedding(
            EMBEDDING_DIM,
            admit_after=cfg.admit_after,
            ttl_steps=cfg.ttl_steps,
            ttl_seconds=cfg.ttl_seconds,
            max_rows_per_shard=cfg.max_rows_per_shard,
            name="embedding",
        )
    else:
        table = keras.layers.Embedding(cfg.rows, EMBEDDING_DIM, name="embedding")
    embedded = table(features[:, NUM_DENSE:])
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
    rows, or into the dynamic table's keys, as the file reader does (CTR_TABLE and CTR_ROWS
    must be the training run's)."""
    ids = table_inputs(inputs["categorical"], config())
    return tf.concat([inputs["dense"], ids], axis=1)


def create_optimizer() -> keras.optimizers.Optimizer:
    if config().optimizer == "adagrad":
        return keras.optimizers.Adagrad(learning_rate=0.1)
    return keras.optimizers.Adam(learning_rate=1e-3)


def loss_fn(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    return log_loss(labels, logits)


def _files(pattern: str, field: str, ctx: DataContext) -> criteo.TsvFiles:
    with tf.init_scope():  # eagerly, also when first called while a dataset fn is traced
        return criteo.check_files(pattern, field=field, full_below=ctx.full_check_bytes)


def dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    cfg = config()
    if ctx.eval_data:  # checked before training, not at the end
        _files(ctx.eval_data, "--eval-data", ctx)
    if ctx.train_data:
        info = _files(ctx.train_data, "--train-data", ctx)
        return criteo.make_dataset(info, ctx, rows=cfg.buckets, training=True)
    source = SyntheticData(cfg)
    blocks = tf.data.Dataset.range(cfg.train_blocks)
    if ctx.one_pass:  # --epochs: one pass; the tf.data service hands out the blocks
        return source.dataset(blocks, ctx.batch_size, drop=False)
    if cfg.drift is None:
        blocks = blocks.shard(ctx.num_workers, ctx.worker_index).repeat()
    else:  # a drifting stream goes on forward in time, never back to its start
        blocks = tf.data.Dataset.range(EVAL_FIRST_BLOCK).shard(ctx.num_workers, ctx.worker_index)
    return source.dataset(blocks, ctx.batch_size, drop=True)


def eval_dataset_fn(ctx: DataContext) -> tf.data.Dataset:
    cfg = config()
    if ctx.eval_data:
        info = _files(ctx.eval_data, "--eval-data", ctx)
        return criteo.make_dataset(info, ctx, rows=cfg.buckets, training=False)
    blocks = tf.data.Dataset.range(EVAL_FIRST_BLOCK, EVAL_FIRST_BLOCK + cfg.eval_blocks)
    blocks = blocks.shard(ctx.num_workers, ctx.worker_index)
    # With drift: held-out draws from the training stream's last CTR_EVAL_EXAMPLES.
    offset = cfg.eval_time_block - EVAL_FIRST_BLOCK
    return SyntheticData(cfg).dataset(blocks, ctx.batch_size, drop=False, time_offset=offset)
