"""Time to accuracy: psctl against the raw TensorFlow parameter-server loop, on one cluster.

For every mode, the wall seconds of training from the first ``schedule()`` until the held-out
eval accuracy first reaches ``--target`` (default 0.90). Evaluation runs at a fixed cadence
of training time (``--eval-every``): the loop drains its in-flight calls (raw:
``coordinator.join()``; psctl: the loop's own drain), the ps variables are copied into a
local model and the eval split is scored on the coordinator; that pause is left out of the
clock and reported apart. Modes (same cluster, data, batch per worker, model and job):

``raw@1``, ``raw@K``
    The TF tutorial loop (``bench/throughput.py``'s ``build_raw``) at 1 and K steps per
    call; ``raw_tf_best`` is the fastest of them.
``psctl``
    ``coordinator.trainer.Trainer`` in its default mode, ``--steps-per-execution auto``.
``psctl-local``
    ``Trainer`` with ``--update-mode local --local-steps 50``.

Each mode runs ``--repeats`` times (order rotated per round), each run in a fresh
coordinator process against the same servers. Printed: per-run lines, a table with min and
median, the peak RSS of every process, and last ``raw_tf_best/psctl_best tta = R.RR`` (the
median TTA of the best raw mode over that of the best psctl mode). Written to the results
folder (default ``bench/results/tta-<time>/``): ``tta.png`` (eval accuracy and loss against
training seconds, every mode), ``table.md`` and ``results.json``.

    .venv/bin/python bench/tta.py            # ~6 minutes on 2 cores
    .venv/bin/python bench/tta.py --quick    # one round, lower target: a smoke test
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import throughput

REPO = throughput.REPO


@dataclass(frozen=True)
class Mode:
    kind: str  # "raw" | "psctl" | "psctl-local"
    k: int  # steps per call; 0 = auto

    @property
    def label(self) -> str:
        if self.kind == "raw":
            return f"raw@{self.k}"
        return self.kind


# --------------------------------------------------------------------------------------------
# Children: one measured run each, one JSON line on stdout.
# --------------------------------------------------------------------------------------------


class Probe:
    """Snapshots of the ps variables at a cadence of training time, scored on the coordinator.

    A snapshot (``--eval-every``) is a plain read of every variable while the workers go on:
    the model as it is at that second; its small cost counts as training time. Scoring is
    left out of the clock: snapshots are scored after training, except that every
    ``--check-every`` seconds the loop drains its calls and scores one there and then, to
    stop once the target is reached (its pause is excluded too).
    """

    def __init__(self, job: Any, variables: list[Any], args: argparse.Namespace) -> None:
        import keras
        import tensorflow as tf

        from coordinator.job import DataContext
        from coordinator.metric_objects import make_eval_step, metric_factories

        if job.eval_dataset_fn is None:
            raise SystemExit(f"tta: job {job.name} has no eval_dataset_fn")
        self.variables = variables
        self.model = job.create_model()
        ctx = DataContext(worker_index=0, num_workers=1, batch_size=1024, seed=throughput.SEED)
        self.batches = list(job.eval_dataset_fn(ctx))
        x, y = self.batches[0][0], self.batches[0][1]
        if not self.model.built:
            self.model.build(x.shape)
        if len(self.model.variables) != len(variables):
            raise SystemExit("tta: the eval model's variables do not match the trained ones")
        pred_shape = self.model(x[:1]).shape
        factories = metric_factories(job.metrics, label_shape=y.shape, pred_shape=pred_shape)
        self.loss = keras.metrics.Mean(name="loss")
        self.metrics = [make() for make in factories]
        if "accuracy" not in [m.name for m in self.metrics]:
            raise SystemExit(f"tta: job {job.name} has no accuracy metric")
        self.step = tf.function(make_eval_step(self.model, job.loss_fn, self.loss, self.metrics))
        self.cadence, self.target, self.max_seconds = args.eval_every, args.target, args.max_seconds
        self.check_every = args.check_every
        self.t0: float | None = None
        self.excluded = 0.0  # seconds of scoring, off the clock
        self.snapshot_s = 0.0  # seconds of reading snapshots, on the clock
        self.next_snapshot = self.next_check = 0.0
        self.snapshots: list[tuple[float, int, list[Any]]] = []
        self.scores: dict[int, tuple[float, float]] = {}  # snapshot index: (accuracy, loss)
        self.reached = False
        self.first_call_s: float | None = None  # the clock when the first call finished

    def first_call_done(self) -> None:
        if self.first_call_s is None:
            self.first_call_s = self.train_seconds()

    def start(self) -> None:
        if self.t0 is None:
            self.t0 = time.monotonic()
            self.next_snapshot, self.next_check = self.cadence, self.check_every

    def train_seconds(self) -> float:
        return 0.0 if self.t0 is None else time.monotonic() - self.t0 - self.excluded

    def snapshot_due(self) -> bool:
        return self.t0 is not None and self.train_seconds() >= self.next_snapshot

    def check_due(self) -> bool:
        return self.t0 is not None and self.train_seconds() >= self.next_check

    def done(self) -> bool:
        return self.reached or self.train_seconds() >= self.max_seconds

    def snapshot(self, step: int) -> None:
        at = self.train_seconds()
        began = time.monotonic()
        self.snapshots.append((at, step, [v.numpy() for v in self.variables]))
        self.snapshot_s += time.monotonic() - began
        self.next_snapshot = at + self.cadence

    def check(self, step: int) -> None:
        """Call with every call drained: snapshot and score now; stop at the target."""
        self.snapshot(step)
        began = time.monotonic()
        accuracy, _ = self._score(len(self.snapshots) - 1)
        self.reached = accuracy >= self.target
        self.excluded += time.monotonic() - began
        self.next_check = self.train_seconds() + self.check_every

    def _score(self, index: int) -> tuple[float, float]:
        if index not in self.scores:
            for copy, value in zip(self.model.variables, self.snapshots[index][2], strict=True):
                copy.assign(value)
            self.loss.reset_state()
            for metric in self.metrics:
                metric.reset_state()
            for batch in self.batches:
                self.step(batch[0], batch[1])
            accuracy = next(m for m in self.metrics if m.name == "accuracy").result()
            self.scores[index] = (float(accuracy), float(self.loss.result()))
        return self.scores[index]

    def result(self) -> dict[str, Any]:
        train_s = self.train_seconds()
        began = time.monotonic()
        curve = []
        for i, (at, step, _) in enumerate(self.snapshots):
            accuracy, loss = self._score(i)
            curve.append([at, step, accuracy, loss])
        tta = next((at for at, _, acc, _ in curve if acc >= self.target), None)
        return {
            "tta_s": tta,
            "first_call_s": self.first_call_s,
            "curve": curve,
            "evals": len(curve),
            "eval_s": self.excluded + time.monotonic() - began,
            "snapshot_s": self.snapshot_s,
            "train_s": train_s,
            "final_accuracy": curve[-1][2] if curve else None,
        }


def run_raw(args: argparse.Namespace) -> dict[str, Any]:
    from coordinator.job import load_job
    from coordinator.trainer import _is_done

    raw = throughput.build_raw(
        args.cluster, batch_size=args.batch_size, k=args.steps_per_execution, job_name=args.job
    )
    probe = Probe(load_job(args.job), raw.model.variables, args)
    raw.warm_up()
    coordinator = raw.coordinator
    iterator = iter(coordinator.create_per_worker_dataset(raw.per_worker_dataset_fn))
    steps = 0
    # schedule() returns at once until TF's closure queue is full (thousands of calls): the
    # tutorial's loop joins per epoch; here at most psctl's in-flight bound (4 per worker) is
    # outstanding, so an eval sees the variables of the time it is due, as psctl's does.
    in_flight: collections.deque[Any] = collections.deque()
    bound = 4 * raw.num_workers
    probe.start()
    while not probe.done():
        in_flight.append(coordinator.schedule(raw.train_fn, args=(iterator,)))
        steps += args.steps_per_execution
        if probe.first_call_s is None and _is_done(in_flight[0]):
            probe.first_call_done()
        if len(in_flight) > bound:
            in_flight.popleft().fetch()
            probe.first_call_done()
            done = steps - len(in_flight) * args.steps_per_execution
            if probe.snapshot_due():
                probe.snapshot(done)
        if probe.check_due():
            coordinator.join()
            in_flight.clear()
            probe.first_call_done()
            probe.check(steps)
    coordinator.join()
    return {**probe.result(), "steps": steps, "k": args.steps_per_execution}


def run_psctl(args: argparse.Namespace) -> dict[str, Any]:
    """psctl's own loop in-process; the probe runs in its scheduling thread (a subclass of the
    loop that drains and evaluates at the cadence; instrumentation only)."""
    from cluster.spec import load_cluster_file
    from coordinator import trainer as trainer_module
    from coordinator.job import load_job
    from coordinator.settings import TrainSettings

    local = args.run_mode == "psctl-local"
    settings = TrainSettings(
        job=args.job,
        steps=10**8,  # until the target or --max-seconds
        batch_size=args.batch_size,
        steps_per_execution=0 if local else args.steps_per_execution,
        update_mode="local" if local else "default",
        local_steps=args.local_steps,
        checkpoint_dir="",
        seed=throughput.SEED,
        log_every=1e9,
    )
    job = load_job(args.job)
    trainer = throughput._new_trainer(job, load_cluster_file(args.cluster), settings)
    probe = Probe(job, trainer.model.variables, args)
    schedule = trainer.coordinator.schedule

    def first_schedule(*a: Any, **kw: Any) -> Any:
        probe.start()
        return schedule(*a, **kw)

    trainer.coordinator.schedule = first_schedule

    class ProbedLoop(trainer_module._Loop):
        probing = False

        def _retire(self, entry: Any) -> None:
            super()._retire(entry)
            probe.first_call_done()
            # As in the raw loop: snapshots right after a call finished.
            if probe.snapshot_due():
                probe.snapshot(self.completed)

        def _watch_for_stall(self) -> None:
            super()._watch_for_stall()
            if self.probing:
                return
            if probe.check_due():
                self.probing = True
                self.drain()
                self.ended = None
                probe.check(self.completed)
                self.probing = False
            if probe.done():
                self.t.control.stop_requested.set()

    trainer_module._Loop = ProbedLoop  # type: ignore[misc]
    summary = trainer.run()
    return {**probe.result(), "steps": summary.global_step, "k": summary.steps_per_execution}


CHILDREN = {"raw": run_raw, "psctl": run_psctl, "psctl-local": run_psctl}


def child_main(args: argparse.Namespace) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    result = CHILDREN[args.run_mode](args)
    result.update(
        mode=args.run_mode,
        rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )
    print(json.dumps(result), flush=True)
    return 0


# --------------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------------


def run_child(mode: Mode, args: argparse.Namespace, cluster_file: Path, logs: Path, n: int) -> Any:
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--run-mode", mode.kind,
        "--cluster", str(cluster_file),
        "--job", args.job,
        "--steps-per-execution", str(mode.k),
        "--local-steps", str(args.local_steps),
        "--batch-size", str(args.batch_size),
        "--target", str(args.target),
        "--eval-every", str(args.eval_every),
        "--check-every", str(args.check_every),
        "--max-seconds", str(args.max_seconds),
    ]  # fmt: skip
    out_path = logs / f"run{n:02d}-{mode.label.replace('@', '-')}.out"
    err_path = out_path.with_suffix(".log")
    with out_path.open("wb") as out, err_path.open("wb") as err:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            start_new_session=True,
            preexec_fn=throughput._die_with_parent,
        )
        try:
            code = proc.wait(timeout=args.max_seconds * 3 + 120)
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
    if code != 0:
        raise throughput.ChildFailed(
            f"{mode.label} exited with status {code}; last lines of {err_path}:\n"
            + throughput._tail(err_path)
        )
    for line in reversed(out_path.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            result: dict[str, Any] = json.loads(line)
            result["label"] = mode.label
            return result
    raise throughput.ChildFailed(f"{mode.label} printed no result; see {out_path}")


def peak_rss_mb(pid: int) -> float | None:
    """VmHWM of a live process, in MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def summarize(modes: list[Mode], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for mode in modes:
        mine = [r for r in runs if r["label"] == mode.label]
        times = [r["tta_s"] for r in mine if r["tta_s"] is not None]
        median = statistics.median(times) if len(times) == len(mine) and times else None
        rows.append(
            {
                "mode": mode.label,
                "runs": len(mine),
                "reached": len(times),
                "min_s": min(times) if times else None,
                "median_s": median,
                "first_call_s": statistics.median(r["first_call_s"] or 0.0 for r in mine),
                "after_first_s": statistics.median(
                    r["tta_s"] - (r["first_call_s"] or 0.0) for r in mine if r["tta_s"] is not None
                )
                if times
                else None,
                "k": sorted({r["k"] for r in mine}),
                "steps_per_s": statistics.median(
                    r["steps"] / max(r["train_s"], 1e-9) for r in mine
                ),
                "eval_s": statistics.median(r["eval_s"] for r in mine),
                "evals": statistics.median(r["evals"] for r in mine),
                "final_accuracy": statistics.median(r["final_accuracy"] or 0.0 for r in mine),
                "rss_mb": max(r["rss_mb"] for r in mine),
            }
        )
    return rows


def table(rows: list[dict[str, Any]], args: argparse.Namespace, ratio: float | None) -> str:
    lines = [
        "| mode | steps/call | TTA min (s) | TTA median (s) | first call done (s) | TTA after "
        "it (s) | reached | steps/s | evals "
        "(excluded s) | final eval acc | coordinator peak RSS (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        k = ",".join(str(k) for k in r["k"])
        lines.append(
            f"| {r['mode']} | {k} | {_fmt_s(r['min_s'])} | {_fmt_s(r['median_s'])} | "
            f"{_fmt_s(r['first_call_s'])} | {_fmt_s(r['after_first_s'])} | "
            f"{r['reached']}/{r['runs']} | {r['steps_per_s']:.0f} | {r['evals']:.0f} "
            f"({r['eval_s']:.2f}) | {r['final_accuracy']:.3f} | {r['rss_mb']:.0f} |"
        )
    lines.append("")
    lines.append(
        f"{args.job} job, {args.ps} ps + {args.workers} workers, batch {args.batch_size}/worker, "
        f"target eval accuracy {args.target}, eval every {args.eval_every}s of training, "
        f"{args.repeats} repeat(s); TTA = training seconds from the first schedule() to the "
        "first eval at or above the target (eval pauses excluded); first call done = when the "
        "first scheduled call finished (tracing, function registration, first batches); TTA "
        "after it = the median of TTA minus that, per run."
    )
    if ratio is not None:
        lines.append(f"raw_tf_best/psctl_best tta = {ratio:.2f}")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict[str, Any]], modes: list[Mode], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, mode in enumerate(modes):
        for j, run in enumerate(r for r in runs if r["label"] == mode.label):
            if not run["curve"]:
                continue
            t, _, acc, loss = zip(*run["curve"], strict=True)
            label = mode.label if j == 0 else None
            color = colors[i % len(colors)]
            acc_ax.plot(t, acc, color=color, alpha=0.8, label=label, marker=".")
            loss_ax.plot(t, loss, color=color, alpha=0.8, label=label, marker=".")
    acc_ax.axhline(target, color="grey", linestyle="--", linewidth=1)
    acc_ax.set(xlabel="training seconds (eval excluded)", ylabel="eval accuracy")
    loss_ax.set(xlabel="training seconds (eval excluded)", ylabel="eval loss", yscale="log")
    acc_ax.legend()
    acc_ax.set_title("time to accuracy (every repeat)")
    loss_ax.set_title("eval loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parent_main(args: argparse.Namespace) -> int:
    from cluster.logs import quiet_tensorflow
    from coordinator.local import ServerFailed

    quiet_tensorflow()
    raw_ks = sorted({int(k) for k in args.raw_k.split(",")} | {1})
    modes = [Mode("raw", k) for k in raw_ks]
    modes += [Mode("psctl", args.steps_per_execution), Mode("psctl-local", args.local_steps)]
    if args.modes:
        wanted = args.modes.split(",")
        modes = [m for m in modes if m.label in wanted]
    stamp = time.strftime("tta-%Y%m%d-%H%M%S")
    results = Path(args.results or REPO / "bench" / "results" / stamp)
    workdir = results / "work"
    logs = workdir / "logs"
    local, chief_port = throughput.open_bench(
        args, workdir, logs, [m.label for m in modes], f"results {results}"
    )
    runs: list[dict[str, Any]] = []
    servers_rss: dict[str, float | None] = {}
    try:
        local.start()
        local.wait_serving(timeout=args.start_timeout)
        for repeat in range(args.repeats):
            shift = repeat % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                throughput.wait_port_released(chief_port, timeout=30.0)
                result = run_child(mode, args, local.cluster_file, logs, len(runs) + 1)
                result["repeat"] = repeat
                runs.append(result)
                print(
                    f"[{repeat + 1}/{args.repeats}] {mode.label:<12} tta "
                    f"{_fmt_s(result['tta_s']):>7}s  ({result['steps']} steps, K "
                    f"{result['k']}, {result['evals']} evals in {result['eval_s']:.1f}s "
                    f"excluded, final eval acc {result['final_accuracy'] or 0:.3f})",
                    flush=True,
                )
        servers_rss = {s.name: peak_rss_mb(s.proc.pid) for s in local.servers}
    except (throughput.ChildFailed, ServerFailed) as err:
        print(f"tta: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tta: interrupted", file=sys.stderr)
        return 130
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        local.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)

    print(throughput._load(), flush=True)
    rows = summarize(modes, runs)
    raw = [r["median_s"] for r in rows if r["mode"].startswith("raw") and r["median_s"]]
    ours = [r["median_s"] for r in rows if r["mode"].startswith("psctl") and r["median_s"]]
    ratio = min(raw) / min(ours) if raw and ours else None
    text = table(rows, args, ratio)
    rss = ", ".join(f"{name} {_fmt_s(mb)}" for name, mb in servers_rss.items())
    text += f"\npeak RSS (MiB): servers {rss}; coordinators: see the table\n"
    print()
    print(text)
    (results / "table.md").write_text(text)
    report = {"config": vars(args), "runs": runs, "summary": rows, "servers_rss_mb": servers_rss}
    (results / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    png = results / "tta.png"
    plot(runs, modes, args.target, png)
    print(f"plot {png}\ntable {results / 'table.md'}\nruns {results / 'results.json'}")
    if ratio is None:
        print("raw_tf_best/psctl_best tta = n/a (a mode never reached the target)", flush=True)
        return 1
    print(f"raw_tf_best/psctl_best tta = {ratio:.2f}", flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", default=throughput.JOB, help="job to train (default mlp)")
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="per worker (default 64)")
    parser.add_argument("--target", type=float, default=0.90, help="eval accuracy (0.90)")
    parser.add_argument(
        "--eval-every", type=float, default=0.5, help="seconds of training between evals"
    )
    parser.add_argument(
        "--check-every",
        type=float,
        default=2.0,
        help="seconds of training between drained checks that stop the run at the target",
    )
    parser.add_argument(
        "--max-seconds", type=float, default=90.0, help="give up a run after this much training"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--raw-k", default="20,100", help="raw loop packings besides 1 (default 20,100)"
    )
    parser.add_argument(
        "--steps-per-execution", type=int, default=0, help="psctl default mode (0 = auto)"
    )
    parser.add_argument("--local-steps", type=int, default=50, help="psctl local mode K")
    parser.add_argument("--modes", help="only these modes, e.g. raw@20,psctl (default all)")
    parser.add_argument("--results", help="results folder (default bench/results/tta-<time>)")
    parser.add_argument("--start-timeout", type=float, default=120.0)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 1 repeat of raw@1 and psctl-local, target 0.5, max 15 s per run",
    )
    parser.add_argument("--run-mode", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.run_mode:
        return child_main(args)
    if args.quick:  # a smoke test of the whole path (the suite runs it): not a measurement
        args.repeats, args.target, args.max_seconds, args.check_every = 1, 0.5, 15.0, 1.0
        args.modes = args.modes or "raw@1,psctl-local"
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
