"""Checking TFRecord inputs in full (``tf.train.Example`` records,
coordinator/data/readers.py's format): the first record's features are the schema every
record of every file must have, each file checked whole, in parallel processes when there is
enough to read (coordinator/data/checks.py's pieces). TensorFlow reads the records:
``table_scan.scan_table`` imports this module only for TFRecord files, so that checking CSV
or Criteo files stays free of TensorFlow's import.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import tensorflow as tf

from psctl.cluster.errors import ConfigError
from psctl.coordinator.data.checks import Checked, Labels, TableFormat
from psctl.coordinator.data.files import Piece, cut, size_of

__all__ = ["check_tfrecord_piece", "first_schema", "tfrecord_format"]


def tfrecord_format(paths: list[str], *, label_column: str, field: str) -> TableFormat:
    """TFRecord files (``paths``): every record checked against the first record's
    features."""
    schema = first_schema(paths[0], label_column, field)
    features = tuple(sorted(name for name in schema if name != label_column))
    check = functools.partial(
        check_tfrecord_piece,
        schema=schema,
        schema_where=f"{paths[0]} record 1",
        label_column=label_column,
        field=field,
    )
    return TableFormat(
        check,
        cut(paths, splittable=False),
        ("holds no records", "add examples or remove it"),
        {
            "format": "tfrecord",
            "label_column": label_column,
            "feature_names": features,
            "feature_lengths": tuple(schema[n][1] for n in features),
            "feature_kinds": tuple(schema[n][0] for n in features),
            "label_kind": schema[label_column][0],
        },
    )


def first_schema(path: str, label_column: str, field: str) -> dict[str, tuple[str, int]]:
    """The features of the first record of ``path`` (the first file), checked: every
    record of every file must have them."""
    from google.protobuf.message import DecodeError

    if size_of(path) == 0:
        raise ConfigError(
            field, f"{path} is empty", "write tf.train.Example records, or remove the file"
        )
    try:
        first = next(iter(tf.data.TFRecordDataset(path).take(1)), None)
    except tf.errors.OpError as err:
        raise ConfigError(
            field,
            f"{path} after record 0: not a readable TFRecord file ({_op_message(err)})",
            "write the file with tf.io.TFRecordWriter",
        ) from None
    if first is None:
        raise ConfigError(field, f"{path} holds no records", "add examples or remove it")
    try:
        example = tf.train.Example.FromString(first.numpy())
    except DecodeError:
        raise ConfigError(
            field, f"{path} record 1: not a tf.train.Example", "write tf.train.Example records"
        ) from None
    schema = _example_schema(example, path, 1, field)
    _check_schema(schema, path, label_column, field)
    return schema


def check_tfrecord_piece(
    piece: Piece,
    *,
    schema: dict[str, tuple[str, int]],
    schema_where: str,
    label_column: str,
    field: str,
    first_line: int = 1,
) -> Checked:
    """Check every record of one file (a piece is a whole file) against the first record's
    features (``schema``, read at ``schema_where``)."""
    found = Checked(labels=Labels())
    try:
        found.records = found.lines = _check_records(
            piece.path, schema, schema_where, label_column, found.labels, field
        )
    except ConfigError as err:
        found.error = (err.field, err.problem, err.fix)
    return found


def _check_records(
    path: str,
    schema: dict[str, tuple[str, int]],
    schema_where: str,
    label_column: str,
    labels: Any,
    field: str,
) -> int:
    from google.protobuf.message import DecodeError

    if size_of(path) == 0:
        raise ConfigError(
            field, f"{path} is empty", "write tf.train.Example records, or remove the file"
        )
    count = 0
    try:
        for chunk in tf.data.TFRecordDataset(path).batch(4096):
            for serialized in chunk.numpy():
                count += 1
                try:
                    example = tf.train.Example.FromString(serialized)
                except DecodeError:
                    raise ConfigError(
                        field,
                        f"{path} record {count}: not a tf.train.Example",
                        "write tf.train.Example records",
                    ) from None
                found = _example_schema(example, path, count, field)
                if found != schema:
                    raise ConfigError(
                        field,
                        f"{path} record {count}: features {_describe(found)} differ from "
                        f"{schema_where}'s {_describe(schema)}",
                        "give every record the same features, each with a fixed length",
                    )
                feature = example.features.feature[label_column]
                kind = feature.WhichOneof("kind")
                value = float(getattr(feature, kind).value[0])
                if math.isnan(value) or math.isinf(value):
                    raise ConfigError(
                        field,
                        f"{path} record {count}: label is {value}",
                        "give every example a finite label",
                    )
                labels.add(value, path, count)
    except tf.errors.OpError as err:
        good = _readable_records(path)  # the batch failed as a whole: find the record
        raise ConfigError(
            field,
            f"{path} after record {good}: not a readable TFRecord file ({_op_message(err)})",
            "write the file with tf.io.TFRecordWriter",
        ) from None
    return count


def _readable_records(path: str) -> int:
    count = 0
    try:
        for _ in tf.data.TFRecordDataset(path):
            count += 1
    except tf.errors.OpError:
        pass
    return count


def _op_message(err: Any) -> str:
    """TensorFlow's error text without its op and function decorations."""
    text = (err.message or type(err).__name__).strip().splitlines()[0]
    text = re.sub(r"\{\{[^}]*\}\}\s*", "", text)
    return re.sub(r"\s*\[Op:.*$", "", text).strip() or type(err).__name__


def _example_schema(example: Any, path: str, record: int, field: str) -> dict[str, tuple[str, int]]:
    found = {}
    for name, feature in example.features.feature.items():
        kind = feature.WhichOneof("kind")
        if kind == "bytes_list":
            raise ConfigError(
                field,
                f"{path} record {record}: feature {name!r} holds bytes",
                "store model inputs as float or int64 lists",
            )
        values = getattr(feature, kind).value if kind else []
        found[name] = ("float" if kind == "float_list" else "int64", len(values))
    return found


def _check_schema(
    schema: dict[str, tuple[str, int]], path: str, label_column: str, field: str
) -> None:
    if label_column not in schema:
        raise ConfigError(
            field,
            f"{path} record 1: no label feature {label_column!r} in {_describe(schema)}",
            "name the label feature in --label-column (default label)",
        )
    if schema[label_column][1] != 1:
        raise ConfigError(
            field,
            f"{path} record 1: label {label_column!r} has {schema[label_column][1]} values",
            "give each example one label value",
        )
    if len(schema) < 2:
        raise ConfigError(
            field, f"{path} record 1: only the label feature", "add a float feature 'features'"
        )
    for name, (_, length) in schema.items():
        if length == 0:
            raise ConfigError(
                field, f"{path} record 1: feature {name!r} is empty", "give it its values"
            )


def _describe(schema: dict[str, tuple[str, int]]) -> str:
    return "{" + ", ".join(f"{n}: {k}[{length}]" for n, (k, length) in sorted(schema.items())) + "}"
