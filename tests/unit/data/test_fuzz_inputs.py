"""Property-based tests of every parser of user input (hypothesis): whatever it is given,
the cluster parser, the settings layers, the CSV check and `psctl deploy render` either
accept it or raise one ConfigError (one line, exit status 78), never another exception; and
what they accept holds up: a cluster has no endpoint twice, settings fit the Control API, an
accepted CSV file is read by TensorFlow, render writes only under --out."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from psctl.cluster.address import Address, canonical_host
from psctl.cluster.errors import ConfigError
from psctl.cluster.spec import TASK_TYPES, ClusterConfig, parse_cluster, parse_cluster_json
from psctl.cluster.tf_config import check_config
from psctl.control.v1 import control_pb2
from psctl.coordinator.data import readers as data
from psctl.coordinator.data.context import DataContext
from psctl.coordinator.deploy.render import render
from psctl.coordinator.settings import (
    DURATIONS,
    SETTING_TYPES,
    TrainSettings,
    env_name,
    resolve_settings,
)

pytestmark = pytest.mark.timeout(120)
# OUT's own files beside the host directories: the index README, the Prometheus targets.
OUT_FILES = {"README.md", "prometheus.yml"} | {
    f"prometheus-{role}.json" for role in ("coordinator", "ps", "worker")
}


def fuzz(examples: int) -> Any:
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


def check_error(err: ConfigError) -> None:
    """What every ConfigError must be: one short line, exit status 78."""
    event("ConfigError")
    text = str(err)
    assert "\n" not in text and "\r" not in text, text
    assert len(text) < 1000, text[:300]
    assert err.exit_status == 78


# -- the cluster parser (cluster files, TF_CONFIG, psctl check-config) -------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=12,
)
hosts = st.one_of(
    st.text(max_size=10),
    st.from_regex(r"[a-zA-Z0-9_.\-]{1,12}", fullmatch=True),
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(lambda ip: f"[{ip}]"),
    st.sampled_from(["..", ".", "a..b", "::1", "[::1]", "[::0001]", "[fe80::1%eth0]"]),
    st.sampled_from(["[::ffff:10.0.0.1]", "10.0.0.1", "Host", "host", "999.1.1.1", "[::1%..]"]),
)
ports = st.one_of(
    st.integers(-3, 70_000).map(str), st.text(max_size=5), st.sampled_from(["02222", "2222"])
)
addresses = st.one_of(
    st.text(max_size=16), st.builds(lambda host, port: f"{host}:{port}", hosts, ports)
)
jobs = st.dictionaries(
    st.sampled_from([*TASK_TYPES, "master", "pss"]),
    st.one_of(st.lists(addresses, max_size=4), json_values),
    max_size=5,
)
tasks = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {},
        optional={
            "type": st.one_of(st.sampled_from(TASK_TYPES), json_values),
            "index": st.one_of(st.integers(-2, 4), json_values),
        },
    ),
)
# Well-formed addresses, for clusters that get past the first checks.
good_addresses = st.builds(
    lambda host, port: f"{host}:{port}",
    st.one_of(
        st.from_regex(r"[a-z0-9]([a-z0-9-]{0,4}[a-z0-9])?(\.[a-z0-9]{1,3}){0,2}", fullmatch=True),
        st.ip_addresses(v=4).map(str),
        st.ip_addresses(v=6).map(lambda ip: f"[{ip}]"),
        st.sampled_from(["Host", "host", "[::1]", "[::0001]", "[::ffff:10.0.0.1]", "10.0.0.1"]),
    ),
    st.one_of(st.integers(1, 65535), st.sampled_from([2222, 2223])),
)
good_jobs = st.fixed_dictionaries(
    {
        "ps": st.lists(good_addresses, min_size=1, max_size=2),
        "worker": st.lists(good_addresses, min_size=1, max_size=3),
    },
    optional={
        "chief": st.lists(good_addresses, min_size=1, max_size=1),
        "evaluator": st.lists(good_addresses, max_size=1),
    },
)
documents = st.one_of(
    json_values,
    jobs,
    good_jobs,
    st.builds(lambda cluster, task: {"cluster": cluster, "task": task}, good_jobs, tasks),
    st.builds(lambda cluster: {"cluster": cluster}, jobs),
    st.builds(lambda cluster, task: {"cluster": cluster, "task": task}, jobs, tasks),
)


def check_cluster(cluster: ClusterConfig) -> None:
    """An accepted cluster: every address reads back the same, no endpoint twice."""
    event("accepted")
    endpoints = set()
    for _, _, address in cluster.task_addresses():
        assert Address.parse(str(address), field="x") == address
        endpoints.add((canonical_host(address.host), address.port))
    assert len(endpoints) == len(cluster.tasks())
    assert cluster.num_ps >= 1 and cluster.num_workers >= 1


@fuzz(200)
@given(st.one_of(st.text(), st.builds(json.dumps, documents)))
def test_cluster_text_is_a_cluster_or_a_config_error(text: str) -> None:
    try:
        check_cluster(parse_cluster_json(text, source="c.json"))
    except ConfigError as err:
        check_error(err)


@fuzz(200)
@given(documents)
def test_cluster_json_and_task_are_checked_or_a_config_error(document: object) -> None:
    try:
        check_cluster(parse_cluster(document, source="c.json"))
    except ConfigError as err:
        check_error(err)
    try:
        cluster, _, task = check_config(
            cluster_file=None, environ={"TF_CONFIG": json.dumps(document)}
        )
    except ConfigError as err:
        check_error(err)
        return
    check_cluster(cluster)
    if task is not None:
        assert 0 <= task.task_index < len(cluster.jobs[task.task_type])


@fuzz(100)
@given(st.one_of(st.binary(max_size=64), st.builds(lambda d: json.dumps(d).encode(), documents)))
def test_cluster_file_bytes_are_a_cluster_or_a_config_error(content: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "cluster.json")
        path.write_bytes(content)
        try:
            check_config(cluster_file=str(path), environ={})
        except ConfigError as err:
            check_error(err)


# -- settings: TOML file < PSCTL_* environment < flags ----------------------------------------

NAMES = list(SETTING_TYPES)
KINDS = SETTING_TYPES
values = st.one_of(
    st.integers(-5, 10),
    st.integers(),
    st.integers(-(2**80), 2**80),
    st.floats(),
    st.booleans(),
    st.text(max_size=8),
    st.sampled_from(["auto", "local", "default", "sync", "async", "1e3", "inf", " 7"]),
    st.lists(st.integers(), max_size=2),
)
env_values = st.one_of(
    st.text(max_size=8),
    st.from_regex(r"[ +\-]?[0-9]{1,25}(\.[0-9]*)?([eE][+-]?[0-9]{1,3})?", fullmatch=True),
    st.sampled_from(["auto", "nan", "inf", "1_000", "\u0661", "local", "sync", "9" * 5000]),
).filter(lambda text: "\0" not in text)


def toml(value: Any) -> str:
    """``value`` as a TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml(v) for v in value) + "]"
    text = "".join(
        f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ch in '"\\\x7f' else ch for ch in str(value)
    )
    return f'"{text}"'


def check_settings(s: TrainSettings) -> None:
    """Accepted settings have their own types and fit the Control API's fields."""
    event("accepted")
    for name, kind in KINDS.items():
        value = s.values()[name]
        assert type(value).__name__ == kind, (name, value)
        if kind == "float":
            assert math.isfinite(value)
    control_pb2.Status(
        global_step=s.loop.steps,
        target_steps=s.loop.steps,
        eval_step=max(s.checkpoints.checkpoint_every, s.evaluation.eval_every),
        steps_per_execution=s.loop.steps_per_execution,
    )


@fuzz(300)
@given(
    table=st.dictionaries(st.sampled_from([*NAMES, "stepz", "batch-size"]), values, max_size=4),
    environ=st.dictionaries(st.sampled_from(NAMES).map(env_name), env_values, max_size=3),
    flags=st.dictionaries(st.sampled_from(NAMES), st.none() | values, max_size=3),
)
def test_settings_are_settings_or_a_config_error(
    table: dict[str, Any], environ: dict[str, str], flags: dict[str, Any]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "job.toml")
        path.write_text("[train]\n" + "".join(f"{k} = {toml(v)}\n" for k, v in table.items()))
        try:
            check_settings(resolve_settings(flags=flags, config_file=str(path), environ=environ))
        except ConfigError as err:
            check_error(err)


@fuzz(200)
@given(
    name=st.sampled_from(NAMES),
    value=st.one_of(
        st.floats(),
        st.booleans(),
        st.text(max_size=5),
        st.integers(),
        st.lists(st.integers(), max_size=1),
    ),
)
def test_toml_values_are_never_coerced(name: str, value: Any) -> None:
    """A TOML value of another type than its setting's is an error; an int for a float is
    the one widening allowed ("auto" is --steps-per-execution's word for 0, and a duration
    may be a string: "30s")."""
    kind = KINDS[name]
    fits = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
    }[kind] or (name == "steps_per_execution" and str(value).strip().lower() == "auto")
    spelt = name in DURATIONS and isinstance(value, str)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "job.toml")
        path.write_text(f"[train]\n{name} = {toml(value)}\n")
        try:
            s = resolve_settings(flags={}, config_file=str(path), environ={})
        except ConfigError as err:
            check_error(err)
            assert fits or err.field == f"{path}: train.{name}", str(err)
            return
    assert fits or spelt, (name, value)
    if not spelt:
        expected = 0 if name == "steps_per_execution" and value == "auto" else value
        assert s.values()[name] == expected


@fuzz(150)
@given(st.one_of(st.text(max_size=60), st.binary(max_size=60).map(bytes.hex)))
def test_any_toml_text_is_settings_or_a_config_error(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "job.toml")
        path.write_text(text, encoding="utf-8", errors="surrogateescape")
        try:
            check_settings(resolve_settings(flags={}, config_file=str(path), environ={}))
        except ConfigError as err:
            check_error(err)


# -- the CSV check ----------------------------------------------------------------------------

numbers = st.from_regex(  # within float32: exponents up to 29
    r"[ \t]?[+-]?([0-9]{1,4}(\.[0-9]{0,3})?|\.[0-9]{1,3})([eE][+-]?[0-2]?[0-9])?[ \t]?",
    fullmatch=True,
)
odd_cells = st.sampled_from(
    [
        *("", "nan", "inf", "-Infinity", "1e39", "1e999", "0x10", "1_0", "\u0661", "\uff11"),
        *("1\xa0", '"1"', '" 1 "', ' "1"', '"1', '""', "1e", ".", "+", "\ufeff1", "\x00", "1\x0b"),
    ]
)
cells = st.one_of(numbers, numbers.map(lambda n: f'"{n}"'), odd_cells, st.text(max_size=3))


@st.composite
def csv_files(draw: Any, *, valid_bias: bool = False) -> bytes:
    """Near-valid CSV: a header with a label column, rows of mostly numbers, mixed line ends."""
    width = draw(st.integers(1, 4))
    header = [f"f{i}" for i in range(width - 1)] + ["label"]
    head = draw(st.sampled_from(["", "", "", "", "\ufeff", " "])) + ",".join(header)
    cell = numbers if (valid_bias or draw(st.booleans())) and draw(st.booleans()) else cells
    rows = draw(st.lists(st.lists(cell, min_size=width, max_size=width).map(",".join), max_size=5))
    if draw(st.integers(0, 9)) == 0:  # a row of another width
        rows.append(",".join(draw(st.lists(cell, max_size=5))))
    odd_endings = ["\r"] if valid_bias else ["\r", "\r", "\n\n"]
    endings = st.sampled_from(["\n", "\n", "\n", "\r\n", "\r\n", *odd_endings])
    text = head
    for row in rows:
        text += draw(endings) + row
    if draw(st.booleans()):
        text += draw(endings)
    return text.encode("utf-8")


def scan(content: bytes, directory: str) -> data.DataFiles | None:
    path = os.path.join(directory, "d.csv")
    with open(path, "wb") as f:
        f.write(content)
    data.clear_cache()
    try:
        return data.inspect_files(path)
    except ConfigError as err:
        check_error(err)
        return None


@fuzz(300)
@given(st.one_of(st.binary(max_size=80), csv_files()))
def test_any_bytes_are_accepted_or_a_config_error(content: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        info = scan(content, tmp)
    if info is not None:
        event("accepted")
        assert info.num_records >= 1 and info.columns[-1] == "label"


@fuzz(30)
@given(csv_files(valid_bias=True))
def test_accepted_csv_files_are_read_by_tensorflow(content: bytes) -> None:
    """What the check accepts, TensorFlow's reader (TextLineDataset + decode_csv) parses:
    every record, finite, the same numbers as the check read."""
    with tempfile.TemporaryDirectory() as tmp:
        info = scan(content, tmp)
        if info is None:
            return
        context = DataContext(
            worker_index=0, num_workers=1, batch_size=64, seed=1, eval_data=info.files[0]
        )
        xs, ys = [], []
        for x, y in data.eval_dataset(context):
            xs.append(x.numpy())
            ys.append(y.numpy())
    x, y = np.concatenate(xs), np.concatenate(ys)
    event("accepted and read")
    assert len(y) == info.num_records
    assert np.isfinite(x).all() and np.isfinite(y).all()
    assert y.min() == np.float32(info.label_min.value)
    assert y.max() == np.float32(info.label_max.value)
    data.clear_cache()


# -- psctl deploy render: files under --out only ----------------------------------------------


@fuzz(80)
@given(st.lists(hosts, min_size=3, max_size=5))
def test_render_writes_under_out_or_raises_a_config_error(names: list[str]) -> None:
    addresses = [f"{host}:{2222 + 10 * i}" for i, host in enumerate(names)]
    body = {"chief": addresses[:1], "ps": addresses[1:2], "worker": addresses[2:]}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp, "base")
        base.mkdir()
        (base / "c.json").write_text(json.dumps({"cluster": body}))
        out = base / "out"
        try:
            plans = render(
                cluster_file=str(base / "c.json"),
                out=out,
                bin_dir="/opt/psctl/venv/bin",
                keys=None,
            )
        except ConfigError as err:
            check_error(err)
            plans = []
        assert os.listdir(tmp) == ["base"]
        written = {p for p in base.rglob("*")} - {base / "c.json", out}
        assert all(p.is_relative_to(out) and not p.is_symlink() for p in written), written
        if plans:
            event("rendered")
            assert {p.name for p in out.iterdir()} == {p.host for p in plans} | OUT_FILES
