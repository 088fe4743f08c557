"""The sidecar evaluator: the job's model and optimizer in this process, restored from a
training run's checkpoints (the trainer's ``tf.train.Checkpoint(model, optimizer,
global_step)``) and evaluated over the job's ``eval_dataset_fn`` (worker 0 of 1: every eval
example once). `psctl evaluate`'s process around it is coordinator/launch/sidecar.py.

TensorFlow is imported only when an evaluator is built, so ``psctl --help`` stays light.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from psctl.cluster.errors import ConfigError
from psctl.coordinator.failures import describe
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.saving.checkpoint_files import checkpoints_in, is_model_mismatch

if TYPE_CHECKING:
    from psctl.coordinator.job import Job

log = logging.getLogger("psctl.evaluate")


@dataclass
class Evaluation:
    """One checkpoint evaluated: a line of output, an entry of ``--summary-json``."""

    step: int
    checkpoint: str
    loss: float
    metrics: dict[str, float]
    examples: int
    seconds: float
    timestamp: float


class SidecarEvaluator:
    """The job's model and optimizer in this process, restored from each checkpoint."""

    def __init__(self, job: Job, settings: TrainSettings, *, logdir: str = "") -> None:
        import tensorflow as tf

        from psctl.coordinator.training.evaluation.final_eval import DatasetEvaluator
        from psctl.coordinator.training.job_model.model import JobModel
        from psctl.coordinator.training.reporting.tensorboard import ScalarWriter

        self.job = job
        self.settings = settings
        # As the final evaluation reads it; --eval-data's files checked now, before waiting.
        self.dataset = job.whole_eval_split(settings)
        x_spec, y_spec = self.dataset.element_spec[0], self.dataset.element_spec[1]
        built = JobModel(job, x_spec, y_spec, source="eval_dataset_fn")
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        # The trainer's checkpoint: the same object names, so every variable matches.
        self.checkpoint = built.checkpoint(self.step)
        self.evaluator = DatasetEvaluator(
            built.model, job.loss_fn, built.metric_factories, compiled=True
        )
        self.writer = ScalarWriter(logdir) if logdir else None
        # Trace the step and start the input pipeline now, while no checkpoint is waiting.
        for batch in self.dataset.take(1):
            self.evaluator.step(batch[0], batch[1])

    def latest_checkpoint(self) -> str | None:
        """The newest checkpoint by its files (``ckpt-<step>.index``), whatever the state
        file says: a garbage state file does not hide the trainer's checkpoints."""
        found = checkpoints_in(self.settings.checkpoints.checkpoint_dir)
        return found[0].prefix if found else None

    def score(self, path: str, eval_data: str, metric: str) -> float:
        """``metric`` (``loss`` or one of the job's) of checkpoint ``path`` over the files
        ``eval_data`` names: ``--export-if-better``'s scoring, in the export process."""
        dataset = self.job.whole_eval_split(self.settings.replace(eval_data=eval_data))
        result = self.evaluate_checkpoint(path, dataset)
        if result is None:
            raise ConfigError("--export-if-better", f"{path} cannot be read", "try a newer one")
        values = {"loss": result.loss, **result.metrics}
        if metric not in values:
            raise ConfigError(
                "--export-if-better",
                f"the job's evaluation has no metric {metric!r}",
                f"use one of {', '.join(values)}",
            )
        return values[metric]

    def evaluate_checkpoint(self, path: str, dataset: Any = None) -> Evaluation | None:
        """Restore ``path`` and evaluate (over ``dataset``, else the eval split); None if it
        vanished first (rotated away)."""
        import tensorflow as tf

        try:
            status = self.checkpoint.restore(path)
            status.assert_existing_objects_matched()
        except tf.errors.OpError as err:
            if is_model_mismatch(err):  # a dynamic table's rows of another dimension
                raise self._mismatch(path, err) from None
            # Rotated away by the trainer's --keep-checkpoints between the look and the read.
            log.warning("cannot read %s (%s); skipping it", path, type(err).__name__)
            return None
        except (AssertionError, ValueError) as err:
            raise self._mismatch(path, err) from None
        status.expect_partial()
        step = int(self.step.numpy())
        started = time.monotonic()
        values, examples = self.evaluator.run(self.dataset if dataset is None else dataset)
        loss = values.pop("loss")
        result = Evaluation(
            step=step,
            checkpoint=path,
            loss=loss,
            metrics=values,
            examples=examples,
            seconds=time.monotonic() - started,
            timestamp=time.time(),
        )
        self._summarize(result)
        return result

    def _mismatch(self, path: str, err: BaseException) -> ConfigError:
        # The half-restored checkpoint lists every unused value when collected: noise here.
        logging.getLogger("tensorflow").setLevel(logging.ERROR)
        said = describe(err).removeprefix(f"{type(err).__name__}: ")
        return ConfigError(
            f"--job {self.settings.job}",
            f"its model does not match checkpoint {path} ({said[:200]})",
            "evaluate with the --job that wrote the checkpoints",
        )

    def _summarize(self, result: Evaluation) -> None:
        if self.writer is not None:
            self.writer.write("eval", result.step, {"loss": result.loss, **result.metrics})
