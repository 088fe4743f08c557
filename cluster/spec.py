"""The cluster model (ClusterConfig, TaskConfig) and the cluster file: JSON decoding
(duplicate keys and long integers named by their field), validation and display."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass
from typing import Any

from psctl.cluster.address import Address, LongInteger, canonical_host, config_error, kind, show

TASK_TYPES: tuple[str, ...] = ("chief", "worker", "ps", "evaluator")

# The order tasks are listed, stored and shown in.
_ORDER: tuple[str, ...] = ("chief", "ps", "worker", "evaluator")
# Task types that may have at most one task.
_SINGLE: tuple[str, ...] = ("chief", "evaluator")
# Task types every cluster needs.
REQUIRED: tuple[str, ...] = ("ps", "worker")
SYNC_REQUIRED: tuple[str, ...] = ("worker",)  # --strategy sync: all-reduce over the workers

_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
_KEY_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")

_EXAMPLE_TF_CONFIG = (
    '{"cluster": {"chief": ["host0:2222"], "ps": ["host1:2222"], "worker": ["host2:2222"]}, '
    '"task": {"type": "worker", "index": 0}}'
)
ALLOWED_TYPES = ", ".join(TASK_TYPES)  # TASK_TYPES as an error's fix lists them
# The fix where a cluster or a task names TensorFlow 1's "master".
MASTER_FIX = 'use "chief": TensorFlow 2 calls the coordinator\'s task "chief", not "master"'


def field_name(source: str, path: str) -> str:
    """Name a field: ``TF_CONFIG.cluster.ps[1]`` for a variable, ``f.json: cluster.ps[1]`` else."""
    if not path:
        return source
    if not source:
        return path
    if _ENV_NAME.fullmatch(source):
        return f"{source}.{path}"
    return f"{source}: {path}"


def _key_path(parent: str, key: str) -> str:
    step = key if _KEY_NAME.fullmatch(key) else f"[{show(key)}]"
    if not parent:
        return step
    return f"{parent}.{step}" if not step.startswith("[") else f"{parent}{step}"


def _read_integer(digits: str) -> int | LongInteger:
    return int(digits) if len(digits) <= 1000 else LongInteger(digits)


def plural(count: int, task_type: str) -> str:
    """``1 worker``, ``2 workers``; ``ps`` is its own plural."""
    if count == 1 or task_type == "ps":
        return f"{count} {task_type}"
    return f"{count} {task_type}s"


def index_range(count: int) -> str:
    """The indexes of ``count`` tasks, as an error's fix names them."""
    return "0..0 (only 0)" if count == 1 else f"0..{count - 1}"


def _endpoint(address: Address) -> tuple[str, int]:
    """What makes two addresses the same endpoint."""
    return canonical_host(address.host), address.port


def _parse_job(task_type: str, texts: Sequence[str]) -> tuple[Address, ...]:
    return tuple(
        Address.parse(text, field=f"cluster.{task_type}[{index}]")
        for index, text in enumerate(texts)
    )


@dataclass(frozen=True)
class ClusterConfig:
    """A validated cluster: task type -> task addresses, only non-empty types, stable order.

    Every address is parsed once, here: ``task_addresses()`` and ``task_address()`` hand
    out the parsed form; ``jobs`` keeps the text as written (what TensorFlow is given).
    """

    jobs: dict[str, tuple[str, ...]]
    # The parsed addresses when the caller already has them (the validation below).
    parsed: InitVar[Mapping[str, Sequence[Address]] | None] = None
    _addresses: dict[str, tuple[Address, ...]] = dataclasses.field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self, parsed: Mapping[str, Sequence[Address]] | None) -> None:
        unknown = [t for t in self.jobs if t not in _ORDER]
        if unknown:
            raise ValueError(f"unknown task types {unknown}; allowed: {ALLOWED_TYPES}")
        ordered = {t: tuple(self.jobs[t]) for t in _ORDER if self.jobs.get(t)}
        object.__setattr__(self, "jobs", ordered)
        given = parsed or {}
        addresses = {
            task_type: tuple(given.get(task_type) or _parse_job(task_type, texts))
            for task_type, texts in ordered.items()
        }
        object.__setattr__(self, "_addresses", addresses)

    def __hash__(self) -> int:
        return hash(tuple(self.jobs.items()))

    @property
    def ps(self) -> tuple[str, ...]:
        return self.jobs.get("ps", ())

    @property
    def workers(self) -> tuple[str, ...]:
        return self.jobs.get("worker", ())

    @property
    def chief(self) -> str | None:
        chief = self.jobs.get("chief", ())
        return chief[0] if chief else None

    @property
    def evaluator(self) -> str | None:
        evaluator = self.jobs.get("evaluator", ())
        return evaluator[0] if evaluator else None

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def num_ps(self) -> int:
        return len(self.ps)

    def _check_task(self, task_type: str, index: int) -> None:
        """ConfigError if the cluster has no such task."""
        field = f"cluster.{task_type}[{index}]"
        addresses = self.jobs.get(task_type, ())
        if not addresses:
            raise config_error(
                field,
                f"the cluster has no {task_type} task",
                f"use one of the task types it has: {', '.join(self.jobs)}",
            )
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(addresses):
            raise config_error(
                field,
                f"index {show(index)} is out of range for {plural(len(addresses), task_type)}",
                f"use an index in {index_range(len(addresses))}",
            )

    def address(self, task_type: str, index: int) -> str:
        """The address of one task, as written; ConfigError if the cluster has no such task."""
        self._check_task(task_type, index)
        return self.jobs[task_type][index]

    def task_address(self, task_type: str, index: int) -> Address:
        """The parsed address of one task; ConfigError if the cluster has no such task."""
        self._check_task(task_type, index)
        return self._addresses[task_type][index]

    def tasks(self) -> list[tuple[str, int, str]]:
        """Every task as (type, index, address), chief, ps, worker, evaluator in order."""
        return [
            (task_type, index, address)
            for task_type, addresses in self.jobs.items()
            for index, address in enumerate(addresses)
        ]

    def task_addresses(self) -> list[tuple[str, int, Address]]:
        """Every task as (type, index, parsed address), in the order of ``tasks()``."""
        return [
            (task_type, index, address)
            for task_type, addresses in self._addresses.items()
            for index, address in enumerate(addresses)
        ]

    def as_dict(self) -> dict[str, list[str]]:
        """The cluster in the dict form of ``tf.train.ClusterSpec`` and TF_CONFIG's cluster."""
        return {task_type: list(addresses) for task_type, addresses in self.jobs.items()}

    def with_chief(self, address: str) -> ClusterConfig:
        """This cluster with its chief set (added or replaced) to ``address``."""
        field = "cluster.chief[0]"
        chief = Address.parse(address, field=field)
        for task_type, index, other in self.task_addresses():
            if task_type != "chief" and _endpoint(other) == _endpoint(chief):
                raise config_error(
                    field,
                    f"address {show(address)} is also used by cluster.{task_type}[{index}]",
                    "give the chief its own host:port",
                )
        jobs = dict(self.jobs)
        jobs["chief"] = (address,)
        return ClusterConfig(jobs, {**self._addresses, "chief": (chief,)})


@dataclass(frozen=True)
class TaskConfig:
    """One task of a cluster: what a server or the coordinator runs as."""

    cluster: ClusterConfig
    task_type: str
    task_index: int

    def __post_init__(self) -> None:
        self.cluster.address(self.task_type, self.task_index)

    @property
    def address(self) -> str:
        return self.cluster.address(self.task_type, self.task_index)

    @property
    def task_address(self) -> Address:
        return self.cluster.task_address(self.task_type, self.task_index)

    @property
    def port(self) -> int:
        return self.task_address.port

    def tf_config(self) -> str:
        """This task's TF_CONFIG, as a JSON string."""
        return json.dumps(
            {
                "cluster": self.cluster.as_dict(),
                "task": {"type": self.task_type, "index": self.task_index},
            }
        )


class _DuplicateKeyError(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKeyError(key)
        result[key] = value
    return result


def decode_json(text: str, source: str) -> object:
    """``text`` decoded, or a ConfigError naming ``source`` (not JSON, a key twice); an
    integer of over 1000 digits decodes as a LongInteger, for its field's check to name."""
    if not isinstance(text, str):
        raise config_error(source, f"is {kind(text)}, not JSON text", "give a JSON object")
    if not text.strip():
        raise config_error(source, "is empty", f"give a JSON object like {_EXAMPLE_TF_CONFIG}")
    try:
        return json.loads(text, object_pairs_hook=_pairs_hook, parse_int=_read_integer)
    except json.JSONDecodeError as e:
        raise config_error(
            source,
            f"is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} (char {e.pos})",
            "fix the JSON syntax",
        ) from None
    except _DuplicateKeyError as e:
        raise config_error(
            source,
            f"a JSON object has the key {show(e.key)} twice",
            "give each key once",
        ) from None
    except RecursionError:
        raise config_error(
            source, "is nested too deeply to read", "give a flat cluster: type -> address list"
        ) from None
    except ValueError:  # an integer of thousands of digits (sys.get_int_max_str_digits)
        raise config_error(
            source, "holds a number too long to read", "use integers of a few digits"
        ) from None


def top_object(obj: object, source: str) -> Mapping[str, object]:
    """``obj`` if it is a JSON object, else a ConfigError showing a TF_CONFIG to copy."""
    if not isinstance(obj, Mapping):
        raise config_error(
            source,
            f"the top level is {kind(obj)}, not a JSON object",
            f"give a JSON object like {_EXAMPLE_TF_CONFIG}",
        )
    return obj


def object_member(
    top: Mapping[str, object], key: str, source: str, *, add: str, rewrite: str
) -> Mapping[str, object]:
    """``top[key]``, a JSON object; the fix is ``add`` when it is missing, else ``rewrite``."""
    field = field_name(source, key)
    if key not in top:
        raise config_error(field, "is missing", add)
    member = top[key]
    if not isinstance(member, Mapping):
        raise config_error(field, f"is {kind(member)}, not an object", rewrite)
    return member


# What psctl reads at the top of a cluster file or TF_CONFIG; TF_CONFIG's "environment" and
# "rpc_layer" too (TensorFlow's). Other keys (a platform's own) are left alone.
TOP_KEYS = ("cluster", "task", "health", "data_service", "environment", "rpc_layer")


def check_misspelt_keys(
    section: Mapping[str, object], known: Sequence[str], source: str, prefix: str
) -> None:
    """A key close to one psctl reads is a misspelling that would be ignored in silence
    ("tsak", "helth", "indx"): one line naming it."""
    import difflib

    for key in section:
        if key in known or not isinstance(key, str):
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
        if close:
            raise config_error(
                field_name(source, f"{prefix}{key}"),
                f"is not a key psctl reads (did you mean {close[0]!r}?)",
                f"rename it {close[0]!r}, or remove it",
            )


def wrapped_cluster(
    top: Mapping[str, object], source: str, required: tuple[str, ...] = REQUIRED
) -> ClusterConfig:
    """The cluster of ``{"cluster": {...}, ...}`` (a cluster file or TF_CONFIG), whose keys
    close to ones psctl reads are refused as misspellings."""
    check_misspelt_keys(top, TOP_KEYS, source, "")
    task = top.get("task")
    if isinstance(task, Mapping):
        check_misspelt_keys(task, ("type", "index"), source, "task.")
    section = object_member(
        top,
        "cluster",
        source,
        add='add "cluster": {"ps": ["host:port", ...], "worker": ["host:port", ...]}',
        rewrite='make it an object like {"ps": ["host:port"], "worker": ["host:port"]}',
    )
    return _validate_jobs(section, source, "cluster", required)


def _validate_jobs(
    section: Mapping[str, object],
    source: str,
    prefix: str,
    required: tuple[str, ...] = REQUIRED,
) -> ClusterConfig:
    """Validate a mapping of task type -> address list; ``prefix`` is its path in the source."""
    for key in section:
        if key not in TASK_TYPES:
            field = field_name(source, _key_path(prefix, str(key)))
            if key == "master":
                raise config_error(field, 'task type "master" is not supported', MASTER_FIX)
            raise config_error(
                field, f"unknown task type {show(key)}", f"use one of {ALLOWED_TYPES}"
            )

    jobs: dict[str, tuple[str, ...]] = {}
    parsed: dict[str, tuple[Address, ...]] = {}
    seen: dict[tuple[str, int], str] = {}
    for task_type in _ORDER:
        if task_type not in section:
            continue
        value = section[task_type]
        job_path = _key_path(prefix, task_type)
        job_field = field_name(source, job_path)
        if isinstance(value, str):
            raise config_error(
                job_field,
                f"is a string ({show(value)}), not a list of addresses",
                f'write a list: "{task_type}": [{show(value)}]',
            )
        if not isinstance(value, (list, tuple)):
            raise config_error(
                job_field,
                f"is {kind(value)}, not a list of addresses",
                f'write a list of "host:port" strings: "{task_type}": ["host:2222"]',
            )
        if task_type in _SINGLE and len(value) > 1:
            raise config_error(
                job_field,
                f"has {len(value)} {task_type} tasks; a cluster has at most one",
                f"keep a single {task_type} address",
            )
        addresses: list[str] = []
        parsed_addresses: list[Address] = []
        for index, address in enumerate(value):
            task_path = f"{job_path}[{index}]"
            task_field = field_name(source, task_path)
            if not isinstance(address, str):
                raise config_error(
                    task_field,
                    f"is {kind(address)} ({show(address)}), not a host:port string",
                    'write the address as a string, e.g. "10.0.0.5:2222"',
                )
            parsed_address = Address.parse(address, field=task_field)
            endpoint = _endpoint(parsed_address)
            if endpoint in seen:
                raise config_error(
                    task_field,
                    f"address {show(address)} is also used by {seen[endpoint]}",
                    "give every task its own host:port",
                )
            seen[endpoint] = task_path
            addresses.append(address)
            parsed_addresses.append(parsed_address)
        if addresses:
            jobs[task_type] = tuple(addresses)
            parsed[task_type] = tuple(parsed_addresses)

    for task_type in required:
        if task_type not in jobs:
            field = field_name(source, _key_path(prefix, task_type))
            problem = "is empty" if task_type in section else "is missing"
            raise config_error(
                field,
                f"{problem}: a parameter-server cluster needs at least one {task_type} task",
                f'add "{task_type}": ["host:port"]',
            )
    return ClusterConfig(jobs, parsed)


def parse_cluster(
    obj: object, *, source: str, required: tuple[str, ...] = REQUIRED
) -> ClusterConfig:
    """Validate decoded JSON: ``{"cluster": {...}, ...}`` or a bare ``{"ps": [...], ...}``."""
    top = top_object(obj, source)
    if "cluster" in top:
        return wrapped_cluster(top, source, required)
    if any(key in TASK_TYPES or key == "master" for key in top):
        return _validate_jobs(top, source, "", required)
    raise config_error(
        field_name(source, "cluster"),
        "is missing",
        'give {"cluster": {"ps": ["host:port"], "worker": ["host:port"], ...}} '
        f"or a bare mapping of task types ({ALLOWED_TYPES}) to address lists",
    )


def parse_cluster_json(
    text: str, *, source: str, required: tuple[str, ...] = REQUIRED
) -> ClusterConfig:
    """Parse a whole TF_CONFIG or cluster file, wrapped in ``"cluster"`` or bare."""
    return parse_cluster(decode_json(text, source), source=source, required=required)


def load_cluster_file(
    path: str | os.PathLike[str], *, required: tuple[str, ...] = REQUIRED
) -> ClusterConfig:
    """Read and validate a cluster file (its ``"task"``, if any, is ignored); ``required``:
    the task types it must have (SYNC_REQUIRED: workers only)."""
    source = os.fspath(path)
    return parse_cluster_json(read_cluster_file(source), source=source, required=required)


def read_cluster_file(source: str) -> str:
    """The cluster file's text, or a ConfigError: not found, a directory, unreadable, not UTF-8."""
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise config_error(
            source, "cluster file not found", "check the cluster file's path (or set TF_CONFIG)"
        ) from None
    except IsADirectoryError:
        raise config_error(
            source, "is a directory, not a cluster file", "pass the JSON file's path"
        ) from None
    except OSError as e:
        raise config_error(
            source,
            f"cannot read the cluster file: {e.strerror or e}",
            "check the path and its permissions",
        ) from None
    except UnicodeDecodeError as e:
        raise config_error(
            source, f"is not UTF-8 text ({e.reason} at byte {e.start})", "save it as UTF-8 JSON"
        ) from None
    return text


def require_chief(cluster: ClusterConfig, *, source: str) -> str:
    """The chief's address, or a ConfigError saying to add one."""
    if cluster.chief is None:
        raise config_error(
            field_name(source, "cluster.chief"),
            "is missing: the coordinator runs as the chief task",
            'add "chief": ["host:port"] to the cluster',
        )
    return cluster.chief


def summary(cluster: ClusterConfig, *, source: str) -> str:
    """One line, e.g. ``cluster from FILE: 1 chief, 1 ps, 2 workers``."""
    counts = ", ".join(plural(len(a), t) for t, a in cluster.jobs.items())
    return f"cluster from {source}: {counts}"


def format_table(cluster: ClusterConfig, *, source: str) -> str:
    """A summary line, then an aligned TYPE INDEX ADDRESS table of every task."""
    rows = [("TYPE", "INDEX", "ADDRESS")]
    rows += [(t, str(i), a) for t, i, a in cluster.tasks()]
    type_width = max(len(r[0]) for r in rows)
    index_width = max(len(r[1]) for r in rows)
    lines = [summary(cluster, source=source)]
    lines += [f"{t:<{type_width}}  {i:<{index_width}}  {a}" for t, i, a in rows]
    return "\n".join(lines)
