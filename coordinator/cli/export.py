"""Flags of `psctl export` (a checkpoint as a SavedModel). The process is
coordinator/launch/serving.py's; TensorFlow is imported only when the command runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from psctl.cluster.processes.logs import import_tensorflow_quietly
from psctl.cluster.processes.requirements import require_tensorflow
from psctl.coordinator.settings import default_help, flag_values

# Run settings shared with training (flags > PSCTL_* environment > --config [train] table),
# as (flag, help): their values are settings text, checked as training's are.
SHARED_FLAGS: list[tuple[str, str]] = [
    ("--job", f"the job that trained the checkpoints {default_help('job')}"),
    ("--checkpoint-dir", "the training run's checkpoint directory (its newest is exported)"),
    ("--train-data", "the job's training files (glob), if it reads files"),
    ("--eval-data", "the job's evaluation files (glob), if it reads files"),
    ("--label-column", f"CSV label column {default_help('label_column')}"),
]


def add_export_command(sub: Any) -> dict[str, Callable[[argparse.Namespace], int]]:
    parser = sub.add_parser(
        "export",
        help="write a checkpoint as a SavedModel for serving (OUT/<step>/)",
        description=(
            "Build the job's model in this process (no cluster), restore the newest checkpoint "
            "of --checkpoint-dir (or --checkpoint), and save it as a TensorFlow SavedModel in "
            "OUT/<global step>/ with a serving_default signature."
        ),
    )
    parser.add_argument("--config", metavar="FILE", help="TOML job file ([train] table)")
    for flag, text in SHARED_FLAGS:  # settings text, parsed where the settings are
        parser.add_argument(flag, default=None, help=text)
    parser.add_argument("--checkpoint", help="this checkpoint (a ckpt-N prefix) instead")
    parser.add_argument("--out", required=True, help="the export base directory")
    parser.add_argument(
        "--requests",
        action="store_true",
        help="stay up: read checkpoint prefixes from standard input, one a line, export each "
        "and answer one line (exported PREFIX to PATH, or error: ...); what --export-every "
        "runs, so that a version costs no TensorFlow import",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug and TF logs")
    return {"export": cmd_export}


def cmd_export(args: argparse.Namespace) -> int:
    require_tensorflow()
    import_tensorflow_quietly()
    from psctl.coordinator.launch.serving import export_main

    return export_main(args, flag_values(args, (flag for flag, _ in SHARED_FLAGS)))
