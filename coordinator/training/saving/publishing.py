"""``--export-every``: serving versions published while training goes on.

Every ``--export-every`` seconds the newest checkpoint, when it is newer than the version
in serving, is exported by ``psctl export --requests`` in a process of its own, kept up
between versions (the model is built there once, as the export command builds it; the
training loop is never held up) into
``--export-dir/<global step>/``: TensorFlow Serving's file-system source layout, each
version written aside and renamed into place (saving/saved_model.py). The newest
``--export-keep`` versions are kept. In follow mode the newest checkpoint is the last
round's, so a version holds whole partitions, and it goes out as soon as the round ends
(``poke``; once ``--export-every`` has passed since the last version); otherwise a checkpoint is
written first, on the cadence. With ``--export-if-better`` a version goes out only when it
scores no worse than the one in serving (saving/publish_gate.py).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import os
import queue
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psctl.coordinator.argv import psctl_argv
from psctl.coordinator.data.files import file_list
from psctl.coordinator.data.follow import PartitionWatcher
from psctl.coordinator.failures import describe
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.saving.checkpoint_files import Found, checkpoints_in
from psctl.coordinator.training.saving.publish_gate import (
    Pins,
    Verdict,
    eval_watcher,
    held_out_files,
)
from psctl.coordinator.training.saving.saved_model import READY, SCORED

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
    """A thread that publishes a version every ``settings.publishing.export_every`` seconds."""

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
        self.base = settings.publishing.export_dir
        self.published_step = max(versions_in(self.base), default=0)
        self.exporter: ExportProcess | None = None  # started with the first version
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poke = threading.Event()
        self._thread: threading.Thread | None = None
        self.gate = settings.publishing.export_if_better
        self.pins = Pins(settings.checkpoints.checkpoint_dir)
        self.judged_step = 0  # the newest candidate the gate judged
        self._watcher: PartitionWatcher | None = None  # --eval-data's partitions
        self.control.update(fresh=True, export_dir=self.base)
        if metrics is not None:
            metrics.set_export_every(settings.publishing.export_every)
        if self.published_step:
            self._show(self.published_step, self._checkpoint_time(self.published_step))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="psctl-publish", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """A round's checkpoint is written (follow mode): publish it as soon as
        ``--export-every`` has passed since the last version."""
        self._poke.set()

    def _run(self) -> None:
        follow, every = self.settings.data.follow, self.settings.publishing.export_every
        last = -math.inf
        while not self._stop.is_set():
            if follow:
                self._poke.wait()
                self._poke.clear()
                due = every - (time.monotonic() - last)
                if self._stop.is_set() or (due > 0 and self._stop.wait(due)):
                    break
            elif self._stop.wait(every):
                break
            try:
                published = self.publish()
            except Exception as err:  # this turn's version is lost, not the cadence
                log.error("publishing failed: %s; trying again next time", describe(err))
                if self.metrics is not None:
                    self.metrics.publish_failed()
                published = None
            if published is not None or not follow:
                last = time.monotonic()

    def finish(self) -> None:
        """Stop the cadence and publish the final checkpoint if it is not in serving yet."""
        self._stop.set()
        self._poke.set()
        if self._thread is not None:
            self._thread.join(timeout=EXPORT_TIMEOUT)
        self.publish()
        if self.exporter is not None:
            self.exporter.close()

    def publish(self) -> int | None:
        """Export the newest checkpoint if it is newer than the version in serving; the
        version published, or None."""
        with self._lock:
            if not self.settings.data.follow:
                self.checkpointer.save()
            found = checkpoints_in(self.settings.checkpoints.checkpoint_dir)
            if not found or found[0].step <= self.published_step:
                return None
            newest = found[0]
            if self.gate:
                return self._publish_if_better(newest)
            if self._export(newest.prefix):
                self._published(newest)
                return newest.step
            if self.metrics is not None:
                self.metrics.publish_failed()
            return None

    def _publish_if_better(self, newest: Found) -> int | None:
        """``--export-if-better``: score ``newest`` and the version in serving on the newest
        held-out files; publish ``newest`` only if it is no worse."""
        if newest.step == self.judged_step:
            return None  # judged already; wait for a newer one
        self.judged_step = newest.step
        try:
            candidate = self.pins.keep(newest)  # the trainer's rotation cannot take it now
        except OSError as err:
            log.warning("--export-if-better: cannot keep %s to judge it: %s", newest.name, err)
            self.pins.drop_all_but(self.published_step)
            return None
        verdict = self._judge(newest.step, candidate)
        if verdict is None:
            self.pins.drop_all_but(self.published_step)
            return None
        log.info("--export-if-better: %s", verdict.line)
        self.control.update(publish_decision=verdict.line)
        if not verdict.publish:
            self.pins.drop_all_but(self.published_step)
            return None
        if not self._export(candidate):
            self.pins.drop_all_but(self.published_step)
            if self.metrics is not None:
                self.metrics.publish_failed()
            return None
        self.pins.drop_all_but(newest.step)
        self._published(newest)
        return newest.step

    def _judge(self, step: int, candidate: str) -> Verdict | None:
        """Both versions scored on the same files; None when that cannot be done now (no
        complete held-out partition while a version serves, or the export process
        failed): the candidate is dropped and a newer one judged next time."""
        files = held_out_files(self.watcher())
        if not files and not self.published_step:  # the first version: nothing to beat
            return Verdict(self.gate, step, None, 0, None, 0)
        if not files:
            self.control.update(
                publish_decision=f"version {step} not judged: no complete partition of "
                "--eval-data to score it on"
            )
            return None
        serving = self.pins.serving(self.published_step) if self.published_step else None
        if self.published_step and serving is None:
            log.warning(
                "--export-if-better: serving version %d's checkpoint is not kept (published "
                "before the gate was on); version %d is compared with nothing",
                self.published_step,
                step,
            )
        scored = self._exporter().score([p for p in (candidate, serving) if p], files)
        if isinstance(scored, str):
            log.error("--export-if-better: scoring version %d failed: %s", step, scored)
            return None
        return Verdict(
            metric=self.gate,
            step=step,
            score=scored[candidate],
            serving_version=self.published_step,
            serving_score=scored[serving] if serving else None,
            files=len(files),
        )

    def watcher(self) -> PartitionWatcher:
        if self._watcher is None:
            self._watcher = eval_watcher(self.settings)
        return self._watcher

    def _published(self, newest: Found) -> None:
        self.published_step = newest.step
        checkpoint_time = self._checkpoint_time(newest.step)
        self._show(newest.step, checkpoint_time)
        if self.metrics is not None:
            self.metrics.published(version=newest.step, checkpoint_time=checkpoint_time)
        removed = prune(self.base, self.settings.publishing.export_keep)
        log.info(
            "published serving version %d in %s%s",
            newest.step,
            self.base,
            f" (removed {', '.join(map(str, removed))})" if removed else "",
        )

    def _exporter(self) -> ExportProcess:
        if self.exporter is None:
            s = self.settings.replace(train_data=self.train_data())
            argv = psctl_argv(
                "export", "--requests", "--out", self.base,
                *s.argv("job", "label_column", "train_data", "eval_data"),
            )  # fmt: skip
            self.exporter = ExportProcess(argv, metric=s.publishing.export_if_better)
        return self.exporter

    def _export(self, checkpoint: str) -> bool:
        error = self._exporter().export(checkpoint)
        if error is not None:
            log.error("publishing %s failed: %s", checkpoint, error)
            return False
        return True

    def _checkpoint_time(self, step: int) -> float:
        index = Path(self.settings.checkpoints.checkpoint_dir) / f"ckpt-{step}.index"
        try:
            return index.stat().st_mtime
        except OSError:
            return time.time()

    def _show(self, version: int, checkpoint_time: float) -> None:
        self.control.update(published_version=version, published_time=checkpoint_time)


class ExportProcess:
    """``psctl export --requests``, kept up between versions: TensorFlow imported and the
    model built once. Started again when it died; its last lines of stderr say why."""

    def __init__(self, argv: list[str], *, metric: str = "") -> None:
        """``metric``: what ``score`` asks for (``--export-if-better``'s)."""
        self.argv = argv
        self.metric = metric
        self.proc: subprocess.Popen[str] | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: collections.deque[str] = collections.deque(maxlen=20)
        self.answer = ""  # the last good answer line

    def _start(self) -> str | None:
        self.lines = queue.Queue()
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        threading.Thread(
            target=self._read, args=(self.proc.stdout, self.lines.put), daemon=True
        ).start()
        threading.Thread(
            target=self._read, args=(self.proc.stderr, self.stderr.append), daemon=True
        ).start()
        return self._answer(READY)

    @staticmethod
    def _read(stream: Any, put: Callable[[Any], None]) -> None:
        for line in stream:
            put(line.rstrip("\n"))
        put(None)

    def _answer(self, expected: str | None = None) -> str | None:
        """None when the process answered well (``expected``, or ``exported ...``), else
        why not."""
        deadline = time.monotonic() + EXPORT_TIMEOUT
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.close()
                return f"no answer in {EXPORT_TIMEOUT:g}s"
            if line is None:  # stdout closed: it died
                assert self.proc is not None
                code = self.proc.wait()
                self.proc = None
                last = [e for e in self.stderr if e.strip()][-1:] or ["(no output)"]
                return f"the export process exited ({code}): {last[0]}"
            if line == expected or line.startswith(("exported ", SCORED)):
                self.answer = line
                return None
            if line.startswith("error: "):
                return line.removeprefix("error: ")

    def export(self, checkpoint: str) -> str | None:
        """Export ``checkpoint``; None, or why it failed."""
        return self._ask(checkpoint)

    def score(self, checkpoints: list[str], files: list[str]) -> dict[str, float] | str:
        """``--export-if-better``'s metric of each checkpoint over ``files``, by
        checkpoint; or why they could not be scored."""
        request = {"score": checkpoints, "eval_data": file_list(files), "metric": self.metric}
        error = self._ask(json.dumps(request))
        if error is not None:
            return error
        scores = json.loads(self.answer.removeprefix(SCORED))
        return {path: float(scores[path]) for path in checkpoints}

    def _ask(self, request: str) -> str | None:
        if self.proc is None or self.proc.poll() is not None:
            error = self._start()
            if error is not None:
                return error
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(request + "\n")
            self.proc.stdin.flush()
        except OSError as err:
            return f"the export process is gone: {err}"
        return self._answer()

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
