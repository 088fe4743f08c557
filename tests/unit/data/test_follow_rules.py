"""Follow mode's pure parts: which partitions are complete (marker, settle time), in which
order they train, the journal a restart goes on from, the publisher's pruning, and the
settings refused in one line."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from psctl.cluster.errors import ConfigError
from psctl.coordinator.data.files import expand, file_list
from psctl.coordinator.data.follow import PartitionWatcher
from psctl.coordinator.settings import parse_duration, resolve_settings
from psctl.coordinator.training.saving.follow_journal import FollowJournal
from psctl.coordinator.training.saving.publishing import prune, versions_in
from psctl.coordinator.training.steps.follow import wait_for_partition

pytestmark = pytest.mark.timeout(60)


def write(path: Path, text: str = "x\n", *, age: float = 0.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if age:
        stamp = path.stat().st_mtime - age
        os.utime(path, (stamp, stamp))
    return path


def watcher(root: Path, settle: float = 60.0) -> PartitionWatcher:
    return PartitionWatcher(str(root / "*" / "part-*"), marker="_SUCCESS", settle_seconds=settle)


def test_a_partition_trains_once_its_marker_is_there_and_in_path_order(tmp_path: Path):
    write(tmp_path / "hour=01" / "part-1")
    write(tmp_path / "hour=01" / "part-0")
    write(tmp_path / "hour=00" / "part-0")
    write(tmp_path / "hour=02" / "part-0")  # no marker yet: being written
    for hour in ("00", "01"):
        write(tmp_path / f"hour={hour}" / "_SUCCESS", "")
    listing = watcher(tmp_path).look(trained=())
    assert [p.directory for p in listing.ready] == [
        str(tmp_path / "hour=00"),
        str(tmp_path / "hour=01"),
    ]
    assert listing.ready[1].files == (
        str(tmp_path / "hour=01" / "part-0"),
        str(tmp_path / "hour=01" / "part-1"),
    )
    assert listing.waiting == 1
    marker = (tmp_path / "hour=00" / "_SUCCESS").stat().st_mtime
    assert listing.ready[0].completed_at == marker


def test_trained_files_are_not_listed_again(tmp_path: Path):
    done = write(tmp_path / "hour=00" / "part-0")
    write(tmp_path / "hour=00" / "_SUCCESS", "")
    listing = watcher(tmp_path).look(trained={str(done)})
    assert listing.ready == () and listing.waiting == 0


def test_without_markers_a_partition_is_complete_once_it_settled(tmp_path: Path):
    write(tmp_path / "a" / "part-0", age=120)
    write(tmp_path / "b" / "part-0", age=120)
    write(tmp_path / "b" / "part-1")  # still changing
    listing = watcher(tmp_path, settle=60).look(trained=())
    assert [p.directory for p in listing.ready] == [str(tmp_path / "a")]
    assert listing.waiting == 2


def test_once_markers_are_seen_a_settled_partition_without_one_waits(tmp_path: Path):
    write(tmp_path / "a" / "part-0", age=120)
    write(tmp_path / "a" / "_SUCCESS", "")
    write(tmp_path / "b" / "part-0", age=120)  # settled, but the pipeline writes markers
    listing = watcher(tmp_path, settle=60).look(trained=())
    assert [p.directory for p in listing.ready] == [str(tmp_path / "a")]
    assert listing.waiting == 1


def test_after_a_restart_trained_partitions_still_say_markers_are_written(tmp_path: Path):
    done = write(tmp_path / "a" / "part-0", age=120)
    write(tmp_path / "a" / "_SUCCESS", "")
    write(tmp_path / "b" / "part-0", age=120)  # half-written, settled: its writer stalled
    fresh = watcher(tmp_path, settle=60)  # a new training process's watcher
    listing = fresh.look(trained={str(done)})
    assert listing.ready == () and listing.waiting == 1


def test_a_file_system_of_tensorflows_own_is_followed_too():
    """ram:// (TensorFlow's in-process file system) stands for gs:// and hdfs://: listed
    and stat'ed through tf.io.gfile."""
    import tensorflow as tf

    root = "ram://follow-test"
    for hour in ("00", "01"):
        tf.io.gfile.makedirs(f"{root}/hour={hour}")
        with tf.io.gfile.GFile(f"{root}/hour={hour}/part-0", "w") as f:
            f.write("x\n")
    with tf.io.gfile.GFile(f"{root}/hour=00/_SUCCESS", "w") as f:
        f.write("")
    w = PartitionWatcher(f"{root}/*/part-*", marker="_SUCCESS", settle_seconds=60)
    listing = w.look(trained=())
    assert [p.files for p in listing.ready] == [(f"{root}/hour=00/part-0",)]
    assert listing.waiting == 1 and listing.ready[0].completed_at > 0


def test_hidden_and_underscore_files_are_never_trained(tmp_path: Path):
    pattern = str(tmp_path / "d" / "*")
    write(tmp_path / "d" / "part-0")
    write(tmp_path / "d" / ".part-1.crc")
    write(tmp_path / "d" / "_SUCCESS", "")
    w = PartitionWatcher(pattern, marker="_SUCCESS", settle_seconds=60)
    (partition,) = w.look(trained=()).ready
    assert partition.files == (str(tmp_path / "d" / "part-0"),)


def test_waiting_ends_at_the_idle_timeout_or_a_stop(tmp_path: Path):
    w = watcher(tmp_path)
    ticks = iter([0.0, 0.0, 5.0, 11.0])
    stop = threading.Event()
    found = wait_for_partition(w, (), stop=stop, idle_timeout=10, clock=lambda: next(ticks))
    assert found is None
    stop.set()
    assert wait_for_partition(w, (), stop=stop, idle_timeout=0) is None


def test_a_file_list_reads_back_as_its_files(tmp_path: Path):
    files = [str(write(tmp_path / n)) for n in ("b", "a")]
    assert expand(file_list(files), "--train-data") == files  # in the list's order


def test_the_journal_goes_on_from_its_last_round(tmp_path: Path):
    journal = FollowJournal(str(tmp_path))
    assert journal.restore_step() is None  # never followed here: any checkpoint
    journal.begin(0)
    journal.record(16, ("h0/part-0",), 100.0)
    journal.record(32, ("h1/part-0", "h1/part-1"), 200.0)
    again = FollowJournal(str(tmp_path))
    assert again.restore_step() == 32
    assert [r.files for r in again.begin(32)] == [("h0/part-0",), ("h1/part-0", "h1/part-1")]
    # A damaged ckpt-32 was skipped: step 16 restored, so h1's files train again.
    third = FollowJournal(str(tmp_path))
    assert [r.step for r in third.begin(16)] == [16]
    assert FollowJournal(str(tmp_path)).restore_step() == 16


def test_prune_keeps_the_newest_versions(tmp_path: Path):
    for version in (5, 40, 120, 7):
        (tmp_path / str(version)).mkdir()
    (tmp_path / ".9.partial-1").mkdir()  # a version being written: not a version
    assert prune(str(tmp_path), 2) == [5, 7]
    assert versions_in(str(tmp_path)) == [40, 120]
    assert (tmp_path / ".9.partial-1").is_dir()


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90.0), ("2.5", 2.5), ("30s", 30.0), ("10m", 600.0), ("1h", 3600.0)]
)
def test_durations(text: str, seconds: float):
    assert parse_duration(text, "--export-every") == seconds


FOLLOW = {"follow": "true", "train_data": "d/*/part-*", "checkpoint_dir": "ck"}


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        ({**FOLLOW, "epochs": "2"}, "--epochs: 2 with --follow"),
        ({**FOLLOW, "steps": "100"}, "--steps: with --follow"),
        ({**FOLLOW, "strategy": "sync"}, "--strategy: 'sync' with --follow"),
        ({**FOLLOW, "follow_marker": "a/_SUCCESS"}, "--follow-marker: 'a/_SUCCESS' is not a file"),
        ({"follow": "true", "checkpoint_dir": "ck"}, "--follow: has no --train-data"),
        ({"follow": "true", "train_data": "x"}, "--follow: has no --checkpoint-dir"),
        ({"export_every": "30s"}, "--export-every: has no --export-dir"),
        ({"export_dir": "exp"}, "--export-dir: has no --export-every"),
        ({"idle_timeout": "soon"}, "--idle-timeout: 'soon' is not a duration"),
        ({"export_every": "-5"}, "--export-every: got -5.0"),
    ],
)
def test_follow_settings_refused_in_one_line(flags: dict[str, str], line: str):
    with pytest.raises(ConfigError) as err:
        resolve_settings(flags=flags, config_file=None, environ={})
    assert str(err.value).startswith(line), str(err.value)
