"""Sync against async: eval accuracy against wall seconds, psctl's three ways to train a job.

The same job, data, batch per worker and loopback hosts (``--workers`` 2; plus ``--ps`` 1 in
the async modes), one ``psctl local`` run per mode and repeat:

``sync``
    ``--strategy sync``: every worker runs the step under MultiWorkerMirroredStrategy and the
    gradients are all-reduced each step (one step = one batch on EVERY worker).
``async``
    The default parameter-server mode (``--update-mode default``, ``--steps-per-execution
    auto``; one step = one batch on one worker).
``async-local``
    Local-step mode (``--update-mode local --local-steps 50``).

Every run checkpoints every ``--checkpoint-every`` steps of its mode (about every 0.2 s at
its usual rate here; a checkpoint is a snapshot of the model the modes write alike), and the
parent scores the checkpoints with psctl's sidecar evaluator (``psctl evaluate``'s code: every
eval example once): the curve is eval accuracy against the checkpoint's write time, in
seconds from the start of the training loop: the final checkpoint's write time less the
summary's ``train_seconds`` (the loop's window, which that checkpoint closes in every mode;
tracing, the first calls and the checkpoints count, starting processes, connecting and
building the model do not). TTA is the first
checkpoint at or above ``--target``. While a run goes on the parent scores its newest
checkpoint every half second, and stops the run (``psctl stop``, graceful: the final
evaluation follows) ``--after-target`` seconds after it reached the target, or
``--max-seconds`` after its first checkpoint. From the run's summary: steps/s and examples/s
(its training window) and the final eval accuracy.

Printed: a line per run, a table (median over ``--repeats``), and last
``sync/async_best tta = R.RR``: sync's median TTA over the best async mode's (above 1: async
reaches the target sooner). Written to the results folder (default
``bench/results/sync-vs-async-<time>/``): ``tta.png`` (``bench/tta.py``'s plot), ``table.md``,
``results.json``, and every run's work dir.

    .venv/bin/python bench/sync_vs_async.py            # 3 repeats, ~4 minutes on 2 cores
    .venv/bin/python bench/sync_vs_async.py --quick    # a smoke test, lower target
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import throughput, tta
from bench.harness import results_dir, spawn

REPO = throughput.REPO


@dataclass(frozen=True)
class Mode:
    label: str  # "sync" | "async" | "async-local"
    flags: tuple[str, ...]
    checkpoint_every: int  # default steps between checkpoints: ~0.2 s at its usual rate

    @property
    def async_mode(self) -> bool:
        return self.label != "sync"


MODES = (
    Mode("sync", ("--strategy", "sync"), 60),
    Mode("async", ("--update-mode", "default"), 75),
    Mode("async-local", ("--update-mode", "local", "--local-steps", "50"), 500),
)


class Scorer:
    """Eval accuracy of a run's checkpoints, each scored once, by psctl's sidecar evaluator
    (``psctl evaluate``'s: the job's model restored from the checkpoint, every eval example
    once), so that every mode's checkpoints are read and scored by the same code."""

    def __init__(self, args: argparse.Namespace) -> None:
        from psctl.coordinator.job import load_job
        from psctl.coordinator.settings import TrainSettings
        from psctl.coordinator.training.evaluation.sidecar_eval import SidecarEvaluator

        settings = TrainSettings.of(job=args.job, checkpoint_dir="", seed=throughput.SEED)
        self.sidecar = SidecarEvaluator(load_job(args.job), settings)
        self.points: dict[str, list[float]] = {}  # path: [wall time, step, accuracy, loss]

    def checkpoints(self, directory: Path) -> list[str]:
        """The checkpoints saved so far (the state file lists each once it is complete)."""
        import tensorflow as tf

        state = tf.train.get_checkpoint_state(str(directory)) if directory.is_dir() else None
        return list(state.all_model_checkpoint_paths) if state else []

    def score(self, path: str) -> list[float] | None:
        from psctl.coordinator.training.reporting.summary import accuracy_of

        if path not in self.points:
            wall = Path(path + ".index").stat().st_mtime  # when the save finished
            result = self.sidecar.evaluate_checkpoint(path)
            if result is None:
                return None
            accuracy = accuracy_of(result.metrics)
            if accuracy is None:
                raise SystemExit(f"sync_vs_async: job {path} has no accuracy metric")
            self.points[path] = [wall, result.step, accuracy, result.loss]
        return self.points[path]

    def curve(self, directory: Path) -> list[list[float]]:
        """Every checkpoint's point, by time."""
        return sorted(p for p in map(self.score, self.checkpoints(directory)) if p is not None)


def run_mode(
    mode: Mode, args: argparse.Namespace, scorer: Scorer, results: Path, n: int
) -> dict[str, Any]:
    """One ``psctl local`` run of ``mode``, stopped after the target or at --max-seconds."""
    from psctl.coordinator.argv import psctl_argv

    name = f"run{n:02d}-{mode.label}"
    workdir, summary_path = results / name, results / f"{name}.json"
    control = f"127.0.0.1:{throughput._free_port()}"
    every = args.checkpoint_every.get(mode.label, mode.checkpoint_every)
    checkpoints = workdir / "checkpoints"
    argv = psctl_argv(
        "local",
        "--job", args.job,
        "--workers", str(args.workers),
        *(("--ps", str(args.ps)) if mode.async_mode else ()),
        *mode.flags,
        "--batch-size", str(args.batch_size),
        "--steps", str(10**8),  # until psctl stop
        "--checkpoint-every", str(every),
        "--keep-checkpoints", str(10**6),
        "--checkpoint-dir", str(checkpoints),
        "--log-every", "2",
        "--seed", str(throughput.SEED),
        "--workdir", str(workdir),
        "--control-address", control,
        "--summary-json", str(summary_path),
    )  # fmt: skip
    workdir.mkdir(parents=True)
    log_path = results / f"{name}.log"
    with log_path.open("wb") as log:
        proc = spawn(argv, stdout=log)  # Ctrl-C reaches the bench only; it stops the run
        stopped: float | None = None
        try:
            stopped = _watch(proc, scorer, checkpoints, control, args)
            code = proc.wait(timeout=args.max_seconds + args.start_timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # the run's own session
                proc.wait()
    if code != 0 or not summary_path.is_file():
        raise throughput.ChildFailed(
            f"{mode.label} run ended with status {code}; last lines of {log_path}:\n"
            f"{throughput._tail(log_path)}"
        )
    summary = json.loads(summary_path.read_text())
    # The clock starts with the training window (the summary's train_seconds): it ends where
    # the final checkpoint is written, in every mode (the summary file may be written later).
    final = scorer.checkpoints(checkpoints)[-1]
    t0 = Path(final + ".index").stat().st_mtime - summary["train_seconds"]
    curve = [[wall - t0, step, acc, loss] for wall, step, acc, loss in scorer.curve(checkpoints)]
    tta_s = next((at for at, _, acc, _ in curve if acc >= args.target), None)
    examples_per_step = args.batch_size * (1 if mode.async_mode else args.workers)
    return {
        "label": mode.label,
        "tta_s": tta_s,
        "stopped_at_s": None if stopped is None else stopped - t0,  # psctl stop sent
        "curve": curve,
        "evals": len(curve),
        "checkpoint_every": every,
        "steps": summary["global_step"],
        "steps_per_s": summary["steps_per_sec"],
        "examples_per_s": summary["steps_per_sec"] * examples_per_step,
        "summary_examples_per_s": summary["examples_per_sec"],
        "final_accuracy": summary["eval_accuracy"],
        "train_s": summary["train_seconds"],
        "wall_s": summary["wall_seconds"],
    }


def _watch(
    proc: subprocess.Popen[bytes], scorer: Scorer, checkpoints: Path, control: str, args: Any
) -> float | None:
    """Score the run's newest checkpoint every half second; ``psctl stop`` it --after-target s
    after one reached the target, or --max-seconds after its first. When it sent the stop."""
    from psctl.coordinator.argv import psctl_argv

    launched = time.monotonic()
    first: float | None = None
    reached: float | None = None
    while proc.poll() is None:
        time.sleep(0.5)
        paths = scorer.checkpoints(checkpoints)
        if not paths:
            if time.monotonic() - launched > args.start_timeout:
                raise subprocess.TimeoutExpired("psctl local", args.start_timeout)
            continue
        point = scorer.score(paths[-1])
        first = first or time.time()
        if reached is None and point is not None and point[2] >= args.target:
            reached = time.time()
        now = time.time()
        if now - first >= args.max_seconds or (reached and now >= reached + args.after_target):
            stop = psctl_argv("stop", "--address", control, "--timeout", "60")
            subprocess.run(stop, capture_output=True, timeout=90, cwd=REPO, check=False)
            return now
    return None


def summarize(runs: list[dict[str, Any]], modes: list[Mode]) -> list[dict[str, Any]]:
    rows = []
    for mode in modes:
        mine = [r for r in runs if r["label"] == mode.label]
        times = [r["tta_s"] for r in mine if r["tta_s"] is not None]
        rows.append(
            {
                "mode": mode.label,
                "runs": len(mine),
                "reached": len(times),
                "median_s": statistics.median(times) if len(times) == len(mine) else None,
                "first_point_s": statistics.median(
                    r["curve"][0][0] if r["curve"] else 0.0 for r in mine
                ),
                "steps_per_s": statistics.median(r["steps_per_s"] for r in mine),
                "examples_per_s": statistics.median(r["examples_per_s"] for r in mine),
                "final_accuracy": statistics.median(r["final_accuracy"] or 0.0 for r in mine),
                "checkpoint_every": mine[0]["checkpoint_every"],
            }
        )
    return rows


def ratio_line(rows: list[dict[str, Any]]) -> str:
    sync = [r["median_s"] for r in rows if r["mode"] == "sync" and r["median_s"]]
    best = [r["median_s"] for r in rows if r["mode"] != "sync" and r["median_s"]]
    if not sync or not best:
        return "sync/async_best tta = n/a (a mode never reached the target)"
    return f"sync/async_best tta = {sync[0] / min(best):.2f}"


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    fmt = tta._fmt_s
    lines = [
        "| mode | TTA median (s) | reached | first checkpoint at (s) | checkpoint every (steps) | "
        "steps/s | examples/s | final eval accuracy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {fmt(r['median_s'])} | {r['reached']}/{r['runs']} | "
            f"{fmt(r['first_point_s'])} | {r['checkpoint_every']} | {r['steps_per_s']:.0f} | "
            f"{r['examples_per_s']:.0f} | {r['final_accuracy']:.4f} |"
        )
    lines += [
        "",
        f"{args.job} job, {args.workers} workers (+ {args.ps} ps in the async modes), batch "
        f"{args.batch_size}/worker, target eval accuracy {args.target}, {args.repeats} "
        "repeat(s); TTA = seconds from the start of the training loop to the first checkpoint "
        "whose eval accuracy (every eval example) is at or above the target (datasets, tracing "
        "and the checkpoints included); a sync step is a batch on every worker, an async step "
        "a batch on one; steps/s and examples/s over the run's training window (its "
        "summary); final eval accuracy over every eval example after the stop.",
        "",
        ratio_line(rows),
    ]
    return "\n".join(lines) + "\n"


def parse_steps(text: str) -> dict[str, int]:
    """``sync=25,async=50`` -> {"sync": 25, "async": 50}."""
    labels = {m.label for m in MODES}
    found: dict[str, int] = {}
    for part in filter(None, text.split(",")):
        label, _, steps = part.partition("=")
        if label not in labels or not steps.isdigit() or int(steps) < 1:
            raise argparse.ArgumentTypeError(f"{part!r}: want MODE=STEPS, MODE one of {labels}")
        found[label] = int(steps)
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", default=throughput.JOB, help="job to train (default mlp)")
    parser.add_argument("--ps", type=int, default=1, help="ps tasks in the async modes (1)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="per worker (default 64)")
    parser.add_argument("--target", type=float, default=0.90, help="eval accuracy (0.90)")
    parser.add_argument(
        "--checkpoint-every",
        type=parse_steps,
        default={},
        help="steps between checkpoints per mode, e.g. sync=60,async=75,async-local=500 "
        "(those are the defaults)",
    )
    parser.add_argument(
        "--after-target", type=float, default=3.0, help="seconds to go on after the target (3)"
    )
    parser.add_argument(
        "--max-seconds", type=float, default=60.0, help="stop a run after this long (60)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", help="only these modes, e.g. sync,async (default all)")
    parser.add_argument(
        "--results", help="results folder (default bench/results/sync-vs-async-<time>)"
    )
    parser.add_argument("--start-timeout", type=float, default=180.0)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: target 0.5, at most 8 s per run, 1 s after the target",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:  # a smoke test of the whole path (the suite runs it): not a measurement
        args.repeats, args.target, args.max_seconds, args.after_target = 1, 0.5, 8.0, 1.0
    from psctl.cluster.processes.logs import quiet_tensorflow, tensorflow_import_quietly

    quiet_tensorflow()
    with tensorflow_import_quietly():  # now, so that polling a run's events starts at once
        import tensorflow as tf
    tf.get_logger().setLevel("ERROR")  # summary_iterator's deprecation notice
    modes = [m for m in MODES if not args.modes or m.label in args.modes.split(",")]
    results = results_dir(args.results, "sync-vs-async")
    print(f"results {results}; {len(modes)} modes x {args.repeats} repeat(s)", flush=True)
    print(f"{throughput._load()} (other work on this machine skews every mode)", flush=True)
    runs: list[dict[str, Any]] = []
    scorer = Scorer(args)
    try:
        for repeat in range(args.repeats):
            shift = repeat % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                result = run_mode(mode, args, scorer, results, len(runs) + 1)
                runs.append(result)
                print(
                    f"[{repeat + 1}/{args.repeats}] {mode.label:<12} tta "
                    f"{tta._fmt_s(result['tta_s']):>7}s  ({result['steps']} steps, "
                    f"{result['steps_per_s']:.0f} steps/s, {result['evals']} checkpoints, "
                    f"final eval acc {result['final_accuracy'] or 0:.4f})",
                    flush=True,
                )
    except throughput.ChildFailed as err:
        print(f"sync_vs_async: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("sync_vs_async: interrupted", file=sys.stderr)
        return 130
    print(throughput._load(), flush=True)
    rows = summarize(runs, modes)
    text = table(rows, args)
    print()
    print(text, end="")
    (results / "table.md").write_text(text)
    report = {"config": {k: v for k, v in vars(args).items()}, "runs": runs, "summary": rows}
    (results / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    png = results / "tta.png"
    tta.plot(runs, modes, args.target, png, xlabel="seconds from the start of the training loop")
    print(f"plot {png}\ntable {results / 'table.md'}")
    line = ratio_line(rows)
    print(line, flush=True)
    return 1 if line.endswith(")") else 0


if __name__ == "__main__":
    sys.exit(main())
