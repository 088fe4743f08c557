"""Checkpoints of the training state: restore on start, periodic saves on their own
thread, saves on request (``psctl checkpoint``) and the final one.

Saving variables spread over several tasks traces a new tf.function per save, and
registering it waits on EVERY worker: one frozen worker blocks the save (seen). So saves go
through a mirror of the same objects on the coordinator, filled by plain reads of the ps
variables: same checkpoint layout, no function, and faster.

Workers keep training while a checkpoint is written, so the ps's global step moves during
the save. The checkpoint stores the step read just before (ckpt-N holds step N); the model
may include a few in-flight steps more, as async training does.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf

from psctl.coordinator.failures import RestartFromCheckpoint
from psctl.coordinator.job import Job
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.model import JobModel, TrainState

if TYPE_CHECKING:
    from psctl.coordinator.control.metrics import CoordinatorMetrics
    from psctl.coordinator.control.service import JobControl

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(
        self,
        *,
        state: TrainState,
        job: Job,
        settings: TrainSettings,
        x_spec: Any,
        y_spec: Any,
        control: JobControl,
        metrics: CoordinatorMetrics | None,
    ) -> None:
        self.state = state
        self.control = control
        self.metrics = metrics
        self._lock = threading.Lock()
        self._saver: threading.Thread | None = None
        self._error: BaseException | None = None
        self.saved_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="saved_step")
        self.checkpoint = state.checkpoint(self.saved_step)
        self.manager: Any = None
        if not settings.checkpoint_dir:
            return
        mirror = JobModel(job, x_spec, y_spec)
        self._mirror_pairs = list(
            zip(
                state.model.variables + state.optimizer.variables,
                mirror.model.variables + mirror.optimizer.variables,
                strict=True,
            )
        )
        self.manager = tf.train.CheckpointManager(
            mirror.checkpoint(self.saved_step),
            settings.checkpoint_dir,
            max_to_keep=settings.keep_checkpoints,
        )

    @property
    def enabled(self) -> bool:
        return self.manager is not None

    @property
    def latest(self) -> str | None:
        return None if self.manager is None else self.manager.latest_checkpoint

    def restore(self) -> int:
        """Restore the newest checkpoint, if any; returns the global step to start from."""
        path = self.latest
        if path is None:
            return 0
        # Restored straight into the ps variables (every task is up at start).
        started = time.monotonic()
        self.checkpoint.restore(path).assert_existing_objects_matched()
        step = int(self.saved_step.numpy())
        self.state.global_step.assign(step)
        log.info("restored %s (global step %d) in %.2fs", path, step, time.monotonic() - started)
        return step

    def save(self) -> str | None:
        """Write a checkpoint now, while the workers go on (ps variables are always
        readable); the step recorded is the global step read just before."""
        if self.manager is None:
            return None
        with self._lock, self.control.activity("checkpointing"):
            return self._write()

    def save_in_background(self) -> bool:
        """Start a periodic checkpoint on its own thread, so that the loop keeps the workers
        busy meanwhile: while a worker is frozen, reading the ps variables can wait until it
        thaws or gRPC gives up on it (seen: 120 s), and a save on the loop's thread held every
        worker idle that long. Skipped (False) while the previous one is still running."""
        if self._saver is not None and self._saver.is_alive():
            log.warning("checkpoint skipped: the previous save is still running (a frozen task?)")
            return False
        self._saver = threading.Thread(target=self._save_logged, name="checkpoint", daemon=True)
        self._saver.start()
        return True

    def take_error(self) -> BaseException | None:
        """What a background save raised that the loop must act on (a refused checkpoint of
        a non-finite model), once."""
        error, self._error = self._error, None
        return error

    def _save_logged(self) -> None:
        try:
            self.save()
        except RestartFromCheckpoint as err:
            self._error = err  # the controller hands it to the failure policy
        except Exception as err:  # the next save or the final one tries again
            log.error("checkpoint failed: %s", err)

    def _write(self) -> str:
        assert self.manager is not None
        started = time.monotonic()
        step = self.state.step()
        values = [source.numpy() for source, _ in self._mirror_pairs]
        for (source, _), value in zip(self._mirror_pairs, values, strict=True):
            if value.dtype.kind == "f" and not np.isfinite(value).all():
                # Never write it: with --keep-checkpoints the good ones would be deleted.
                raise RestartFromCheckpoint(
                    f"{source.name} is not finite at global step {step}: checkpoint refused"
                )
        self.saved_step.assign(step)
        for (_, copy), value in zip(self._mirror_pairs, values, strict=True):
            copy.assign(value)
        path: str = self.manager.save(checkpoint_number=step)
        seconds = time.monotonic() - started
        log.info("checkpoint %s (%.2fs)", path, seconds)
        now = time.time()
        self.control.update(checkpoint_path=path, checkpoint_step=step, checkpoint_time=now)
        if self.metrics is not None:
            self.metrics.observe_checkpoint(seconds=seconds, step=step, timestamp=now)
        return path

    def serve_requests(self) -> None:
        """Answer ``psctl checkpoint`` requests waiting since the last look."""
        for request in self.control.take_checkpoint_requests():
            try:
                path = self.save()
                request.future.set_result(
                    (path or "", self.control.snapshot().last_checkpoint.step)
                )
            except Exception as err:
                log.error("requested checkpoint failed: %s", err)
                request.future.set_exception(err)
