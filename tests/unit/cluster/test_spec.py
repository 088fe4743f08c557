"""Unit tests for cluster.address, cluster.spec and cluster.tf_config: TF_CONFIG / cluster file
parsing, validation and display."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from psctl.cluster.address import Address, canonical_host, split_host_port
from psctl.cluster.errors import ConfigError
from psctl.cluster.spec import (
    TASK_TYPES,
    ClusterConfig,
    TaskConfig,
    format_table,
    load_cluster_file,
    parse_cluster,
    parse_cluster_json,
    require_chief,
)
from psctl.cluster.tf_config import check_config, parse_tf_config, resolve_cluster, resolve_task
from tests.conftest import child_env, psctl_argv

CLUSTER: dict[str, list[str]] = {
    "chief": ["host0:2222"],
    "worker": ["host1:2222", "host2:2222"],
    "ps": ["host3:2222"],
}


_DEFAULT = object()


def tf_config(cluster: object = _DEFAULT, task: object = _DEFAULT, **extra: object) -> str:
    """A TF_CONFIG JSON string; ``cluster`` and ``task`` default to CLUSTER and worker 0."""
    obj: dict[str, object] = {"cluster": CLUSTER if cluster is _DEFAULT else cluster}
    obj["task"] = {"type": "worker", "index": 0} if task is _DEFAULT else task
    obj.update(extra)
    return json.dumps(obj)


def config_error(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> ConfigError:
    """Call ``fn``, expect a ConfigError, and check what every ConfigError must satisfy."""
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    err = info.value
    message = str(err)
    assert "\n" not in message and "\r" not in message
    assert err.exit_status == 78
    assert message.startswith(f"{err.field}: ")
    assert err.problem and err.fix
    return err


def write(tmp_path: Path, content: object, name: str = "cluster.json") -> Path:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


# --- happy paths -------------------------------------------------------------------------


def test_task_types() -> None:
    assert TASK_TYPES == ("chief", "worker", "ps", "evaluator")


def test_parse_tf_config() -> None:
    task = parse_tf_config(tf_config(task={"type": "worker", "index": 1}))
    assert task.task_type == "worker"
    assert task.task_index == 1
    assert task.address == "host2:2222"
    assert task.port == 2222
    cluster = task.cluster
    assert cluster.chief == "host0:2222"
    assert cluster.evaluator is None
    assert cluster.workers == ("host1:2222", "host2:2222")
    assert cluster.ps == ("host3:2222",)
    assert cluster.num_workers == 2
    assert cluster.num_ps == 1


def test_stable_order_and_views() -> None:
    cluster = parse_cluster(
        {
            "evaluator": ["e:1"],
            "worker": ["w0:1", "w1:1"],
            "ps": ["p0:1", "p1:1"],
            "chief": ["c:1"],
        },
        source="x",
    )
    assert list(cluster.jobs) == ["chief", "ps", "worker", "evaluator"]
    assert cluster.tasks() == [
        ("chief", 0, "c:1"),
        ("ps", 0, "p0:1"),
        ("ps", 1, "p1:1"),
        ("worker", 0, "w0:1"),
        ("worker", 1, "w1:1"),
        ("evaluator", 0, "e:1"),
    ]
    assert cluster.as_dict() == {
        "chief": ["c:1"],
        "ps": ["p0:1", "p1:1"],
        "worker": ["w0:1", "w1:1"],
        "evaluator": ["e:1"],
    }
    assert list(cluster.as_dict()) == ["chief", "ps", "worker", "evaluator"]
    assert cluster.evaluator == "e:1"
    assert cluster.address("ps", 1) == "p1:1"


def test_empty_jobs_are_dropped() -> None:
    cluster = parse_cluster({"chief": [], "ps": ["p:1"], "worker": ["w:1"]}, source="x")
    assert cluster.chief is None
    assert "chief" not in cluster.jobs
    assert "chief" not in cluster.as_dict()


def test_extra_top_level_keys_are_ignored() -> None:
    text = tf_config(environment="cloud", rpc_layer="grpc")
    assert parse_tf_config(text).cluster.num_workers == 2


def test_tf_config_round_trip() -> None:
    task = parse_tf_config(tf_config(task={"type": "ps", "index": 0}))
    again = parse_tf_config(task.tf_config())
    assert again == task
    decoded = json.loads(task.tf_config())
    assert decoded["task"] == {"type": "ps", "index": 0}
    assert decoded["cluster"] == task.cluster.as_dict()


def test_cluster_is_hashable_and_comparable() -> None:
    a = parse_cluster({"cluster": CLUSTER}, source="a")
    b = parse_cluster(CLUSTER, source="b")
    assert a == b
    assert hash(a) == hash(b)
    assert {a, b} == {a}


def test_cluster_config_normalises_direct_construction() -> None:
    cluster = ClusterConfig({"worker": ("w:1",), "ps": ("p:1",), "chief": ()})
    assert list(cluster.jobs) == ["ps", "worker"]
    with pytest.raises(ValueError, match="master"):
        ClusterConfig({"master": ("m:1",)})


def test_parse_cluster_json_wrapped_and_bare() -> None:
    wrapped = parse_cluster_json(tf_config(), source="TF_CONFIG")
    bare = parse_cluster_json(json.dumps(CLUSTER), source="cluster.json")
    assert wrapped == bare


def test_cluster_file_task_is_ignored(tmp_path: Path) -> None:
    path = write(tmp_path, {"cluster": CLUSTER, "task": "garbage"})
    assert load_cluster_file(path).num_workers == 2
    assert load_cluster_file(str(path)) == load_cluster_file(path)


def test_bare_cluster_file(tmp_path: Path) -> None:
    assert load_cluster_file(write(tmp_path, CLUSTER)).num_ps == 1


def test_with_chief() -> None:
    cluster = parse_cluster({"ps": ["p:1"], "worker": ["w:1"]}, source="x")
    with_chief = cluster.with_chief("c:1")
    assert with_chief.chief == "c:1"
    assert list(with_chief.jobs) == ["chief", "ps", "worker"]
    assert cluster.chief is None  # the original is unchanged
    assert with_chief.with_chief("c:2").chief == "c:2"
    assert with_chief.with_chief("c:1") == with_chief


def test_with_chief_rejects_bad_or_taken_address() -> None:
    cluster = parse_cluster({"ps": ["p:1"], "worker": ["w:1"]}, source="x")
    err = config_error(cluster.with_chief, "c")
    assert err.field == "cluster.chief[0]"
    err = config_error(cluster.with_chief, "W:1")
    assert "cluster.worker[0]" in err.problem


def test_require_chief() -> None:
    cluster = parse_cluster(CLUSTER, source="x")
    assert require_chief(cluster, source="x") == "host0:2222"
    no_chief = parse_cluster({"ps": ["p:1"], "worker": ["w:1"]}, source="c.json")
    err = config_error(require_chief, no_chief, source="c.json")
    assert err.field == "c.json: cluster.chief"
    err = config_error(require_chief, no_chief, source="TF_CONFIG")
    assert err.field == "TF_CONFIG.cluster.chief"


def test_format_table() -> None:
    cluster = parse_cluster(
        {"chief": ["c:1"], "ps": ["p:1"], "worker": ["w0:1", "w1:1"], "evaluator": ["e:1"]},
        source="x",
    )
    table = format_table(cluster, source="cluster.json")
    lines = table.splitlines()
    assert lines[0] == "cluster from cluster.json: 1 chief, 1 ps, 2 workers, 1 evaluator"
    assert lines[1].split() == ["TYPE", "INDEX", "ADDRESS"]
    for _, _, address in cluster.tasks():
        assert address in table
    assert [line.split() for line in lines[2:]] == [[t, str(i), a] for t, i, a in cluster.tasks()]
    # Columns line up: every ADDRESS starts in the same column.
    starts = {line.index(line.split()[2]) for line in lines[1:]}
    assert len(starts) == 1


def test_format_table_plurals() -> None:
    cluster = parse_cluster({"ps": ["p0:1", "p1:1"], "worker": ["w:1"]}, source="x")
    assert format_table(cluster, source="TF_CONFIG").splitlines()[0] == (
        "cluster from TF_CONFIG: 2 ps, 1 worker"
    )


@pytest.mark.parametrize(
    ("address", "host", "port"),
    [
        ("localhost:2222", "localhost", 2222),
        ("10.0.0.5:1", "10.0.0.5", 1),
        ("host-1.example.com:65535", "host-1.example.com", 65535),
        ("[::1]:2222", "::1", 2222),
        ("[fe80::1%eth0]:2222", "fe80::1%eth0", 2222),
        ("ps_0.svc:2222", "ps_0.svc", 2222),
    ],
)
def test_split_host_port(address: str, host: str, port: int) -> None:
    assert split_host_port(address, field="f") == (host, port)
    parsed = Address.parse(address, field="f")
    assert (parsed.host, parsed.port) == (host, port)
    assert str(parsed) == address  # IPv6 back in brackets


def test_address_with_port_keeps_ipv6_brackets() -> None:
    assert str(Address("::1", 2222).with_port(3222)) == "[::1]:3222"
    assert str(Address("h", 1).with_port(2)) == "h:2"


def test_address_parse_errors_are_split_host_port_errors() -> None:
    err = config_error(Address.parse, "::1:2222", field="--addr")
    assert err.field == "--addr"
    assert "unbracketed IPv6" in err.problem
    assert Address.parse("h:0", field="f", allow_port_zero=True).port == 0


# --- parsed task addresses --------------------------------------------------------------


def test_task_addresses_are_parsed_once_in_task_order() -> None:
    cluster = parse_cluster(
        {"chief": ["c:1"], "ps": ["[::1]:2"], "worker": ["W0:3", "w1:4"]}, source="x"
    )
    assert cluster.task_addresses() == [
        ("chief", 0, Address("c", 1)),
        ("ps", 0, Address("::1", 2)),
        ("worker", 0, Address("W0", 3)),
        ("worker", 1, Address("w1", 4)),
    ]
    assert [(t, i) for t, i, _ in cluster.task_addresses()] == [
        (t, i) for t, i, _ in cluster.tasks()
    ]
    assert cluster.task_address("ps", 0) == Address("::1", 2)
    task = TaskConfig(cluster, "worker", 1)
    assert task.task_address == Address("w1", 4)
    assert task.port == 4


def test_direct_construction_parses_too() -> None:
    cluster = ClusterConfig({"ps": ("p:1",), "worker": ("w:2",)})
    assert cluster.task_address("worker", 0) == Address("w", 2)
    err = config_error(ClusterConfig, {"ps": ("p",), "worker": ("w:2",)})
    assert err.field == "cluster.ps[0]"


def test_with_chief_parses_the_chief() -> None:
    cluster = parse_cluster({"ps": ["p:1"], "worker": ["w:1"]}, source="x").with_chief("[::1]:9")
    assert cluster.task_address("chief", 0) == Address("::1", 9)
    assert cluster.task_addresses()[1:] == [
        ("ps", 0, Address("p", 1)),
        ("worker", 0, Address("w", 1)),
    ]


def test_task_address_lookup_errors_match_address() -> None:
    cluster = parse_cluster(CLUSTER, source="x")
    for task_type, index in (("evaluator", 0), ("worker", 2), ("ps", True)):
        a = config_error(cluster.address, task_type, index)
        b = config_error(cluster.task_address, task_type, index)
        assert str(a) == str(b)


# --- resolve_task / resolve_cluster ------------------------------------------------------


def test_resolve_task_from_tf_config() -> None:
    environ = {"TF_CONFIG": tf_config(task={"type": "ps", "index": 0})}
    task = resolve_task(cluster_file=None, task_type=None, task_index=None, environ=environ)
    assert (task.task_type, task.task_index, task.address) == ("ps", 0, "host3:2222")


def test_resolve_task_cluster_file_wins(tmp_path: Path) -> None:
    path = write(tmp_path, CLUSTER)
    environ = {"TF_CONFIG": tf_config(task={"type": "ps", "index": 0})}
    task = resolve_task(cluster_file=str(path), task_type="worker", task_index=1, environ=environ)
    assert (task.task_type, task.task_index, task.address) == ("worker", 1, "host2:2222")


def test_resolve_task_default_type(tmp_path: Path) -> None:
    path = write(tmp_path, CLUSTER)
    task = resolve_task(
        cluster_file=str(path), task_type=None, task_index=0, environ={}, default_type="ps"
    )
    assert task.task_type == "ps"
    # A type with one task needs no --index.
    task = resolve_task(
        cluster_file=str(path), task_type=None, task_index=None, environ={}, default_type="ps"
    )
    assert task.task_index == 0


def test_resolve_task_needs_index_when_ambiguous(tmp_path: Path) -> None:
    path = write(tmp_path, CLUSTER)
    err = config_error(
        resolve_task, cluster_file=str(path), task_type="worker", task_index=None, environ={}
    )
    assert err.field == "--index"
    assert "0..1" in err.fix


def test_resolve_task_needs_type(tmp_path: Path) -> None:
    path = write(tmp_path, CLUSTER)
    err = config_error(
        resolve_task, cluster_file=str(path), task_type=None, task_index=0, environ={}
    )
    assert err.field == "--type"


@pytest.mark.parametrize(
    ("task_type", "task_index", "needle"),
    [
        ("master", 0, "chief"),
        ("boss", 0, "chief, worker, ps, evaluator"),
        ("evaluator", 0, "chief, ps, worker"),
    ],
)
def test_resolve_task_bad_type(
    tmp_path: Path, task_type: str, task_index: int, needle: str
) -> None:
    path = write(tmp_path, CLUSTER)
    err = config_error(
        resolve_task, cluster_file=str(path), task_type=task_type, task_index=task_index, environ={}
    )
    assert err.field == "--type"
    assert needle in err.fix


@pytest.mark.parametrize("index", [-1, 2, 99])
def test_resolve_task_index_out_of_range(tmp_path: Path, index: int) -> None:
    path = write(tmp_path, CLUSTER)
    err = config_error(
        resolve_task, cluster_file=str(path), task_type="worker", task_index=index, environ={}
    )
    assert err.field == "--index"
    assert "0..1" in err.fix


def test_resolve_task_neither() -> None:
    for environ in ({}, {"TF_CONFIG": ""}, {"TF_CONFIG": "  \n"}):
        err = config_error(
            resolve_task, cluster_file=None, task_type=None, task_index=None, environ=environ
        )
        assert err.field == "TF_CONFIG"
        assert "TF_CONFIG" in err.fix and "--cluster FILE --index I" in err.fix


def test_resolve_task_flags_without_cluster() -> None:
    environ = {"TF_CONFIG": tf_config()}
    err = config_error(
        resolve_task, cluster_file=None, task_type=None, task_index=1, environ=environ
    )
    assert err.field == "--index"
    assert "--cluster" in err.fix


def test_resolve_task_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    err = config_error(
        resolve_task, cluster_file=str(path), task_type="ps", task_index=0, environ={}
    )
    assert err.field == str(path)


def test_resolve_cluster(tmp_path: Path) -> None:
    path = write(tmp_path, CLUSTER)
    cluster, source = resolve_cluster(cluster_file=str(path), environ={})
    assert cluster.num_workers == 2 and source == str(path)
    environ = {"TF_CONFIG": json.dumps({"cluster": CLUSTER})}  # no task needed
    cluster, source = resolve_cluster(cluster_file=None, environ=environ)
    assert cluster.num_ps == 1 and source == "TF_CONFIG"
    err = config_error(resolve_cluster, cluster_file=None, environ={})
    assert err.field == "TF_CONFIG"
    # TF_CONFIG must wrap its cluster in "cluster".
    err = config_error(
        resolve_cluster, cluster_file=None, environ={"TF_CONFIG": json.dumps(CLUSTER)}
    )
    assert err.field == "TF_CONFIG.cluster"


# --- errors: JSON and top level ----------------------------------------------------------


def test_malformed_json_names_position() -> None:
    err = config_error(parse_tf_config, '{"cluster": {"ps": ["a:1",]}}')
    assert err.field == "TF_CONFIG"
    assert "line 1 column" in err.problem


def test_malformed_json_multiline_position(tmp_path: Path) -> None:
    path = write(tmp_path, '{\n  "ps": ["a:1"]\n  "worker": ["b:1"]\n}\n')
    err = config_error(load_cluster_file, path)
    assert err.field == str(path)
    assert "line 3 column 3" in err.problem


def test_empty_json() -> None:
    err = config_error(parse_cluster_json, "", source="cluster.json")
    assert err.field == "cluster.json"


def test_duplicate_json_key() -> None:
    err = config_error(parse_cluster_json, '{"ps": ["a:1"], "ps": ["b:1"]}', source="c.json")
    assert err.field == "c.json"
    assert '"ps"' in err.problem


@pytest.mark.parametrize("text", ["[]", '"x"', "1", "null", "true"])
def test_top_level_not_object(text: str) -> None:
    err = config_error(parse_tf_config, text)
    assert err.field == "TF_CONFIG"
    assert "not a JSON object" in err.problem
    err = config_error(parse_cluster_json, text, source="c.json")
    assert err.field == "c.json"


def test_cluster_missing() -> None:
    err = config_error(parse_tf_config, json.dumps({"task": {"type": "ps", "index": 0}}))
    assert err.field == "TF_CONFIG.cluster"
    assert "missing" in err.problem
    err = config_error(parse_cluster_json, "{}", source="c.json")
    assert err.field == "c.json: cluster"
    # A TF_CONFIG may not be a bare mapping.
    err = config_error(parse_tf_config, json.dumps(CLUSTER))
    assert err.field == "TF_CONFIG.cluster"


@pytest.mark.parametrize("value", [[], "ps", 1, None])
def test_cluster_not_object(value: object) -> None:
    err = config_error(parse_tf_config, tf_config(cluster=value))
    assert err.field == "TF_CONFIG.cluster"
    assert "not an object" in err.problem


# --- errors: jobs -------------------------------------------------------------------------


def test_unknown_task_type() -> None:
    err = config_error(parse_tf_config, tf_config(cluster={**CLUSTER, "workers": ["x:1"]}))
    assert err.field == "TF_CONFIG.cluster.workers"
    assert "chief, worker, ps, evaluator" in err.fix


def test_unknown_task_type_in_bare_file(tmp_path: Path) -> None:
    path = write(tmp_path, {**CLUSTER, "pss": ["x:1"]})
    err = config_error(load_cluster_file, path)
    assert err.field == f"{path}: pss"


def test_master_rejected() -> None:
    err = config_error(parse_tf_config, tf_config(cluster={**CLUSTER, "master": ["m:1"]}))
    assert err.field == "TF_CONFIG.cluster.master"
    assert '"chief"' in err.fix


def test_odd_key_is_quoted() -> None:
    err = config_error(parse_cluster_json, json.dumps({"cluster": {"a b": []}}), source="c.json")
    assert err.field == 'c.json: cluster["a b"]'


@pytest.mark.parametrize("value", ["host:1", {"0": "host:1"}, 5, None, True])
def test_job_not_a_list(value: object) -> None:
    err = config_error(parse_tf_config, tf_config(cluster={**CLUSTER, "ps": value}))
    assert err.field == "TF_CONFIG.cluster.ps"
    assert "not a list" in err.problem


@pytest.mark.parametrize("item", [1, None, ["a:1"], {"a": 1}, True])
def test_job_item_not_a_string(item: object) -> None:
    cluster = {**CLUSTER, "worker": ["w:1", item]}
    err = config_error(parse_cluster_json, json.dumps({"cluster": cluster}), source="cluster.json")
    assert err.field == "cluster.json: cluster.worker[1]"
    assert "not a host:port string" in err.problem


@pytest.mark.parametrize("job", ["ps", "worker"])
def test_required_job_missing_or_empty(job: str) -> None:
    missing = {k: v for k, v in CLUSTER.items() if k != job}
    err = config_error(parse_tf_config, tf_config(cluster=missing))
    assert err.field == f"TF_CONFIG.cluster.{job}"
    assert "missing" in err.problem
    err = config_error(parse_tf_config, tf_config(cluster={**CLUSTER, job: []}))
    assert err.field == f"TF_CONFIG.cluster.{job}"
    assert "empty" in err.problem


@pytest.mark.parametrize("job", ["chief", "evaluator"])
def test_at_most_one(job: str) -> None:
    err = config_error(parse_tf_config, tf_config(cluster={**CLUSTER, job: ["a:1", "b:1"]}))
    assert err.field == f"TF_CONFIG.cluster.{job}"
    assert "at most one" in err.problem


@pytest.mark.parametrize(
    ("address", "needle"),
    [
        ("", "empty address"),
        (":2222", "empty host"),
        ("host", "no port"),
        ("host:", "empty port"),
        ("host:abc", "not an integer"),
        ("host:-1", "not an integer"),
        ("host:+1", "not an integer"),
        ("host:1.5", "not an integer"),
        ("host:0", "out of range"),
        ("host:65536", "out of range"),
        ("::1:2222", "unbracketed IPv6"),
        ("[::1]", "no port"),
        ("[::1:2222", "no closing"),
        ("[]:2222", "empty host"),
        ("[host]:2222", "not an IPv6 address"),
        ("grpc://host:2222", "scheme"),
        ("host :2222", "whitespace"),
        ("ho/st:2222", "not a valid host name"),
    ],
)
def test_bad_address(address: str, needle: str) -> None:
    cluster = {**CLUSTER, "ps": ["p:1", address]}
    err = config_error(parse_tf_config, tf_config(cluster=cluster))
    assert err.field == "TF_CONFIG.cluster.ps[1]"
    assert needle in err.problem
    err = config_error(split_host_port, address, field="--addr")
    assert err.field == "--addr"


def test_bad_address_in_file(tmp_path: Path) -> None:
    path = write(tmp_path, {"cluster": {**CLUSTER, "worker": ["w:99999"]}}, name="cluster.json")
    err = config_error(load_cluster_file, path)
    assert err.field == f"{path}: cluster.worker[0]"


def test_bad_address_newline_stays_one_line() -> None:
    cluster = {**CLUSTER, "ps": ["host\n:1"]}
    err = config_error(parse_tf_config, tf_config(cluster=cluster))
    assert err.field == "TF_CONFIG.cluster.ps[0]"


@pytest.mark.parametrize(
    ("cluster", "field", "other"),
    [
        (
            {"ps": ["a:1"], "worker": ["b:1", "a:1"]},
            "TF_CONFIG.cluster.worker[1]",
            "cluster.ps[0]",
        ),
        ({"ps": ["a:1"], "worker": ["b:1", "b:1"]}, "TF_CONFIG.cluster.worker[1]", "worker[0]"),
        (
            {"chief": ["A:1"], "ps": ["a:1"], "worker": ["b:1"]},
            "TF_CONFIG.cluster.ps[0]",
            "chief[0]",
        ),
        (
            {"ps": ["[::1]:5"], "worker": ["b:1"], "evaluator": ["[::1]:5"]},
            "TF_CONFIG.cluster.evaluator[0]",
            "cluster.ps[0]",
        ),
    ],
)
def test_duplicate_address(cluster: dict[str, list[str]], field: str, other: str) -> None:
    err = config_error(parse_tf_config, tf_config(cluster=cluster, task={"type": "ps", "index": 0}))
    assert err.field == field
    assert other in err.problem


def test_same_host_other_port_is_fine() -> None:
    cluster = parse_cluster({"ps": ["a:1"], "worker": ["a:2"]}, source="x")
    assert cluster.tasks() == [("ps", 0, "a:1"), ("worker", 0, "a:2")]


# --- errors: task -------------------------------------------------------------------------


def test_task_missing() -> None:
    err = config_error(parse_tf_config, json.dumps({"cluster": CLUSTER}))
    assert err.field == "TF_CONFIG.task"
    assert "missing" in err.problem


@pytest.mark.parametrize("task", [[], "worker", 0, None])
def test_task_not_object(task: object) -> None:
    text = json.dumps({"cluster": CLUSTER, "task": task})
    err = config_error(parse_tf_config, text)
    assert err.field == "TF_CONFIG.task"
    assert "not an object" in err.problem


def test_task_type_missing() -> None:
    err = config_error(parse_tf_config, tf_config(task={"index": 0}))
    assert err.field == "TF_CONFIG.task.type"
    assert "missing" in err.problem


@pytest.mark.parametrize(
    ("task_type", "needle"),
    [
        ("master", '"chief"'),
        ("boss", "chief, worker, ps, evaluator"),
        (1, "chief, worker, ps, evaluator"),
        (None, "chief, worker, ps, evaluator"),
    ],
)
def test_task_type_bad(task_type: object, needle: str) -> None:
    err = config_error(parse_tf_config, tf_config(task={"type": task_type, "index": 0}))
    assert err.field == "TF_CONFIG.task.type"
    assert needle in err.fix


def test_task_type_not_in_cluster() -> None:
    err = config_error(parse_tf_config, tf_config(task={"type": "evaluator", "index": 0}))
    assert err.field == "TF_CONFIG.task.type"
    assert "no tasks" in err.problem


def test_task_index_missing() -> None:
    err = config_error(parse_tf_config, tf_config(task={"type": "worker"}))
    assert err.field == "TF_CONFIG.task.index"
    assert "0..1" in err.fix


@pytest.mark.parametrize("index", [True, False, "0", 0.0, 1.5, None, [0]])
def test_task_index_not_int(index: object) -> None:
    err = config_error(parse_tf_config, tf_config(task={"type": "worker", "index": index}))
    assert err.field == "TF_CONFIG.task.index"
    assert "not a non-negative integer" in err.problem


@pytest.mark.parametrize(
    ("task_type", "index", "valid"),
    [("worker", 2, "0..1"), ("ps", 1, "0..0 (only 0)"), ("worker", -1, "0..1")],
)
def test_task_index_out_of_range(task_type: str, index: int, valid: str) -> None:
    err = config_error(parse_tf_config, tf_config(task={"type": task_type, "index": index}))
    assert err.field == "TF_CONFIG.task.index"
    assert "out of range" in err.problem
    assert err.fix.endswith(valid)


def test_custom_source_name() -> None:
    err = config_error(parse_tf_config, tf_config(task={"type": "worker", "index": 5}), source="X")
    assert err.field == "X.task.index"


# --- errors: files and direct construction ------------------------------------------------


def test_load_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "missing.json"
    err = config_error(load_cluster_file, path)
    assert err.field == str(path)
    assert "not found" in err.problem


def test_load_directory(tmp_path: Path) -> None:
    err = config_error(load_cluster_file, tmp_path)
    assert err.field == str(tmp_path)


def test_load_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bin.json"
    path.write_bytes(b"\xff\xfe\x00")
    err = config_error(load_cluster_file, path)
    assert err.field == str(path)


def test_address_lookup_errors() -> None:
    cluster = parse_cluster(CLUSTER, source="x")
    err = config_error(cluster.address, "evaluator", 0)
    assert err.field == "cluster.evaluator[0]"
    err = config_error(cluster.address, "worker", 2)
    assert "0..1" in err.fix
    err = config_error(TaskConfig, cluster, "ps", 3)
    assert err.field == "cluster.ps[3]"


# --- fuzzed inputs the parser once let through ----------------------------------------------


@pytest.mark.parametrize(
    ("host", "problem"),
    [
        ("..", "not a valid host name"),
        (".", "not a valid host name"),
        ("a..b", "not a valid host name"),
        (".a", "not a valid host name"),
        ("a.", "not a valid host name"),
        ("-a", "not a valid host name"),
        ("a-", "not a valid host name"),
        ("a" * 64, "not a valid host name"),
        (".".join(["a" * 60] * 5), "longer than 253"),
        ("999.1.1.1", "not a valid IPv4 address"),
        ("01.2.3.4", "not a valid IPv4 address"),
        ("1234", "not a valid IPv4 address"),
        ("ho\u0301st", "not a valid host name"),
    ],
)
def test_bad_host_names(host: str, problem: str) -> None:
    err = config_error(split_host_port, f"{host}:2222", field="--addr")
    assert problem in err.problem


@pytest.mark.parametrize(
    "address", ["host-1.example.com:1", "a_b:1", "10.0.0.1:1", "[fe80::1%eth0]:1", "A:1"]
)
def test_good_host_names(address: str) -> None:
    assert str(Address.parse(address, field="--addr")) == address


def test_ipv6_zone_must_be_an_interface_name() -> None:
    err = config_error(split_host_port, "[fe80::1%..]:1", field="--addr")
    assert "zone" in err.problem


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("[::1]:2222", "[::0001]:2222"),
        ("[::1]:2222", "[0:0:0:0:0:0:0:1]:2222"),
        ("[FE80::1]:2222", "[fe80::1]:2222"),
        ("10.0.0.1:2222", "[::ffff:10.0.0.1]:2222"),
        ("Host.Example:2222", "host.example:2222"),
        ("h:2222", "h:02222"),
    ],
)
def test_one_endpoint_written_two_ways_is_a_duplicate(first: str, second: str) -> None:
    cluster = {"ps": [first], "worker": [second]}
    err = config_error(parse_cluster, {"cluster": cluster}, source="c.json")
    assert err.field == "c.json: cluster.worker[0]"
    assert "also used by cluster.ps[0]" in err.problem


def test_canonical_host() -> None:
    assert canonical_host("::0001") == "::1"
    assert canonical_host("::ffff:10.0.0.1") == "10.0.0.1"
    assert canonical_host("Host") == "host"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ],
)
def test_json_python_cannot_read_is_a_config_error(text: str, problem: str) -> None:
    err = config_error(parse_cluster_json, text, source="c.json")
    assert problem in err.problem


def test_an_integer_of_thousands_of_digits_is_named_by_its_field() -> None:
    """Python's int() refuses it; the check of the field it stands in still names that field."""
    huge = "9" * 5000
    err = config_error(parse_cluster_json, '{"ps": ["a:1"], "worker": [' + huge + "]}", source="c")
    assert err.field == "c: worker[0]" and "an integer of 5000 digits" in err.problem
    err = config_error(
        parse_tf_config, tf_config(task={"type": "worker", "index": 0})[:-3] + huge + "}}"
    )
    assert err.field == "TF_CONFIG.task.index" and "5000 digits is out of range" in err.problem


def test_a_port_of_thousands_of_digits_is_out_of_range() -> None:
    err = config_error(split_host_port, "h:" + "9" * 5000, field="--addr")
    assert "out of range" in err.problem and len(str(err)) < 300


def test_huge_values_are_cut_in_the_error_line() -> None:
    cluster = {"ps": ["x" * 1_000_000 + ":1"], "worker": ["b:1"]}
    err = config_error(parse_cluster, {"cluster": cluster}, source="c.json")
    assert len(str(err)) < 400 and "..." in str(err)
    err = config_error(parse_cluster, {"cluster": {**cluster, "ps": [[[[1] * 10**5]]]}}, source="c")
    assert len(str(err)) < 400


# --- check_config: the cluster and its task -------------------------------------------------


@pytest.mark.parametrize(
    ("task", "field", "problem"),
    [
        ({"index": 0}, "task.type", "is missing"),
        ({"type": "master", "index": 0}, "task.type", "not supported"),
        ({"type": "evaluator", "index": 0}, "task.type", "has no tasks"),
        ({"type": 3, "index": 0}, "task.type", "not a task type"),
        ({"type": "worker"}, "task.index", "is missing"),
        ({"type": "worker", "index": 2}, "task.index", "out of range"),
        ({"type": "worker", "index": -1}, "task.index", "out of range"),
        ({"type": "worker", "index": 1.0}, "task.index", "not a non-negative integer"),
        ({"type": "worker", "index": True}, "task.index", "not a non-negative integer"),
        ("worker", "task", "not an object"),
    ],
)
def test_check_config_checks_the_task(tmp_path: Path, task: object, field: str, problem: str):
    text = json.dumps({"cluster": CLUSTER, "task": task})
    err = config_error(check_config, cluster_file=None, environ={"TF_CONFIG": text})
    assert err.field == f"TF_CONFIG.{field}" and problem in err.problem
    path = write(tmp_path, text)
    err = config_error(check_config, cluster_file=str(path), environ={})
    assert err.field == f"{path}: {field}" and problem in err.problem


def test_check_config_returns_the_task(tmp_path: Path) -> None:
    text = json.dumps({"cluster": CLUSTER, "task": {"type": "worker", "index": 1}})
    cluster, source, task = check_config(cluster_file=None, environ={"TF_CONFIG": text})
    assert source == "TF_CONFIG" and task is not None
    assert (task.task_type, task.task_index, task.address) == ("worker", 1, "host2:2222")
    path = write(tmp_path, CLUSTER)  # bare, no task
    cluster, source, task = check_config(cluster_file=str(path), environ={})
    assert cluster.num_workers == 2 and source == str(path) and task is None


def test_check_config_without_a_cluster_names_its_own_argument() -> None:
    """check-config takes the file as its argument, not as --cluster FILE (it has no such
    flag); the commands that have the flag name it."""
    err = config_error(check_config, cluster_file=None, environ={})
    assert err.field == "TF_CONFIG" and "pass FILE" in err.fix and "--cluster" not in str(err)
    err = config_error(resolve_cluster, cluster_file=None, environ={})
    assert "pass --cluster FILE" in err.fix


@pytest.mark.timeout(60)
def test_check_config_cli_bad_task_is_one_line_78(tmp_path: Path) -> None:
    path = write(tmp_path, {"cluster": CLUSTER, "task": {"type": "ps", "index": 4}})
    proc = subprocess.run(
        psctl_argv("check-config", str(path)),
        capture_output=True,
        text=True,
        timeout=50,
        env=child_env(),
    )
    assert proc.returncode == 78, proc.stderr
    assert proc.stderr.splitlines() == [
        f"psctl: error: {path}: task.index: 4 is out of range for 1 ps; "
        "use an index in 0..0 (only 0)"
    ]
    path = write(tmp_path, {"cluster": CLUSTER, "task": {"type": "ps", "index": 0}})
    proc = subprocess.run(
        psctl_argv("check-config", str(path)), capture_output=True, text=True, timeout=50
    )
    assert proc.returncode == 0 and "task: ps 0 (host3:2222)" in proc.stdout


def test_a_misspelt_key_in_tf_config_is_refused_as_in_a_cluster_file() -> None:
    """TF_CONFIG {"tsak": ...} was read without its task in silence (check-config exit 0)
    while the same JSON as a cluster file was refused."""
    cluster = {"ps": ["h:1"], "worker": ["h:2"]}
    tsak = json.dumps({"cluster": cluster, "tsak": {"type": "ps", "index": 0}})
    indx = json.dumps({"cluster": cluster, "task": {"type": "ps", "indx": 0}})
    for call in (
        lambda: parse_tf_config(tsak),
        lambda: resolve_cluster(cluster_file=None, environ={"TF_CONFIG": tsak}),
        lambda: check_config(cluster_file=None, environ={"TF_CONFIG": tsak}),
        lambda: resolve_task(
            cluster_file=None, task_type=None, task_index=None, environ={"TF_CONFIG": tsak}
        ),
    ):
        with pytest.raises(ConfigError, match=r"^TF_CONFIG.tsak: .*did you mean 'task'\?"):
            call()
    with pytest.raises(ConfigError, match=r"^TF_CONFIG.task.indx: .*did you mean 'index'\?"):
        parse_tf_config(indx)
