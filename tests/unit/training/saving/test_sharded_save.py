"""Checkpoints saved and restored by shard (training/saving/sharded_save.py), in one
process: a fixed table split in 2 shards restored into 3 and into 1 row for row, in blocks
smaller than a shard; what TensorFlow's own reader sees; a checkpoint written whole (before
psctl saved by shard) restored; damage found (a data file cut short, one missing, bytes
changed); a value that is not finite refused with nothing written. The same on a real
cluster: tests/integration/embeddings/test_sharded_checkpoints.py."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from psctl.coordinator.training.saving import sharded_save
from psctl.coordinator.training.saving.checkpoint_files import ModelMismatch, Unusable
from psctl.coordinator.training.saving.sharded_save import Dense, NotFinite, Rows, ShardedCheckpoint

pytestmark = pytest.mark.timeout(120)

ROWS, DIM = 1000, 4
KEY = "model/table/.ATTRIBUTES/VARIABLE_VALUE"
TABLE = np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM)


def split(sizes: list[int], value: np.ndarray | None = None) -> list[tf.Variable]:
    """A table in shards of ``sizes`` rows (zeros, or ``value``'s rows)."""
    starts = np.cumsum([0, *sizes])
    source = np.zeros((ROWS, DIM), np.float32) if value is None else value
    return [tf.Variable(source[a:b]) for a, b in itertools.pairwise(starts)]


def checkpoint_of(shards: list[tf.Variable], bias: tf.Variable) -> ShardedCheckpoint:
    return ShardedCheckpoint(
        dense=[Dense("model/bias/.ATTRIBUTES/VARIABLE_VALUE", "bias", bias)],
        rows=[Rows(KEY, "table", shards)],
        hashed=[],
        summed=[],
        step_key="global_step/.ATTRIBUTES/VARIABLE_VALUE",
        saved_step=tf.Variable(0, dtype=tf.int64),
        object_graph=b"",
    )


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sharded_save, "BLOCK_BYTES", 3000)  # ~190 rows: several per shard


def saved(tmp_path: Path, step: int = 7) -> str:
    source = checkpoint_of(split([600, 400], TABLE), tf.Variable([1.5, -2.0]))
    source.saved_step.assign(step)
    prefix = str(tmp_path / f"ckpt-{step}")
    assert source._write(prefix) == prefix
    return prefix


@pytest.mark.parametrize("sizes", [[334, 333, 333], [ROWS]])
def test_a_table_of_two_shards_restores_into_three_and_into_one_row_for_row(
    tmp_path, small_blocks, sizes
):
    prefix = saved(tmp_path)
    shards, bias = split(sizes), tf.Variable([0.0, 0.0])
    target = checkpoint_of(shards, bias)
    target.load(prefix)
    np.testing.assert_array_equal(np.concatenate([s.numpy() for s in shards]), TABLE)
    np.testing.assert_array_equal(bias.numpy(), [1.5, -2.0])
    assert int(target.saved_step.numpy()) == 7
    # Each shard's blocks went to files of their own; the reader joins them.
    data = [n for n in os.listdir(tmp_path) if n.startswith("ckpt-7.data-")]
    assert len(data) > 2, data
    reader = tf.train.load_checkpoint(prefix)
    np.testing.assert_array_equal(reader.get_tensor(KEY), TABLE)


def test_a_checkpoint_written_whole_restores_by_shard(tmp_path):
    """What psctl wrote before it saved by shard: one tensor per table, from one process."""
    whole = tf.train.Checkpoint(model=tf.Module())
    whole.model.table = tf.Variable(TABLE)
    whole.model.bias = tf.Variable([3.0, 4.0])
    whole.global_step = tf.Variable(9, dtype=tf.int64)
    prefix = whole.write(str(tmp_path / "ckpt-9"))
    shards = split([500, 500])
    target = checkpoint_of(shards, tf.Variable([0.0, 0.0]))
    target.load(prefix)
    np.testing.assert_array_equal(np.concatenate([s.numpy() for s in shards]), TABLE)
    assert int(target.saved_step.numpy()) == 9


def damage_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:7])


def damage_scramble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data)):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (damage_truncate, "restoring it failed"),
        (damage_scramble, "restoring it failed"),
        (Path.unlink, "data file(s) missing: ckpt-7.data-"),
    ],
)
def test_a_damaged_shard_file_makes_the_checkpoint_unusable(tmp_path, small_blocks, damage, said):
    prefix = saved(tmp_path)
    biggest = max(Path(prefix).parent.glob("ckpt-7.data-*"), key=lambda p: p.stat().st_size)
    damage(biggest)
    with pytest.raises(Unusable) as err:
        checkpoint_of(split([500, 500]), tf.Variable([0.0, 0.0])).load(prefix)
    assert said in str(err.value), err.value


def test_another_table_size_is_a_model_mismatch(tmp_path):
    prefix = saved(tmp_path)
    shards = [tf.Variable(np.zeros((500, DIM), np.float32)) for _ in range(3)]
    with pytest.raises(ModelMismatch, match=r"is \(1000, 4\) there, \(1500, 4\) in the model"):
        checkpoint_of(shards, tf.Variable([0.0, 0.0])).load(prefix)


def test_a_table_that_is_not_finite_is_refused_and_nothing_is_written(tmp_path, small_blocks):
    value = TABLE.copy()
    value[950, 1] = np.nan
    source = checkpoint_of(split([600, 400], value), tf.Variable([0.0, 0.0]))
    with pytest.raises(NotFinite) as err:
        source._write(str(tmp_path / "ckpt-3"))
    assert err.value.name == "table"
    assert os.listdir(tmp_path) == []


def test_the_parts_of_an_unfinished_save_are_removed_before_the_next_save(tmp_path):
    """A coordinator killed between the ps tasks' writes and its join leaves their parts:
    as big as the model, every time. The next training process removes them; nothing
    else."""
    from psctl.coordinator.training.saving.checkpoint_files import remove_unfinished_saves

    prefix = saved(tmp_path)
    parts = tmp_path / "ckpt-9_temp_0123abcd"
    parts.mkdir()
    (parts / "ps-0-00001.data-00000-of-00001").write_bytes(b"x" * 100)
    other = tmp_path / "ckpt-9_temp_notmine"
    other.mkdir()
    assert remove_unfinished_saves(str(tmp_path)) == ["ckpt-9_temp_0123abcd"]
    assert not parts.exists() and other.is_dir()
    checkpoint_of(split([500, 500]), tf.Variable([0.0, 0.0])).load(prefix)  # untouched
