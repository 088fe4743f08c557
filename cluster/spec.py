"""Cluster configuration (TF_CONFIG or a cluster file): parsing, validation and display."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass
from typing import Any

from psctl.cluster.errors import ECHO_LIMIT, ConfigError, echo

TASK_TYPES: tuple[str, ...] = ("chief", "worker", "ps", "evaluator")

# The order tasks are listed, stored and shown in.
_ORDER: tuple[str, ...] = ("chief", "ps", "worker", "evaluator")
# Task types that may have at most one task.
_SINGLE: tuple[str, ...] = ("chief", "evaluator")
# Task types every cluster needs.
_REQUIRED: tuple[str, ...] = ("ps", "worker")
SYNC_REQUIRED: tuple[str, ...] = ("worker",)  # --strategy sync: all-reduce over the workers

_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
_KEY_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# A DNS label (underscores allowed, as many internal names have them); a host name is one or
# more of them joined by dots: no empty label, so never "." or "..".
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_NUMERIC_HOST = re.compile(r"[0-9.]*[0-9][0-9.]*")  # digits and dots: must be IPv4
_SCOPE_ID = re.compile(r"[A-Za-z0-9_-]{1,32}")  # an IPv6 zone: an interface name or number
_MAX_HOST = 253

_EXAMPLE_TF_CONFIG = (
    '{"cluster": {"chief": ["host0:2222"], "ps": ["host1:2222"], "worker": ["host2:2222"]}, '
    '"task": {"type": "worker", "index": 0}}'
)
_ALLOWED = ", ".join(TASK_TYPES)
_MASTER_FIX = 'use "chief": TensorFlow 2 calls the coordinator\'s task "chief", not "master"'


def _one_line(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")


def _error(field: str, problem: str, fix: str) -> ConfigError:
    return ConfigError(_one_line(field), _one_line(problem), _one_line(fix))


def _field(source: str, path: str) -> str:
    """Name a field: ``TF_CONFIG.cluster.ps[1]`` for a variable, ``f.json: cluster.ps[1]`` else."""
    if not path:
        return source
    if not source:
        return path
    if _ENV_NAME.fullmatch(source):
        return f"{source}.{path}"
    return f"{source}: {path}"


def _key_path(parent: str, key: str) -> str:
    step = key if _KEY_NAME.fullmatch(key) else f"[{_show(key)}]"
    if not parent:
        return step
    return f"{parent}.{step}" if not step.startswith("[") else f"{parent}{step}"


class _LongInteger:
    """A JSON integer too long for int() (sys.get_int_max_str_digits): decoded as this, so
    the check of the field it is in names that field."""

    def __init__(self, digits: str) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"an integer of {len(self.digits.lstrip('-'))} digits"


def _read_integer(digits: str) -> int | _LongInteger:
    return int(digits) if len(digits) <= 1000 else _LongInteger(digits)


def _kind(value: object) -> str:
    """The JSON kind of a decoded value, with its article."""
    if isinstance(value, _LongInteger):
        return "a number"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, Mapping):
        return "an object"
    return f"a {type(value).__name__}"


def _show(value: object) -> str:
    """A short, one-line rendering of a user's value, as JSON writes it where it can."""
    if isinstance(value, str) and len(value) > ECHO_LIMIT:
        return echo(value)
    if isinstance(value, _LongInteger):
        return repr(value)
    if isinstance(value, (list, dict)) or (isinstance(value, int) and value.bit_length() > 64):
        return echo(value)  # cut before rendering: it may be huge or deeply nested
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return echo(value)
    return text if len(text) <= ECHO_LIMIT else text[: ECHO_LIMIT - 3] + "..."


def _check_host(host: str, *, field: str, shown: str) -> None:
    """ConfigError unless ``host`` is an IPv4 address or a host name (labels joined by dots)."""
    if len(host) > _MAX_HOST:
        problem = f"is longer than {_MAX_HOST} characters"
    elif _NUMERIC_HOST.fullmatch(host):
        try:
            ipaddress.IPv4Address(host)
            return
        except ValueError:
            problem = "is not a valid IPv4 address"
    elif all(_LABEL.fullmatch(label) for label in host.split(".")):
        return
    else:
        problem = "is not a valid host name"
    raise _error(
        field,
        f"address {shown}: {_show(host)} {problem}",
        "use an IP address or a host name: labels of letters, digits, '-' and '_' "
        "(at most 63 each) joined by single dots",
    )


def _plural(count: int, task_type: str) -> str:
    if count == 1 or task_type == "ps":
        return f"{count} {task_type}"
    return f"{count} {task_type}s"


def _index_range(count: int) -> str:
    return "0..0 (only 0)" if count == 1 else f"0..{count - 1}"


def split_host_port(address: str, *, field: str, allow_port_zero: bool = False) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 as ``[::1]:2222``) into host (brackets removed) and port."""
    if not isinstance(address, str):
        raise _error(field, f"is {_kind(address)}, not a host:port string", 'write "host:port"')
    shown = _show(address)
    if not address:
        raise _error(field, "is an empty address", 'write "host:port", e.g. "10.0.0.5:2222"')
    if any(ch.isspace() for ch in address):
        raise _error(field, f"address {shown} contains whitespace", "remove the whitespace")
    if "://" in address:
        raise _error(
            field,
            f"address {shown} has a URL scheme",
            'give a bare "host:port" without "grpc://" or any other scheme',
        )
    if address.startswith("["):
        close = address.find("]")
        if close < 0:
            raise _error(field, f"address {shown} has no closing ']'", 'write IPv6 as "[::1]:2222"')
        host = address[1:close]
        rest = address[close + 1 :]
        if not host:
            raise _error(field, f"address {shown} has an empty host", 'write "[::1]:2222"')
        try:
            scope = ipaddress.IPv6Address(host).scope_id
        except ValueError:
            raise _error(
                field,
                f"address {shown}: {_show(host)} is not an IPv6 address",
                "put only IPv6 addresses in brackets; write hostnames and IPv4 as host:port",
            ) from None
        if scope is not None and not _SCOPE_ID.fullmatch(scope):
            raise _error(
                field,
                f"address {shown}: zone {_show(scope)} is not an interface name",
                'write the zone as an interface name or number, e.g. "[fe80::1%eth0]:2222"',
            )
        if not rest.startswith(":"):
            raise _error(
                field, f"address {shown} has no port", 'write "[host]:port", e.g. "[::1]:2222"'
            )
        port_text = rest[1:]
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep:
            raise _error(
                field,
                f"address {shown} has no port",
                f'write "host:port", e.g. "{address if len(address) <= 40 else "host"}:2222"',
            )
        if ":" in host:
            raise _error(
                field,
                f"address {shown} looks like an unbracketed IPv6 address",
                'put IPv6 hosts in brackets, e.g. "[::1]:2222"',
            )
        if not host:
            raise _error(
                field,
                f"address {shown} has an empty host",
                'write "host:port", e.g. "localhost:2222"',
            )
        _check_host(host, field=field, shown=shown)
    if not port_text:
        raise _error(field, f"address {shown} has an empty port", "give a port number 1..65535")
    if not (port_text.isascii() and port_text.isdigit()):
        raise _error(
            field,
            f"address {shown}: port {_show(port_text)} is not an integer",
            "give a port number 1..65535",
        )
    # int() refuses thousands of digits; past 5 the port is out of range anyway.
    port = int(port_text) if len(port_text.lstrip("0")) <= 5 else 65536
    if not (0 if allow_port_zero else 1) <= port <= 65535:
        number = port if port < 65536 else echo(port_text, limit=12)
        raise _error(
            field, f"address {shown}: port {number} is out of range", "give a port number 1..65535"
        )
    return host, port


@dataclass(frozen=True)
class Address:
    """A parsed ``host:port``: the host without IPv6 brackets, and the port."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str, *, field: str, allow_port_zero: bool = False) -> Address:
        """``split_host_port``'s checks and error lines, as an Address."""
        return cls(*split_host_port(text, field=field, allow_port_zero=allow_port_zero))

    def __str__(self) -> str:
        """``host:port``, an IPv6 host in brackets (``[::1]:2222``)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def with_port(self, port: int) -> Address:
        """The same host on another port (a side port)."""
        return Address(self.host, port)


def canonical_host(host: str) -> str:
    """One spelling per host: host names in lower case (DNS ignores case), IP addresses as
    ``ipaddress`` writes them (``::0001`` -> ``::1``; an IPv4-mapped IPv6 address as IPv4)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host.lower()
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


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
            raise ValueError(f"unknown task types {unknown}; allowed: {_ALLOWED}")
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
            raise _error(
                field,
                f"the cluster has no {task_type} task",
                f"use one of the task types it has: {', '.join(self.jobs)}",
            )
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(addresses):
            raise _error(
                field,
                f"index {_show(index)} is out of range for {_plural(len(addresses), task_type)}",
                f"use an index in {_index_range(len(addresses))}",
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
                raise _error(
                    field,
                    f"address {_show(address)} is also used by cluster.{task_type}[{index}]",
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


def _decode(text: str, source: str) -> object:
    if not isinstance(text, str):
        raise _error(source, f"is {_kind(text)}, not JSON text", "give a JSON object")
    if not text.strip():
        raise _error(source, "is empty", f"give a JSON object like {_EXAMPLE_TF_CONFIG}")
    try:
        return json.loads(text, object_pairs_hook=_pairs_hook, parse_int=_read_integer)
    except json.JSONDecodeError as e:
        raise _error(
            source,
            f"is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} (char {e.pos})",
            "fix the JSON syntax",
        ) from None
    except _DuplicateKeyError as e:
        raise _error(
            source,
            f"a JSON object has the key {_show(e.key)} twice",
            "give each key once",
        ) from None
    except RecursionError:
        raise _error(
            source, "is nested too deeply to read", "give a flat cluster: type -> address list"
        ) from None
    except ValueError:  # an integer of thousands of digits (sys.get_int_max_str_digits)
        raise _error(
            source, "holds a number too long to read", "use integers of a few digits"
        ) from None


def _top_object(obj: object, source: str) -> Mapping[str, object]:
    if not isinstance(obj, Mapping):
        raise _error(
            source,
            f"the top level is {_kind(obj)}, not a JSON object",
            f"give a JSON object like {_EXAMPLE_TF_CONFIG}",
        )
    return obj


def _object_member(
    top: Mapping[str, object], key: str, source: str, *, add: str, rewrite: str
) -> Mapping[str, object]:
    """``top[key]``, a JSON object; the fix is ``add`` when it is missing, else ``rewrite``."""
    field = _field(source, key)
    if key not in top:
        raise _error(field, "is missing", add)
    member = top[key]
    if not isinstance(member, Mapping):
        raise _error(field, f"is {_kind(member)}, not an object", rewrite)
    return member


def _wrapped_cluster(
    top: Mapping[str, object], source: str, required: tuple[str, ...] = _REQUIRED
) -> ClusterConfig:
    """The cluster of ``{"cluster": {...}, ...}``."""
    section = _object_member(
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
    required: tuple[str, ...] = _REQUIRED,
) -> ClusterConfig:
    """Validate a mapping of task type -> address list; ``prefix`` is its path in the source."""
    for key in section:
        if key not in TASK_TYPES:
            field = _field(source, _key_path(prefix, str(key)))
            if key == "master":
                raise _error(field, 'task type "master" is not supported', _MASTER_FIX)
            raise _error(field, f"unknown task type {_show(key)}", f"use one of {_ALLOWED}")

    jobs: dict[str, tuple[str, ...]] = {}
    parsed: dict[str, tuple[Address, ...]] = {}
    seen: dict[tuple[str, int], str] = {}
    for task_type in _ORDER:
        if task_type not in section:
            continue
        value = section[task_type]
        job_path = _key_path(prefix, task_type)
        job_field = _field(source, job_path)
        if isinstance(value, str):
            raise _error(
                job_field,
                f"is a string ({_show(value)}), not a list of addresses",
                f'write a list: "{task_type}": [{_show(value)}]',
            )
        if not isinstance(value, (list, tuple)):
            raise _error(
                job_field,
                f"is {_kind(value)}, not a list of addresses",
                f'write a list of "host:port" strings: "{task_type}": ["host:2222"]',
            )
        if task_type in _SINGLE and len(value) > 1:
            raise _error(
                job_field,
                f"has {len(value)} {task_type} tasks; a cluster has at most one",
                f"keep a single {task_type} address",
            )
        addresses: list[str] = []
        parsed_addresses: list[Address] = []
        for index, address in enumerate(value):
            task_path = f"{job_path}[{index}]"
            task_field = _field(source, task_path)
            if not isinstance(address, str):
                raise _error(
                    task_field,
                    f"is {_kind(address)} ({_show(address)}), not a host:port string",
                    'write the address as a string, e.g. "10.0.0.5:2222"',
                )
            parsed_address = Address.parse(address, field=task_field)
            endpoint = _endpoint(parsed_address)
            if endpoint in seen:
                raise _error(
                    task_field,
                    f"address {_show(address)} is also used by {seen[endpoint]}",
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
            field = _field(source, _key_path(prefix, task_type))
            problem = "is empty" if task_type in section else "is missing"
            raise _error(
                field,
                f"{problem}: a parameter-server cluster needs at least one {task_type} task",
                f'add "{task_type}": ["host:port"]',
            )
    return ClusterConfig(jobs, parsed)


def parse_cluster(
    obj: object, *, source: str, required: tuple[str, ...] = _REQUIRED
) -> ClusterConfig:
    """Validate decoded JSON: ``{"cluster": {...}, ...}`` or a bare ``{"ps": [...], ...}``."""
    top = _top_object(obj, source)
    if "cluster" in top:
        return _wrapped_cluster(top, source, required)
    if any(key in TASK_TYPES or key == "master" for key in top):
        return _validate_jobs(top, source, "", required)
    raise _error(
        _field(source, "cluster"),
        "is missing",
        'give {"cluster": {"ps": ["host:port"], "worker": ["host:port"], ...}} '
        f"or a bare mapping of task types ({_ALLOWED}) to address lists",
    )


def parse_cluster_json(
    text: str, *, source: str, required: tuple[str, ...] = _REQUIRED
) -> ClusterConfig:
    """Parse a whole TF_CONFIG or cluster file, wrapped in ``"cluster"`` or bare."""
    return parse_cluster(_decode(text, source), source=source, required=required)


def load_cluster_file(
    path: str | os.PathLike[str], *, required: tuple[str, ...] = _REQUIRED
) -> ClusterConfig:
    """Read and validate a cluster file (its ``"task"``, if any, is ignored); ``required``:
    the task types it must have (SYNC_REQUIRED: workers only)."""
    source = os.fspath(path)
    return parse_cluster_json(_read_cluster_file(source), source=source, required=required)


def _read_cluster_file(source: str) -> str:
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise _error(
            source, "cluster file not found", "check the --cluster path (or set TF_CONFIG)"
        ) from None
    except IsADirectoryError:
        raise _error(
            source, "is a directory, not a cluster file", "pass the JSON file's path"
        ) from None
    except OSError as e:
        raise _error(
            source,
            f"cannot read the cluster file: {e.strerror or e}",
            "check the path and its permissions",
        ) from None
    except UnicodeDecodeError as e:
        raise _error(
            source, f"is not UTF-8 text ({e.reason} at byte {e.start})", "save it as UTF-8 JSON"
        ) from None
    return text


def _check_task_type(task_type: object, cluster: ClusterConfig, field: str, where: str) -> str:
    if not isinstance(task_type, str):
        raise _error(field, f"is {_kind(task_type)}, not a task type", f"use one of {_ALLOWED}")
    if task_type == "master":
        raise _error(field, 'task type "master" is not supported', _MASTER_FIX)
    if task_type not in TASK_TYPES:
        raise _error(field, f"unknown task type {_show(task_type)}", f"use one of {_ALLOWED}")
    if task_type not in cluster.jobs:
        raise _error(
            field,
            f"task type {_show(task_type)} has no tasks in {where}",
            f"add {task_type} addresses to the cluster or use one of: {', '.join(cluster.jobs)}",
        )
    return task_type


def _check_task_index(
    index: object, cluster: ClusterConfig, task_type: str, field: str, how: str
) -> int:
    count = len(cluster.jobs[task_type])
    if isinstance(index, _LongInteger):
        raise _error(
            field, f"{_show(index)} is out of range", f"{how} an index in {_index_range(count)}"
        )
    if isinstance(index, bool) or not isinstance(index, int):
        raise _error(
            field,
            f"is {_kind(index)} ({_show(index)}), not a non-negative integer",
            f"{how} an integer in {_index_range(count)}",
        )
    if index < 0 or index >= count:
        raise _error(
            field,
            f"{_show(index)} is out of range for {_plural(count, task_type)}",
            f"{how} an index in {_index_range(count)}",
        )
    return index


def parse_tf_config(
    text: str, *, source: str = "TF_CONFIG", required: tuple[str, ...] = _REQUIRED
) -> TaskConfig:
    """Parse a TF_CONFIG: ``{"cluster": {...}, "task": {"type": T, "index": I}}``."""
    top = _top_object(_decode(text, source), source)
    return _parse_task(top, _wrapped_cluster(top, source, required), source)


def _parse_task(top: Mapping[str, object], cluster: ClusterConfig, source: str) -> TaskConfig:
    """TF_CONFIG's ``"task": {"type": T, "index": I}``, checked against ``cluster``."""
    task = _object_member(
        top,
        "task",
        source,
        add='add "task": {"type": "worker", "index": 0}',
        rewrite='write "task": {"type": "worker", "index": 0}',
    )
    type_field = _field(source, "task.type")
    if "type" not in task:
        raise _error(type_field, "is missing", f'add "type": one of {_ALLOWED}')
    task_type = _check_task_type(task["type"], cluster, type_field, "the cluster")
    index_field = _field(source, "task.index")
    count = len(cluster.jobs[task_type])
    if "index" not in task:
        raise _error(index_field, "is missing", f'add "index": an integer in {_index_range(count)}')
    index = _check_task_index(task["index"], cluster, task_type, index_field, "use")
    return TaskConfig(cluster, task_type, index)


def _tf_config_text(environ: Mapping[str, str]) -> str | None:
    text = environ.get("TF_CONFIG")
    if text is None or not text.strip():
        return None
    return text


def resolve_task(
    *,
    cluster_file: str | None,
    task_type: str | None,
    task_index: int | None,
    environ: Mapping[str, str],
    default_type: str | None = None,
) -> TaskConfig:
    """This process's task: ``--cluster FILE`` with --type/--index wins, else TF_CONFIG."""
    if cluster_file is not None:
        cluster = load_cluster_file(cluster_file)
        chosen = task_type if task_type is not None else default_type
        if chosen is None:
            raise _error("--type", "no task type given", f"pass --type with one of {_ALLOWED}")
        where = f"cluster file {cluster_file}"
        chosen = _check_task_type(chosen, cluster, "--type", where)
        count = len(cluster.jobs[chosen])
        if task_index is None:
            if count == 1:
                return TaskConfig(cluster, chosen, 0)
            raise _error(
                "--index",
                f"not given, and {where} has {_plural(count, chosen)}",
                f"pass --index with an integer in {_index_range(count)}",
            )
        index = _check_task_index(task_index, cluster, chosen, "--index", "pass")
        return TaskConfig(cluster, chosen, index)

    for flag, value in (("--type", task_type), ("--index", task_index)):
        if value is not None:
            raise _error(
                flag,
                "is given without --cluster FILE",
                f"pass --cluster FILE with {flag}, or drop {flag} and set TF_CONFIG's task",
            )
    text = _tf_config_text(environ)
    if text is None:
        raise _error(
            "TF_CONFIG",
            "is not set and no --cluster FILE was given",
            "set TF_CONFIG (a JSON cluster and task) or pass --cluster FILE --index I",
        )
    return parse_tf_config(text, source="TF_CONFIG")


# What a training process runs as, per strategy: its TF_CONFIG task type, what the cluster
# must hold, and how an error says why.
_TRAINING_ROLES: Mapping[str, tuple[tuple[str, ...], str, str]] = {
    # role: (required task types, why TF_CONFIG's task type must be the role, its fix)
    "chief": (_REQUIRED, "the coordinator runs as the chief task", "for the coordinator"),
    "worker": (SYNC_REQUIRED, "with --strategy sync every training process is a worker", ""),
}


def resolve_training_task(
    *,
    role: str,
    cluster_file: str | None,
    task_index: int | None,
    environ: Mapping[str, str],
) -> tuple[ClusterConfig, int, str]:
    """The one TF_CONFIG resolver of the training processes: (cluster, this process's task
    index, where they came from) for ``role`` "chief" (``psctl train``: the coordinator;
    the cluster must have a chief) or "worker" (``--strategy sync``: one of the workers,
    ``--task-index``, which overrides TF_CONFIG's index). ``--cluster FILE`` wins over
    TF_CONFIG, whose task type must be ``role``."""
    required, why, fix_suffix = _TRAINING_ROLES[role]
    if cluster_file:
        cluster, source = load_cluster_file(cluster_file, required=required), cluster_file
        if role == "chief":
            require_chief(cluster, source=source)
            return cluster, 0, source
        if task_index is None:
            raise _error(
                "--task-index",
                "is missing: with --cluster and --strategy sync it says which worker this is",
                "pass --task-index N (0 is the chief)",
            )
        index = task_index
    else:
        text = _tf_config_text(environ)
        if text is None:
            raise _error("TF_CONFIG", "is not set", "set TF_CONFIG or pass --cluster FILE")
        task = parse_tf_config(text.strip(), required=required)
        if task.task_type != role:
            raise _error(
                "TF_CONFIG.task.type",
                f"is {task.task_type!r}; {why}",
                f'set task.type to "{role}"' + (f" {fix_suffix}" if fix_suffix else ""),
            )
        cluster, source = task.cluster, "TF_CONFIG"
        if role == "chief":
            return cluster, 0, source
        index = task.task_index if task_index is None else task_index
    if cluster.num_workers < 1:
        raise _error(f"{source}: cluster.worker", "is missing", 'add "worker": ["host:port", ...]')
    if not 0 <= index < cluster.num_workers:
        raise _error(
            "--task-index",
            f"got {index}; {source} has {cluster.num_workers} worker(s)",
            f"give 0 to {cluster.num_workers - 1}",
        )
    return cluster, index, source


def resolve_cluster(
    *, cluster_file: str | None, environ: Mapping[str, str]
) -> tuple[ClusterConfig, str]:
    """The cluster alone, from ``--cluster FILE`` or TF_CONFIG; returns (cluster, source)."""
    if cluster_file is not None:
        return load_cluster_file(cluster_file), os.fspath(cluster_file)
    text = _tf_config_text(environ)
    if text is None:
        raise _error(
            "TF_CONFIG",
            "is not set and no --cluster FILE was given",
            "set TF_CONFIG or pass --cluster FILE",
        )
    top = _top_object(_decode(text, "TF_CONFIG"), "TF_CONFIG")
    return _wrapped_cluster(top, "TF_CONFIG"), "TF_CONFIG"


def check_config(
    *, cluster_file: str | None, environ: Mapping[str, str]
) -> tuple[ClusterConfig, str, TaskConfig | None]:
    """``psctl check-config``: the cluster from ``FILE`` or TF_CONFIG as ``resolve_cluster``
    reads it, and its ``"task"``, when it has one, checked against it (the type has tasks,
    the index is in range); returns (cluster, source, task or None)."""
    if cluster_file is not None:
        source = os.fspath(cluster_file)
        decoded = _decode(_read_cluster_file(source), source)
        cluster = parse_cluster(decoded, source=source)
    else:
        cluster, source = resolve_cluster(cluster_file=None, environ=environ)
        decoded = _decode(environ["TF_CONFIG"], source)
    top = _top_object(decoded, source)
    # A bare mapping of task types has no "task": parse_cluster refused it as a task type.
    task = _parse_task(top, cluster, source) if "task" in top else None
    return cluster, source, task


def require_chief(cluster: ClusterConfig, *, source: str) -> str:
    """The chief's address, or a ConfigError saying to add one."""
    if cluster.chief is None:
        raise _error(
            _field(source, "cluster.chief"),
            "is missing: the coordinator runs as the chief task",
            'add "chief": ["host:port"] to the cluster',
        )
    return cluster.chief


def summary(cluster: ClusterConfig, *, source: str) -> str:
    """One line, e.g. ``cluster from FILE: 1 chief, 1 ps, 2 workers``."""
    counts = ", ".join(_plural(len(a), t) for t, a in cluster.jobs.items())
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
