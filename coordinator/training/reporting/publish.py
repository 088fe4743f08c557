"""Where the coordinator's numbers go: the Control API's status, Prometheus and
TensorBoard, from one place."""

from __future__ import annotations

from typing import TYPE_CHECKING

from psctl.coordinator.operations.job_state import table_counts
from psctl.coordinator.training.reporting.tensorboard import ScalarWriter

if TYPE_CHECKING:
    from psctl.coordinator.operations.job_state import JobControl
    from psctl.coordinator.operations.metrics import CoordinatorMetrics


class Publisher:
    def __init__(
        self,
        *,
        control: JobControl,
        metrics: CoordinatorMetrics | None,
        logdir: str = "",
        batch_size: int,
    ) -> None:
        self.control = control
        self.metrics = metrics
        self.batch_size = batch_size
        # Created after the strategy connected to the cluster, which resets the eager context.
        self.scalars = ScalarWriter(logdir) if logdir else None
        self.last_tables: dict[str, dict[str, int]] = {}  # for the progress line

    def progress(self, step: int, steps_per_sec: float, values: dict[str, float]) -> None:
        """Training progress to the status, Prometheus and TensorBoard."""
        self.control.update(
            global_step=step,
            steps_per_second=steps_per_sec,
            examples_per_second=steps_per_sec * self.batch_size,
            loss=values.get("loss", float("nan")),
            metrics={k: v for k, v in values.items() if k != "loss"},
        )
        if self.metrics is not None:
            self.metrics.set_global_step(step)
            self.metrics.set_train_values(values)
        if self.scalars is not None:
            self.scalars.write("train", step, {**values, "steps_per_sec": steps_per_sec})

    def evaluation(self, values: dict[str, float], *, step: int) -> None:
        """Evaluation results to the status, Prometheus and TensorBoard."""
        self.control.update(eval_metrics=values, eval_step=step)
        if self.metrics is not None:
            self.metrics.set_eval_values(values, step=step)
        if self.scalars is not None:
            self.scalars.write("eval", step, values)

    def tables(self, step: int, stats: dict[str, dict[str, int]]) -> None:
        """The dynamic embedding tables' counts at global step ``step``
        (``TrainState.table_stats()``: per table, by layer name, its live ``rows``, the
        ``admitted`` and ``evicted`` totals and its ``bytes``) to the status, Prometheus
        (psctl_table_rows, psctl_table_admitted_total, psctl_table_evicted_total by
        ``table``, psctl_table_bytes by ``table`` and ``ps``) and TensorBoard
        (``tables/<name>/rows``, ``.../admitted``, ...). Nothing without tables."""
        counts = table_counts(stats)
        if not counts:
            return
        self.last_tables = counts
        self.control.set_tables(counts)
        if self.metrics is not None:
            self.metrics.set_table_stats(counts, step=step)
            self.metrics.set_table_bytes(
                {
                    (name, key.split("/", 1)[1]): n
                    for name, found in stats.items()
                    for key, n in found.items()
                    if key.startswith("bytes/")
                }
            )
        if self.scalars is not None:
            self.scalars.write(
                "tables",
                step,
                {
                    f"{name}/{key}": float(n)
                    for name, kinds in counts.items()
                    for key, n in kinds.items()
                },
            )
