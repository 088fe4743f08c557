"""What a job's dataset functions are given: ``DataContext`` (``psctl.job.DataContext``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from psctl.coordinator.data.checks import FULL_CHECK_BYTES

if TYPE_CHECKING:
    from psctl.coordinator.settings import TrainSettings


@dataclass(frozen=True)
class DataContext:
    """What a dataset function needs to read its own part of the data.

    ``worker_index`` is a scalar int64 tensor inside per-worker dataset functions (they are
    traced once for all workers), usable in ``shard``/``skip``/seeds; a plain int elsewhere
    (on the coordinator, for evaluation). ``num_workers`` is always a Python int, so is
    ``batch_size`` (per worker).
    """

    worker_index: Any
    num_workers: int
    batch_size: int
    seed: int
    # File inputs given on the command line (--train-data / --eval-data GLOB); "" = none,
    # and the job uses its own data.
    train_data: str = ""
    eval_data: str = ""
    label_column: str = "label"
    # --epochs: return ONE pass over the data (finite: no repeat; keep the last partial
    # batch; no sharding, the context says worker 0 of 1). psctl repeats it and the tf.data
    # service hands its pieces to the workers, so every example is read once per epoch.
    one_pass: bool = False
    # --full-check-mb (in bytes): larger inputs are checked in their first lines only, and
    # the readers check every record on the workers; --bad-records: "fail" ends the job on
    # a bad one (exit 78), "skip" drops it (the worker logs where it was).
    full_check_bytes: int = FULL_CHECK_BYTES
    bad_records: str = "fail"

    # tf.distribute.InputContext's names, so that a dataset function written for
    # distribute_datasets_from_function (as in TensorFlow's tutorials) reads the same.
    @property
    def input_pipeline_id(self) -> Any:
        return self.worker_index

    @property
    def num_input_pipelines(self) -> int:
        return self.num_workers

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size`` split over the workers (one replica per worker)."""
        if global_batch_size % self.num_workers:
            raise ValueError(
                f"global batch size {global_batch_size} is not divisible by "
                f"{self.num_workers} workers"
            )
        return global_batch_size // self.num_workers

    @classmethod
    def from_settings(
        cls, settings: TrainSettings, *, worker_index: Any, num_workers: int, batch_size: int
    ) -> DataContext:
        """The context a run's settings give (seed, data files, label column)."""
        return cls(
            worker_index=worker_index,
            num_workers=num_workers,
            batch_size=batch_size,
            seed=settings.loop.seed,
            train_data=settings.data.train_data,
            eval_data=settings.data.eval_data,
            label_column=settings.data.label_column,
            full_check_bytes=settings.data.full_check_mb << 20,
            bad_records=settings.data.bad_records,
        )
