"""``--export-every``: serving versions published while training goes on.

Every ``--export-every`` seconds the newest checkpoint, when it is newer than the version
in serving, is exported by ``psctl export`` in a process of its own (the model is built
there, as the export command builds it; the training loop is never held up) into
``--export-dir/<global step>/``: TensorFlow Serving's file-system source layout, each
version written aside and renamed into place (saving/saved_model.py). The newest
``--export-keep`` versions are kept. In follow mode the newest checkpoint is the last
round's, so a version holds whole partitions; otherwise a checkpoint is written first.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from psctl.coordinator.argv import psctl_argv
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.saving.checkpoint_files import checkpoints_in

if TYPE_CHECKING:
    from psctl.coordinator.operations.job_state import JobControl
    from psctl.coordinator.operations.metrics import CoordinatorMetrics
    from psctl.coordinator.training.saving.checkpoints import Checkpointer

log = logging.getLogger(__name__)

EXPORT_TIMEOUT = 900.0  # seconds one export may take before it is given up


def versions_in(base: str) -> list[int]:
    """The serving versions in ``base``, oldest first."""
    try:
        names = os.listdir(base)
    except OSError:
        return []
    return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(base, n)))


def prune(base: str, keep: int) -> list[int]:
    """Remove all but the newest ``keep`` versions; returns those removed."""
    removed = versions_in(base)[:-keep]
    for version in removed:
        shutil.rmtree(os.path.join(base, str(version)), ignore_errors=True)
    return removed


class VersionPublisher:
    """A thread that publishes a version every ``settings.export_every`` seconds."""

    def __init__(
        self,
        *,
        settings: TrainSettings,
        checkpointer: Checkpointer,
        control: JobControl,
        metrics: CoordinatorMetrics | None,
        train_data: Callable[[], str],
    ) -> None:
        """``train_data()``: the files the exporter may read the features' shapes from
        (follow mode: the last round's, all complete)."""
        self.settings = settings
        self.checkpointer = checkpointer
        self.control = control
        self.metrics = metrics
        self.train_data = train_data
        self.base = settings.export_dir
        self.published_step = max(versions_in(self.base), default=0)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.control.update(fresh=True, export_dir=self.base)
        if metrics is not None:
            metrics.set_export_every(settings.export_every)
        if self.published_step:
            self._show(self.published_step, self._checkpoint_time(self.published_step))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="psctl-publish", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.settings.export_every):
            self.publish()

    def finish(self) -> None:
        """Stop the cadence and publish the final checkpoint if it is not in serving yet."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=EXPORT_TIMEOUT)
        self.publish()

    def publish(self) -> int | None:
        """Export the newest checkpoint if it is newer than the version in serving; the
        version published, or None."""
        with self._lock:
            if not self.settings.follow:
                self.checkpointer.save()
            found = checkpoints_in(self.settings.checkpoint_dir)
            if not found or found[0].step <= self.published_step:
                return None
            newest = found[0]
            if self._export(newest.prefix):
                self.published_step = newest.step
                checkpoint_time = self._checkpoint_time(newest.step)
                self._show(newest.step, checkpoint_time)
                if self.metrics is not None:
                    self.metrics.published(version=newest.step, checkpoint_time=checkpoint_time)
                removed = prune(self.base, self.settings.export_keep)
                log.info(
                    "published serving version %d in %s%s",
                    newest.step,
                    self.base,
                    f" (removed {', '.join(map(str, removed))})" if removed else "",
                )
                return newest.step
            if self.metrics is not None:
                self.metrics.publish_failed()
            return None

    def _export(self, checkpoint: str) -> bool:
        s = self.settings
        argv = psctl_argv(
            "export",
            "--job",
            s.job,
            "--checkpoint",
            checkpoint,
            "--out",
            self.base,
            "--label-column",
            s.label_column,
        )
        data = self.train_data()
        if data:
            argv += ["--train-data", data]
        if s.eval_data:
            argv += ["--eval-data", s.eval_data]
        try:
            done = subprocess.run(
                argv,
                timeout=EXPORT_TIMEOUT,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
            )
        except (subprocess.SubprocessError, OSError) as err:
            log.error("publishing %s failed: %s", checkpoint, err)
            return False
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines() or ["(no output)"]
            log.error("publishing %s failed (exit %d): %s", checkpoint, done.returncode, lines[-1])
            return False
        return True

    def _checkpoint_time(self, step: int) -> float:
        index = Path(self.settings.checkpoint_dir) / f"ckpt-{step}.index"
        try:
            return index.stat().st_mtime
        except OSError:
            return time.time()

    def _show(self, version: int, checkpoint_time: float) -> None:
        self.control.update(published_version=version, published_time=checkpoint_time)
