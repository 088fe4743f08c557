"""TF_CONFIG, and where a process's task and cluster come from: ``--cluster FILE`` (with
--type/--index) or TF_CONFIG, checked against each other."""

from __future__ import annotations

import os
from collections.abc import Mapping

from psctl.cluster.address import LongInteger, config_error, kind, show
from psctl.cluster.spec import (
    ALLOWED_TYPES,
    MASTER_FIX,
    REQUIRED,
    SYNC_REQUIRED,
    TASK_TYPES,
    ClusterConfig,
    TaskConfig,
    decode_json,
    field_name,
    index_range,
    load_cluster_file,
    object_member,
    parse_cluster,
    plural,
    read_cluster_file,
    require_chief,
    top_object,
    wrapped_cluster,
)


def _check_task_type(task_type: object, cluster: ClusterConfig, field: str, where: str) -> str:
    if not isinstance(task_type, str):
        raise config_error(
            field, f"is {kind(task_type)}, not a task type", f"use one of {ALLOWED_TYPES}"
        )
    if task_type == "master":
        raise config_error(field, 'task type "master" is not supported', MASTER_FIX)
    if task_type not in TASK_TYPES:
        raise config_error(
            field, f"unknown task type {show(task_type)}", f"use one of {ALLOWED_TYPES}"
        )
    if task_type not in cluster.jobs:
        raise config_error(
            field,
            f"task type {show(task_type)} has no tasks in {where}",
            f"add {task_type} addresses to the cluster or use one of: {', '.join(cluster.jobs)}",
        )
    return task_type


def _check_task_index(
    index: object, cluster: ClusterConfig, task_type: str, field: str, how: str
) -> int:
    count = len(cluster.jobs[task_type])
    if isinstance(index, LongInteger):
        raise config_error(
            field, f"{show(index)} is out of range", f"{how} an index in {index_range(count)}"
        )
    if isinstance(index, bool) or not isinstance(index, int):
        raise config_error(
            field,
            f"is {kind(index)} ({show(index)}), not a non-negative integer",
            f"{how} an integer in {index_range(count)}",
        )
    if index < 0 or index >= count:
        raise config_error(
            field,
            f"{show(index)} is out of range for {plural(count, task_type)}",
            f"{how} an index in {index_range(count)}",
        )
    return index


def parse_tf_config(
    text: str, *, source: str = "TF_CONFIG", required: tuple[str, ...] = REQUIRED
) -> TaskConfig:
    """Parse a TF_CONFIG: ``{"cluster": {...}, "task": {"type": T, "index": I}}``."""
    top = top_object(decode_json(text, source), source)
    return _parse_task(top, wrapped_cluster(top, source, required), source)


def _parse_task(top: Mapping[str, object], cluster: ClusterConfig, source: str) -> TaskConfig:
    """TF_CONFIG's ``"task": {"type": T, "index": I}``, checked against ``cluster``."""
    task = object_member(
        top,
        "task",
        source,
        add='add "task": {"type": "worker", "index": 0}',
        rewrite='write "task": {"type": "worker", "index": 0}',
    )
    type_field = field_name(source, "task.type")
    if "type" not in task:
        raise config_error(type_field, "is missing", f'add "type": one of {ALLOWED_TYPES}')
    task_type = _check_task_type(task["type"], cluster, type_field, "the cluster")
    index_field = field_name(source, "task.index")
    count = len(cluster.jobs[task_type])
    if "index" not in task:
        raise config_error(
            index_field, "is missing", f'add "index": an integer in {index_range(count)}'
        )
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
            raise config_error(
                "--type", "no task type given", f"pass --type with one of {ALLOWED_TYPES}"
            )
        where = f"cluster file {cluster_file}"
        chosen = _check_task_type(chosen, cluster, "--type", where)
        count = len(cluster.jobs[chosen])
        if task_index is None:
            if count == 1:
                return TaskConfig(cluster, chosen, 0)
            raise config_error(
                "--index",
                f"not given, and {where} has {plural(count, chosen)}",
                f"pass --index with an integer in {index_range(count)}",
            )
        index = _check_task_index(task_index, cluster, chosen, "--index", "pass")
        return TaskConfig(cluster, chosen, index)

    for flag, value in (("--type", task_type), ("--index", task_index)):
        if value is not None:
            raise config_error(
                flag,
                "is given without --cluster FILE",
                f"pass --cluster FILE with {flag}, or drop {flag} and set TF_CONFIG's task",
            )
    text = _tf_config_text(environ)
    if text is None:
        raise config_error(
            "TF_CONFIG",
            "is not set and no --cluster FILE was given",
            "set TF_CONFIG (a JSON cluster and task) or pass --cluster FILE --index I",
        )
    return parse_tf_config(text, source="TF_CONFIG")


# What a training process runs as, per strategy: its TF_CONFIG task type, what the cluster
# must hold, and how an error says why.
_TRAINING_ROLES: Mapping[str, tuple[tuple[str, ...], str, str]] = {
    # role: (required task types, why TF_CONFIG's task type must be the role, its fix)
    "chief": (REQUIRED, "the coordinator runs as the chief task", "for the coordinator"),
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
            raise config_error(
                "--task-index",
                "is missing: with --cluster and --strategy sync it says which worker this is",
                "pass --task-index N (0 is the chief)",
            )
        index = task_index
    else:
        text = _tf_config_text(environ)
        if text is None:
            raise config_error("TF_CONFIG", "is not set", "set TF_CONFIG or pass --cluster FILE")
        task = parse_tf_config(text.strip(), required=required)
        if task.task_type != role:
            raise config_error(
                "TF_CONFIG.task.type",
                f"is {task.task_type!r}; {why}",
                f'set task.type to "{role}"' + (f" {fix_suffix}" if fix_suffix else ""),
            )
        cluster, source = task.cluster, "TF_CONFIG"
        if role == "chief":
            return cluster, 0, source
        index = task.task_index if task_index is None else task_index
    if cluster.num_workers < 1:
        raise config_error(
            f"{source}: cluster.worker", "is missing", 'add "worker": ["host:port", ...]'
        )
    if not 0 <= index < cluster.num_workers:
        raise config_error(
            "--task-index",
            f"got {index}; {source} has {cluster.num_workers} worker(s)",
            f"give 0 to {cluster.num_workers - 1}",
        )
    return cluster, index, source


def resolve_cluster(
    *, cluster_file: str | None, environ: Mapping[str, str], file_arg: str = "--cluster FILE"
) -> tuple[ClusterConfig, str]:
    """The cluster alone, from ``--cluster FILE`` or TF_CONFIG; returns (cluster, source).
    ``file_arg``: how the command takes the file, for the error when it has neither."""
    if cluster_file is not None:
        return load_cluster_file(cluster_file), os.fspath(cluster_file)
    text = _tf_config_text(environ)
    if text is None:
        raise config_error(
            "TF_CONFIG",
            f"is not set and no {file_arg} was given",
            f"set TF_CONFIG or pass {file_arg}",
        )
    top = top_object(decode_json(text, "TF_CONFIG"), "TF_CONFIG")
    return wrapped_cluster(top, "TF_CONFIG"), "TF_CONFIG"


def check_config(
    *, cluster_file: str | None, environ: Mapping[str, str]
) -> tuple[ClusterConfig, str, TaskConfig | None]:
    """``psctl check-config``: the cluster from ``FILE`` or TF_CONFIG as ``resolve_cluster``
    reads it, and its ``"task"``, when it has one, checked against it (the type has tasks,
    the index is in range); returns (cluster, source, task or None)."""
    if cluster_file is not None:
        source = os.fspath(cluster_file)
        decoded = decode_json(read_cluster_file(source), source)
        cluster = parse_cluster(decoded, source=source)
    else:
        cluster, source = resolve_cluster(cluster_file=None, environ=environ, file_arg="FILE")
        decoded = decode_json(environ["TF_CONFIG"], source)
    top = top_object(decoded, source)
    # A bare mapping of task types has no "task": parse_cluster refused it as a task type.
    task = _parse_task(top, cluster, source) if "task" in top else None
    return cluster, source, task
