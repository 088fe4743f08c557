"""CoordinatorMetrics on its own registry: every series the trainer drives, by exact name."""

from __future__ import annotations

import math
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from psctl.coordinator.operations.metrics import STATES, CoordinatorMetrics

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> CoordinatorMetrics:
    return CoordinatorMetrics(registry=registry, job="mlp", num_workers=2, num_ps=1, batch_size=64)


def value(registry: CollectorRegistry, series: str, /, **labels: str) -> float | None:
    return registry.get_sample_value(series, labels)


def test_identity_and_cluster_size(registry, metrics):
    assert value(registry, "psctl_task_info", task_type="chief", task_index="0") == 1
    assert value(registry, "psctl_job_info", name="mlp") == 1
    assert value(registry, "psctl_workers") == 2
    assert value(registry, "psctl_ps") == 1
    assert value(registry, "psctl_batch_size") == 64
    assert value(registry, "psctl_uptime_seconds") is not None
    assert value(registry, "process_cpu_seconds_total") is not None
    # Task identity is only on psctl_task_info: no other psctl series has task labels.
    for family in registry.collect():
        for sample in family.samples:
            if sample.name != "psctl_task_info":
                assert "task_type" not in sample.labels, sample


def test_state_is_one_gauge_per_fixed_state_under_a_state_label(registry, metrics):
    assert value(registry, "psctl_coordinator_state", state="starting") == 1
    for state in STATES:
        metrics.set_state(state)
        for other in STATES:
            got = value(registry, "psctl_coordinator_state", state=other)
            assert got == (1 if other == state else 0), (state, other)
    metrics.set_state("running")
    assert value(registry, "psctl_health_state", state="serving") == 1
    metrics.set_state("done")
    assert value(registry, "psctl_health_state", state="not_serving") == 1
    with pytest.raises(ValueError, match="unknown coordinator state"):
        metrics.set_state("sleeping")
    # The conventional label, not the metric's own name (prometheus_client's Enum).
    text = generate_latest(registry).decode()
    assert 'psctl_coordinator_state{state="done"} 1.0' in text
    assert 'psctl_health_state{state="not_serving"} 1.0' in text
    assert "psctl_coordinator_state=" not in text and "psctl_health_state=" not in text


def test_observe_call_counts_steps_examples_and_both_histograms(registry, metrics):
    metrics.observe_call(steps=20, seconds=0.2)  # 10 ms per step
    metrics.observe_call(steps=1, seconds=0.004)
    assert value(registry, "psctl_train_steps_total") == 21
    assert value(registry, "psctl_train_examples_total") == 21 * 64
    assert value(registry, "psctl_step_duration_seconds_count") == 21
    assert value(registry, "psctl_step_duration_seconds_sum") == pytest.approx(0.204)
    assert value(registry, "psctl_step_duration_seconds_bucket", le="0.005") == 1
    assert value(registry, "psctl_step_duration_seconds_bucket", le="0.0075") == 1
    assert value(registry, "psctl_step_duration_seconds_bucket", le="0.01") == 21
    assert value(registry, "psctl_step_duration_seconds_bucket", le="+Inf") == 21
    assert value(registry, "psctl_scheduled_function_duration_seconds_count") == 2
    assert value(registry, "psctl_scheduled_function_duration_seconds_sum") == pytest.approx(0.204)
    assert value(registry, "psctl_scheduled_function_duration_seconds_bucket", le="0.005") == 1
    assert value(registry, "psctl_scheduled_function_duration_seconds_bucket", le="0.2") == 2
    metrics.observe_call(steps=0, seconds=0.1)  # nothing ran: nothing counted
    assert value(registry, "psctl_scheduled_function_duration_seconds_count") == 2


def test_progress_gauges(registry, metrics):
    metrics.set_global_step(1234)
    metrics.set_target_steps(1500)
    metrics.set_steps_per_execution(20)
    metrics.set_closures(in_flight=8, queued=3)
    assert value(registry, "psctl_global_step") == 1234
    assert value(registry, "psctl_target_steps") == 1500
    assert value(registry, "psctl_steps_per_execution") == 20
    assert value(registry, "psctl_closures_in_flight") == 8
    assert value(registry, "psctl_closures_queued") == 3


def test_train_values_appear_on_first_report_and_follow_the_job(registry, metrics):
    # Before any report there is no loss at all (a 0 would read as a perfect loss).
    assert value(registry, "psctl_train_loss") is None
    assert value(registry, "psctl_train_metric", name="accuracy") is None
    metrics.set_train_values({"loss": 0.5, "accuracy": 0.9, "auc": 0.7})
    assert value(registry, "psctl_train_loss") == 0.5
    assert value(registry, "psctl_train_metric", name="accuracy") == 0.9
    assert value(registry, "psctl_train_metric", name="auc") == 0.7
    assert value(registry, "psctl_train_metric", name="loss") is None
    metrics.set_train_values({"loss": float("nan"), "accuracy": 0.95})
    loss = value(registry, "psctl_train_loss")
    assert loss is not None and math.isnan(loss)
    assert value(registry, "psctl_train_metric", name="accuracy") == 0.95
    assert value(registry, "psctl_train_metric", name="auc") is None  # no longer reported


def test_eval_values(registry, metrics):
    assert value(registry, "psctl_eval_loss") is None
    assert value(registry, "psctl_evaluations_total") == 0
    metrics.set_eval_values({"loss": 0.03, "accuracy": 0.99}, step=1500)
    assert value(registry, "psctl_eval_loss") == 0.03
    assert value(registry, "psctl_eval_metric", name="accuracy") == 0.99
    assert value(registry, "psctl_last_eval_step") == 1500
    assert value(registry, "psctl_evaluations_total") == 1
    # Train and eval values are kept apart.
    assert value(registry, "psctl_train_loss") is None


def test_failures_and_recoveries(registry, metrics):
    metrics.worker_failure()
    metrics.worker_failure(2)
    metrics.ps_failure()
    metrics.recovery()
    assert value(registry, "psctl_worker_failures_total") == 3
    assert value(registry, "psctl_ps_failures_total") == 1
    assert value(registry, "psctl_recoveries_total") == 1


def test_counts_carried_over_from_earlier_training_processes(registry, metrics):
    for name in ("restarts", "recoveries", "ps_failures", "nonfinite_loss"):
        assert value(registry, f"psctl_{name}_total") == 0, name
    metrics.carry_over(restarts=3, ps_failures=2, nonfinite_losses=1)
    assert value(registry, "psctl_restarts_total") == 3
    assert value(registry, "psctl_recoveries_total") == 3  # each restart restored a checkpoint
    assert value(registry, "psctl_ps_failures_total") == 2
    assert value(registry, "psctl_nonfinite_loss_total") == 1
    metrics.nonfinite_loss()
    metrics.recovery()
    assert value(registry, "psctl_nonfinite_loss_total") == 2
    assert value(registry, "psctl_recoveries_total") == 4
    assert value(registry, "psctl_restarts_total") == 3  # only the supervisor restarts


def test_wait_until_scraped_returns_at_once_when_nothing_scrapes(registry, metrics):
    started = time.monotonic()
    assert metrics.wait_until_scraped(max_seconds=10) is False
    assert time.monotonic() - started < 1


def test_wait_until_scraped_waits_for_the_next_scrape(registry, metrics):
    generate_latest(registry)  # Prometheus has been scraping
    generate_latest(registry)
    metrics.set_state("done")
    scraped: list[str] = []
    scraper = threading.Timer(0.3, lambda: scraped.append(generate_latest(registry).decode()))
    scraper.start()
    assert metrics.wait_until_scraped(max_seconds=10) is True
    scraper.join(timeout=5)
    assert 'psctl_coordinator_state{state="done"} 1.0' in scraped[0]


def test_wait_until_scraped_gives_up_after_two_scrape_intervals(registry, metrics):
    generate_latest(registry)
    time.sleep(0.2)
    generate_latest(registry)  # scraped every 0.2 s: waits at most 2 x 0.2 + 1 s
    started = time.monotonic()
    assert metrics.wait_until_scraped(max_seconds=10) is False
    assert time.monotonic() - started < 3


def test_wait_until_scraped_returns_at_once_after_a_single_read(registry, metrics):
    # One read (an operator's curl, a test's) is no scraper that comes back: the job ended
    # 30 s late after it, waiting for a next scrape that never came.
    generate_latest(registry)
    started = time.monotonic()
    assert metrics.wait_until_scraped(max_seconds=10) is False
    assert time.monotonic() - started < 1


def test_wait_until_scraped_returns_at_once_once_the_scraper_is_gone(registry, metrics):
    generate_latest(registry)
    time.sleep(0.1)
    generate_latest(registry)  # every 0.1 s: the next is due by 0.1 + 2 x 0.1 + 1 s ...
    time.sleep(1.5)  # ... and has not come
    started = time.monotonic()
    assert metrics.wait_until_scraped(max_seconds=10) is False
    assert time.monotonic() - started < 0.5


def test_wait_until_scraped_counts_the_interval_past_a_stray_read(registry, metrics):
    generate_latest(registry)
    time.sleep(1.0)
    generate_latest(registry)  # a scraper every 1 s ...
    generate_latest(registry)  # ... and an operator's curl right after its scrape
    scraper = threading.Timer(1.0, lambda: generate_latest(registry))
    scraper.start()
    assert metrics.wait_until_scraped(max_seconds=10) is True
    scraper.join(timeout=5)


def test_checkpoints(registry, metrics):
    assert value(registry, "psctl_last_checkpoint_timestamp_seconds") == 0
    assert value(registry, "psctl_checkpoints_total") == 0
    metrics.observe_checkpoint(seconds=0.4, step=500, timestamp=1_700_000_000.0)
    metrics.observe_checkpoint(seconds=95.0, step=1000, timestamp=1_700_000_100.0)
    assert value(registry, "psctl_checkpoints_total") == 2
    assert value(registry, "psctl_last_checkpoint_step") == 1000
    assert value(registry, "psctl_last_checkpoint_timestamp_seconds") == 1_700_000_100.0
    assert value(registry, "psctl_checkpoint_duration_seconds_count") == 2
    assert value(registry, "psctl_checkpoint_duration_seconds_bucket", le="0.5") == 1
    assert value(registry, "psctl_checkpoint_duration_seconds_bucket", le="60.0") == 1
    assert value(registry, "psctl_checkpoint_duration_seconds_bucket", le="120.0") == 2


def test_registries_are_independent(registry, metrics):
    other = CollectorRegistry()
    CoordinatorMetrics(registry=other, job="ctr", num_workers=8, num_ps=4, batch_size=128)
    metrics.observe_call(steps=5, seconds=0.05)
    assert value(other, "psctl_train_steps_total") == 0
    assert value(other, "psctl_workers") == 8
    assert value(registry, "psctl_workers") == 2


def test_exposition_follows_naming_rules(registry, metrics):
    metrics.observe_call(steps=3, seconds=0.03)
    metrics.set_train_values({"loss": 0.1, "accuracy": 0.5})
    metrics.set_eval_values({"loss": 0.1, "accuracy": 0.5}, step=3)
    metrics.observe_checkpoint(seconds=0.2, step=3, timestamp=1.0)
    types: dict[str, str] = {}
    for family in registry.collect():
        if family.name.startswith("psctl_"):
            types[family.name] = family.type
    assert "summary" not in types.values()
    for name, kind in types.items():
        if kind == "counter":
            # prometheus_client stores counter family names without the _total suffix.
            assert f"{name}_total" in generate_latest(registry).decode(), name
        if kind == "histogram":
            assert name.endswith("_seconds"), name
    assert not any("millis" in name for name in types)


def test_sync_counts_every_workers_batch_but_shows_the_batch_per_worker():
    registry = CollectorRegistry()
    sync = CoordinatorMetrics(
        registry=registry, job="mlp", num_workers=2, num_ps=0, batch_size=64, examples_per_step=128
    )
    sync.observe_call(steps=10, seconds=0.1)
    assert value(registry, "psctl_batch_size") == 64
    assert value(registry, "psctl_train_examples_total") == 10 * 128
