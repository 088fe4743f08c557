"""Time to accuracy: psctl against the raw TensorFlow parameter-server loop, on one cluster.

For every mode, the wall seconds from the first ``schedule()`` until the held-out eval
accuracy first reaches ``--target`` (default 0.90). A probe thread in the coordinator reads
the ps variables every ``--eval-every`` seconds while training goes on (one function call, one
round trip per ps); the snapshots are copied into a local model and scored on the eval split
after the run, so no mode is paused or drained to be measured. Every ``--check-every``
seconds the probe scores its newest snapshot at once, to end the run at the target. Modes
(same cluster, data, batch per worker, model and job):

``raw@1``, ``raw@K``
    The TF tutorial loop (``bench/throughput.py``'s ``build_raw``) at 1 and K steps per
    call; ``raw_tf_best`` is the fastest of them.
``psctl``
    psctl's ``Trainer`` in its default mode, ``--steps-per-execution auto``.
``psctl-local``
    ``Trainer`` with ``--update-mode local --local-steps 50``.

Each mode runs ``--repeats`` times (order rotated per round), each run in a fresh
coordinator process against the same servers. Printed: per-run lines, a table with min and
median, the peak RSS of every process, then ``raw@1/psctl_best tta``, ``raw_tf_best/psctl_best
tta after start-up`` (medians of TTA minus the first snapshot with a step on the ps) and
last ``raw_tf_best/psctl_best tta = R.RR`` (the median TTA of the best raw mode over that of
the best psctl mode). Written to the results folder (default ``bench/results/tta-<time>/``):
``tta.png`` (eval accuracy and loss against seconds from the first ``schedule()``, every
mode and repeat), ``table.md`` and ``results.json``.

    .venv/bin/python bench/tta.py            # ~3-4 minutes on 2 cores
    .venv/bin/python bench/tta.py --quick    # one round, lower target: a smoke test
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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


class Probe(threading.Thread):
    """Snapshots of the ps variables every ``--eval-every`` seconds, on a thread of its own.

    Nothing pauses training: a snapshot is one function call that reads every model variable
    and the optimizer's step counter on the ps while the workers go on (the model as it is at
    that second); the clock is plain wall time from the first ``schedule()``. Snapshots are
    scored on the coordinator after the run, except that every ``--check-every`` seconds the
    newest is scored at once (on this thread) to end the run when the target is reached.
    The same probe, on the same cadence, watches every mode.
    """

    def __init__(
        self, job: Any, variables: list[Any], iterations: Any, args: argparse.Namespace
    ) -> None:
        super().__init__(name="tta-probe", daemon=True)
        import keras
        import tensorflow as tf

        from psctl.coordinator.job import DataContext
        from psctl.coordinator.training.metric_objects import make_eval_step, metric_factories

        if job.eval_dataset_fn is None:
            raise SystemExit(f"tta: job {job.name} has no eval_dataset_fn")
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

        shapes = [tuple(v.shape) for v in variables]
        self.splits = [int(np.prod(shape)) for shape in shapes]
        self.shapes = shapes

        # One call, one round trip per ps, one copy out: every variable and the step counter
        # as one float64 vector (a GIL hand-over per tensor copied cost ~5 ms each, seen).
        @tf.function(autograph=False)
        def read() -> Any:
            flat = [tf.reshape(tf.cast(v.value, tf.float64), [-1]) for v in variables]
            return tf.concat([*flat, tf.cast(tf.reshape(iterations.value, [1]), tf.float64)], 0)

        self.read = read
        # Traced and registered before the clock starts (instrumentation): the read, and the
        # scoring (its first call traced for ~1 s in the probe thread, seen).
        self.read()
        self.step(x, y)
        self.cadence, self.target, self.max_seconds = args.eval_every, args.target, args.max_seconds
        self.check_every = args.check_every
        self.t0: float | None = None
        self.finished = threading.Event()  # target reached, --max-seconds, or stop()
        self.reached = False
        self.busy_s = 0.0  # seconds this thread spent reading and checking during the run
        self.snapshots: list[tuple[float, int, np.ndarray]] = []  # (seconds, step, values)
        self.scores: dict[int, tuple[float, float]] = {}  # snapshot index: (accuracy, loss)
        self.first_call_s: float | None = None  # the clock when the first call finished
        self.train_s = 0.0
        self.error: BaseException | None = None

    def begin(self) -> None:
        """At the first schedule(): the clock starts and so does the sampling."""
        if self.t0 is None:
            self.t0 = time.monotonic()
            self.start()

    def first_call_done(self) -> None:
        if self.first_call_s is None and self.t0 is not None:
            self.first_call_s = time.monotonic() - self.t0

    def done(self) -> bool:
        return self.finished.is_set()

    def run(self) -> None:
        try:
            self._sample()
        except BaseException as err:  # reported by result(); the loop stops either way
            self.error = err
        finally:
            self.finished.set()

    def _sample(self) -> None:
        assert self.t0 is not None
        next_check = self.check_every
        tick = 0
        while not self.finished.is_set():
            tick += 1
            self.finished.wait(max(0.0, self.t0 + tick * self.cadence - time.monotonic()))
            if self.finished.is_set():
                break
            began = time.monotonic()
            flat = self.read().numpy()
            at = time.monotonic() - self.t0  # when the read returned: never early
            self.snapshots.append((at, int(flat[-1]), flat[:-1]))
            if at >= next_check:
                next_check = at + self.check_every
                self.reached = self._score(len(self.snapshots) - 1)[0] >= self.target
            self.busy_s += time.monotonic() - began
            if self.reached or at >= self.max_seconds:
                self.finished.set()

    def stop(self) -> None:
        if self.t0 is not None and not self.train_s:
            self.train_s = time.monotonic() - self.t0
        self.finished.set()
        if self.is_alive():
            self.join()

    def _score(self, index: int) -> tuple[float, float]:
        if index not in self.scores:
            pieces = np.split(self.snapshots[index][2], np.cumsum(self.splits)[:-1])
            for copy, piece, shape in zip(self.model.variables, pieces, self.shapes, strict=True):
                copy.assign(piece.reshape(shape).astype(copy.dtype))
            self.loss.reset_state()
            for metric in self.metrics:
                metric.reset_state()
            for batch in self.batches:
                self.step(batch[0], batch[1])
            accuracy = next(m for m in self.metrics if m.name == "accuracy").result()
            self.scores[index] = (float(accuracy), float(self.loss.result()))
        return self.scores[index]

    def result(self) -> dict[str, Any]:
        self.stop()
        if self.error is not None:
            raise RuntimeError(f"tta: the probe failed: {self.error!r}") from self.error
        curve = []
        for i, (at, step, _) in enumerate(self.snapshots):
            accuracy, loss = self._score(i)
            curve.append([at, step, accuracy, loss])
        tta = next((at for at, _, acc, _ in curve if acc >= self.target), None)
        return {
            "tta_s": tta,
            "first_call_s": self.first_call_s,
            # The first snapshot with a step applied on the ps: the end of the start-up
            # (tracing, datasets, function registration), to a snapshot's resolution.
            "first_step_s": next((at for at, step, _, _ in curve if step > 0), None),
            "curve": curve,
            "evals": len(curve),
            "probe_s": self.busy_s,
            "train_s": self.train_s,
            "steps": curve[-1][1] if curve else 0,  # at the last snapshot
            "steps_per_s": curve[-1][1] / curve[-1][0] if curve else 0.0,
            "final_accuracy": curve[-1][2] if curve else None,
        }


def run_raw(args: argparse.Namespace) -> dict[str, Any]:
    from psctl.coordinator.job import load_job
    from psctl.coordinator.training.inflight import remote_done

    raw = throughput.build_raw(
        args.cluster, batch_size=args.batch_size, k=args.steps_per_execution, job_name=args.job
    )
    probe = Probe(load_job(args.job), raw.model.variables, raw.iterations, args)
    raw.warm_up()
    coordinator = raw.coordinator
    iterator = iter(coordinator.create_per_worker_dataset(raw.per_worker_dataset_fn))
    # schedule() returns at once until TF's closure queue is full (thousands of calls): the
    # tutorial's loop joins per epoch; here at most psctl's in-flight bound (4 per worker) is
    # outstanding, as in psctl's loop.
    in_flight: collections.deque[Any] = collections.deque()
    bound = 4 * raw.num_workers
    probe.begin()
    while not probe.done():
        in_flight.append(coordinator.schedule(raw.train_fn, args=(iterator,)))
        if remote_done(in_flight[0]):
            probe.first_call_done()
        if len(in_flight) > bound:
            in_flight.popleft().fetch()
            probe.first_call_done()
    result = probe.result()
    coordinator.join()
    return {**result, "k": args.steps_per_execution}


def run_psctl(args: argparse.Namespace) -> dict[str, Any]:
    """psctl's own loop in-process; the Trainer's public loop hooks tell the probe when the
    first call is scheduled and done, and stop the loop at the probe's word."""
    from psctl.cluster.spec import load_cluster_file
    from psctl.coordinator.job import load_job
    from psctl.coordinator.settings import TrainSettings
    from psctl.coordinator.training.hooks import LoopHooks

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
    probe: Probe | None = None

    class Probing(LoopHooks):
        def before_schedule(self, steps: int) -> None:
            assert probe is not None
            probe.begin()

        def after_call(self, steps: int, seconds: float) -> None:
            assert probe is not None
            probe.first_call_done()

        def on_poll(self, controller: Any) -> None:
            assert probe is not None
            if probe.done():
                probe.stop()
                controller.request_stop()

    trainer = throughput._new_trainer(
        job, load_cluster_file(args.cluster), settings, hooks=Probing()
    )
    probe = Probe(job, trainer.model.variables, trainer.optimizer.iterations, args)
    summary = trainer.run()  # its final eval comes after the probe has stopped
    return {**probe.result(), "k": summary.steps_per_execution}


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
    timeout = args.max_seconds * 3 + 120
    result = throughput.run_measured(mode.label, argv, out_path, timeout=timeout)
    result["label"] = mode.label
    return result


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
                "first_step_s": statistics.median(r["first_step_s"] or 0.0 for r in mine),
                "after_start_s": statistics.median(
                    r["tta_s"] - (r["first_step_s"] or 0.0) for r in mine if r["tta_s"] is not None
                )
                if len(times) == len(mine) and times
                else None,
                "k": sorted({r["k"] for r in mine}),
                "steps_per_s": statistics.median(r["steps_per_s"] for r in mine),
                "probe_s": statistics.median(r["probe_s"] for r in mine),
                "evals": statistics.median(r["evals"] for r in mine),
                "final_accuracy": statistics.median(r["final_accuracy"] or 0.0 for r in mine),
                "rss_mb": max(r["rss_mb"] for r in mine),
            }
        )
    return rows


def ratio(rows: list[dict[str, Any]], key: str, raw_modes: set[str]) -> float | None:
    """The best (lowest) median ``key`` of ``raw_modes`` over that of the psctl modes."""
    raw = [r[key] for r in rows if r["mode"] in raw_modes and r[key]]
    ours = [r[key] for r in rows if r["mode"].startswith("psctl") and r[key]]
    return min(raw) / min(ours) if raw and ours else None


def ratio_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The ratio lines, the issue's own last: ``raw_tf_best/psctl_best tta = R.RR``."""
    every_raw = {r["mode"] for r in rows if r["mode"].startswith("raw@")}
    lines = []
    for label, key, raw_modes in (
        ("raw@1/psctl_best tta", "median_s", {"raw@1"}),
        ("raw_tf_best/psctl_best tta after start-up", "after_start_s", every_raw),
        ("raw_tf_best/psctl_best tta", "median_s", every_raw),
    ):
        if not raw_modes & every_raw and label != "raw_tf_best/psctl_best tta":
            continue  # not run (--modes); the line is always printed
        value = ratio(rows, key, raw_modes)
        text = "n/a (a mode never reached the target)" if value is None else f"{value:.2f}"
        if not raw_modes & every_raw:
            text = "n/a (no raw mode was run)"
        lines.append(f"{label} = {text}")
    return lines


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        "| mode | steps/call | TTA min (s) | TTA median (s) | first step in (s) | TTA after it "
        "(s) | first call done (s) | reached | steps/s | snapshots (probe s) | final eval acc | "
        "coordinator peak RSS (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        k = ",".join(str(k) for k in r["k"])
        lines.append(
            f"| {r['mode']} | {k} | {_fmt_s(r['min_s'])} | {_fmt_s(r['median_s'])} | "
            f"{_fmt_s(r['first_step_s'])} | {_fmt_s(r['after_start_s'])} | "
            f"{_fmt_s(r['first_call_s'])} | "
            f"{r['reached']}/{r['runs']} | {r['steps_per_s']:.0f} | {r['evals']:.0f} "
            f"({r['probe_s']:.2f}) | {r['final_accuracy']:.3f} | {r['rss_mb']:.0f} |"
        )
    lines.append("")
    lines.append(
        f"{args.job} job, {args.ps} ps + {args.workers} workers, batch {args.batch_size}/worker, "
        f"target eval accuracy {args.target}, a snapshot of the ps variables every "
        f"{args.eval_every}s (read while training goes on, scored after), {args.repeats} "
        "repeat(s); TTA = wall seconds from the first schedule() to the first snapshot at or "
        "above the target; first step in = the first snapshot with a step applied on the ps "
        "(the end of start-up: tracing, datasets, function registration on every worker); "
        "TTA after it = TTA minus that, per run (median); first call done = when the first "
        "scheduled call returned; probe s = seconds the probe thread spent reading and "
        "checking during the run (it shares the coordinator's CPU with the loop)."
    )
    lines += ["", *ratio_lines(rows)]
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
    acc_ax.set(xlabel="seconds from the first schedule()", ylabel="eval accuracy")
    loss_ax.set(xlabel="seconds from the first schedule()", ylabel="eval loss", yscale="log")
    acc_ax.legend()
    acc_ax.set_title("time to accuracy (every repeat)")
    loss_ax.set_title("eval loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parent_main(args: argparse.Namespace) -> int:
    from psctl.cluster.logs import quiet_tensorflow
    from psctl.coordinator.launch.local import ServerFailed

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
                    f"{result['k']}, {result['evals']} snapshots, probe {result['probe_s']:.1f}s, "
                    f"final eval acc {result['final_accuracy'] or 0:.3f})",
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
        throughput.close_bench(local)

    print(throughput._load(), flush=True)
    rows = summarize(modes, runs)
    text = table(rows, args)
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
    lines = ratio_lines(rows)
    print("\n".join(lines), flush=True)
    return 1 if lines[-1].endswith(")") else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", default=throughput.JOB, help="job to train (default mlp)")
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="per worker (default 64)")
    parser.add_argument("--target", type=float, default=0.90, help="eval accuracy (0.90)")
    parser.add_argument(
        "--eval-every",
        type=float,
        default=0.1,
        help="seconds between snapshots of the ps variables (each scored after the run; 0.1)",
    )
    parser.add_argument(
        "--check-every",
        type=float,
        default=1.0,
        help="seconds between scorings during the run that stop it at the target (1.0)",
    )
    parser.add_argument(
        "--max-seconds", type=float, default=60.0, help="give up a run after this long (60)"
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
        args.repeats, args.target, args.max_seconds = 1, 0.5, 15.0
        args.modes = args.modes or "raw@1,psctl-local"
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
