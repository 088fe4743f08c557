"""Dynamic embedding tables' counts wherever an operator looks: Prometheus (a real registry),
the job's status (JobControl, status_proto, the client's text and JSON), TensorBoard (an
event file) and the run's summary (end_run over stand-ins)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from psctl.control.v1 import control_pb2
from psctl.coordinator.operations.client import format_status, status_dict
from psctl.coordinator.operations.job_state import JobControl, table_counts
from psctl.coordinator.operations.metrics import CoordinatorMetrics
from psctl.coordinator.operations.service import status_proto
from psctl.coordinator.operations.task_book import TaskInfo
from psctl.coordinator.training.loop import end_run
from psctl.coordinator.training.reporting.publish import Publisher
from psctl.coordinator.training.reporting.summary import Summary, write_summary

pytestmark = pytest.mark.timeout(30)

USER = {"rows": 12_345, "admitted": 20_000, "evicted": 7_655, "bytes": 3_604_740}
ITEM = {"rows": 900, "admitted": 1_000, "evicted": 100, "bytes": 0}


def new_metrics() -> tuple[CoordinatorMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(
        registry=registry, job="ctr", num_workers=2, num_ps=2, batch_size=64
    )
    return metrics, registry


def new_control() -> JobControl:
    return JobControl(
        job="ctr",
        target_steps=1000,
        steps_per_execution=10,
        tasks=[TaskInfo("chief", 0, "127.0.0.1:1")],
        can_checkpoint=False,
    )


def sample(registry: CollectorRegistry, series: str, table: str) -> float | None:
    return registry.get_sample_value(series, {"table": table})


# -- Prometheus -----------------------------------------------------------------------------


def test_no_table_series_before_a_report_or_without_tables():
    metrics, registry = new_metrics()
    metrics.set_global_step(0)
    metrics.set_table_stats({}, step=10)
    text = generate_latest(registry).decode()
    assert "psctl_table_rows{" not in text
    assert "psctl_table_admitted_total{" not in text
    assert "psctl_table_evicted_total{" not in text


def test_three_series_per_table_with_its_label_and_counters_from_zero_at_step_0():
    metrics, registry = new_metrics()
    metrics.set_global_step(0)  # the loop says where the run starts before it trains
    metrics.set_table_stats({"user_id": USER, "item_id": ITEM}, step=100)
    assert sample(registry, "psctl_table_rows", "user_id") == 12_345
    assert sample(registry, "psctl_table_admitted_total", "user_id") == 20_000
    assert sample(registry, "psctl_table_evicted_total", "user_id") == 7_655
    assert sample(registry, "psctl_table_rows", "item_id") == 900
    assert sample(registry, "psctl_table_admitted_total", "item_id") == 1_000
    assert sample(registry, "psctl_table_evicted_total", "item_id") == 100
    metrics.set_table_stats(
        {"user_id": {"rows": 12_000, "admitted": 21_000, "evicted": 9_000}}, step=200
    )
    assert sample(registry, "psctl_table_rows", "user_id") == 12_000  # a gauge: down too
    assert sample(registry, "psctl_table_admitted_total", "user_id") == 21_000
    assert sample(registry, "psctl_table_evicted_total", "user_id") == 9_000
    text = generate_latest(registry).decode()
    assert "# TYPE psctl_table_rows gauge" in text
    assert "# TYPE psctl_table_admitted_total counter" in text
    assert "# TYPE psctl_table_evicted_total counter" in text
    assert 'psctl_table_admitted_total{table="user_id"} 21000.0' in text


def test_a_restored_process_counts_from_its_first_report_never_the_restored_totals():
    # The process before counted up to 20,000; the checkpoint held 18,000 admitted: the
    # new process must not read to Prometheus as 18,000 admissions in its first seconds.
    metrics, registry = new_metrics()
    metrics.set_global_step(5000)  # restored at step 5000
    metrics.set_table_stats({"user_id": {**USER, "admitted": 18_000}}, step=5020)
    assert sample(registry, "psctl_table_admitted_total", "user_id") == 0
    assert sample(registry, "psctl_table_evicted_total", "user_id") == 0
    assert sample(registry, "psctl_table_rows", "user_id") == 12_345
    metrics.set_table_stats(
        {"user_id": {"rows": 12_400, "admitted": 18_500, "evicted": 7_700}}, step=5040
    )
    assert sample(registry, "psctl_table_admitted_total", "user_id") == 500
    assert sample(registry, "psctl_table_evicted_total", "user_id") == 45
    assert sample(registry, "psctl_table_rows", "user_id") == 12_400


def test_a_first_report_right_after_the_restore_is_the_base():
    metrics, registry = new_metrics()
    metrics.set_table_stats({"user_id": USER}, step=5000)  # before the loop's first step
    metrics.set_global_step(5000)
    metrics.set_table_stats({"user_id": {**USER, "admitted": 20_010}}, step=5010)
    assert sample(registry, "psctl_table_admitted_total", "user_id") == 10


def test_a_total_going_back_within_a_process_counts_nothing_and_is_the_new_base():
    metrics, registry = new_metrics()
    metrics.set_global_step(0)
    metrics.set_table_stats({"user_id": USER}, step=10)
    metrics.set_table_stats({"user_id": {**USER, "admitted": 15_000}}, step=20)
    assert sample(registry, "psctl_table_admitted_total", "user_id") == 20_000
    metrics.set_table_stats({"user_id": {**USER, "admitted": 15_100}}, step=30)
    assert sample(registry, "psctl_table_admitted_total", "user_id") == 20_100


# -- the Publisher: status, Prometheus, TensorBoard -----------------------------------------


class Scalars:
    def __init__(self) -> None:
        self.written: list[tuple[str, int, dict[str, float]]] = []

    def write(self, prefix: str, step: int, values: dict[str, float]) -> None:
        self.written.append((prefix, step, dict(values)))


def test_publisher_sends_the_counts_everywhere():
    metrics, registry = new_metrics()
    metrics.set_global_step(0)
    control = new_control()
    publisher = Publisher(control=control, metrics=metrics, batch_size=64)
    scalars = Scalars()
    publisher.scalars = scalars  # type: ignore[assignment]
    shards = {"bytes/ps:0": 1_800_000, "bytes/ps:1": 1_804_740}
    publisher.tables(100, {"user_id": {**USER, **shards}})
    assert control.view().board.tables == {"user_id": USER}
    assert sample(registry, "psctl_table_rows", "user_id") == 12_345
    assert sample(registry, "psctl_table_admitted_total", "user_id") == 20_000
    for ps, nbytes in (("ps:0", 1_800_000), ("ps:1", 1_804_740)):
        labels = {"table": "user_id", "ps": ps}
        assert registry.get_sample_value("psctl_table_bytes", labels) == nbytes
    assert scalars.written == [
        (
            "tables",
            100,
            {
                "user_id/rows": 12_345.0,
                "user_id/admitted": 20_000.0,
                "user_id/evicted": 7_655.0,
                "user_id/bytes": 3_604_740.0,
            },
        )
    ]
    publisher.tables(200, {})  # no dynamic tables: nothing published, nothing cleared
    assert len(scalars.written) == 1
    assert control.view().board.tables == {"user_id": USER}


def test_tensorboard_gets_one_scalar_per_table_and_count(tmp_path: Path):
    import tensorflow as tf

    publisher = Publisher(control=new_control(), metrics=None, logdir=str(tmp_path), batch_size=64)
    publisher.tables(100, {"user_id": USER})
    found: dict[str, tuple[int, float]] = {}
    for path in tmp_path.iterdir():
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                found[value.tag] = (event.step, float(tf.make_ndarray(value.tensor)))
    assert found == {
        "tables/user_id/rows": (100, 12_345.0),
        "tables/user_id/admitted": (100, 20_000.0),
        "tables/user_id/evicted": (100, 7_655.0),
        "tables/user_id/bytes": (100, 3_604_740.0),
    }


def test_publisher_without_prometheus_or_tensorboard():
    control = new_control()
    Publisher(control=control, metrics=None, batch_size=64).tables(5, {"item_id": ITEM})
    assert control.view().board.tables == {"item_id": ITEM}


def test_table_counts_copies_to_exactly_the_four_ints():
    given = {"b": {"rows": 3.0, "admitted": 4, "evicted": 1, "bytes": 7, "other": 9},
             "a": {"rows": 1}}  # fmt: skip
    got = table_counts(given)  # type: ignore[arg-type]
    assert got == {
        "a": {"rows": 1, "admitted": 0, "evicted": 0, "bytes": 0},
        "b": {"rows": 3, "admitted": 4, "evicted": 1, "bytes": 7},
    }
    assert list(got) == ["a", "b"]
    assert all(type(n) is int for counts in got.values() for n in counts.values())
    got["a"]["rows"] = 99
    assert given["a"]["rows"] == 1


def test_the_view_keeps_the_counts_published_not_later_changes():
    control = new_control()
    stats = {"user_id": dict(USER)}
    control.set_tables(stats)
    stats["user_id"]["rows"] = 1
    assert control.view().board.tables["user_id"]["rows"] == 12_345


# -- the Control API's status and psctl status ----------------------------------------------


def test_status_proto_carries_every_table_by_name():
    control = new_control()
    control.set_tables({"user_id": USER, "item_id": ITEM})
    status = status_proto(control)
    assert [(t.name, t.rows, t.admitted, t.evicted) for t in status.tables] == [
        ("item_id", 900, 1_000, 100),
        ("user_id", 12_345, 20_000, 7_655),
    ]
    again = control_pb2.Status.FromString(status.SerializeToString())
    assert again.tables[1].admitted == 20_000
    assert not status_proto(new_control()).tables


def test_tables_is_field_16_of_status_a_new_number():
    fields = control_pb2.Status.DESCRIPTOR.fields_by_name
    assert fields["tables"].number == 16
    assert fields["message"].number == 15
    table = control_pb2.Table.DESCRIPTOR.fields_by_name
    assert [(n, table[n].number) for n in ("name", "rows", "admitted", "evicted", "bytes")] == [
        ("name", 1),
        ("rows", 2),
        ("admitted", 3),
        ("evicted", 4),
        ("bytes", 5),
    ]


def test_psctl_status_prints_one_line_per_table():
    control = new_control()
    control.set_tables({"user_id": USER, "item_id": ITEM})
    text = format_status(status_proto(control))
    lines = text.splitlines()
    user = "table user_id: 12,345 rows (3.6 MB, 292 bytes/key), 20,000 admitted, 7,655 evicted"
    assert user in lines
    assert "table item_id: 900 rows, 1,000 admitted, 100 evicted" in lines  # no size reported
    assert lines.index("table item_id: 900 rows, 1,000 admitted, 100 evicted") < lines.index(user)
    assert not any(
        line.startswith("table ")
        for line in format_status(status_proto(new_control())).splitlines()
    )


def test_psctl_status_json_has_tables_by_name_with_numbers():
    control = new_control()
    control.set_tables({"user_id": USER})
    control.update(global_step=1200)
    as_json = json.loads(json.dumps(status_dict(status_proto(control))))
    assert as_json["tables"] == {"user_id": {**USER, "bytes_per_key": 292}}
    # Every 64-bit integer a number, as jq and scripts compare them (proto JSON: strings).
    assert as_json["global_step"] == 1200 and as_json["target_steps"] == 1000
    (chief,) = as_json["tasks"]
    assert chief["failures"] == 0 and chief["pid"] == 0, chief
    assert as_json["cluster_generation"] == 0
    assert json.loads(json.dumps(status_dict(status_proto(new_control()))))["tables"] == {}


# -- the run's summary ------------------------------------------------------------------------


class State:
    def __init__(self, tables: dict[str, dict[str, int]]) -> None:
        self.tables = tables

    def step(self) -> int:
        return 100

    def read_train_metrics(self) -> dict[str, float]:
        return {"loss": 0.5}

    def table_stats(self) -> dict[str, dict[str, int]]:
        return self.tables


class Status:
    last_values: dict[str, float] = {}  # noqa: RUF012

    def __init__(self) -> None:
        self.progress = SimpleNamespace(finish=lambda *args: None)


class Recorder:
    """The Publisher's end-of-run calls, recorded."""

    def __init__(self) -> None:
        self.published: list[tuple[int, dict[str, dict[str, int]]]] = []

    def progress(self, step: int, rate: float, values: dict[str, float]) -> None:
        pass

    def evaluation(self, values: dict[str, float], *, step: int) -> None:
        pass

    def tables(self, step: int, stats: dict[str, dict[str, int]]) -> None:
        self.published.append((step, stats))


def summary_of(tables: dict[str, dict[str, int]], *, chief: bool) -> tuple[Summary, Recorder]:
    """``end_run`` after 100 steps over stand-ins, as the chief (status, evaluation) or as a
    sync worker other than the chief (neither)."""
    publisher = Recorder()
    loop = SimpleNamespace(
        train_seconds=lambda: 10.0,
        status=Status() if chief else None,
        publisher=publisher,
        checkpointer=SimpleNamespace(enabled=False, latest=None),
        program=SimpleNamespace(target=100, stopped_early=lambda step: False),
        runner=SimpleNamespace(stalls=0),
    )
    trainer = SimpleNamespace(
        state=State(tables),
        settings=SimpleNamespace(loop=SimpleNamespace(batch_size=64)),
        examples_per_step=64,
        job=SimpleNamespace(name="ctr"),
        num_workers=2,
        num_ps=2,
    )
    summary = end_run(
        loop,  # type: ignore[arg-type]
        trainer,  # type: ignore[arg-type]
        start_step=0,
        wall_started=time.monotonic(),
        steps_per_execution=10,
        evaluate=(lambda step, checkpoint: {}) if chief else None,
    )
    return summary, publisher


@pytest.mark.parametrize("chief", [True, False])
def test_the_summary_has_the_tables_at_the_end(tmp_path: Path, chief: bool):
    summary, publisher = summary_of({"user_id": USER}, chief=chief)
    assert summary.tables == {"user_id": USER}
    # The chief publishes the final counts with the final progress; a sync worker does not.
    assert publisher.published == ([(100, {"user_id": USER})] if chief else [])
    path = tmp_path / "summary.json"
    write_summary(summary, str(path))
    assert json.loads(path.read_text())["tables"] == {"user_id": USER}


def test_the_summary_has_an_empty_tables_without_dynamic_tables(tmp_path: Path):
    summary, _ = summary_of({}, chief=True)
    path = tmp_path / "summary.json"
    write_summary(summary, str(path))
    assert json.loads(path.read_text())["tables"] == {}
