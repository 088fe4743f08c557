"""PublishStatus and the NaN guard: a non-finite loss is published (status, Prometheus) before
it ends the training process. Scripted stand-ins; TensorFlow is only imported."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from psctl.coordinator.failures import Failure, RestartFromCheckpoint, classify
from psctl.coordinator.operations.job_state import JobControl
from psctl.coordinator.operations.metrics import CoordinatorMetrics
from psctl.coordinator.training.actions import PublishStatus
from psctl.coordinator.training.reporting.publish import Publisher

pytestmark = pytest.mark.timeout(30)


class Values:
    """The train state's metrics as the job reports them, scripted."""

    def __init__(self, values: dict[str, float]) -> None:
        self.values = values

    def read_train_metrics(self) -> dict[str, float]:
        return dict(self.values)


class Lines:
    def __init__(self) -> None:
        self.lines: list[Any] = []

    def report(self, *args: Any) -> None:
        self.lines.append(args)


def publish_status(values: dict[str, float]) -> tuple[PublishStatus, JobControl, Any]:
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(
        registry=registry, job="mlp", num_workers=2, num_ps=1, batch_size=64
    )
    control = JobControl(
        job="mlp", target_steps=1000, steps_per_execution=1, tasks=[], can_checkpoint=False
    )
    publisher = Publisher(control=control, metrics=metrics, batch_size=64)
    status = PublishStatus(
        state=Values(values),  # type: ignore[arg-type]
        publisher=publisher,
        progress=Lines(),  # type: ignore[arg-type]
        every=0.0,
        log_every=0.0,
        batch_size=64,
        start_step=0,
    )
    return status, control, registry


def test_a_finite_loss_is_published():
    status, control, registry = publish_status({"loss": 0.25, "accuracy": 0.9})
    status(SimpleNamespace(completed=100))  # type: ignore[arg-type]
    assert registry.get_sample_value("psctl_train_loss") == 0.25
    assert registry.get_sample_value("psctl_global_step") == 100
    assert control.view().board.loss == 0.25


@pytest.mark.parametrize("loss", [math.nan, math.inf])
def test_a_non_finite_loss_is_published_then_ends_the_process(loss: float):
    status, control, registry = publish_status({"loss": loss, "accuracy": 0.5})
    with pytest.raises(RestartFromCheckpoint, match="training loss is") as raised:
        status(SimpleNamespace(completed=400))  # type: ignore[arg-type]
    assert classify(raised.value) is Failure.NON_FINITE  # counted on the way out (train.py)
    exported = registry.get_sample_value("psctl_train_loss")
    assert exported is not None and not math.isfinite(exported)
    assert registry.get_sample_value("psctl_global_step") == 400
    shown = control.view().board.loss
    assert not math.isfinite(shown)
