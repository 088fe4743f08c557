"""Flags of `psctl evaluate`, the sidecar evaluator. The process is
coordinator/launch/sidecar.py's; TensorFlow is imported only when the command runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from psctl.cluster.processes.logs import import_tensorflow_quietly
from psctl.cluster.processes.requirements import require_tensorflow
from psctl.coordinator.cli.numbers import decimal, whole_number
from psctl.coordinator.settings import default_help, flag_values

DEFAULT_POLL_INTERVAL = 2.0
DEFAULT_TIMEOUT = 3600.0

# Run settings shared with training (flags > PSCTL_* environment > --config [train] table),
# as (flag, help): their values are settings text, checked as training's are.
SHARED_FLAGS: list[tuple[str, str]] = [
    ("--job", f"the job that trained the checkpoints {default_help('job')}"),
    (
        "--checkpoint-dir",
        "the training run's checkpoint directory (required without --checkpoint: this flag, "
        "PSCTL_CHECKPOINT_DIR or the --config file's [train] checkpoint_dir)",
    ),
    ("--eval-data", "evaluation files (glob) for the job; default: the job's own"),
    ("--label-column", f"CSV label column {default_help('label_column')}"),
    ("--eval-batch-size", f"evaluation batch size {default_help('eval_batch_size')}"),
    ("--seed", f"seed given to the dataset function {default_help('seed')}"),
]


def add_evaluate_command(sub: Any) -> dict[str, Callable[[argparse.Namespace], int]]:
    """Register ``psctl evaluate`` on the CLI's subparsers; returns {name: handler}."""
    parser = sub.add_parser(
        "evaluate",
        help="sidecar evaluator: evaluate each new checkpoint of a run as it appears",
        description=(
            "Evaluate every new checkpoint in --checkpoint-dir once, in this process (no "
            "cluster), and exit after the final one; or one chosen checkpoint (--checkpoint), "
            "or every checkpoint of the directory (--all), and exit."
        ),
    )
    parser.add_argument("--config", metavar="FILE", help="TOML job file ([train] table)")
    for flag, text in SHARED_FLAGS:  # settings text, parsed where the settings are
        parser.add_argument(flag, default=None, help=text)
    parser.add_argument(
        "--steps",
        type=whole_number,
        default=None,
        help="the run's final global step: exit after evaluating a checkpoint that reaches it "
        "(default: PSCTL_STEPS or the --config file's steps, else none)",
    )
    parser.add_argument(
        "--max-evaluations", type=whole_number, default=None, help="exit after N evaluations"
    )
    once = parser.add_mutually_exclusive_group()
    once.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="evaluate this checkpoint (a DIR/ckpt-N prefix) once and exit, instead of watching",
    )
    once.add_argument(
        "--all",
        action="store_true",
        help="evaluate every checkpoint in --checkpoint-dir once, oldest first, and exit",
    )
    parser.add_argument(
        "--poll-interval",
        type=decimal,
        default=DEFAULT_POLL_INTERVAL,
        help=f"seconds between looks for a new checkpoint (default {DEFAULT_POLL_INTERVAL:g})",
    )
    parser.add_argument(
        "--timeout",
        type=decimal,
        default=DEFAULT_TIMEOUT,
        help=f"exit when no new checkpoint appears for this long (default {DEFAULT_TIMEOUT:g} s)",
    )
    parser.add_argument(
        "--summary-json", help="write every evaluation so far as JSON here (after each one)"
    )
    parser.add_argument("--logdir", help="TensorBoard scalars (eval/loss, eval/<metric>) here")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug and TF logs")
    return {"evaluate": cmd_evaluate}


def cmd_evaluate(args: argparse.Namespace) -> int:
    require_tensorflow()
    import_tensorflow_quietly()
    from psctl.coordinator.launch.sidecar import evaluate_main

    return evaluate_main(args, flag_values(args, (flag for flag, _ in SHARED_FLAGS)))
