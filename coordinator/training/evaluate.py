"""`psctl evaluate`: a sidecar evaluator that follows a training run's checkpoints.

One local process, no cluster: it builds the job's model and optimizer, and each time a new
checkpoint appears in ``--checkpoint-dir`` it restores it (the trainer's
``tf.train.Checkpoint(model, optimizer, global_step)``) and evaluates the job's
``eval_dataset_fn`` (worker 0 of 1: every eval example once), printing one line::

    eval | step:    600 | loss: 0.1234 | accuracy: 0.9650 | 10000 examples in 0.41s

It evaluates the newest checkpoint each time it looks (checkpoints written faster than it
evaluates are skipped, never queued), and exits 0 after the final one: the first whose step
reaches ``--steps`` (flag, ``PSCTL_STEPS`` or the ``--config`` file), the
``--max-evaluations``-th, or the last before ``--timeout`` seconds pass without a new one
(exit 69 if none ever came). SIGTERM ends it after the evaluation in progress.

TensorFlow is imported only when the command runs, so ``psctl --help`` stays light.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from psctl.cluster.errors import EXIT_UNAVAILABLE, ConfigError
from psctl.cluster.files import write_json_atomic
from psctl.coordinator.settings import (
    ENV_PREFIX,
    TrainSettings,
    default_help,
    flag_values,
    load_toml,
    resolve_settings,
)
from psctl.coordinator.training.report import eval_line

if TYPE_CHECKING:
    from psctl.coordinator.job import Job

log = logging.getLogger("psctl.evaluate")

DEFAULT_POLL_INTERVAL = 2.0
DEFAULT_TIMEOUT = 3600.0

# Run settings shared with training (flags > PSCTL_* environment > --config [train] table).
SHARED_FLAGS: list[tuple[str, type, str]] = [
    ("--job", str, f"the job that trained the checkpoints {default_help('job')}"),
    ("--checkpoint-dir", str, "the training run's checkpoint directory (required)"),
    ("--eval-data", str, "evaluation files (glob) for the job; default: the job's own"),
    ("--label-column", str, f"CSV label column {default_help('label_column')}"),
    ("--eval-batch-size", int, f"evaluation batch size {default_help('eval_batch_size')}"),
    ("--seed", int, f"seed given to the dataset function {default_help('seed')}"),
]


def add_evaluate_command(sub: Any) -> dict[str, Any]:
    """Register ``psctl evaluate`` on the CLI's subparsers; returns {name: handler}."""
    parser = sub.add_parser(
        "evaluate",
        help="sidecar evaluator: evaluate each new checkpoint of a run as it appears",
        description=(
            "Evaluate every new checkpoint in --checkpoint-dir once, in this process (no "
            "cluster), and exit after the final one."
        ),
    )
    parser.add_argument("--config", metavar="FILE", help="TOML job file ([train] table)")
    for flag, kind, text in SHARED_FLAGS:
        parser.add_argument(flag, type=kind, default=None, help=text)
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="the run's final global step: exit after evaluating a checkpoint that reaches it "
        "(default: PSCTL_STEPS or the --config file's steps, else none)",
    )
    parser.add_argument(
        "--max-evaluations", type=int, default=None, help="exit after N evaluations"
    )
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=DEFAULT_POLL_INTERVAL,
        help=f"seconds between looks for a new checkpoint (default {DEFAULT_POLL_INTERVAL:g})",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"exit when no new checkpoint appears for this long (default {DEFAULT_TIMEOUT:g} s)",
    )
    parser.add_argument(
        "--summary-json", help="write every evaluation so far as JSON here (after each one)"
    )
    parser.add_argument("--logdir", help="TensorBoard scalars (eval/loss, eval/<metric>) here")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug and TF logs")
    return {"evaluate": evaluate_main}


@dataclass
class Evaluation:
    step: int
    checkpoint: str
    loss: float
    metrics: dict[str, float]
    examples: int
    seconds: float
    timestamp: float


@dataclass
class EvaluateSummary:
    """``--summary-json``: rewritten after every evaluation."""

    job: str
    checkpoint_dir: str
    final_step: int | None
    evaluations: list[Evaluation] = field(default_factory=list)
    done: bool = False
    reason: str = ""  # final-step, max-evaluations, timeout, stopped
    global_step: int | None = None  # of the last evaluation
    eval_loss: float | None = None
    eval_accuracy: float | None = None
    eval_metrics: dict[str, float] = field(default_factory=dict)


def _final_step(args: argparse.Namespace, environ: Any = None) -> int | None:
    """--steps, else PSCTL_STEPS, else the config file's steps (as for training)."""
    env = os.environ if environ is None else environ
    value: Any = args.steps
    where = "--steps"
    if value is None and env.get(ENV_PREFIX + "STEPS"):
        value, where = env[ENV_PREFIX + "STEPS"], ENV_PREFIX + "STEPS"
    if value is None and args.config:
        value, where = load_toml(args.config).get("steps"), f"{args.config}: steps"
    if value is None:
        return None
    try:
        steps = int(value)
    except (TypeError, ValueError):
        raise ConfigError(where, f"{value!r} is not a whole number", "give a step >= 1") from None
    if steps < 1:
        raise ConfigError(where, f"got {steps}", "give a step >= 1")
    return steps


def resolve(args: argparse.Namespace) -> tuple[TrainSettings, int | None]:
    flags = flag_values(args, (flag for flag, *_ in SHARED_FLAGS))
    settings = resolve_settings(flags=flags, config_file=args.config)
    if not settings.checkpoint_dir:
        raise ConfigError(
            "--checkpoint-dir", "is required", "give the training run's checkpoint directory"
        )
    if args.max_evaluations is not None and args.max_evaluations < 1:
        raise ConfigError("--max-evaluations", f"got {args.max_evaluations}", "give N >= 1")
    if not args.poll_interval > 0:
        raise ConfigError("--poll-interval", f"got {args.poll_interval}", "give seconds > 0")
    if not args.timeout > 0:
        raise ConfigError("--timeout", f"got {args.timeout}", "give seconds > 0")
    return settings, _final_step(args)


def evaluate_main(args: argparse.Namespace) -> int:
    settings, final_step = resolve(args)
    from psctl.coordinator.job import load_job

    job = load_job(settings.job)
    if job.eval_dataset_fn is None:
        raise ConfigError(
            f"--job {settings.job}",
            "defines no eval_dataset_fn, so there is nothing to evaluate",
            "add def eval_dataset_fn(ctx) to the job",
        )
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda _signum, _frame: stop.set())
    sidecar = SidecarEvaluator(job, settings, logdir=args.logdir or "")
    summary = EvaluateSummary(
        job=settings.job, checkpoint_dir=settings.checkpoint_dir, final_step=final_step
    )
    log.info(
        "watching %s for checkpoints (job %s%s)",
        settings.checkpoint_dir,
        settings.job,
        f", final step {final_step}" if final_step else "",
    )
    last_path = ""
    last_new = time.monotonic()
    reason = ""
    while not reason:
        path = sidecar.latest_checkpoint()
        if path and path != last_path:
            last_path, last_new = path, time.monotonic()
            result = sidecar.evaluate_checkpoint(path)
            if result is not None:
                _record(summary, result)
                print(_line(result), flush=True)
                if args.summary_json:
                    write_json(summary, args.summary_json)
                if final_step is not None and result.step >= final_step:
                    reason = "final-step"
                elif args.max_evaluations and len(summary.evaluations) >= args.max_evaluations:
                    reason = "max-evaluations"
        elif time.monotonic() - last_new >= args.timeout:
            reason = "timeout"
        if not reason and stop.wait(args.poll_interval):
            reason = "stopped"
    summary.done, summary.reason = True, reason
    if args.summary_json:
        write_json(summary, args.summary_json)
    if not summary.evaluations and reason == "timeout":
        print(
            f"psctl: error: no checkpoint appeared in {settings.checkpoint_dir} "
            f"within {args.timeout:g}s",
            file=sys.stderr,
        )
        return EXIT_UNAVAILABLE
    log.info("done after %d evaluation(s) (%s)", len(summary.evaluations), reason)
    return 0


def _record(summary: EvaluateSummary, result: Evaluation) -> None:
    summary.evaluations.append(result)
    summary.global_step = result.step
    summary.eval_loss = result.loss
    summary.eval_accuracy = result.metrics.get("accuracy")
    summary.eval_metrics = dict(result.metrics)


def _line(result: Evaluation) -> str:
    values = {"loss": result.loss, **result.metrics}
    return eval_line(result.step, values, examples=result.examples, seconds=result.seconds)


def write_json(summary: EvaluateSummary, path: str) -> None:
    """Atomically, so a reader never sees half a file."""
    write_json_atomic(path, asdict(summary), sort_keys=True, newline=True)


class SidecarEvaluator:
    """The job's model and optimizer in this process, restored from each checkpoint."""

    def __init__(self, job: Job, settings: TrainSettings, *, logdir: str = "") -> None:
        import tensorflow as tf

        from psctl.coordinator.job import DataContext
        from psctl.coordinator.training.evaluation import DatasetEvaluator
        from psctl.coordinator.training.model import JobModel
        from psctl.coordinator.training.tensorboard import ScalarWriter

        self.job = job
        self.settings = settings
        # Evaluation's context, as the trainer gives it: worker 0 of 1, the whole split.
        ctx = DataContext.from_settings(
            settings, worker_index=0, num_workers=1, batch_size=settings.eval_batch_size
        )
        assert job.eval_dataset_fn is not None
        self.dataset = job.eval_dataset_fn(ctx)  # checks --eval-data files now, before waiting
        x_spec, y_spec = self.dataset.element_spec[0], self.dataset.element_spec[1]
        built = JobModel(job, x_spec, y_spec)
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        # The trainer's checkpoint: the same object names, so every variable matches.
        self.checkpoint = built.checkpoint(self.step)
        self.evaluator = DatasetEvaluator(
            built.model, job.loss_fn, built.metric_factories, compiled=True
        )
        self.writer = ScalarWriter(logdir) if logdir else None
        # Trace the step and start the input pipeline now, while no checkpoint is waiting.
        for batch in self.dataset.take(1):
            self.evaluator.step(batch[0], batch[1])

    def latest_checkpoint(self) -> str | None:
        import tensorflow as tf

        try:
            path: str | None = tf.train.latest_checkpoint(self.settings.checkpoint_dir)
        except tf.errors.OpError as err:  # e.g. a half-written state file on some file systems
            log.debug("cannot read checkpoint state: %s", err)
            return None
        return path

    def evaluate_checkpoint(self, path: str) -> Evaluation | None:
        """Restore ``path`` and evaluate; None if it vanished first (rotated away)."""
        import tensorflow as tf

        try:
            status = self.checkpoint.restore(path)
            status.assert_existing_objects_matched()
        except tf.errors.OpError as err:
            # Rotated away by the trainer's --keep-checkpoints between the look and the read.
            log.warning("cannot read %s (%s); skipping it", path, type(err).__name__)
            return None
        except (AssertionError, ValueError) as err:
            # The half-restored checkpoint lists every unused value when collected: noise here.
            logging.getLogger("tensorflow").setLevel(logging.ERROR)
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise ConfigError(
                f"--job {self.settings.job}",
                f"its model does not match checkpoint {path} ({first[:200]})",
                "evaluate with the --job that wrote the checkpoints",
            ) from None
        status.expect_partial()
        step = int(self.step.numpy())
        started = time.monotonic()
        values, examples = self.evaluator.run(self.dataset)
        loss = values.pop("loss")
        result = Evaluation(
            step=step,
            checkpoint=path,
            loss=loss,
            metrics=values,
            examples=examples,
            seconds=time.monotonic() - started,
            timestamp=time.time(),
        )
        self._summarize(result)
        return result

    def _summarize(self, result: Evaluation) -> None:
        if self.writer is not None:
            self.writer.write("eval", result.step, {"loss": result.loss, **result.metrics})
