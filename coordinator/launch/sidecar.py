"""`psctl evaluate`: the sidecar evaluator's process, following a training run's checkpoints.

One local process, no cluster: it builds a ``SidecarEvaluator``
(training/evaluation/sidecar_eval.py) and each time a new checkpoint appears in
``--checkpoint-dir`` has it evaluate that one, printing one line::

    eval | step:    600 | loss: 0.1234 | accuracy: 0.9650 | 10000 examples in 0.41s

It evaluates the newest checkpoint each time it looks (checkpoints written faster than it
evaluates are skipped, never queued), and exits 0 after the final one: the first whose step
reaches ``--steps`` (flag, ``PSCTL_STEPS`` or the ``--config`` file), the
``--max-evaluations``-th, or the last before ``--timeout`` seconds pass without a new one
(exit 69 if none ever came). SIGTERM ends it after the evaluation in progress.
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
from typing import Any

from psctl.cluster.errors import EXIT_UNAVAILABLE, ConfigError
from psctl.cluster.processes.files import write_json_atomic
from psctl.cluster.processes.signals import SignalRelay
from psctl.coordinator.settings import ENV_PREFIX, TrainSettings, load_toml, resolve_settings
from psctl.coordinator.training.evaluation.report import eval_line
from psctl.coordinator.training.evaluation.sidecar_eval import Evaluation, SidecarEvaluator

log = logging.getLogger("psctl.evaluate")


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


def resolve(args: argparse.Namespace, flags: dict[str, Any]) -> tuple[TrainSettings, int | None]:
    """The run settings (``flags``: the shared flags' values, by setting name) and the final
    step, checked."""
    chosen = getattr(args, "checkpoint", None)
    if chosen:
        # One checkpoint: its directory is the one to read, whatever else is set.
        flags = {**flags, "checkpoint_dir": os.path.dirname(os.path.abspath(chosen))
                 if "://" not in chosen else chosen.rsplit("/", 1)[0]}  # fmt: skip
    settings = resolve_settings(flags=flags, config_file=args.config)
    if not settings.checkpoints.checkpoint_dir:
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


def evaluate_main(args: argparse.Namespace, flags: dict[str, Any]) -> int:
    settings, final_step = resolve(args, flags)
    from psctl.coordinator.job import load_job

    job = load_job(settings.job)
    paths = _chosen_checkpoints(args, settings.checkpoints.checkpoint_dir)
    if job.eval_dataset_fn is None:
        raise ConfigError(
            f"--job {settings.job}",
            "defines no eval_dataset_fn, so there is nothing to evaluate",
            "add def eval_dataset_fn(ctx) to the job",
        )
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        SignalRelay(lambda _signum: stop.set(), [signal.SIGTERM])
    sidecar = SidecarEvaluator(job, settings, logdir=args.logdir or "")
    summary = EvaluateSummary(
        job=settings.job, checkpoint_dir=settings.checkpoints.checkpoint_dir, final_step=final_step
    )
    if paths is not None:
        return _evaluate_each(sidecar, summary, paths, args)
    log.info(
        "watching %s for checkpoints (job %s%s)",
        settings.checkpoints.checkpoint_dir,
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
            f"psctl: error: no checkpoint appeared in {settings.checkpoints.checkpoint_dir} "
            f"within {args.timeout:g}s",
            file=sys.stderr,
        )
        return EXIT_UNAVAILABLE
    log.info("done after %d evaluation(s) (%s)", len(summary.evaluations), reason)
    return 0


def _chosen_checkpoints(args: argparse.Namespace, directory: str) -> list[str] | None:
    """``--checkpoint PATH``: that one; ``--all``: every checkpoint in ``directory``, oldest
    first; else None (watch the directory). A path or directory with no checkpoint is one
    line, exit 78, at once."""
    from psctl.coordinator.training.saving.checkpoint_files import checkpoints_in

    chosen = getattr(args, "checkpoint", None)
    if chosen:
        import tensorflow as tf

        name = os.path.basename(chosen.rstrip("/"))
        if not tf.io.gfile.exists(chosen + ".index"):
            present = [f.name for f in checkpoints_in(os.path.dirname(chosen) or ".")]
            raise ConfigError(
                "--checkpoint",
                f"{chosen} is not a checkpoint (no {name}.index)",
                f"give a DIR/ckpt-N prefix ({', '.join(present[:5])} are there)"
                if present
                else "give a DIR/ckpt-N prefix of a training run's checkpoint directory",
            )
        return [chosen]
    if getattr(args, "all", False):
        found = sorted(checkpoints_in(directory), key=lambda f: f.step)
        if not found:
            raise ConfigError(
                "--checkpoint-dir",
                f"no checkpoint (ckpt-N.index) in {directory}",
                "give the checkpoint directory of a training run",
            )
        return [f.prefix for f in found]
    return None


def _evaluate_each(
    sidecar: Any, summary: EvaluateSummary, paths: list[str], args: argparse.Namespace
) -> int:
    """Evaluate ``paths`` in order, a line and a JSON entry each, then exit 0."""
    for path in paths:
        result = sidecar.evaluate_checkpoint(path)
        if result is None:  # rotated away meanwhile
            log.warning("checkpoint %s is gone (rotated away?): skipped", path)
            continue
        _record(summary, result)
        print(_line(result), flush=True)
        if args.summary_json:
            write_json(summary, args.summary_json)
    summary.done, summary.reason = True, "checkpoint" if args.checkpoint else "all"
    if args.summary_json:
        write_json(summary, args.summary_json)
    log.info("done after %d evaluation(s)", len(summary.evaluations))
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
