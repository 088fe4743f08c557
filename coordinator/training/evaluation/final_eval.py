"""Evaluation over every eval example once: the final one on the coordinator, the same in
a fresh process when a task is frozen, and the loop every evaluator shares.

Inline evaluation on the workers (``--eval-every``) is in inline_eval.py; the sidecar
evaluator (``psctl evaluate``) in sidecar_eval.py; all print ``report.eval_line``.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

from psctl.coordinator.argv import psctl_argv
from psctl.coordinator.job import Job
from psctl.coordinator.settings import TrainSettings
from psctl.coordinator.training.evaluation.report import eval_line
from psctl.coordinator.training.job_model.metric_objects import make_eval_step
from psctl.coordinator.training.job_model.model import scalar

log = logging.getLogger(__name__)


class DatasetEvaluator:
    """The mean loss (weighted by batch size) and the job's metrics over a dataset."""

    def __init__(
        self,
        model: Any,
        loss_fn: Callable[[Any, Any], Any],
        metric_factories: Sequence[Callable[[], Any]],
        *,
        compiled: bool,
    ) -> None:
        self.loss = keras.metrics.Mean(name="loss")
        self.metrics = [make() for make in metric_factories]
        step = make_eval_step(model, loss_fn, self.loss, self.metrics)
        self.step = tf.function(step) if compiled else step

    def run(self, dataset: Any) -> tuple[dict[str, float], int]:
        """(values, examples) over one pass of ``dataset``."""
        self.loss.reset_state()
        for metric in self.metrics:
            metric.reset_state()
        examples = 0
        for batch in dataset:
            self.step(batch[0], batch[1])
            examples += int(tf.nest.flatten(batch[1])[0].shape[0])
        values = {"loss": scalar(self.loss.result())}
        values.update({m.name: scalar(m.result()) for m in self.metrics})
        return values, examples


def evaluate_final(
    job: Job, settings: TrainSettings, model: Any, factories: Any, step: int
) -> dict[str, float]:
    """Evaluate the held-out split once, on the coordinator, reading ps variables.

    Exact (every eval example once) and independent of worker failures.
    """
    if job.eval_dataset_fn is None:
        return {}
    dataset = job.whole_eval_split(settings)
    # Eager on purpose: a new tf.function is registered on every worker, and a frozen
    # worker would block that registration (seen); the eval set is read once anyway.
    evaluator = DatasetEvaluator(model, job.loss_fn, factories, compiled=False)
    started = time.monotonic()
    values, examples = evaluator.run(dataset)
    log.info(
        "%s",
        eval_line(step, values, examples=examples, seconds=time.monotonic() - started),
    )
    return values


def evaluate_elsewhere(settings: TrainSettings, checkpoint: str) -> dict[str, float]:
    """Evaluate the final checkpoint in a fresh process (`psctl evaluate`).

    With a task frozen, this process can't create new functions or datasets: TensorFlow
    registers each on every worker and waits for the frozen one (seen)."""
    out = Path(checkpoint).parent / "final-eval.json"
    argv = psctl_argv(
        "evaluate", "--checkpoint-dir", str(Path(checkpoint).parent), "--max-evaluations", "1",
        *settings.argv("job", "eval_batch_size", "seed", "label_column", "eval_data"),
        "--summary-json", str(out),
    )  # fmt: skip
    log.info("a task is frozen: evaluating %s in a separate process", checkpoint)
    try:
        subprocess.run(argv, check=True, timeout=600, stdin=subprocess.DEVNULL)
        result = json.loads(out.read_text())
    except (subprocess.SubprocessError, OSError, ValueError) as err:
        log.error("final evaluation failed: %s", err)
        return {}
    values = {"loss": result["eval_loss"], **result.get("eval_metrics", {})}
    return {k: float(v) for k, v in values.items() if v is not None}
