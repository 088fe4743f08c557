"""Checkpoints of the training state: restore on start, periodic saves on their own
thread, saves on request (``psctl checkpoint``) and the final one.

Every ps saves and restores its own variables and table shards (sharded_save.py), all at
once, in the shared checkpoint directory: no process holds the whole model, and a frozen
worker blocks no save. A damaged checkpoint (checkpoint_files.py) is skipped for the next
newest.

Workers keep training while a checkpoint is written, so the ps's global step moves during
the save. The checkpoint stores the step read just before (ckpt-N holds step N); the model
may include a few in-flight steps more, as async training does.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from psctl.coordinator.embeddings.sharded import skeleton
from psctl.coordinator.failures import RestartFromCheckpoint
from psctl.coordinator.job import Job
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.job_model.model import JobModel, TrainState, ps_devices
from psctl.coordinator.training.saving.checkpoint_files import (
    remove_unfinished_saves,
    restore_newest,
    set_aside_unreadable_state,
)
from psctl.coordinator.training.saving.sharded_save import (
    NotFinite,
    ShardedCheckpoint,
    check_shared,
    plan,
)

if TYPE_CHECKING:
    from psctl.coordinator.operations.job_state import JobControl
    from psctl.coordinator.operations.metrics import CoordinatorMetrics

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
        self.manager: Any = None
        directory = settings.checkpoints.checkpoint_dir
        if not directory:
            return
        self.sharded = sharded_checkpoint(state, job, settings, x_spec, y_spec, self.saved_step)
        self._keep = settings.checkpoints.keep_checkpoints
        check_shared(directory, ps_devices(state.num_ps))
        set_aside_unreadable_state(directory)  # restore() writes a new one
        remove_unfinished_saves(directory)
        self.manager = self._manager(directory)

    def _manager(self, directory: str) -> Any:
        # The manager keeps TensorFlow's rotation and state file; it saves through the
        # sharded checkpoint's _write.
        return tf.train.CheckpointManager(self.sharded, directory, max_to_keep=self._keep)

    @property
    def enabled(self) -> bool:
        return self.manager is not None

    @property
    def latest(self) -> str | None:
        return None if self.manager is None else self.manager.latest_checkpoint

    def restore(self, *, at_most: int | None = None) -> int:
        """Restore the newest usable checkpoint, if any (of step ``at_most`` or older:
        follow mode's last round); returns the global step to start from. A damaged one is
        skipped with a line saying why (checkpoint_files.py), and ``NoUsableCheckpoint``
        (exit 78) ends the job when none of those present is usable."""
        if self.manager is None:
            return 0
        started = time.monotonic()
        directory = self.manager.directory
        # Each ps reads its own rows, however many ps tasks wrote them; a damaged
        # checkpoint is found while it is read, and the next newest overwrites every value.
        found = restore_newest(directory, self.sharded.load, at_most=at_most)
        if found is None:
            return 0
        self.manager = self._manager(directory)  # it read the state file before a rewrite
        path = found.prefix
        step = int(self.saved_step.numpy())
        self.state.global_step.assign(step)
        log.info(
            "resuming: restored %s (global step %d) in %.2fs",
            path,
            step,
            time.monotonic() - started,
        )
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
            log.warning(
                "checkpoint skipped: the previous save is still running (a save takes longer "
                "than --checkpoint-every steps train, or a task is frozen)"
            )
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
        self.saved_step.assign(step)
        try:
            path: str = self.manager.save(checkpoint_number=step)
        except NotFinite as err:
            # Never written: with --keep-checkpoints the good ones would be deleted.
            raise RestartFromCheckpoint(
                f"{err.name} is not finite at global step {step}: checkpoint refused"
            ) from None
        seconds = time.monotonic() - started
        log.info("checkpoint %s (%.2fs: %s)", path, seconds, self.sharded.last_report)
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
                request.future.set_result((path or "", self.control.view().board.checkpoint_step))
            except Exception as err:
                log.error("requested checkpoint failed: %s", err)
                request.future.set_exception(err)


def sharded_checkpoint(
    state: TrainState, job: Job, settings: TrainSettings, x_spec: Any, y_spec: Any,
    saved_step: Any,
) -> ShardedCheckpoint:  # fmt: skip
    """The training state's checkpoint, keyed as the plain model's: the skeleton (the job's
    model built here, each psctl table one row long) gives the keys and the object graph."""
    with skeleton(settings):
        plain = JobModel(job, x_spec, y_spec)
    return plan(state, plain, saved_step)
