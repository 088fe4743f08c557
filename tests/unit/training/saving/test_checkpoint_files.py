"""Damaged checkpoints on disk: real tf.train.Checkpoint files of a few variables, damaged as
a disk or an operator does it, and the newest usable one found
(training/saving/checkpoint_files.py)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from psctl.cluster.errors import EXIT_CONFIG, ConfigError
from psctl.coordinator.failures import Decision, Failure, FailurePolicy, Scope, classify
from psctl.coordinator.failures import exit_status as decision_status
from psctl.coordinator.training.saving.checkpoint_files import (
    STATE_FILE,
    ModelDoesNotMatch,
    NoUsableCheckpoint,
    check_output_dirs,
    checkpoints_in,
    load_checked,
    require_creatable_dir,
    require_writable_dir,
    restore_newest,
    set_aside_unreadable_state,
)
from tests.conftest import child_env, psctl_argv

STEPS = (100, 200, 300)


class State:
    """What a psctl checkpoint holds, in small: a float table and the global step."""

    def __init__(self) -> None:
        self.table = tf.Variable(tf.zeros([4, 3]), name="table")
        self.step = tf.Variable(0, dtype=tf.int64, name="step")
        self.checkpoint = tf.train.Checkpoint(table=self.table, global_step=self.step)

    def load(self, prefix: str) -> None:
        load_checked(self.checkpoint, prefix, [self.table, self.step])


def write(directory: Path, steps=STEPS, *, keep: int = 5, value=None) -> None:
    """Checkpoints ckpt-<step> as psctl writes them: the table filled with the step."""
    state = State()
    manager = tf.train.CheckpointManager(state.checkpoint, str(directory), max_to_keep=keep)
    for step in steps:
        state.step.assign(step)
        state.table.assign(tf.fill([4, 3], float(step) if value is None else value))
        manager.save(checkpoint_number=step)


def scramble(path: Path) -> None:
    """Flip the bits of the second half of a file, as a bad disk block does."""
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data)):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def data_file(directory: Path, step: int) -> Path:
    (path,) = directory.glob(f"ckpt-{step}.data-*")
    return path


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    write(directory)
    return directory


def restore(directory: Path) -> tuple[int | None, State]:
    state = State()
    found = restore_newest(str(directory), state.load)
    if found is not None:
        assert int(state.step.numpy()) == found.step  # ckpt-N holds step N
        assert np.all(state.table.numpy() == float(found.step))  # all from one checkpoint
    return (None if found is None else found.step), state


def test_intact_checkpoints_restore_the_newest_and_leave_the_state_file(ckpt):
    before = (ckpt / STATE_FILE).read_text()
    assert [f.step for f in checkpoints_in(str(ckpt))] == [300, 200, 100]
    assert checkpoints_in(str(ckpt))[0].files == ("ckpt-300.data-00000-of-00001", "ckpt-300.index")
    assert restore(ckpt)[0] == 300
    assert (ckpt / STATE_FILE).read_text() == before


def test_no_checkpoint_is_none(tmp_path):
    assert restore(tmp_path / "missing")[0] is None
    (tmp_path / "empty").mkdir()
    assert restore(tmp_path / "empty")[0] is None


def test_scrambled_newest_data_file_falls_back_to_the_previous_one(ckpt, caplog):
    scramble(data_file(ckpt, 300))
    with caplog.at_level(logging.ERROR):
        assert restore(ckpt)[0] == 200
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "ckpt-300 is unusable" in line
    assert "ckpt-300.index" in line and "ckpt-300.data-00000-of-00001" in line
    assert "restoring it failed" in line and "checksum" in line.lower()
    # The state file now names the one restored, and the manager goes on from it.
    assert tf.train.latest_checkpoint(str(ckpt)) == str(ckpt / "ckpt-200")
    state = State()
    manager = tf.train.CheckpointManager(state.checkpoint, str(ckpt), max_to_keep=5)
    assert manager.checkpoints == [str(ckpt / "ckpt-100"), str(ckpt / "ckpt-200")]


def test_garbage_index_of_the_newest_falls_back(ckpt, caplog):
    (ckpt / "ckpt-300.index").write_bytes(os.urandom(300))
    with caplog.at_level(logging.ERROR):
        assert restore(ckpt)[0] == 200
    assert "its index cannot be read" in caplog.text


def test_missing_data_file_falls_back(ckpt):
    data_file(ckpt, 300).unlink()
    assert restore(ckpt)[0] == 200


def test_non_finite_values_fall_back(tmp_path, caplog):
    write(tmp_path, (100,))
    write(tmp_path, (200,), value=float("nan"))
    with caplog.at_level(logging.ERROR):
        step, _ = restore(tmp_path)
    assert step == 100
    assert "table" in caplog.text and "not finite" in caplog.text


def test_checkpoint_of_another_model_is_unusable(tmp_path):
    other = tf.train.Checkpoint(table=tf.Variable(tf.zeros([4, 3])))  # no global_step
    tf.train.CheckpointManager(other, str(tmp_path), max_to_keep=2).save(checkpoint_number=50)
    with pytest.raises(ModelDoesNotMatch) as info:
        restore(tmp_path)
    assert "ckpt-50: it lacks variables the model has" in str(info.value)


def test_checkpoint_of_another_shape_is_the_models_mismatch_not_damage(tmp_path):
    """Good files of another model are not 'damaged': the line names the --job and its
    settings, and does not tell the operator to move them away."""
    other = tf.train.Checkpoint(
        table=tf.Variable(tf.zeros([5, 3])), global_step=tf.Variable(7, dtype=tf.int64)
    )
    tf.train.CheckpointManager(other, str(tmp_path), max_to_keep=2).save(checkpoint_number=7)
    with pytest.raises(ModelDoesNotMatch) as info:
        restore(tmp_path)
    text = str(info.value)
    assert text.startswith("--job: the job's model does not match the 1 checkpoint(s) in")
    assert "ckpt-7: the model does not match it: ValueError" in text and "move" not in text
    assert info.value.exit_status == 78


def test_a_dynamic_tables_rows_of_another_dimension_are_a_mismatch(tmp_path):
    """A DynamicEmbedding's shards are hash tables: rows of another dimension fail in
    their import (InvalidArgumentError 'Expected shape'), not as a ValueError."""

    def table(dim: int) -> tf.Module:
        module = tf.Module()
        module.rows = tf.lookup.experimental.MutableHashTable(
            tf.int64, tf.float32, default_value=tf.zeros([dim])
        )
        module.step = tf.Variable(3, dtype=tf.int64)
        return module

    saved = table(8)
    saved.rows.insert(tf.constant([1, 2], tf.int64), tf.ones([2, 8]))
    tf.train.Checkpoint(model=saved).write(str(tmp_path / "ckpt-3"))
    wider = tf.train.Checkpoint(model=table(16))
    with pytest.raises(ModelDoesNotMatch) as info:
        restore_newest(str(tmp_path), lambda prefix: load_checked(wider, prefix, []))
    text = str(info.value)
    assert "the model does not match it: InvalidArgumentError: " in text, text
    assert "{{function_node" not in text and "Expected shape" in text, text


@pytest.mark.parametrize("damage", ["garbage", "missing", "empty"])
def test_damaged_state_file_is_rebuilt_from_the_files(ckpt, damage, caplog):
    if damage == "garbage":
        (ckpt / STATE_FILE).write_bytes(b"model_checkpoint_path: {{{ \x00\xff garbage")
    elif damage == "missing":
        (ckpt / STATE_FILE).unlink()
    else:
        (ckpt / STATE_FILE).write_text("")
    # What the Checkpointer does before its CheckpointManager reads the file (which takes
    # garbage for "no checkpoint", and raises on an empty file).
    with caplog.at_level(logging.WARNING):
        set_aside_unreadable_state(str(ckpt))
        assert (ckpt / "checkpoint.unreadable").exists() == (damage != "missing")
        assert (
            tf.train.CheckpointManager(State().checkpoint, str(ckpt), 5).latest_checkpoint is None
        )
        assert restore(ckpt)[0] == 300
    assert "rewritten from the checkpoint files present" in caplog.text
    assert tf.train.latest_checkpoint(str(ckpt)) == str(ckpt / "ckpt-300")
    # Every intact checkpoint is back in the rotation: with --keep-checkpoints 2 the next
    # save removes the two oldest, nothing is left orphaned.
    state = State()
    manager = tf.train.CheckpointManager(state.checkpoint, str(ckpt), max_to_keep=2)
    manager.save(checkpoint_number=400)
    assert sorted(f.step for f in checkpoints_in(str(ckpt))) == [300, 400]


def test_state_file_naming_a_damaged_checkpoint_is_rewritten(ckpt, caplog):
    scramble(data_file(ckpt, 300))
    with caplog.at_level(logging.WARNING):
        assert restore(ckpt)[0] == 200
    assert "names ckpt-300: rewritten from the checkpoint files present" in caplog.text
    set_aside_unreadable_state(str(ckpt))  # a readable one stays
    assert not (ckpt / "checkpoint.unreadable").exists()


def test_every_checkpoint_damaged_is_a_config_error_naming_them(ckpt, caplog):
    for step in STEPS:
        scramble(data_file(ckpt, step))
    state_before = (ckpt / STATE_FILE).read_text()
    with caplog.at_level(logging.ERROR), pytest.raises(NoUsableCheckpoint) as info:
        restore(ckpt)
    err = info.value
    assert isinstance(err, ConfigError) and err.exit_status == EXIT_CONFIG == 78
    text = str(err)
    assert "\n" not in text
    assert text.startswith("--checkpoint-dir: none of the 3 checkpoint(s) in")
    assert all(f"ckpt-{step}:" in text for step in STEPS)
    assert len([r for r in caplog.records if "is unusable" in r.getMessage()]) == 3
    # Permanent: the job fails with 78 and no supervisor restarts it.
    decision = FailurePolicy().decide(classify(err), scope=Scope.PROCESS)
    assert classify(err) is Failure.CONFIG_ERROR
    assert decision is Decision.FAIL_CONFIG and decision_status(decision) == 78
    assert (ckpt / STATE_FILE).read_text() == state_before  # nothing rewritten


def test_a_lost_task_while_restoring_is_not_a_damaged_checkpoint(ckpt):
    class LosesItsTask:
        def restore(self, prefix: str) -> None:
            raise tf.errors.UnavailableError(None, None, "/job:ps/replica:0/task:0 is gone")

    with pytest.raises(tf.errors.UnavailableError):
        load_checked(LosesItsTask(), str(ckpt / "ckpt-300"), [])


def test_writable_dir_is_created(tmp_path):
    target = tmp_path / "a" / "b" / "ckpt"
    require_writable_dir(str(target), field="--checkpoint-dir")
    assert target.is_dir() and list(target.iterdir()) == []  # the probe file is gone


def test_unwritable_dir_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError) as info:
        require_writable_dir(str(blocker / "ckpt"), field="--checkpoint-dir")
    assert str(info.value).startswith(f"--checkpoint-dir: cannot write to {blocker / 'ckpt'}")
    assert info.value.exit_status == 78
    with pytest.raises(ConfigError, match=r"^--summary-json: cannot write to"):
        check_output_dirs(str(tmp_path / "ok"), str(blocker / "out.json"))
    with pytest.raises(ConfigError, match=r"^--summary-json: .* is a directory; give a file"):
        check_output_dirs(str(tmp_path / "ok"), str(tmp_path))
    # TensorBoard's directory too: a file there failed the run after the servers started,
    # with TensorFlow's own error and exit 1.
    with pytest.raises(ConfigError, match=r"^--logdir: cannot write to .*not a directory"):
        check_output_dirs(str(tmp_path / "ok"), "", logdir=str(blocker))
    # --workdir: checked without creating it (a run refused next leaves no directory).
    with pytest.raises(ConfigError, match=r"^--workdir: cannot write to .*\(not a directory\)"):
        require_creatable_dir(str(blocker / "w" / "x"), field="--workdir")
    require_creatable_dir(str(tmp_path / "new" / "deeper"), field="--workdir")
    assert not (tmp_path / "new").exists()


@pytest.mark.timeout(60)
def test_read_only_dir_is_a_config_error(tmp_path):
    if os.geteuid() != 0:
        tmp_path.chmod(0o500)
        try:
            with pytest.raises(ConfigError, match="Permission denied"):
                require_writable_dir(str(tmp_path), field="--checkpoint-dir")
        finally:
            tmp_path.chmod(0o700)
        return
    # Root writes to read-only directories; nobody may create files in sysfs.
    with pytest.raises(
        ConfigError, match=r"cannot write to /sys/psctl-ckpt \(Operation not permitted"
    ):
        require_writable_dir("/sys/psctl-ckpt", field="--checkpoint-dir")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("once", [False, True])
def test_psctl_train_checks_the_directories_before_anything_else(tmp_path, once):
    # Servers that do not exist: the check comes before the wait for them.
    cluster = tmp_path / "cluster.json"
    cluster.write_text(
        json.dumps(
            {
                "cluster": {
                    "chief": ["127.0.0.1:1"],
                    "ps": ["127.0.0.1:2"],
                    "worker": ["127.0.0.1:3"],
                }
            }
        )
    )
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    argv = ["train", "--cluster", str(cluster), "--summary-json", str(blocker / "out.json")]
    started = time.monotonic()
    proc = subprocess.run(
        psctl_argv(*argv, *(["--once"] if once else [])),
        capture_output=True,
        text=True,
        timeout=50,
        env=child_env(),
    )
    assert proc.returncode == 78, proc.stderr
    assert proc.stderr == (
        f"psctl: error: --summary-json: cannot write to {blocker} (not a directory); "
        "give a directory this user can create and write to\n"
    )
    assert time.monotonic() - started < 20


def test_a_long_reason_is_cut_between_words():
    """The final line cut TensorFlow's message mid-word ('... and name de); give ...')."""
    from psctl.coordinator.training.saving.checkpoint_files import WHY_CHARS, cut_reason

    why = "Expected shape [500,8] for value, got [500,16] " + "word " * 60
    cut = cut_reason(why)
    assert len(cut) <= WHY_CHARS + 4 and cut.endswith(" ...")
    assert cut[: -len(" ...")].split(" ")[-1] == "word"
    assert cut_reason("short  reason\n") == "short reason"
