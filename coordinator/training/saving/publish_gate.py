"""``--export-if-better METRIC``: a version goes to serving only when it scores no worse than
the version in serving on the newest held-out files.

Before a checkpoint is published, both models are scored on the same files: the newest
complete partition of ``--eval-data`` (the same completeness rule as ``--follow``'s: its
marker, else its files unchanged for ``--settle-seconds``), by the kept-up export process
(``psctl export --requests``), one after the other in its one evaluation model. The version
in serving is scored from its own checkpoint, which psctl keeps (hard links, else a copy)
in ``CHECKPOINT_DIR/publishing/`` as long as it serves: the trainer's ``--keep-checkpoints``
rotation would remove it long before the next version is due. The candidate is kept there
too while it is judged, so that the rotation cannot take it from under the scoring and the
export. Nothing is compared when no version serves yet: the first one is published.
"""

from __future__ import annotations

import contextlib
import math
import os
import posixpath
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from psctl.cluster.errors import ConfigError
from psctl.coordinator.data.files import has_scheme
from psctl.coordinator.data.follow import PartitionWatcher
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.saving.checkpoint_files import Found, checkpoints_in

PINNED = "publishing"  # CHECKPOINT_DIR/publishing/: the serving version's and the candidate's
# Metric names (as the job's metrics name themselves) for which lower is better.
_LOWER_SUFFIXES = ("loss", "error", "crossentropy", "mse", "mae", "hinge")


def lower_is_better(metric: str) -> bool:
    """``loss``, ``*_error``, ``*crossentropy``, ``mse``...: lower is better; any other
    metric (``auc``, ``accuracy``, ``precision``...): higher."""
    return metric.lower().endswith(_LOWER_SUFFIXES)


@dataclass(frozen=True)
class Verdict:
    """One candidate judged against the version in serving, on the same files."""

    metric: str
    step: int  # the candidate's global step: its version number once published
    score: float | None  # None: not scored (the first version, before any held-out file)
    serving_version: int  # 0: none serves yet
    serving_score: float | None  # None: nothing to compare with
    files: int  # held-out files scored

    @property
    def publish(self) -> bool:
        if self.score is None:
            return True
        if not math.isfinite(self.score):
            return False
        if self.serving_score is None or not math.isfinite(self.serving_score):
            return True
        if lower_is_better(self.metric):
            return self.score <= self.serving_score
        return self.score >= self.serving_score

    @property
    def line(self) -> str:
        """``version 1200 published: auc 0.7312 against serving version 1100's 0.7290, on 3
        held-out file(s)`` (or ``held back``)."""
        decision = "published" if self.publish else "held back"
        if self.score is None:
            return f"version {self.step} {decision}: the first, with no held-out file to score"
        against = (
            f"against serving version {self.serving_version}'s {self.serving_score:.4f}"
            if self.serving_score is not None
            else "(no version in serving to compare with)"
        )
        return (
            f"version {self.step} {decision}: {self.metric} {self.score:.4f} {against}, "
            f"on {self.files} held-out file(s)"
        )


def check_metric(metric: str, metric_factories: Sequence[Callable[[], Any]]) -> None:
    """``--export-if-better``'s metric is ``loss`` or one of the job's evaluation metrics,
    or a ConfigError before the first step (not at the first version, minutes later)."""
    names = ["loss", *(make().name for make in metric_factories)]
    if metric not in names:
        raise ConfigError(
            "--export-if-better",
            f"the job's evaluation has no metric {metric!r}",
            f"use one of {', '.join(names)}",
        )


def held_out_files(watcher: PartitionWatcher) -> list[str]:
    """The newest complete partition of ``--eval-data`` (path order, as ``--follow``
    trains): the files both versions are scored on; none when no partition is complete."""
    ready = watcher.look(()).ready
    return list(ready[-1].files) if ready else []


def eval_watcher(settings: TrainSettings) -> PartitionWatcher:
    return PartitionWatcher(
        settings.data.eval_data,
        marker=settings.data.follow_marker,
        settle_seconds=settings.data.settle_seconds,
        field="--eval-data",
    )


class Pins:
    """The checkpoints the gate keeps in ``CHECKPOINT_DIR/publishing/``: the version in
    serving's, and the candidate's while it is judged."""

    def __init__(self, checkpoint_dir: str) -> None:
        self.directory = posixpath.join(checkpoint_dir, PINNED)

    def serving(self, version: int) -> str | None:
        """The kept checkpoint of serving version ``version``, or None (none kept: the
        version was published before the gate was on, or by another run)."""
        for found in checkpoints_in(self.directory):
            if found.step == version:
                return found.prefix
        return None

    def keep(self, found: Found) -> str:
        """Keep ``found`` here (its files linked, else copied); its prefix here. OSError
        when a file cannot be kept (rotated away since it was listed)."""
        source = posixpath.dirname(found.prefix)
        _make_dirs(self.directory)
        for name in found.files:
            _link(posixpath.join(source, name), posixpath.join(self.directory, name))
        return posixpath.join(self.directory, found.name)

    def drop_all_but(self, step: int) -> None:
        """Remove every kept checkpoint but ``step``'s."""
        for found in checkpoints_in(self.directory):
            if found.step != step:
                for name in found.files:
                    _remove(posixpath.join(self.directory, name))


def _make_dirs(path: str) -> None:
    if has_scheme(path):
        import tensorflow as tf

        tf.io.gfile.makedirs(path)
    else:
        os.makedirs(path, exist_ok=True)


def _link(source: str, target: str) -> None:
    """A hard link (the same file system: no copy, no space) or, elsewhere, a copy."""
    if has_scheme(source):
        import tensorflow as tf

        try:
            tf.io.gfile.copy(source, target, overwrite=True)
        except tf.errors.OpError as err:  # as os.link's: OSError, for one except
            raise OSError(f"cannot copy {source}: {err.message}") from None
        return
    if os.path.exists(target):
        os.remove(target)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _remove(path: str) -> None:
    if has_scheme(path):
        import tensorflow as tf

        if tf.io.gfile.exists(path):
            tf.io.gfile.remove(path)
        return
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
