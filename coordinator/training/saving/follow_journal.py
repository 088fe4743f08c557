"""Which input files follow mode trained, kept with the checkpoints (``--follow``).

``CHECKPOINT_DIR/follow.json`` holds the global step follow mode started from and, for
every round (one partition: coordinator/data/follow.py), the global step of the checkpoint
written when the round ended and the files it trained. A round is recorded only after its
checkpoint is written. A restarted coordinator restores the checkpoint of the last recorded
round (``restore_step``), not a newer one taken in the middle of the next round, and goes
on with the first file not recorded: each file is trained once in the model that carries
on, however the training process ended.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)

NAME = "follow.json"


@dataclass(frozen=True)
class Round:
    step: int  # the global step of the checkpoint written at its end
    files: tuple[str, ...]
    completed_at: float  # when its partition was complete (Unix time)
    trained_at: float


class FollowJournal:
    def __init__(self, checkpoint_dir: str) -> None:
        self.path = checkpoint_dir.rstrip("/") + "/" + NAME
        self.base_step: int | None = None  # None: follow mode never ran in this directory
        self.rounds: list[Round] = []
        self._read()

    def _read(self) -> None:
        import tensorflow as tf  # tf.io.gfile: wherever the checkpoints are

        if not tf.io.gfile.exists(self.path):
            return
        with tf.io.gfile.GFile(self.path, "r") as f:
            data = json.loads(f.read())
        self.base_step = int(data["base_step"])
        self.rounds = [
            Round(int(r["step"]), tuple(r["files"]), float(r["completed_at"]), r["trained_at"])
            for r in data["rounds"]
        ]

    def restore_step(self) -> int | None:
        """The newest checkpoint step a restart may restore (None: any, as without
        follow mode): the last round's, or the step follow mode started from."""
        if self.base_step is None:
            return None
        return self.rounds[-1].step if self.rounds else self.base_step

    def begin(self, restored_step: int) -> list[Round]:
        """After the restore: forget rounds newer than the checkpoint restored (a damaged
        one was skipped), write the journal, and return the rounds that stand."""
        if self.base_step is None or self.base_step > restored_step:
            self.base_step = restored_step
        dropped = [r for r in self.rounds if r.step > restored_step]
        if dropped:
            log.warning(
                "follow mode: the checkpoint of step %d is restored, so %d file(s) recorded "
                "after it are trained again",
                restored_step,
                sum(len(r.files) for r in dropped),
            )
        self.rounds = [r for r in self.rounds if r.step <= restored_step]
        self._write()
        return list(self.rounds)

    def record(self, step: int, files: tuple[str, ...], completed_at: float) -> Round:
        entry = Round(step, files, completed_at, time.time())
        self.rounds.append(entry)
        self._write()
        return entry

    def _write(self) -> None:
        import tensorflow as tf

        data: dict[str, Any] = {
            "base_step": self.base_step,
            "rounds": [asdict(r) for r in self.rounds],
        }
        temporary = f"{self.path}.tmp"
        with tf.io.gfile.GFile(temporary, "w") as f:
            f.write(json.dumps(data, indent=1))
        tf.io.gfile.rename(temporary, self.path, overwrite=True)
