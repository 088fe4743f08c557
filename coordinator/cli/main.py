"""`psctl`: the command line, and the flags of `local`, `train` and `check-config`; the other
commands' flags are in cli/client.py, cli/deploy.py, cli/evaluate.py and cli/check_data.py.
TensorFlow is imported only by commands that train or evaluate (check-data: TFRecord only)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from psctl.cluster.errors import EXIT_FAILURE, ConfigError, OneLineParser
from psctl.cluster.processes import scratch
from psctl.cluster.processes.logs import configure_logging, end_quiet_import, quiet_tensorflow
from psctl.cluster.processes.requirements import require_tensorflow
from psctl.coordinator.cli.check_data import add_check_data_command
from psctl.coordinator.cli.client import add_client_commands, add_control_security
from psctl.coordinator.cli.deploy import add_deploy_commands
from psctl.coordinator.cli.evaluate import add_evaluate_command
from psctl.coordinator.cli.export import add_export_command
from psctl.coordinator.cli.numbers import check_ranges, decimal, whole_number
from psctl.coordinator.failures import describe
from psctl.coordinator.settings import (
    DEFAULT_CONTROL_ADDRESS,
    DEFAULT_METRICS_PORT,
    DEFAULTS,
    IN_FLIGHT_PER_WORKER,
    default_help,
    flag_values,
    show_steps_per_execution,
)

log = logging.getLogger("psctl")
STARTED = time.time()  # this command's start, near enough (its imports are cheap)


def _seconds(value: float) -> str:
    return f"{value:g}"


def _in_flight(value: int) -> str:
    return str(value) if value else f"{IN_FLIGHT_PER_WORKER} per worker"


# (flag, help) for every run setting; the names match settings.TrainSettings, and the
# defaults shown are its own. The flags take text: the settings layer parses it as it does
# PSCTL_* values (ASCII digits only, finite, in range), so a bad one is one line naming the
# flag, exit 78.
TRAIN_FLAGS: list[tuple[str, str]] = [
    (
        "--job",
        f"job: built-in name (mlp), module (pkg.job) or file (job.py); default {DEFAULTS.job}",
    ),
    (
        "--strategy",
        "async: parameter servers, a coordinator dispatches steps to the workers; sync: "
        "every worker runs the loop and gradients are all-reduced each step "
        f"(MultiWorkerMirroredStrategy; ps tasks unused) {default_help('strategy')}",
    ),
    ("--steps", f"train until this global step {default_help('steps')}"),
    (
        "--epochs",
        "instead of --steps: every example exactly N times, through the tf.data service "
        "(dynamic sharding over the workers)",
    ),
    ("--batch-size", f"examples per step per worker {default_help('batch_size')}"),
    (
        "--steps-per-execution",
        "steps packed into one scheduled function, or auto: measured at start and re-checked "
        "so the per-call overhead stays under 10%% "
        + default_help("steps_per_execution", show_steps_per_execution),
    ),
    (
        "--update-mode",
        "default: the ps optimizer updates the variables every step; local: each call runs "
        f"--local-steps steps on the worker and pushes the change "
        f"{default_help('update_mode', repr)}",
    ),
    ("--local-steps", f"--update-mode local: steps per call {default_help('local_steps')}"),
    (
        "--local-scale",
        f"--update-mode local: factor on each call's change {default_help('local_scale')}",
    ),
    ("--checkpoint-dir", "checkpoint directory; restored from on start"),
    ("--checkpoint-every", f"steps between checkpoints {default_help('checkpoint_every')}"),
    ("--keep-checkpoints", f"checkpoints kept {default_help('keep_checkpoints')}"),
    ("--eval-batch-size", f"batch size of evaluations {default_help('eval_batch_size')}"),
    (
        "--eval-every",
        "also evaluate every N steps, on the workers, over the whole eval set once",
    ),
    ("--seed", f"seed given to dataset functions {default_help('seed')}"),
    ("--log-every", f"seconds between progress lines {default_help('log_every', _seconds)}"),
    (
        "--max-shards",
        "split each embedding table of at least --min-shard-bytes into up to N shards over "
        "the ps tasks, with sparse updates (nothing else is split) " + default_help("max_shards"),
    ),
    (
        "--min-shard-bytes",
        "smallest table shard " + default_help("min_shard_bytes", lambda n: f"{n >> 10} KiB"),
    ),
    (
        "--max-in-flight",
        f"scheduled calls not yet finished {default_help('max_in_flight', _in_flight)}",
    ),
    (
        "--stall-timeout",
        "seconds without a finished step before the stall watchdog "
        f"reports and reschedules stuck calls {default_help('stall_timeout', _seconds)}",
    ),
    ("--summary-json", "write the final summary as JSON to this path"),
    ("--logdir", "TensorBoard summaries here (psctl local: WORKDIR/tensorboard)"),
    ("--train-data", "training files (glob) for the job, e.g. 'data/train-*.csv'"),
    ("--eval-data", "evaluation files (glob) for the job"),
    ("--label-column", f"CSV label column {default_help('label_column')}"),
    (
        "--full-check-mb",
        "Criteo inputs up to this many MB are checked in full before training; larger ones "
        "in their first lines, the workers checking every line as they read it (0: always "
        f"so) {default_help('full_check_mb')}",
    ),
    (
        "--bad-records",
        "a bad record the workers find in a large input: fail (one error naming its file "
        f"and line, exit 78) or skip (dropped, logged by the worker) "
        f"{default_help('bad_records', repr)}",
    ),
    (
        "--connect-timeout",
        "seconds to wait for every server's TF port (sync: for every worker), then exit 69 "
        + default_help("connect_timeout", _seconds),
    ),
    (
        "--max-restarts",
        "restarts of the training process within 10 minutes before the job FAILS "
        + default_help("max_restarts"),
    ),
    (
        "--recovery-timeout",
        "seconds to wait for failed ps tasks before restarting anyway "
        + default_help("recovery_timeout", _seconds),
    ),
    (
        "--drop-after",
        "seconds a worker may stay unreachable before the job resizes without it (it can "
        "join again through psctl scale) " + default_help("drop_after", _seconds),
    ),
    (
        "--follow",
        "keep training: each new file of --train-data once, in path order, as its partition "
        "completes (docs/data.md, follow mode); needs --checkpoint-dir",
    ),
    (
        "--follow-marker",
        "--follow: a partition directory is complete when this file is in it "
        + default_help("follow_marker"),
    ),
    (
        "--settle-seconds",
        "--follow: a partition with no marker is complete when its files have not changed "
        "for this long, unless other partitions have markers "
        + default_help("settle_seconds", _seconds),
    ),
    (
        "--idle-timeout",
        "--follow: end cleanly (final checkpoint) after this long with no new file; "
        "seconds or 30s, 10m, 1h (default: never)",
    ),
    (
        "--export-every",
        "publish a serving version (a SavedModel in --export-dir/<step>/) this often, while "
        "training goes on; seconds or 30s, 10m, 1h (default: never)",
    ),
    ("--export-dir", "where --export-every publishes: TensorFlow Serving's base directory"),
    ("--export-keep", f"serving versions kept in --export-dir {default_help('export_keep')}"),
    (
        "--export-if-better",
        "--export-every: publish a version only when this evaluation metric (loss, auc, "
        "accuracy...) on the newest partition of --eval-data is not worse than the version "
        "in serving's (loss and *error: lower is better; others: higher) (default: always)",
    ),
]
# Run settings that are switches: ``--follow`` alone means true (``--follow false`` too).
SWITCH_FLAGS = {"--follow"}


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training (flags > PSCTL_* environment > --config file)")
    group.add_argument("--config", metavar="FILE", help="TOML job file ([train] table)")
    for flag, text in TRAIN_FLAGS:
        if flag in SWITCH_FLAGS:
            group.add_argument(flag, default=None, nargs="?", const="true", help=text)
        else:
            group.add_argument(flag, default=None, help=text)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug and TF logs")


def add_control_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--control-address",
        default=DEFAULT_CONTROL_ADDRESS,
        metavar="HOST:PORT",
        help="psctl's control API (default %(default)s; port 0 picks a free one)",
    )
    add_control_security(parser, server=True)


def train_flag_values(args: argparse.Namespace) -> dict[str, Any]:
    return flag_values(args, (flag for flag, _ in TRAIN_FLAGS))


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="psctl",
        description="Parameter-server training for TensorFlow 2.",
        epilog=(
            "Exit status: 0 ok, 1 failure, 2 bad command line, 69 unreachable, 70 restart budget "
            "used up, 77 control credential refused, 78 configuration error, 130 interrupted."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    local = sub.add_parser(
        "local",
        help="run a whole cluster on this machine and train a job on it",
        description="Start ps and worker servers on loopback, train, then stop every server.",
    )
    local.add_argument(
        "--ps", type=whole_number, default=1, help="ps servers (default %(default)s)"
    )
    local.add_argument(
        "--workers", type=whole_number, default=2, help="worker servers (default %(default)s)"
    )
    local.add_argument("--workdir", help="run directory (default ./psctl-work/local-TIME)")
    local.add_argument(
        "--start-timeout",
        type=decimal,
        default=None,
        help="seconds to wait for every server to be SERVING (default 120, longer for more "
        "than about 80 servers per 2 CPUs: each takes about a CPU-second to start)",
    )
    local.add_argument(
        "--open-tf-ports",
        action="store_true",
        help="leave TensorFlow's ports open to every local user and host, as TensorFlow "
        "serves them (a trusted machine only; default: in a private network namespace, "
        "docs/security.md; also PSCTL_OPEN_TF_PORTS=1)",
    )
    add_control_address(local)
    add_train_arguments(local)

    train = sub.add_parser(
        "train",
        help="drive a training job on an existing cluster",
        description="Run the coordinator (task type chief) against a running cluster.",
    )
    train.add_argument(
        "--cluster",
        metavar="FILE",
        help="cluster file (TF_CONFIG's JSON); default: $TF_CONFIG with chief",
    )
    train.add_argument(
        "--task-index",
        type=whole_number,
        metavar="N",
        help="--strategy sync: which worker of the cluster this host runs (0 is the chief); "
        "default: TF_CONFIG's task index",
    )
    train.add_argument(
        "--tasks-file",
        metavar="FILE",
        help=argparse.SUPPRESS,  # written by psctl local
    )
    # The supervisor runs the training process as `train ... --once`, telling it what it saw.
    train.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    train.add_argument("--supervisor-counters", help=argparse.SUPPRESS)
    add_control_address(train)
    train.add_argument(
        "--metrics-port",
        type=whole_number,
        default=None,
        help=f"coordinator's Prometheus /metrics port (default {DEFAULT_METRICS_PORT}; 0: off); "
        "--strategy sync: worker 0's",
    )
    train.add_argument(
        "--worker-metrics-port",
        type=whole_number,
        default=None,
        help="--strategy sync, every worker but 0: this worker's /metrics port (default: its "
        "TF port + 2000, as a worker-server's; 0: off)",
    )
    train.add_argument(
        "--health-port",
        type=whole_number,
        default=None,
        help="--strategy sync: this worker's grpc.health.v1 port, SERVING while it trains "
        "(default: its TF port + 1000, as a worker-server's; 0: off)",
    )
    add_train_arguments(train)

    check = sub.add_parser(
        "check-config",
        help="validate a cluster file (or $TF_CONFIG) and print it as a table",
        description="Validate a cluster file (or $TF_CONFIG, with its task) and print its "
        "tasks as a table; a mistake is one line naming the field, exit 78.",
    )
    check.add_argument("file", nargs="?", help="cluster file; default: $TF_CONFIG")
    COMMANDS.update(add_check_data_command(sub))
    CLIENT_COMMANDS.update(add_client_commands(sub))
    CLIENT_COMMANDS.update(add_deploy_commands(sub))
    COMMANDS.update(add_evaluate_command(sub))
    COMMANDS.update(add_export_command(sub))
    return parser


def cmd_check_config(args: argparse.Namespace) -> int:
    from psctl.cluster.dataservice import dispatcher_address
    from psctl.cluster.ports import HealthAddresses
    from psctl.cluster.spec import format_table
    from psctl.cluster.tf_config import check_config

    cluster, source, task = check_config(cluster_file=args.file, environ=os.environ)
    # The file's optional sections too: the tf.data service and the health addresses.
    dispatcher = dispatcher_address(flag=None, cluster_file=args.file, environ={})
    health = HealthAddresses.of_file(args.file)
    health.check_tasks({"ps": cluster.num_ps, "worker": cluster.num_workers})
    print(format_table(cluster, source=source))
    if task is not None:
        print(f"task: {task.task_type} {task.task_index} ({task.address})")
    if dispatcher:
        print(f"tf.data service dispatcher: {dispatcher}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    require_tensorflow()
    from psctl.coordinator.launch.strategy import train_main

    return train_main(args, train_flag_values(args))


def cmd_local(args: argparse.Namespace) -> int:
    args.started = STARTED  # the summary's start-up counts from here
    require_tensorflow()
    from psctl.coordinator.launch.strategy import local_main

    return local_main(args, train_flag_values(args))


COMMANDS: dict[str, Any] = {
    "check-config": cmd_check_config,
    "train": cmd_train,
    "local": cmd_local,
}
CLIENT_COMMANDS: dict[str, Any] = {}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.raw_argv = list(sys.argv[1:] if argv is None else argv)
    verbose = getattr(args, "verbose", False)
    configure_logging(verbose=verbose)
    quiet_tensorflow(verbose=verbose)
    training = args.command == "train" and args.once
    if training:  # it never runs atexit: autograph's files go where it can remove them
        scratch.use_private_tempdir()
    status = run_command(args)
    if training:
        # TensorFlow's cluster threads can hold up interpreter shutdown for minutes (seen
        # after a graceful stop): the run is over and its files are written, so leave now.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        end_quiet_import()  # a job still loading: its pipe holds this process's last lines
        scratch.remove_private_tempdir()
        os._exit(status)
    return status


def run_command(args: argparse.Namespace) -> int:
    """Run one command; every error a user can meet ends in one line and its status."""
    from psctl.coordinator.operations.client import ControlError

    try:
        check_ranges(args)
        return int({**COMMANDS, **CLIENT_COMMANDS}[args.command](args))
    except (ConfigError, ControlError) as err:
        print(f"psctl: error: {err}", file=sys.stderr)
        _quiet_teardown()
        return err.exit_status
    except BrokenPipeError:  # e.g. `psctl status --json | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("psctl: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # one line for the operator; the traceback with -v
        log.debug("failed", exc_info=True)
        print(f"psctl: error: {describe(err)}", file=sys.stderr)
        _quiet_teardown()
        return EXIT_FAILURE


def _quiet_teardown() -> None:
    """The error line stays the last one: TensorFlow warns as the objects of a failed
    restore are collected at exit (seen: 40 'Value in checkpoint could not be found'
    lines after `psctl export`'s error)."""
    logging.getLogger("tensorflow").setLevel(logging.ERROR)


if __name__ == "__main__":
    sys.exit(main())
