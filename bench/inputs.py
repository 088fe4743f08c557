"""Input pipelines side by side: in-memory data vs per-worker files vs the tf.data service.

Trains the built-in ``mlp`` job on the same 40,000 examples (its default data, also written
to CSV files) with ``psctl local``, once per mode and repeat, and compares the training
rate in examples per second:

``memory``          the job's in-memory arrays, each worker its shard (``--steps``)
``files``           ``--train-data 'train-*.csv'``: each worker its own files (``--steps``)
``service-files``   the same files through the tf.data service (``--epochs``)
``service-memory``  the in-memory arrays through the tf.data service (``--epochs``)

Every mode trains the same number of examples (``--epochs`` passes: 625 steps of 64 per
pass). The rate is examples / the Summary's ``train_seconds`` (from creating the per-worker
dataset until the last call finished: it includes each worker's first call, so the set-up
of the service and of the file readers counts), so process start, connecting and the final
evaluation are left out. The modes run interleaved, the order rotated each round; the table
shows the median, the range and the ratio to ``memory``.

    .venv/bin/python bench/inputs.py --quick        # 1 pass, 1 round: about 3 minutes
    .venv/bin/python bench/inputs.py --modes memory,service-files   # a subset
    .venv/bin/python bench/inputs.py                # 2 passes, 3 rounds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from psctl.coordinator.argv import psctl_argv  # noqa: E402

MODES = ("memory", "files", "service-files", "service-memory")


def write_files(directory: Path, count: int) -> tuple[str, int]:
    """The mlp job's training data as ``count`` CSV files; returns (glob, examples)."""
    import numpy as np

    from psctl.coordinator.data.readers import write_csv
    from psctl.jobs.mlp import make_data

    x, y, _, _ = make_data()
    directory.mkdir(parents=True, exist_ok=True)
    parts = zip(np.array_split(x, count), np.array_split(y, count), strict=True)
    for i, (xs, ys) in enumerate(parts):
        write_csv(directory / f"train-{i:03d}.csv", xs, ys)
    return str(directory / "train-*.csv"), len(y)


def run_mode(
    mode: str, args: argparse.Namespace, pattern: str, examples: int, workdir: Path
) -> dict[str, Any]:
    out = workdir / "summary.json"
    argv = psctl_argv(
        "local",
        "--workdir",
        str(workdir),
        "--control-address",
        "127.0.0.1:0",
        "--workers",
        str(args.workers),
        "--job",
        "mlp",
        "--batch-size",
        str(args.batch_size),
        "--steps-per-execution",
        str(args.steps_per_execution),
        "--log-every",
        "30",
        "--summary-json",
        str(out),
    )
    if mode.startswith("service"):
        argv += ["--epochs", str(args.epochs)]
    else:
        argv += ["--steps", str(args.epochs * examples // args.batch_size)]
    if mode.endswith("files"):
        argv += ["--train-data", pattern]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    started = time.monotonic()
    proc = subprocess.run(
        argv, capture_output=True, text=True, env=env, timeout=args.timeout, cwd=REPO
    )
    (workdir / "stderr.log").write_text(proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads(out.read_text())
    trained = args.epochs * examples
    return {
        "mode": mode,
        "examples": trained,
        "train_seconds": summary["train_seconds"],
        "examples_per_sec": trained / summary["train_seconds"],
        "global_step": summary["global_step"],
        "eval_accuracy": summary["eval_accuracy"],
        "wall_seconds": time.monotonic() - started,
    }


def print_table(
    runs: list[dict[str, Any]], args: argparse.Namespace, modes: tuple[str, ...]
) -> None:
    by_mode = {m: [r["examples_per_sec"] for r in runs if r["mode"] == m] for m in modes}
    base = statistics.median(by_mode[modes[0]])
    print(
        f"\nmlp, {args.workers} workers, batch {args.batch_size}/worker, "
        f"K={args.steps_per_execution}, {args.epochs} pass(es) of 40,000 examples, "
        f"{args.repeats} round(s); load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'mode':<16}{'ex/s (median)':>14}{'range':>20}{'vs ' + modes[0]:>11}{'eval acc':>10}")
    for mode, rates in by_mode.items():
        accuracy = [r["eval_accuracy"] for r in runs if r["mode"] == mode][-1]
        print(
            f"{mode:<16}{statistics.median(rates):>14.0f}"
            f"{f'{min(rates):.0f}-{max(rates):.0f}':>20}"
            f"{statistics.median(rates) / base:>11.2f}{accuracy:>10.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 pass, 1 round")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the data (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over all modes")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps-per-execution", type=int, default=20)
    parser.add_argument("--files", type=int, default=8, help="CSV files (default 8)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--workdir", help="default psctl-work/bench-inputs-<time>")
    parser.add_argument("--json", metavar="PATH", help="write every run here")
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.repeats = 1, 1
    workdir = Path(args.workdir or f"psctl-work/bench-inputs-{time.strftime('%Y%m%d-%H%M%S')}")
    pattern, examples = write_files(workdir / "data", args.files)
    runs = []
    modes = tuple(m for m in MODES if m in args.modes.split(","))
    if not modes:
        parser.error(f"--modes: give some of {','.join(MODES)}")
    for round_ in range(args.repeats):
        order = modes[round_ % len(modes) :] + modes[: round_ % len(modes)]
        for mode in order:
            result = run_mode(mode, args, pattern, examples, workdir / f"{mode}-{round_}")
            print(
                f"{mode:<16} {result['examples_per_sec']:8.0f} ex/s "
                f"(train {result['train_seconds']:.1f}s, wall {result['wall_seconds']:.1f}s)",
                flush=True,
            )
            runs.append(result)
    print_table(runs, args, modes)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
