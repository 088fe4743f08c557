"""Checkpoints of the training state: restore on start, periodic saves on their own
thread, saves on request (``psctl checkpoint``) and the final one.

Saving variables spread over several tasks traces a new tf.function per save, and
registering it waits on EVERY worker: one frozen worker blocks the save (seen). So saves go
through a mirror of the same objects on the coordinator, filled by plain reads of the ps
variables: same checkpoint layout, no function, and faster. Restores go through it too: a
checkpoint is read and checked on the coordinator (checkpoint_files.py) before any value
reaches the ps, so a damaged one is skipped for the next newest.

Workers keep training while a checkpoint is written, so the ps's global step moves during
the save. The checkpoint stores the step read just before (ckpt-N holds step N); the model
may include a few in-flight steps more, as async training does.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import keras
import tensorflow as tf

from psctl.coordinator.failures import RestartFromCheckpoint
from psctl.coordinator.job import Job
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.checkpoint_files import (
    finite,
    load_checked,
    restore_newest,
    set_aside_unreadable_state,
)
from psctl.coordinator.training.dynamic_updates import dynamic_transfers
from psctl.coordinator.training.model import JobModel, TrainState
from psctl.coordinator.training.tables import Table

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
        self.checkpoint = state.checkpoint(self.saved_step)
        self.manager: Any = None
        if not settings.checkpoint_dir:
            return
        mirror = JobModel(job, x_spec, y_spec)
        self._transfers = transfers(state, mirror)
        self._mirror = mirror.checkpoint(self.saved_step)
        self._keep = settings.keep_checkpoints
        set_aside_unreadable_state(settings.checkpoint_dir)  # restore() writes a new one
        self.manager = self._manager(settings.checkpoint_dir)

    def _manager(self, directory: str) -> Any:
        return tf.train.CheckpointManager(self._mirror, directory, max_to_keep=self._keep)

    @property
    def enabled(self) -> bool:
        return self.manager is not None

    @property
    def latest(self) -> str | None:
        return None if self.manager is None else self.manager.latest_checkpoint

    def restore(self) -> int:
        """Restore the newest usable checkpoint, if any; returns the global step to start
        from. A damaged one is skipped with a line saying why (checkpoint_files.py), and
        ``NoUsableCheckpoint`` (exit 78) ends the job when none of those present is usable."""
        if self.manager is None:
            return 0
        started = time.monotonic()
        directory = self.manager.directory
        mirrors = [transfer.mirror for transfer in self._transfers]
        # Into the coordinator's mirror first, where a damaged file costs nothing but a
        # line: the next newest is tried before anything reaches the ps. The checkpoint
        # holds each table whole, and the shards take their rows from it, however many ps
        # tasks there are now.
        found = restore_newest(directory, lambda p: load_checked(self._mirror, p, mirrors))
        if found is None:
            return 0
        self.manager = self._manager(directory)  # it read the state file before a rewrite
        for transfer in self._transfers:
            transfer.write(transfer.mirror.numpy())
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
        values = [transfer.read() for transfer in self._transfers]
        for transfer, value in zip(self._transfers, values, strict=True):
            if not finite(value):
                # Never write it: with --keep-checkpoints the good ones would be deleted.
                raise RestartFromCheckpoint(
                    f"{transfer.name} is not finite at global step {step}: checkpoint refused"
                )
        self.saved_step.assign(step)
        for transfer, value in zip(self._transfers, values, strict=True):
            transfer.mirror.assign(value)
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
                request.future.set_result((path or "", self.control.view().board.checkpoint_step))
            except Exception as err:
                log.error("requested checkpoint failed: %s", err)
                request.future.set_exception(err)


@dataclass(frozen=True)
class Transfer:
    """One variable of the checkpoint: how to read it whole from the ps, how to write it
    back, and its copy in the coordinator's mirror (what the checkpoint holds). A dynamic
    table's value is a (keys, values) pair."""

    name: str
    read: Callable[[], Any]
    write: Callable[[Any], None]
    mirror: Any


def transfers(state: TrainState, mirror: JobModel) -> list[Transfer]:
    """Pair every ps variable with its mirror copy. Both models come from the same
    ``create_model``: the mirror is the plain Keras model, so where the ps model has a psctl
    table, the mirror has the layer's ``embeddings`` and the optimizer's slots for it."""
    ps_layers = _embeddings(state.model)
    mirror_layers = _embeddings(mirror.model)
    table_vars: list[tuple[Table, Any]] = []
    for table in state.tables:
        copy = mirror_layers[next(i for i, lay in enumerate(ps_layers) if lay is table.layer)]
        table_vars.append((table, copy.embeddings))
    skip = {id(var) for _, var in table_vars}
    slots = {v.name: v for v in mirror.optimizer.variables}
    table_slots = [
        (table, kind, slots[f"{var.path.replace('/', '_')}_{kind}"])
        for table, var in table_vars
        for kind in table.slots
    ]
    skip |= {id(slot) for _, _, slot in table_slots}
    sources = state.model.variables + state.optimizer.variables
    copies = [v for v in mirror.model.variables + mirror.optimizer.variables if id(v) not in skip]
    result = [
        Transfer(source.name, source.numpy, source.assign, copy)
        for source, copy in zip(sources, copies, strict=True)
    ]
    for table, var in table_vars:
        result.append(Transfer(var.path, table.read, table.write, var))
    for table, kind, slot in table_slots:
        shards = table.slots[kind]
        result.append(
            Transfer(
                slot.path,
                functools.partial(table.read, shards),
                functools.partial(table.write, shards=shards),
                slot,
            )
        )
    for name, read, write, copy in dynamic_transfers(state.dynamic_layers, mirror.dynamic_layers):
        result.append(Transfer(name, read, write, copy))
    return result


def _embeddings(model: Any) -> list[Any]:
    """The model's Embedding layers, in build order (both models list them alike)."""
    return [layer for layer in model._flatten_layers() if isinstance(layer, keras.layers.Embedding)]
