"""Follow mode's input side (``--follow``): which files of ``--train-data`` are complete
and not trained yet, in the order they train.

Files land in partition directories (``day=2026-12-05/hour=07/part-*``). A partition is
complete when its directory holds the marker (``--follow-marker``, ``_SUCCESS`` by
default, as Hadoop and Spark write it). A directory without one is complete once none of
its files has changed for ``--settle-seconds``, unless the marker was seen in another
partition already: a pipeline that writes markers writes them everywhere, so there a
missing marker means "still being written". Names starting with ``_`` or ``.`` (markers,
temporary files) are never trained, as Hadoop's readers skip them.

Rounds: one partition at a time, the partitions in path order (partitions named by time
train in time order), each partition's files in path order. The trained set lives with the
checkpoints (training/saving/follow_journal.py); this module only lists.
"""

from __future__ import annotations

import os
import posixpath
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from psctl.coordinator.data.files import has_scheme, matching


@dataclass(frozen=True)
class Partition:
    """A complete partition's files not trained yet, and when it was complete (the
    marker's time, else its newest file's)."""

    directory: str
    files: tuple[str, ...]
    completed_at: float


@dataclass(frozen=True)
class Listing:
    """What one look at the glob found: the complete partitions with files to train (in
    training order), and how many matching files wait for their partition to complete."""

    ready: tuple[Partition, ...]
    waiting: int


def _mtime(path: str) -> float | None:
    """Seconds since the epoch of the last change; None when the file is gone."""
    if not has_scheme(path):
        try:
            return os.stat(path).st_mtime
        except OSError:
            return None
    import tensorflow as tf

    try:
        return float(tf.io.gfile.stat(path).mtime_nsec) / 1e9
    except tf.errors.OpError:
        return None


class PartitionWatcher:
    """Looks at ``pattern`` (a glob) and says which partitions are ready to train. Paths
    are split with ``posixpath``: a URL's and a local path's alike (psctl runs on POSIX)."""

    def __init__(
        self,
        pattern: str,
        *,
        marker: str,
        settle_seconds: float,
        clock: Callable[[], float] = time.time,
        field: str = "--train-data",
    ) -> None:
        self.pattern = pattern
        self.marker = marker
        self.settle_seconds = settle_seconds
        self.clock = clock
        self.field = field
        self.markers_seen = False
        self._marks: dict[str, float] = {}  # directory -> its marker's time, once seen
        self._first_seen: dict[str, float] = {}  # files of a file system keeping no times

    def look(self, trained: Collection[str]) -> Listing:
        by_dir: dict[str, list[str]] = {}
        for path in matching(self.pattern, self.field):
            name = posixpath.basename(path)
            if name.startswith(("_", ".")):
                continue
            by_dir.setdefault(posixpath.dirname(path), []).append(path)
        marked = {d: self._marked_at(d) for d in sorted(by_dir)}
        # Trained partitions count too: a restarted process that finds only a half-written
        # partition left to train must still know that this pipeline writes markers.
        self.markers_seen = self.markers_seen or any(t is not None for t in marked.values())
        ready: list[Partition] = []
        waiting = 0
        now = self.clock()
        for directory, marker_time in marked.items():
            files = [p for p in by_dir[directory] if p not in trained]
            if not files:
                continue
            completed = marker_time
            if completed is None and not self.markers_seen:
                completed = self._settled_at(by_dir[directory], now)
            if completed is None:
                waiting += len(files)
            else:
                ready.append(Partition(directory, tuple(sorted(files)), completed))
        return Listing(tuple(ready), waiting)

    def _marked_at(self, directory: str) -> float | None:
        """When the partition's marker was written; None without one. A marker seen once is
        remembered: trained partitions are not looked at again."""
        if directory in self._marks:
            return self._marks[directory]
        stamp = _mtime(posixpath.join(directory, self.marker))
        if stamp is not None:
            stamp = self._known(stamp)
            self._marks[directory] = stamp
        return stamp

    def _known(self, stamp: float, path: str = "") -> float:
        """``stamp``, or where the file system keeps no times (0: ram://, some object
        stores' directories) when psctl first saw it."""
        if stamp > 0:
            return stamp
        return self._first_seen.setdefault(path, self.clock()) if path else self.clock()

    def _settled_at(self, files: list[str], now: float) -> float | None:
        times = [_mtime(p) for p in files]
        if any(t is None for t in times):
            return None  # a file went away while we looked: look again later
        newest = max(self._known(t, p) for t, p in zip(times, files, strict=True) if t is not None)
        return newest if now - newest >= self.settle_seconds else None
