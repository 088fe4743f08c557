"""Time to accuracy: psctl against the raw TensorFlow parameter-server loop, on one cluster.

For every mode, the wall seconds from the first ``schedule()`` until the held-out eval
accuracy first reaches ``--target`` (default 0.90), or with ``--job ctr`` the eval AUC
``--target-auc`` (default 0.72). A probe thread in the coordinator reads the ps variables
every ``--eval-every`` seconds while training goes on (one function call, one
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

``--job ctr`` races the built-in ctr job (jobs/ctr.py: 26 ids per example into one
``keras.layers.Embedding``, ``--ctr-rows`` 1M rows, ``--ctr-optimizer`` Adam) on 2 ps + 2
workers, batch 256 per worker, to an eval AUC (on 20,480 held-out examples): psctl's modes
with ``--max-shards 2`` (the table split over the ps, sparse updates; bench/embeddings.py
measures the same two loops' steps/s), the raw loop with the table whole on one ps and
Keras's own ``apply_gradients`` (every row, every step), at 1, 10 and 50 steps per call.
Snapshots every 3 s; a snapshot holds only the table rows the eval set looks up (all that
scoring needs). The raw child exits without waiting for its queued calls. One more line
before the last compares the best psctl and best raw mode at the same number of steps:
``eval auc at step S``.

    .venv/bin/python bench/tta.py            # ~3-4 minutes on 2 cores
    .venv/bin/python bench/tta.py --quick    # one round, lower target: a smoke test
    .venv/bin/python bench/tta.py --job ctr --repeats 1    # ~8 minutes on 2 cores
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

from bench import embeddings, throughput

REPO = throughput.REPO
CTR = "ctr"
CTR_EVAL_EXAMPLES = 40 * 512  # held-out examples the probe scores (40 of ctr's blocks)
# --quick: 10 blocks. Every snapshot is scored after the run, each check during it, and
# psctl's final eval too, all on the cores the run shares: the smoke test's AUC 0.55 needs
# no finer score.
CTR_QUICK_EVAL_EXAMPLES = 10 * 512
# Defaults per race: the mlp job to eval accuracy, the ctr job to eval AUC.
DEFAULTS: dict[str, dict[str, Any]] = {
    "mlp": {
        "ps": 1,
        "batch_size": 64,
        "target": 0.90,
        "eval_every": 0.1,
        "check_every": 1.0,
        "max_seconds": 60.0,
        "raw_k": "20,100",
        "max_shards": 1,
    },
    CTR: {
        "ps": 2,
        "batch_size": 256,
        "target": 0.72,
        "eval_every": 3.0,
        "check_every": 9.0,
        "max_seconds": 300.0,
        "raw_k": "10,50",
        "max_shards": 2,
        "ctr_rows": "1M",
    },
}
QUICK: dict[str, dict[str, Any]] = {  # --quick: a smoke test (defaults over DEFAULTS)
    "mlp": {"target": 0.5, "max_seconds": 15.0, "modes": "raw@1,psctl-local"},
    CTR: {
        "target": 0.55,
        "max_seconds": 40.0,
        "eval_every": 1.0,
        "check_every": 1.0,
        "modes": "raw@1,psctl-local",
        "ctr_rows": "10k",
    },
}


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
        self,
        job: Any,
        variables: list[Any],
        iterations: Any,
        args: argparse.Namespace,
        trained_model: Any = None,
    ) -> None:
        super().__init__(name="tta-probe", daemon=True)
        import keras
        import tensorflow as tf

        from psctl.coordinator.data.context import DataContext
        from psctl.coordinator.training.job_model.metric_objects import (
            make_eval_step,
            metric_factories,
        )

        if job.eval_dataset_fn is None:
            raise SystemExit(f"tta: job {job.name} has no eval_dataset_fn")
        self.model = job.create_model()
        ctx = DataContext(worker_index=0, num_workers=1, batch_size=1024, seed=throughput.SEED)
        self.batches = list(job.eval_dataset_fn(ctx))
        x, y = self.batches[0][0], self.batches[0][1]
        if not self.model.built:
            self.model.build(x.shape)
        if trained_model is not None:  # psctl's: its tables in the plain model's order
            variables = plain_order(trained_model, self.model)
        if len(self.model.variables) != len(variables):
            raise SystemExit("tta: the eval model's variables do not match the trained ones")
        pred_shape = self.model(x[:1]).shape
        factories = metric_factories(job.metrics, label_shape=y.shape, pred_shape=pred_shape)
        self.loss = keras.metrics.Mean(name="loss")
        self.metrics = [make() for make in factories]
        self.metric = args.metric
        if self.metric not in [m.name for m in self.metrics]:
            raise SystemExit(f"tta: job {job.name} has no {self.metric} metric")
        self.step = tf.function(make_eval_step(self.model, job.loss_fn, self.loss, self.metrics))

        # Embedding tables are read at the rows the eval set looks up only (a 1M-row ctr
        # table: a fraction of it), which is all that scoring needs.
        looked_up = eval_rows(self.model, [b[0] for b in self.batches])
        self.rows = [looked_up.get(id(v)) for v in self.model.variables]
        shapes = [
            tuple(v.shape) if rows is None else (len(rows), *v.shape[1:])
            for v, rows in zip(self.model.variables, self.rows, strict=True)
        ]
        self.splits = [int(np.prod(shape)) for shape in shapes]
        self.shapes = shapes
        self.full = {  # the tables' copies between scorings; rows never looked up stay 0
            i: np.zeros(tuple(v.shape), np.float32)
            for i, (v, rows) in enumerate(zip(self.model.variables, self.rows, strict=True))
            if rows is not None
        }

        # One call, one round trip per ps, one copy out: every variable and the step counter
        # as one float32 vector (a GIL hand-over per tensor copied cost ~5 ms each, seen;
        # float32: the variables' own type, and a ctr table is in every snapshot). The step
        # counter is exact in float32 up to 2**24.
        @tf.function(autograph=False)
        def read() -> Any:
            flat = [
                tf.reshape(tf.cast(_value(v, rows), tf.float32), [-1])
                for v, rows in zip(variables, self.rows, strict=True)
            ]
            return tf.concat([*flat, tf.cast(tf.reshape(iterations.value, [1]), tf.float32)], 0)

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
        self.scores: dict[int, tuple[float, float]] = {}  # snapshot index: (metric, loss)
        self.first_call_s: float | None = None  # the clock when the first call finished
        self.train_s = 0.0
        self.error: BaseException | None = None

    def begin(self) -> None:
        """At the first schedule(): the clock starts and so does the sampling. The model as
        it is then is the curve's first point (0 s): every mode's curve starts at its step,
        so the runs can be compared at any step below their last snapshot."""
        if self.t0 is None:
            flat = self.read().numpy()
            self.snapshots.append((0.0, int(flat[-1]), flat[:-1]))
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
            for i, (copy, piece) in enumerate(zip(self.model.variables, pieces, strict=True)):
                value = piece.reshape(self.shapes[i])
                if i in self.full:
                    self.full[i][self.rows[i]] = value
                    value = self.full[i]
                copy.assign(value.astype(copy.dtype))
            self.loss.reset_state()
            for metric in self.metrics:
                metric.reset_state()
            for batch in self.batches:
                self.step(batch[0], batch[1])
            score = next(m for m in self.metrics if m.name == self.metric).result()
            self.scores[index] = (float(score), float(self.loss.result()))
        return self.scores[index]

    def result(self) -> dict[str, Any]:
        self.stop()
        if self.error is not None:
            raise RuntimeError(f"tta: the probe failed: {self.error!r}") from self.error
        curve = []
        for i, (at, step, _) in enumerate(self.snapshots):
            score, loss = self._score(i)
            curve.append([at, step, score, loss])
        tta = time_to_target(curve, self.target)
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
            "steps_per_s": curve[-1][1] / curve[-1][0] if curve and curve[-1][0] else 0.0,
            "final_metric": curve[-1][2] if curve else None,
        }


def time_to_target(curve: list[list[float]], target: float) -> float | None:
    """Seconds to the first snapshot at or above ``target`` ([at, step, score, loss] each),
    the curve's first point left out: the model as it was when the clock started (0 s)
    trained nothing yet, however it scores (CI: an untrained ctr model's AUC of 0.554 met a
    quick run's 0.55 target at 0 s)."""
    return next((at for at, _, score, _ in curve[1:] if score >= target), None)


def _value(variable: Any, rows: np.ndarray | None = None) -> Any:
    """A variable's value (its ``rows`` only, when given) as one tensor: a Keras variable, a
    psctl table's ``tf.Variable`` or its ``ShardedVariable``. Rows are gathered on the ps
    that hold them."""
    import tensorflow as tf

    if hasattr(variable, "path"):  # a Keras variable (its value: the tf.Variable on the ps)
        value = variable.value
        return value if rows is None else tf.nn.embedding_lookup(value, tf.constant(rows))
    if rows is not None:
        return tf.nn.embedding_lookup(variable, tf.constant(rows))
    if isinstance(variable, tf.Variable):
        return variable.read_value()
    return tf.concat([shard.read_value() for shard in variable.variables], axis=0)


def eval_rows(model: Any, inputs: list[Any]) -> dict[int, np.ndarray]:
    """For every Embedding layer of the (plain Keras) model that is called once: the rows the
    ``inputs`` look up, sorted, by ``id`` of its ``embeddings``. Nothing for other models."""
    import keras

    layers = [x for x in model._flatten_layers() if isinstance(x, keras.layers.Embedding)]
    if not layers:
        return {}
    try:
        ids = keras.Model(model.inputs, [layer.input for layer in layers])
    except (AttributeError, ValueError):  # no functional graph, or a layer called twice
        return {}
    found: list[list[np.ndarray]] = [[] for _ in layers]
    for x in inputs:
        outputs = ids(x, training=False)
        outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        for seen, out in zip(found, outputs, strict=True):
            seen.append(np.unique(np.asarray(out)))
    return {
        id(layer.embeddings): np.unique(np.concatenate(seen)).astype(np.int64)
        for layer, seen in zip(layers, found, strict=True)
        if seen
    }


def plain_order(trained: Any, plain: Any) -> list[Any]:
    """The variables of psctl's model on the ps in the order of the plain Keras model built by
    the same job: where the plain model has an Embedding's ``embeddings``, psctl's table
    (embeddings/sharded.py; not a Keras weight). The rest come in the same order in both (as
    the checkpoint pairs them with the keys of the plain model,
    training/saving/sharded_save.py)."""
    import keras

    from psctl.coordinator.embeddings.sharded import table_of

    def embeddings(model: Any) -> list[Any]:
        return [x for x in model._flatten_layers() if isinstance(x, keras.layers.Embedding)]

    tables = {}
    for ours, theirs in zip(embeddings(trained), embeddings(plain), strict=True):
        table = table_of(ours)
        if table is not None:
            tables[id(theirs.embeddings)] = table.variable
    rest = iter(trained.variables)
    return [tables[id(v)] if id(v) in tables else next(rest) for v in plain.variables]


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
    # Not join(): the calls still queued would take as long again (ctr: up to 8 calls of K
    # steps of a whole-table update). child_main exits the process without waiting for them;
    # each worker finishes at most the call it runs, while the next run starts.
    return {**probe.result(), "k": args.steps_per_execution}


def run_psctl(args: argparse.Namespace) -> dict[str, Any]:
    """psctl's own loop in-process; the Trainer's public loop hooks tell the probe when the
    first call is scheduled and done, and stop the loop at the probe's word."""
    from psctl.cluster.spec import load_cluster_file
    from psctl.coordinator.job import load_job
    from psctl.coordinator.settings import MAX_SECONDS, TrainSettings
    from psctl.hooks import LoopHooks

    local = args.run_mode == "psctl-local"
    settings = TrainSettings.of(
        job=args.job,
        steps=10**8,  # until the target or --max-seconds
        batch_size=args.batch_size,
        steps_per_execution=0 if local else args.steps_per_execution,
        update_mode="local" if local else "default",
        local_steps=args.local_steps,
        checkpoint_dir="",
        seed=throughput.SEED,
        log_every=MAX_SECONDS,  # no progress lines
        max_shards=args.max_shards,
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
    probe = Probe(job, trainer.model.variables, trainer.optimizer.iterations, args, trainer.model)
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
    if args.run_mode == "raw":
        os._exit(0)  # its queued calls left unfinished (run_raw)
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
        "--metric", args.metric,
        "--max-shards", str(args.max_shards),
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
                "final_metric": statistics.median(r["final_metric"] or 0.0 for r in mine),
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


def best(rows: list[dict[str, Any]], prefix: str) -> dict[str, Any] | None:
    """The mode starting with ``prefix`` with the lowest median TTA (None: none reached)."""
    ranked = [r for r in rows if r["mode"].startswith(prefix) and r["median_s"]]
    return min(ranked, key=lambda r: r["median_s"]) if ranked else None


def score_at(curve: list[list[float]], step: float) -> float | None:
    """A run's score at ``step`` steps, interpolated between the snapshots around it (a
    local-step mode's counter moves K steps at a time); None before its first snapshot."""
    by_step = {at_step: score for _, at_step, score, _ in curve}  # the last one per step
    steps = sorted(by_step)
    if not steps or step < steps[0]:
        return None
    return float(np.interp(step, steps, [by_step[x] for x in steps]))


def equal_steps_line(rows: list[dict[str, Any]], runs: list[dict[str, Any]], metric: str) -> str:
    """Every psctl mode's eval ``metric`` against the best raw mode's at the same step count:
    the fewest steps any of their runs had reached at its last snapshot (medians over
    repeats, interpolated between snapshots), e.g. ``eval auc at step 760: raw@1 (best raw)
    0.7210; psctl 0.7259 (+0.0049), psctl-local 0.7086 (-0.0124)``."""
    raw = best(rows, "raw@")
    ours = [r["mode"] for r in rows if r["mode"].startswith("psctl") and r["median_s"]]
    if raw is None or not ours:
        return f"eval {metric} at the same step: n/a (a mode never reached the target)"
    chosen = [r for r in runs if r["label"] in (raw["mode"], *ours) and r["curve"]]
    step = min(r["curve"][-1][1] for r in chosen)
    scores = {}
    for mode in (raw["mode"], *ours):
        found = [score_at(r["curve"], step) for r in chosen if r["label"] == mode]
        known = [score for score in found if score is not None]
        scores[mode] = statistics.median(known) if known else None
    base = scores[raw["mode"]]
    if base is None:
        return f"eval {metric} at step {step:.0f}: n/a (no snapshot that early)"
    theirs = ", ".join(
        f"{mode} n/a" if score is None else f"{mode} {score:.4f} ({score - base:+.4f})"
        for mode, score in scores.items()
        if mode != raw["mode"]
    )
    return f"eval {metric} at step {step:.0f}: {raw['mode']} (best raw) {base:.4f}; {theirs}"


def table(rows: list[dict[str, Any]], args: argparse.Namespace, runs: list[dict[str, Any]]) -> str:
    name = "acc" if args.metric == "accuracy" else args.metric
    lines = [
        "| mode | steps/call | TTA min (s) | TTA median (s) | first step in (s) | TTA after it "
        f"(s) | first call done (s) | reached | steps/s | snapshots (probe s) | final eval {name} "
        "| coordinator peak RSS (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        k = ",".join(str(k) for k in r["k"])
        lines.append(
            f"| {r['mode']} | {k} | {_fmt_s(r['min_s'])} | {_fmt_s(r['median_s'])} | "
            f"{_fmt_s(r['first_step_s'])} | {_fmt_s(r['after_start_s'])} | "
            f"{_fmt_s(r['first_call_s'])} | "
            f"{r['reached']}/{r['runs']} | {r['steps_per_s']:.0f} | {r['evals']:.0f} "
            f"({r['probe_s']:.2f}) | {r['final_metric']:.3f} | {r['rss_mb']:.0f} |"
        )
    lines.append("")
    shards = f", --max-shards {args.max_shards} for psctl" if args.max_shards > 1 else ""
    rows_note = f" ({os.environ['CTR_ROWS']} table rows)" if args.job == CTR else ""
    lines.append(
        f"{args.job} job{rows_note}, {args.ps} ps + {args.workers} workers{shards}, batch "
        f"{args.batch_size}/worker, "
        f"target eval {args.metric} {args.target}, a snapshot of the ps variables every "
        f"{args.eval_every}s (read while training goes on, scored after), {args.repeats} "
        "repeat(s); TTA = wall seconds from the first schedule() to the first snapshot at or "
        "above the target; first step in = the first snapshot with a step applied on the ps "
        "(the end of start-up: tracing, datasets, function registration on every worker); "
        "TTA after it = TTA minus that, per run (median); first call done = when the first "
        "scheduled call returned; probe s = seconds the probe thread spent reading and "
        "checking during the run (it shares the coordinator's CPU with the loop)."
    )
    lines += ["", equal_steps_line(rows, runs, args.metric), *ratio_lines(rows)]
    return "\n".join(lines) + "\n"


def plot(
    runs: list[dict[str, Any]],
    modes: list[Any],  # anything with a .label (bench/sync_vs_async.py's modes too)
    target: float,
    path: Path,
    *,
    xlabel: str = "seconds from the first schedule()",
    ylabel: str = "eval accuracy",
) -> None:
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
    acc_ax.set(xlabel=xlabel, ylabel=ylabel)
    loss_ax.set(xlabel=xlabel, ylabel="eval loss", yscale="log")
    acc_ax.legend()
    acc_ax.set_title(f"time to {ylabel.removeprefix('eval ')} (every repeat)")
    loss_ax.set_title("eval loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parent_main(args: argparse.Namespace) -> int:
    from psctl.cluster.processes.logs import quiet_tensorflow
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
                    f"final eval {args.metric} {result['final_metric'] or 0:.3f})",
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
    text = table(rows, args, runs)
    rss = ", ".join(f"{name} {_fmt_s(mb)}" for name, mb in servers_rss.items())
    text += f"\npeak RSS (MiB): servers {rss}; coordinators: see the table\n"
    print()
    print(text)
    (results / "table.md").write_text(text)
    report = {"config": vars(args), "runs": runs, "summary": rows, "servers_rss_mb": servers_rss}
    (results / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    png = results / "tta.png"
    plot(runs, modes, args.target, png, ylabel=f"eval {args.metric}")
    print(f"plot {png}\ntable {results / 'table.md'}\nruns {results / 'results.json'}")
    lines = ratio_lines(rows)
    print("\n".join(lines), flush=True)
    return 1 if lines[-1].endswith(")") else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mlp, ctr = DEFAULTS["mlp"], DEFAULTS[CTR]

    def both(key: str) -> str:
        return f"default {mlp[key]}; --job ctr: {ctr[key]}"

    parser.add_argument("--job", default=throughput.JOB, help="job to train (default mlp)")
    parser.add_argument("--ps", type=int, help=f"ps servers ({both('ps')})")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, help=f"per worker ({both('batch_size')})")
    parser.add_argument("--target", type=float, help=f"eval accuracy (default {mlp['target']})")
    parser.add_argument(
        "--target-auc",
        type=float,
        help=f"race to this eval AUC instead (--job ctr: default {ctr['target']})",
    )
    parser.add_argument(
        "--eval-every",
        type=float,
        help=f"seconds between snapshots of the ps variables (each scored after the run; "
        f"{both('eval_every')})",
    )
    parser.add_argument(
        "--check-every",
        type=float,
        help="seconds between scorings during the run that stop it at the target "
        f"({both('check_every')})",
    )
    parser.add_argument(
        "--max-seconds", type=float, help=f"give up a run after this long ({both('max_seconds')})"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--raw-k", help=f"raw loop packings besides 1 ({both('raw_k')})")
    parser.add_argument(
        "--steps-per-execution", type=int, default=0, help="psctl default mode (0 = auto)"
    )
    parser.add_argument("--local-steps", type=int, default=50, help="psctl local mode K")
    parser.add_argument(
        "--max-shards", type=int, help=f"psctl's --max-shards ({both('max_shards')})"
    )
    parser.add_argument("--ctr-rows", help="--job ctr: table rows (default 1M)")
    parser.add_argument(
        "--ctr-optimizer", default="adam", choices=sorted(embeddings.SLOTS), help="--job ctr"
    )
    parser.add_argument("--modes", help="only these modes, e.g. raw@20,psctl (default all)")
    parser.add_argument("--results", help="results folder (default bench/results/tta-<time>)")
    parser.add_argument("--start-timeout", type=float, default=120.0)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 1 repeat of raw@1 and psctl-local, target 0.5 (--job ctr: AUC 0.55 "
        "on a 10k-row table, scored on 5120 examples), max 15 s per run (ctr: 40 s)",
    )
    parser.add_argument("--run-mode", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    parser.add_argument("--metric", default="accuracy", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.run_mode:
        return child_main(args)
    race = CTR if args.job == CTR else "mlp"
    if race == CTR and args.target is not None:
        parser.error("--job ctr races to an eval AUC: give --target-auc, not --target")
    if args.target_auc is not None or race == CTR:
        args.metric, args.target = "auc", args.target_auc
    profile = dict(DEFAULTS[race])
    if args.quick:  # a smoke test of the whole path (the suite runs it): not a measurement
        args.repeats = 1
        profile.update(QUICK[race])
    for key, value in profile.items():  # what is not given on the command line
        if getattr(args, key) is None:
            setattr(args, key, value)
    if race == CTR:
        try:
            (rows,) = embeddings.parse_rows(args.ctr_rows)
        except ValueError as err:
            parser.error(f"--ctr-rows: {err}")
        examples = CTR_QUICK_EVAL_EXAMPLES if args.quick else CTR_EVAL_EXAMPLES
        embeddings.ctr_env(rows=rows, optimizer=args.ctr_optimizer, eval_examples=examples)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
