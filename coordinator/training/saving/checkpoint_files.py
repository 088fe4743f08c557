"""The files of a checkpoint directory: which checkpoints are there, the newest usable one
(a damaged one is skipped with a line saying why, never taken for "no checkpoint"), the
state file (``checkpoint``) rebuilt from the files present, and the start-up check that
psctl can write there.

TensorFlow is imported only by the functions that read checkpoints: the start-up check runs
in processes that never import it (``psctl local`` before it starts any server).
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psctl.cluster.errors import ConfigError
from psctl.coordinator.failures import Failure, classify, describe

log = logging.getLogger(__name__)

STATE_FILE = "checkpoint"  # what tf.train.CheckpointManager reads to find the newest
_INDEX = re.compile(r"^ckpt-(\d+)\.index$")  # CheckpointManager's names: ckpt-<global step>
WHY_CHARS = 160  # a reason in the final one-line error, cut to this
_DIR_FIX = "give a directory this user can create and write to"


def cut_reason(why: str) -> str:
    """A reason for the one-line error: at most WHY_CHARS, cut between words."""
    why = " ".join(why.split())
    if len(why) <= WHY_CHARS:
        return why
    return why[: WHY_CHARS + 1].rsplit(" ", 1)[0].rstrip(" ,;:") + " ..."


@dataclass(frozen=True)
class Found:
    """One checkpoint in the directory: ``ckpt-<step>.index`` and the files beside it."""

    step: int
    prefix: str  # what tf.train.Checkpoint.restore takes: <directory>/ckpt-<step>
    files: tuple[str, ...]  # the names of its files in the directory

    @property
    def name(self) -> str:
        return os.path.basename(self.prefix)


class Unusable(Exception):
    """Why a checkpoint cannot be used, in one line."""


class ModelMismatch(Unusable):
    """The checkpoint is whole but was written by another model: a variable or table of
    another shape, or variables the model lacks (another --job, or other settings)."""


def is_model_mismatch(err: BaseException) -> bool:
    """Whether a restore's error says the model's variables do not fit the checkpoint's
    values (a fixed variable of another shape: ValueError; a dynamic table's rows of
    another dimension: InvalidArgumentError from its import), not that files are bad."""
    import tensorflow as tf

    text = str(err)
    if isinstance(err, ValueError):
        return "incompatible tensor" in text or "shape" in text
    return isinstance(err, tf.errors.InvalidArgumentError) and (
        "LookupTableImport" in text or "Expected shape" in text
    )


class ModelDoesNotMatch(ConfigError):
    """Every checkpoint present was written by another model: a configuration error (exit
    78), and the files are good: they are not to be moved away."""

    def __init__(self, directory: str, bad: list[tuple[Found, str]]) -> None:
        newest, why = bad[0]
        super().__init__(
            "--job",
            f"the job's model does not match the {len(bad)} checkpoint(s) in {directory} "
            f"({newest.name}: {cut_reason(why)})",
            "give the --job and the settings (its optimizer, table sizes, dimensions) that "
            "wrote them, or "
            "another --checkpoint-dir for this model",
        )


class NoUsableCheckpoint(ConfigError):
    """Checkpoint files are there, and none can be restored. Starting over from step 0 would
    hide the damage and overwrite the state file, and a new process would meet the same
    files: a configuration error (exit 78), for the operator to look at."""

    def __init__(self, directory: str, bad: list[tuple[Found, str]]) -> None:
        shown = "; ".join(f"{found.name}: {cut_reason(why)}" for found, why in bad)
        super().__init__(
            "--checkpoint-dir",
            f"none of the {len(bad)} checkpoint(s) in {directory} can be restored ({shown})",
            "move the damaged ckpt-* files out of it (training then starts from step 0), or "
            "give the --checkpoint-dir and --job of the run that wrote them",
        )


def checkpoints_in(directory: str) -> list[Found]:
    """The checkpoints in ``directory``, newest (highest step) first, found by their
    ``ckpt-<step>.index`` files, whatever the state file says."""
    import tensorflow as tf  # tf.io.gfile: any file system TensorFlow writes checkpoints to

    try:
        names = tf.io.gfile.listdir(directory)
    except tf.errors.NotFoundError:
        return []
    except tf.errors.OpError as err:
        raise ConfigError(
            "--checkpoint-dir", f"cannot list {directory}: {describe(err)}", _DIR_FIX
        ) from None
    found = []
    for name in names:
        match = _INDEX.match(name)
        if match:
            stem = name[: -len(".index")]
            files = tuple(sorted(n for n in names if n.startswith(stem + ".")))
            found.append(Found(int(match.group(1)), os.path.join(directory, stem), files))
    return sorted(found, key=lambda f: f.step, reverse=True)


AFTER_LAST_ROUND = "after-last-round"  # follow mode's checkpoints newer than its last round


def set_aside_newer(directory: str, step: int) -> None:
    """Move the checkpoints newer than ``step`` into ``directory/after-last-round/``
    (follow mode restores its last round's: follow_journal.py), so that the trainer's
    next saves neither meet nor rotate them."""
    import tensorflow as tf

    newer = [f for f in checkpoints_in(directory) if f.step > step]
    if not newer:
        return
    aside = os.path.join(directory, AFTER_LAST_ROUND)
    tf.io.gfile.makedirs(aside)
    for checkpoint in newer:
        for name in checkpoint.files:
            tf.io.gfile.rename(
                os.path.join(directory, name), os.path.join(aside, name), overwrite=True
            )
    log.warning(
        "follow mode goes on from its last round's checkpoint (step %d): %s, taken in the "
        "middle of the next round, moved to %s",
        step,
        ", ".join(f.name for f in newer),
        aside,
    )


def restore_newest(
    directory: str,
    load: Callable[[str], None],
    *,
    repair_state: bool = True,
    at_most: int | None = None,
) -> Found | None:
    """Load the newest usable checkpoint in ``directory`` with ``load(prefix)`` (which
    raises ``Unusable`` for a bad one): one error line for each bad one, then the next
    newest. With ``repair_state`` (the trainer, which goes on saving there), the state file
    is rewritten when it does not name the checkpoint loaded; readers (export) leave it.
    ``at_most``: the newest step to take (follow mode's last round); newer ones are set
    aside first. None when there is no checkpoint; ``NoUsableCheckpoint`` when none can be
    loaded."""
    if at_most is not None:
        set_aside_newer(directory, at_most)
    found = checkpoints_in(directory)
    bad: list[tuple[Found, str]] = []
    mismatched = 0
    for candidate in found:
        try:
            load(candidate.prefix)
        except Unusable as err:
            mismatched += isinstance(err, ModelMismatch)
            log.error(
                "checkpoint %s is unusable, skipped (%s in %s): %s",
                candidate.name,
                ", ".join(candidate.files),
                directory,
                err,
            )
            bad.append((candidate, str(err)))
            continue
        if repair_state:
            rebuild_state(directory, [f for f in found if f.step <= candidate.step], candidate)
        return candidate
    if bad and mismatched == len(bad):
        raise ModelDoesNotMatch(directory, bad)
    if bad:
        raise NoUsableCheckpoint(directory, bad)
    return None


def load_checked(
    checkpoint: Any, prefix: str, variables: Iterable[Any], *, partial: bool = False
) -> None:
    """Restore ``prefix`` into ``checkpoint`` (a ``tf.train.Checkpoint``) and check it:
    its index readable, every object under ``checkpoint`` given a value, and every float
    value among ``variables`` finite. ``partial``: the checkpoint may hold more than
    ``checkpoint`` asks for (export: no optimizer). Raises ``Unusable`` saying what is
    wrong; an error of the cluster (a lost task) is raised as it is."""
    import tensorflow as tf

    try:
        tf.train.load_checkpoint(prefix)
    except tf.errors.OpError as err:
        raise Unusable(f"its index cannot be read: {describe(err)}") from None
    try:
        status = checkpoint.restore(prefix)
    except (tf.errors.OpError, ValueError) as err:
        if classify(err) in (Failure.PS_LOST, Failure.WORKER_LOST):
            raise
        if is_model_mismatch(err):
            raise ModelMismatch(f"the model does not match it: {describe(err)}") from None
        raise Unusable(f"restoring it failed: {describe(err)}") from None
    if partial:
        status.expect_partial()
    try:
        status.assert_existing_objects_matched()
    except AssertionError as err:
        status.expect_partial()  # else its unused values are listed when it is collected
        lines = str(err).strip().splitlines()
        raise ModelMismatch(
            f"it lacks variables the model has (another --job?): {lines[0] if lines else ''}"
        ) from None
    for variable in variables:
        if not finite(variable.numpy()):
            raise Unusable(f"{_name(variable)} holds values that are not finite")


def finite(value: Any) -> bool:
    """Whether an array, or each array of a tuple (a dynamic table's keys and values), holds
    only finite numbers where it holds floats."""
    import numpy as np

    arrays = value if isinstance(value, tuple) else (value,)
    return all(a.dtype.kind != "f" or np.isfinite(a).all() for a in arrays)


def finite_there(tensor: Any) -> bool:
    """Whether a tensor holds only finite numbers where it holds floats, checked on the
    task that holds it: only the answer crosses the network."""
    import tensorflow as tf

    if not tf.as_dtype(tensor.dtype).is_floating:
        return True
    return bool(tf.reduce_all(tf.math.is_finite(tensor)))


def _name(variable: Any) -> str:
    return str(getattr(variable, "path", None) or getattr(variable, "name", "a variable"))


def read_state(directory: str) -> tuple[Any, str]:
    """The state file's ``CheckpointState``, or None and why not (TensorFlow returns None
    for some damage and raises ``ValueError`` for other: an empty file, say)."""
    import tensorflow as tf

    path = os.path.join(directory, STATE_FILE)
    if not tf.io.gfile.exists(path):
        return None, "is missing"
    try:
        state = tf.train.get_checkpoint_state(directory)
    except (tf.errors.OpError, ValueError) as err:
        return None, f"cannot be read ({describe(err)})"
    return state, "" if state is not None else "cannot be read (not a CheckpointState)"


def set_aside_unreadable_state(directory: str) -> None:
    """Move an unreadable state file to ``checkpoint.unreadable``, before a
    ``tf.train.CheckpointManager`` reads it: it takes one for "no checkpoint" (and would
    overwrite it on its first save, orphaning every checkpoint), or raises. ``restore_newest``
    then writes a new one from the checkpoint files present."""
    import tensorflow as tf

    state, problem = read_state(directory)
    path = os.path.join(directory, STATE_FILE)
    if state is None and tf.io.gfile.exists(path):
        tf.io.gfile.rename(path, path + ".unreadable", overwrite=True)
        log.warning("%s %s: moved to %s.unreadable", path, problem, STATE_FILE)


_PARTS = re.compile(r"^ckpt-\d+_temp_[0-9a-f]{8}$")  # sharded_save.py's parts of a save


def remove_unfinished_saves(directory: str) -> list[str]:
    """Remove the parts of saves that never finished (``ckpt-N_temp_XXXXXXXX/``: every ps's
    shards of a save whose coordinator was killed before it joined them), which would
    otherwise stay, as big as the model each. Only the training process that saves in the
    directory calls it, before its first save. The names removed."""
    import tensorflow as tf

    try:
        names = tf.io.gfile.listdir(directory)
    except tf.errors.OpError:
        return []
    removed = []
    for name in names:
        if _PARTS.match(name.rstrip("/")):
            tf.io.gfile.rmtree(os.path.join(directory, name.rstrip("/")))
            removed.append(name.rstrip("/"))
    if removed:
        log.warning("removed the parts of %d unfinished save(s) in %s: %s", len(removed),
                    directory, ", ".join(sorted(removed)))  # fmt: skip
    return removed


def rebuild_state(directory: str, kept: list[Found], latest: Found) -> bool:
    """Rewrite the state file unless it already names ``latest`` as the newest checkpoint:
    it lists ``kept`` (oldest first, their index files' times as their save times, so
    ``--keep-checkpoints`` rotates them as before), ``latest`` last. True if rewritten."""
    path = os.path.join(directory, STATE_FILE)
    state, problem = read_state(directory)
    if state is not None:
        named = os.path.basename(state.model_checkpoint_path)
        if named == latest.name:
            return False
        problem = f"names {named}"
    ordered = sorted(kept, key=lambda f: f.step)
    times = [_mtime(f.prefix + ".index") for f in ordered]
    lines = [f'model_checkpoint_path: "{latest.name}"']
    lines += [f'all_model_checkpoint_paths: "{f.name}"' for f in ordered]
    lines += [f"all_model_checkpoint_timestamps: {t!r}" for t in times]
    lines.append(f"last_preserved_timestamp: {min(times) - 1.0!r}")
    _write_atomic(path, "\n".join(lines) + "\n")
    log.warning(
        "%s %s: rewritten from the checkpoint files present (newest usable %s; %d listed)",
        path,
        problem,
        latest.name,
        len(ordered),
    )
    return True


def _mtime(path: str) -> float:
    import tensorflow as tf

    try:
        return float(tf.io.gfile.stat(path).mtime_nsec) / 1e9
    except tf.errors.OpError:
        return 0.0


def _write_atomic(path: str, text: str) -> None:
    """A reader (the sidecar evaluator) sees the old file or the new one, never half."""
    import tensorflow as tf

    tmp = path + ".tmp"
    with tf.io.gfile.GFile(tmp, "w") as f:
        f.write(text)
    tf.io.gfile.rename(tmp, path, overwrite=True)


def require_writable_dir(path: str, *, field: str) -> None:
    """``path`` exists or can be created, and this process can create files in it; else a
    ``ConfigError`` naming ``field``. URLs (``gs://...``: TensorFlow's file systems) are
    left to TensorFlow."""
    if "://" in path:
        return
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".psctl-write-check-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        # mkdir of a path that is a file says "File exists": name what is wrong instead.
        reason = "not a directory" if isinstance(err, FileExistsError) else err.strerror or str(err)
        raise ConfigError(field, f"cannot write to {path} ({reason})", _DIR_FIX) from None


def require_creatable_dir(path: str, *, field: str) -> None:
    """``path`` is a directory this process can write in, or one it could create: checked
    without creating anything, so a run refused later leaves nothing behind. URLs are left
    to TensorFlow, as in ``require_writable_dir``."""
    if "://" in path:
        return
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(field, f"cannot write to {path} (not a directory)", _DIR_FIX)
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(field, f"cannot write to {path} (permission denied)", _DIR_FIX)


def check_output_dirs(
    checkpoint_dir: str, summary_json: str, export_dir: str = "", logdir: str = ""
) -> None:
    """Before any training: the directories a run writes to at its end (and
    --export-every's, and TensorBoard's as it trains) are writable, so a mistake there costs
    seconds, not the whole run (exit 78, one line)."""
    for directory, field in (
        (checkpoint_dir, "--checkpoint-dir"),
        (export_dir, "--export-dir"),
        (logdir, "--logdir"),
    ):
        if directory:
            require_writable_dir(directory, field=field)
    if summary_json:
        if os.path.isdir(summary_json):
            raise ConfigError(
                "--summary-json",
                f"{summary_json} is a directory",
                "give a file path, e.g. DIR/summary.json",
            )
        require_writable_dir(os.path.dirname(os.path.abspath(summary_json)), field="--summary-json")
