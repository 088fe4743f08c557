"""Client side of psctl's control API: `psctl status / watch / checkpoint / pause / resume /
stop` and `psctl health` (their flags: coordinator/cli/client.py). No TensorFlow here: these
answer in well under a second."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import grpc

from psctl.cluster.errors import EXIT_CONFIG, EXIT_FAILURE, EXIT_UNAVAILABLE, ConfigError
from psctl.cluster.ports import HealthAddresses
from psctl.cluster.tf_config import resolve_cluster
from psctl.cluster.tunnel_state import STALE_AFTER, UP_WITHIN
from psctl.control.v1 import control_pb2
from psctl.coordinator.operations.security import (
    EXIT_NOT_ALLOWED,
    ControlSecurity,
    bearer,
    is_denied,
    service_runtime_dir,
    token_paths,
)
from psctl.coordinator.operations.stubs import control_stub

RPC_TIMEOUT = 5.0  # seconds; every RPC has a deadline


class ControlError(Exception):
    """One line for the operator, and the exit status that goes with it."""

    def __init__(self, message: str, exit_status: int, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.exit_status = exit_status
        self.code = code  # the RPC's status, where one came back


@dataclass(frozen=True)
class Target:
    """A coordinator's control address, and how to reach it: the channel's TLS settings
    and the bearer token (None: none found; the coordinator then refuses the call)."""

    address: str
    security: ControlSecurity
    token: str | None

    @classmethod
    def of(cls, address: str, security: ControlSecurity | None = None) -> Target:
        security = security or ControlSecurity.from_args(None)
        return cls(address, security, security.client_token(address))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Target:
        return cls.of(args.address, ControlSecurity.from_args(args))

    def channel(self) -> grpc.Channel:
        return self.security.channel(self.address)

    @property
    def metadata(self) -> list[tuple[str, str]]:
        return bearer(self.token)


def _describe(err: grpc.RpcError, address: str, target: Target | None = None) -> ControlError:
    code = err.code() if isinstance(err, grpc.Call) else None
    details = err.details() if isinstance(err, grpc.Call) else str(err)
    if is_denied(code):
        assert code is not None
        hint = ""
        if target is not None and target.token is None and not target.security.token_file:
            control, _ = token_paths(address)
            hint = (
                f" (no token of this user's for the address in {control.parent}, nor the "
                f"coordinator unit's in {service_runtime_dir()}: run as the job's user or as "
                "root on the coordinator's host, or pass --control-token-file)"
            )
        return ControlError(
            f"the coordinator at {address} refused the call ({code.name}): {details}{hint}",
            EXIT_NOT_ALLOWED,
        )
    if code == grpc.StatusCode.UNAVAILABLE:
        reason = "connection refused" if "refused" in (details or "").lower() else details
        return ControlError(f"no coordinator at {address}: {reason}", EXIT_UNAVAILABLE, code)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ControlError(
            f"coordinator at {address} did not answer in time", EXIT_UNAVAILABLE, code
        )
    if code == grpc.StatusCode.INVALID_ARGUMENT:  # the request's to fix: a setting's line
        return ControlError(details or "invalid request", EXIT_CONFIG)
    if code == grpc.StatusCode.UNIMPLEMENTED:  # a gRPC server, but not psctl's Control API
        return ControlError(
            f"no coordinator at {address}: it answers gRPC but not psctl's Control API (a "
            "server's TensorFlow or health port?); give the job's --control-address",
            EXIT_UNAVAILABLE,
        )
    name = code.name if code else "ERROR"
    return ControlError(f"{name}: {details}", EXIT_FAILURE)


def call(address: str | Target, method: str, request: Any, *, timeout: float = RPC_TIMEOUT) -> Any:
    """One Control RPC with a deadline; an address alone finds this user's token for it."""
    target = address if isinstance(address, Target) else Target.of(address)
    with target.channel() as channel:
        stub = control_stub(channel)
        try:
            return getattr(stub, method)(request, timeout=timeout, metadata=target.metadata)
        except grpc.RpcError as err:
            raise _describe(err, target.address, target) from None


def state_name(value: int) -> str:
    name: str = control_pb2.JobState.Name(value)
    return name.removeprefix("JOB_STATE_")


def health_name(value: int) -> str:
    name: str = control_pb2.TaskHealth.Name(value)
    return name.removeprefix("TASK_HEALTH_")


def task_state_name(value: int) -> str:
    """SERVING for a coordinator that does not say (before task states existed)."""
    if value == control_pb2.TASK_STATE_UNSPECIFIED:
        return "SERVING"
    name: str = control_pb2.TaskState.Name(value)
    return name.removeprefix("TASK_STATE_")


def is_member(task: control_pb2.Task) -> bool:
    """In the cluster the job trains on now (SERVING or DRAINING)."""
    return task_state_name(task.state) in ("SERVING", "DRAINING")


def status_dict(status: control_pb2.Status) -> dict[str, Any]:
    from google.protobuf import json_format  # only --json needs it

    as_dict: dict[str, Any] = json_format.MessageToDict(
        status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    _int64s_as_numbers(status, as_dict)
    # By name (proto JSON writes a list); {} if none.
    as_dict["tables"] = {
        t.name: {
            "rows": t.rows,
            "admitted": t.admitted,
            "evicted": t.evicted,
            "bytes": t.bytes,
            "bytes_per_key": round(t.bytes / t.rows) if t.rows else 0,
        }
        for t in status.tables
    }
    return as_dict


def _int64s_as_numbers(message: Any, as_dict: dict[str, Any]) -> None:
    """Proto JSON writes 64-bit integers as strings ("global_step": "1200"); a script
    comparing them (jq '.global_step > 1000') needs numbers. In place, nested messages too."""
    from google.protobuf.descriptor import FieldDescriptor

    wide = (FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64)
    for field in message.DESCRIPTOR.fields:
        if field.name not in as_dict:
            continue
        value = getattr(message, field.name)
        if field.message_type is not None and not field.message_type.GetOptions().map_entry:
            nested = value if field.is_repeated else [value]
            shown = as_dict[field.name] if field.is_repeated else [as_dict[field.name]]
            for inner, inner_dict in zip(nested, shown, strict=True):
                _int64s_as_numbers(inner, inner_dict)
        elif field.cpp_type in wide:
            as_dict[field.name] = list(value) if field.is_repeated else int(value)


def format_table(table: control_pb2.Table) -> str:
    """``table user_id: 12,345 rows (3.6 MB, 292 bytes/key), 20,000 admitted, 7,655
    evicted``."""
    size = ""
    if table.bytes:
        per_key = f", {table.bytes / table.rows:,.0f} bytes/key" if table.rows else ""
        size = f" ({table.bytes / 1e6:,.1f} MB{per_key})"
    return (
        f"table {table.name}: {table.rows:,} rows{size}, {table.admitted:,} admitted, "
        f"{table.evicted:,} evicted"
    )


def format_tunnel(tunnel: control_pb2.Tunnel, now: float) -> list[str]:
    """``tunnel 10.0.0.1: 3 of 3 peers up`` and a line per source of refused handshakes
    (or that the tunnel process stopped writing)."""
    head = f"tunnel {tunnel.address}: "
    quiet = now - tunnel.updated_unix_seconds
    if quiet > STALE_AFTER:
        return [f"{head}its process has not reported for {quiet:.0f}s: is psctl-tunnel running?"]
    down = [p.address for p in tunnel.peers if p.handshake_unix_seconds <= now - UP_WITHIN]
    up = len(tunnel.peers) - len(down)
    silent = f" (no recent handshake: {', '.join(down)})" if down else ""
    lines = [f"{head}{up} of {len(tunnel.peers)} peers up{silent}"]
    for refusal in tunnel.refused:
        lines.append(
            f"tunnel refused {refusal.count} handshake(s) from "
            f"{refusal.source or 'a sender with another host key'}, last "
            f"{now - refusal.last_unix_seconds:.0f}s ago: not a key of this cluster"
        )
    return lines


def format_freshness(fresh: control_pb2.Freshness) -> list[str]:
    """``input: 12 files trained, 2 waiting, lag 41s (newest ...)`` and ``serving: version
    1200 in EXP, 35s old``."""
    lines = []
    if fresh.following:
        lag = f", lag {fresh.input_lag_seconds:.0f}s" if fresh.files_trained else ""
        newest = f" (newest {fresh.newest_file})" if fresh.newest_file else ""
        lines.append(
            f"input: {fresh.files_trained} files trained, {fresh.files_waiting} waiting"
            f"{lag}{newest}"
        )
    if fresh.export_dir:
        if fresh.published_version:
            lines.append(
                f"serving: version {fresh.published_version} in {fresh.export_dir}, "
                f"{fresh.publish_age_seconds:.0f}s old"
            )
        else:
            lines.append(f"serving: no version published yet in {fresh.export_dir}")
    if fresh.publish_decision:
        lines.append(f"gate: {fresh.publish_decision}")
    return lines


def _num(value: float, fmt: str = ".4f") -> str:
    return "-" if value != value else format(value, fmt)  # NaN -> "-"


def step_of(status: control_pb2.Status, *, percent: bool = True) -> str:
    """``N/TARGET (P%)``, or ``N`` where the data decides the target (--epochs: 0)."""
    if not status.target_steps:
        return str(status.global_step)
    pct = f" ({100.0 * status.global_step / status.target_steps:.1f}%)" if percent else ""
    return f"{status.global_step}/{status.target_steps}{pct}"


def format_status(status: control_pb2.Status) -> str:
    lines = [
        f"job {status.job} | {state_name(status.state)} | step {step_of(status)} | "
        f"{status.steps_per_second:.1f} steps/s | "
        f"{status.examples_per_second:.0f} ex/s | up {status.uptime_seconds:.0f}s"
    ]
    train = [f"loss {_num(status.loss)}"] + [
        f"{k} {_num(v)}" for k, v in sorted(status.metrics.items())
    ]
    lines.append("train: " + ", ".join(train))
    if status.eval_metrics:
        evals = ", ".join(f"{k} {_num(v)}" for k, v in sorted(status.eval_metrics.items()))
        lines.append(f"eval (step {status.eval_step}): {evals}")
    if status.HasField("last_checkpoint"):
        ckpt = status.last_checkpoint
        age = time.time() - ckpt.time_unix_seconds
        lines.append(f"checkpoint: {ckpt.path} (step {ckpt.step}, {age:.0f}s ago)")
    lines.extend(format_table(t) for t in status.tables)
    if status.HasField("freshness"):
        lines.extend(format_freshness(status.freshness))
    if status.HasField("tunnel"):
        lines.extend(format_tunnel(status.tunnel, time.time()))
    counts = {
        kind: sum(t.type == kind and is_member(t) for t in status.tasks)
        for kind in ("ps", "worker")
    }
    if status.tasks:
        lines.append(
            f"cluster: {counts['ps']} ps + {counts['worker']} workers "
            f"(generation {status.cluster_generation})"
        )
    if status.message:
        lines.append(f"note: {status.message}")
    rows = [("TYPE", "INDEX", "ADDRESS", "STATE", "HEALTH", "FAILURES", "PID", "METRICS")]
    for t in status.tasks:
        rows.append(
            (
                t.type,
                str(t.index),
                t.address,
                task_state_name(t.state),
                health_name(t.health),
                str(t.failures),
                str(t.pid or "-"),
                t.metrics_url or "-",
            )
        )
    lines.append(_table(rows))
    return "\n".join(lines)


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def cmd_status(args: argparse.Namespace) -> int:
    status = call(Target.from_args(args), "GetStatus", control_pb2.GetStatusRequest())
    if args.json:
        print(json.dumps(status_dict(status), indent=2, sort_keys=True))
    else:
        print(format_status(status))
    return 0


def cmd_watch(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Redraw on a terminal; one line per update when piped."""
    request = control_pb2.WatchStatusRequest(interval_seconds=args.interval)
    tty = out.isatty()
    target = Target.from_args(args)
    with target.channel() as channel:
        stub = control_stub(channel)
        # The stream lives as long as the job: its deadline is --duration (or a day).
        deadline = args.duration or 86400.0
        stream = stub.WatchStatus(request, timeout=deadline, metadata=target.metadata)
        last: control_pb2.Status | None = None
        try:
            for count, status in enumerate(stream, 1):
                last = status
                if tty:
                    out.write("\x1b[H\x1b[2J" + format_status(status) + "\n")
                else:
                    out.write(
                        f"{time.strftime('%H:%M:%S')} {state_name(status.state)} "
                        f"step {step_of(status, percent=False)} "
                        f"loss {_num(status.loss)} {status.steps_per_second:.1f} steps/s\n"
                    )
                out.flush()
                if args.count and count >= args.count:
                    break
        except grpc.RpcError as err:
            code = err.code() if isinstance(err, grpc.Call) else None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return 0  # --duration elapsed
            if last is not None and code in (
                grpc.StatusCode.CANCELLED,
                grpc.StatusCode.UNAVAILABLE,
            ):
                # The coordinator closed the stream as it exited: the job ended (its last
                # state may not have reached the stream). Watching ran until then: 0.
                out.write(
                    f"coordinator at {args.address} has exited (last seen "
                    f"{state_name(last.state)} at step {last.global_step})\n"
                )
                return 0
            raise _describe(err, args.address, target) from None
    return 0


def _simple(method: str, request: Any, verb: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        response = call(Target.from_args(args), method, request)
        print(f"{verb}: job was {state_name(response.state)}")
        return 0

    return run


cmd_pause = _simple("Pause", control_pb2.PauseRequest(), "pause requested")
cmd_resume = _simple("Resume", control_pb2.ResumeRequest(), "resume requested")


def cmd_checkpoint(args: argparse.Namespace) -> int:
    response = call(
        Target.from_args(args), "Checkpoint", control_pb2.CheckpointRequest(), timeout=args.timeout
    )
    print(f"checkpoint {response.checkpoint.path} at step {response.checkpoint.step}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    """Ask for a graceful stop, then wait (bounded) until the coordinator is gone."""
    target = Target.from_args(args)
    response = call(target, "Stop", control_pb2.StopRequest())
    print(
        f"stop requested (job was {state_name(response.state)}); waiting up to {args.timeout:.0f}s",
        flush=True,
    )
    deadline = time.monotonic() + args.timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = call(target, "GetStatus", control_pb2.GetStatusRequest(), timeout=2.0)
        except ControlError as err:
            if err.code == grpc.StatusCode.UNAVAILABLE:  # nothing listens there any more
                print(f"coordinator stopped{stopped_at(last)}", flush=True)
                return 0
            # Busy (a deadline) or any other answer: it is still there.
        time.sleep(0.5)
    raise ControlError(
        f"coordinator at {args.address} still running after {args.timeout:.0f}s "
        f"(state {state_name(last.state) if last else '?'})",
        EXIT_FAILURE,
    )


def stopped_at(last: control_pb2.Status | None) -> str:
    """The final step where the last status seen was the job's end (DONE); else the last
    step seen, as such: the steps in flight at the stop finish after it."""
    if last is None:
        return ""
    if state_name(last.state) == "DONE":
        return f" at step {last.global_step}"
    seen = f"{state_name(last.state)} at step {last.global_step}"
    return f" (last seen {seen}; the summary has the final step)"


def cmd_scale(args: argparse.Namespace) -> int:
    """Resize the running job's cluster: psctl local's counts, or psctl train's new cluster
    description (checked here first, then by the coordinator)."""
    request = control_pb2.ScaleRequest(workers=args.workers or 0, ps=args.ps or 0)
    if args.cluster:
        from psctl.cluster.spec import parse_cluster_json, read_cluster_file

        text = read_cluster_file(args.cluster)
        parse_cluster_json(text, source=args.cluster)  # one line now, not after the RPC
        request.cluster_json = text
    if not (request.workers or request.ps or request.cluster_json):
        raise ConfigError("--workers", "nothing to change", "give --workers, --ps or --cluster")
    target = Target.from_args(args)
    response = call(target, "Scale", request, timeout=args.timeout)
    print(response.message, flush=True)
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """Like grpc_health_probe over every server of the cluster; non-zero if any is not
    SERVING."""
    from psctl.cluster import health  # only this command: `psctl status` starts faster

    cluster, source = resolve_cluster(cluster_file=args.cluster, environ=_environ())
    addresses = HealthAddresses.of_file(args.cluster, offset=args.health_port_offset)
    rows = [("TYPE", "INDEX", "ADDRESS", "HEALTH ADDRESS", "STATUS")]
    bad = 0
    tasks = []
    for task_type, index, address in cluster.task_addresses():
        if task_type in health.TASK_TYPES:
            found = addresses.get(task_type, index, address)
            tasks.append((task_type, index, address, str(found) if found else ""))
    served = health.served_task_types([t[3] for t in tasks if t[3]], timeout=args.timeout)
    for task_type, index, address, target in tasks:
        if not target:  # TF port + offset is past 65535, and the file names none
            bad += 1
            rows.append((task_type, str(index), str(address), "-", "NO HEALTH PORT"))
            continue
        status = health.check(target, timeout=args.timeout).status
        if served[target] not in (None, task_type):  # the cluster's addresses swapped
            status = f"{status} (a {served[target]}-server)"
        bad += status != "SERVING"
        rows.append((task_type, str(index), str(address), target, status))
    print(f"cluster from {source}")
    print(_table(rows))
    return 0 if bad == 0 else EXIT_UNAVAILABLE


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)
