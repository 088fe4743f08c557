"""Training throughput: psctl against the raw TensorFlow tutorial loop and one local process.

All modes train the built-in ``mlp`` job (same model, optimizer, loss and data) with the same
batch per worker, and report training steps per second (one step = one batch of
``--batch-size`` examples on one worker, so steps/s x batch = examples/s in every mode):

``psctl``
    psctl's ``Trainer(...).run()`` on the cluster at K steps per scheduled call;
    the rate is the ``Summary``'s ``steps_per_sec``.
``raw``
    The TensorFlow parameter-server tutorial loop
    (https://www.tensorflow.org/tutorials/distribute/parameter_server_training):
    ParameterServerStrategy + ClusterCoordinator, a per-worker dataset,
    ``coordinator.schedule(train_fn, args=(iterator,))`` for every call, then
    ``coordinator.join()``; at 1 step per call and at K (``for _ in tf.range(K)`` around
    ``strategy.run``). Like the tutorial it updates an accuracy metric on the ps and returns
    the loss. No psctl code runs in this loop (``load_job`` only imports the job module).
``local``
    One process, no cluster: the same model and data in a plain ``tf.function`` custom loop,
    at 1 and K steps per call.

What is timed is the same in every mode, and matches the window of psctl's ``Summary``: the
clock starts after the strategy, the model, the optimizer (and its slots) exist, just before
the per-worker dataset and its iterator are created, and stops when every scheduled call has
finished (raw: ``join()`` returns; psctl: its last ``fetch()`` returns; local: the last call
returns). So it INCLUDES creating the per-worker datasets, tracing the train function and
every worker's first call (function registration, shuffle-buffer fill), and EXCLUDES process
start, ``import tensorflow``, connecting to the cluster, building the variables, and what
comes after training (psctl: tearing down its loop's iterator, the final evaluation). Each run
also reports ``setup_s`` (dataset creation plus the first ``schedule()``, which traces;
locally, the first call, which also runs K steps) and the rate after it,
``steps_per_sec_excl_setup``, for reference. In the psctl child these come from time stamps
around the Trainer's calls into its ``ClusterCoordinator`` and the results' ``fetch()``
(wrapped, not changed); the parent warns when the Summary's window differs from that one.

Each TF coordinator can connect to a cluster only once per process, so every measured run is a
fresh subprocess (``--run-mode``) that prints one JSON line; the parent starts one local
cluster (``LocalCluster``, psctl.coordinator.launch.local) that serves all runs, runs the
modes interleaved (``--repeats`` rounds, the order rotated each round), and prints the
medians. The last line of output is ``psctl/raw_tf = R.RR``: psctl over raw TF steps/s at
the same steps per call.

``--metrics-overhead`` runs only psctl, with the coordinator's metrics off (``metrics=None``,
the ``psctl`` mode) and on (``psctl-metrics``: a ``CoordinatorMetrics`` on its own
``CollectorRegistry`` served on /metrics as ``psctl train --metrics-port`` serves it, and wired
to the control's state likewise), same cluster, steps and K, interleaved. While an ``on`` child
runs, a thread in the parent GETs its /metrics every second, as Prometheus would. Its last line
is ``metrics overhead = X.X%``: 1 - on/off of the median steps/s (positive = slower with them).

``--tf-ports-overhead`` runs only psctl, on the usual cluster (TensorFlow's ports open, as
``psctl local --open-tf-ports``) and on a second one whose ports are in a job network
namespace, as ``psctl local`` runs them by default (cluster/netns.py), interleaved. Its last
line is ``namespace cost = X.X%``: 1 - namespace/open of the median steps/s.

``--tunnel-overhead`` runs only psctl, across network-namespace hosts (bench/harness/netlab.py,
one host per task; the direct network, or ``--rtt MS``), open and with every host behind
its tunnel (``--transport``: tls, the default, or wireguard) as the units of ``psctl deploy
render --keys`` run them, interleaved.
Its last line is ``tunnel cost = X.X%``: 1 - tunnel/open of the median steps/s.

    .venv/bin/python bench/throughput.py          # defaults: about 4 minutes on 2 cores
    .venv/bin/python bench/throughput.py --repeats 1 --steps 800 --json out.json
    .venv/bin/python bench/throughput.py --metrics-overhead --repeats 5
    .venv/bin/python bench/throughput.py --tf-ports-overhead --repeats 5
    .venv/bin/python bench/throughput.py --tunnel-overhead --repeats 5   # root
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

JOB = "mlp"
SEED = 42
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: the bench package (bench.harness) importable
    sys.path.insert(0, str(REPO))

from bench.harness import spawn  # noqa: E402
from bench.harness.netlab import add_mtu_flag, add_transport_flag  # noqa: E402


@dataclass(frozen=True)
class Mode:
    """One benchmark configuration: which loop, and how many steps per call."""

    kind: str  # "psctl" | "raw" | "local"
    k: int

    @property
    def label(self) -> str:
        return f"{self.kind}@{self.k}"


# --------------------------------------------------------------------------------------------
# Children: one measured run each, one JSON line on stdout.
# --------------------------------------------------------------------------------------------


def _timing(
    steps: int, t_data: float, t_first: float, t_traced: float, t_end: float, *, ran: int = 0
) -> dict[str, Any]:
    """One definition of the window for every mode (see the module docstring).

    ``ran``: steps already finished when the first call returned (local calls are synchronous).
    """
    seconds = t_end - t_data
    return {
        "steps": steps,
        "seconds": seconds,
        "steps_per_sec": steps / seconds,
        "data_s": t_first - t_data,
        "trace_s": t_traced - t_first,
        "setup_s": t_traced - t_data,
        "steps_per_sec_excl_setup": (steps - ran) / (t_end - t_traced) if steps > ran else None,
    }


def _new_trainer(
    job: Any, cluster: Any, settings: Any, metrics: Any = None, hooks: Any = None
) -> Any:
    """``Trainer`` as ``psctl train`` builds it (a ``JobControl``, ``metrics=`` wired to the
    control's state when given), with the bench's ``hooks``."""
    from psctl.coordinator.operations.job_state import JobControl
    from psctl.coordinator.training.trainer import Trainer

    control = JobControl(
        job=settings.job,
        target_steps=settings.loop.steps,
        steps_per_execution=settings.loop.steps_per_execution,
        tasks=[],
        can_checkpoint=False,
        on_state=metrics.set_state if metrics is not None else None,
    )
    return Trainer(
        job=job, cluster=cluster, settings=settings, control=control, metrics=metrics, hooks=hooks
    )


def _stamp_hooks(
    calls: dict[str, list[tuple[float, float]]], cpu: dict[str, list[tuple[float, float]]]
) -> Any:
    """The Trainer's public loop hooks, time-stamping its dataset creation, schedules, fetches
    and join: wall time, and this process's CPU seconds (every thread: TF's, the loop's, a
    /metrics server's), less skewed by other load than wall time."""
    from psctl.hooks import LoopHooks

    open_: dict[str, tuple[float, float]] = {}

    def begin(name: str) -> None:
        open_[name] = (time.monotonic(), time.process_time())

    def end(name: str) -> None:
        started, cpu_started = open_.pop(name, (time.monotonic(), time.process_time()))
        calls[name].append((started, time.monotonic()))
        cpu[name].append((cpu_started, time.process_time()))

    class Stamps(LoopHooks):
        def before_dataset(self) -> None:
            begin("data")

        def after_dataset(self) -> None:
            end("data")

        def before_schedule(self, steps: int) -> None:
            begin("schedule")

        def after_schedule(self, steps: int) -> None:
            end("schedule")

        def after_call(self, steps: int, seconds: float) -> None:
            begin("fetch")
            end("fetch")

        def before_join(self) -> None:
            begin("join")

        def after_join(self) -> None:
            end("join")

    return Stamps()


def run_psctl(args: argparse.Namespace, metrics: Any = None) -> dict[str, Any]:
    """psctl's own loop as `psctl train` runs it (no checkpoints); its Summary's rate."""
    from psctl.cluster.spec import load_cluster_file
    from psctl.coordinator.job import load_job
    from psctl.coordinator.settings import TrainSettings

    settings = TrainSettings.of(
        job=JOB,
        steps=args.steps,
        batch_size=args.batch_size,
        steps_per_execution=args.steps_per_execution,
        checkpoint_dir="",
        seed=SEED,
    )
    # Instrumentation only, to check the Summary's window against the bench's and to split
    # out set-up: time stamps from the Trainer's public loop hooks.
    calls: dict[str, list[tuple[float, float]]] = {
        "data": [],
        "schedule": [],
        "fetch": [],
        "join": [],
    }
    cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
    hooks = _stamp_hooks(calls, cpu)
    trainer = _new_trainer(
        load_job(JOB), load_cluster_file(args.cluster), settings, metrics, hooks=hooks
    )
    summary = trainer.run()
    trained = summary.global_step - summary.start_step
    first, join = calls["schedule"][0], calls["join"][-1]
    # The Trainer fetches every call's result, then joins once the loop has returned; what
    # ends with the loop (its iterator, remote resources) is torn down in between, and the
    # raw loop does not pay that before its join() either. So: the last fetch, else join.
    fetched = len(calls["fetch"]) >= len(calls["schedule"])
    t_end = max(end for _, end in calls["fetch"]) if fetched else join[1]
    if fetched:
        last = max(range(len(calls["fetch"])), key=lambda i: calls["fetch"][i][1])
        cpu_end = cpu["fetch"][last][1]
    else:
        cpu_end = cpu["join"][-1][1]
    result = _timing(trained, calls["data"][0][0], first[0], first[1], t_end)
    result["after_loop_s"] = join[1] - t_end
    # CLOCK_MONOTONIC is system-wide: the parent counts its scrapes inside this window.
    result.update(window_start=calls["data"][0][0], window_end=t_end)
    result["cpu_s"] = cpu_end - cpu["data"][0][0]
    # The headline number is psctl's own report; the bench's window is kept for the check.
    result.update(
        bench_seconds=result["seconds"],
        bench_steps_per_sec=result["steps_per_sec"],
        seconds=summary.train_seconds,
        steps_per_sec=summary.steps_per_sec,
        loss=summary.loss,
        accuracy=summary.accuracy,
    )
    return result


@dataclass
class RawLoop:
    """The TF tutorial's custom loop, built: call ``train_fn(iterator)`` via ``schedule``."""

    coordinator: Any
    num_workers: int
    model: Any
    accuracy: Any
    iterations: Any  # the optimizer's step counter, on the ps
    train_fn: Any
    per_worker_dataset_fn: Any
    warm_up: Any  # builds the job's arrays once, as psctl does before its clock starts


def build_raw(
    cluster_file: str,
    *,
    batch_size: int,
    k: int,
    job_name: str = JOB,
    create_model: Any = None,
    create_optimizer: Any = None,
    variable_partitioner: Any = None,
) -> RawLoop:
    """The TF tutorial's custom loop, with the job's Keras 3 model, optimizer, loss and data;
    ``create_model``, ``create_optimizer`` and ``variable_partitioner`` stand in for the
    job's own and the strategy's default (bench/embeddings.py's tf-keras mode: the official
    path, with ``TF_USE_LEGACY_KERAS=1``, where ``tf.keras`` is tf-keras)."""
    import tensorflow as tf

    keras = tf.keras  # Keras 3, or tf-keras with TF_USE_LEGACY_KERAS=1

    from psctl.coordinator.data.context import DataContext
    from psctl.coordinator.job import load_job

    job = load_job(job_name)
    cluster = json.loads(Path(cluster_file).read_text())["cluster"]
    num_workers = len(cluster["worker"])
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": cluster, "task": {"type": "chief", "index": 0}}
    )
    cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        cluster_resolver, variable_partitioner=variable_partitioner
    )
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

    with strategy.scope():
        model = (create_model or job.create_model)()
        optimizer = (create_optimizer or job.create_optimizer)()
        # Keras creates optimizer slots lazily; create them on the ps now, not in a closure.
        optimizer.build(model.trainable_variables)
        accuracy = keras.metrics.SparseCategoricalAccuracy()

    def dataset_fn(_input_context: Any) -> Any:
        index = tf.distribute.coordinator.experimental_get_current_worker_index()
        ctx = DataContext(
            worker_index=tf.cast(index, tf.int64),
            num_workers=num_workers,
            batch_size=batch_size,
            seed=SEED,
        )
        return job.dataset_fn(ctx)

    @tf.function
    def per_worker_dataset_fn() -> Any:
        return strategy.distribute_datasets_from_function(dataset_fn)

    def replica_fn(batch_data: Any, labels: Any) -> Any:
        with tf.GradientTape() as tape:
            pred = model(batch_data, training=True)
            per_example_loss = job.loss_fn(labels, pred)
            loss = tf.nn.compute_average_loss(per_example_loss)
            if model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        accuracy.update_state(labels, pred)
        return loss

    @tf.function
    def step_fn(iterator: Any) -> Any:
        batch_data, labels = next(iterator)
        losses = strategy.run(replica_fn, args=(batch_data, labels))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    @tf.function
    def packed_step_fn(iterator: Any) -> Any:
        losses = tf.constant(0.0)
        for _ in tf.range(k):
            batch_data, labels = next(iterator)
            losses = strategy.run(replica_fn, args=(batch_data, labels))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    return RawLoop(
        coordinator=coordinator,
        num_workers=num_workers,
        model=model,
        accuracy=accuracy,
        iterations=optimizer.iterations,
        train_fn=step_fn if k == 1 else packed_step_fn,
        per_worker_dataset_fn=per_worker_dataset_fn,
        warm_up=lambda: job.dataset_fn(DataContext(0, num_workers, batch_size, SEED)),
    )


def run_raw(args: argparse.Namespace) -> dict[str, Any]:
    """The TF tutorial's custom loop: schedule every call, then join()."""
    k = args.steps_per_execution
    raw = build_raw(args.cluster, batch_size=args.batch_size, k=k)
    coordinator, train_fn = raw.coordinator, raw.train_fn
    num_calls = math.ceil(args.steps / k)
    # psctl builds the job's dataset once before its clock starts (for the element spec), so
    # the job's arrays are ready there; do the same.
    raw.warm_up()
    t_data = time.monotonic()
    per_worker_dataset = coordinator.create_per_worker_dataset(raw.per_worker_dataset_fn)
    per_worker_iterator = iter(per_worker_dataset)
    t_first = time.monotonic()
    last = coordinator.schedule(train_fn, args=(per_worker_iterator,))
    t_traced = time.monotonic()  # schedule() traces the function before it returns
    for _ in range(num_calls - 1):
        last = coordinator.schedule(train_fn, args=(per_worker_iterator,))
    coordinator.join()
    t_end = time.monotonic()
    result = _timing(num_calls * k, t_data, t_first, t_traced, t_end)
    result.update(loss=float(last.fetch()), accuracy=float(raw.accuracy.result()))
    return result


def run_local(args: argparse.Namespace) -> dict[str, Any]:
    """The same model and data in one process: a plain tf.function loop, K steps per call."""
    import keras
    import tensorflow as tf

    from psctl.coordinator.data.context import DataContext
    from psctl.coordinator.job import load_job

    job = load_job(JOB)
    k = args.steps_per_execution
    model = job.create_model()
    optimizer = job.create_optimizer()
    optimizer.build(model.trainable_variables)
    accuracy = keras.metrics.SparseCategoricalAccuracy()
    ctx = DataContext(worker_index=0, num_workers=1, batch_size=args.batch_size, seed=SEED)

    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            pred = model(x, training=True)
            loss = tf.reduce_mean(job.loss_fn(y, pred))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        accuracy.update_state(y, pred)
        return loss

    @tf.function
    def train_fn(iterator: Any) -> Any:
        loss = tf.constant(0.0)
        for _ in tf.range(k):
            x, y = next(iterator)
            loss = step(x, y)
        return loss

    @tf.function
    def train_fn_1(iterator: Any) -> Any:
        x, y = next(iterator)
        return step(x, y)

    fn = train_fn_1 if k == 1 else train_fn
    num_calls = math.ceil(args.steps / k)
    job.dataset_fn(ctx)  # as in the other modes: the job's arrays exist before the clock starts
    t_data = time.monotonic()
    iterator = iter(job.dataset_fn(ctx))
    t_first = time.monotonic()
    loss = fn(iterator)
    t_traced = time.monotonic()  # tracing AND the first call's k steps: local calls block
    for _ in range(num_calls - 1):
        loss = fn(iterator)
    final_loss = float(loss.numpy())  # waits for the last call
    t_end = time.monotonic()
    result = _timing(num_calls * k, t_data, t_first, t_traced, t_end, ran=k)
    result.update(loss=final_loss, accuracy=float(accuracy.result()))
    return result


def run_psctl_metrics(args: argparse.Namespace) -> dict[str, Any]:
    """``run_psctl`` with the coordinator's metrics on, as ``psctl train --metrics-port`` has
    them (``start_metrics``, psctl.coordinator.operations.metrics): a ``CoordinatorMetrics``
    on its own registry, served on /metrics; the parent scrapes it every second while this
    runs."""
    from prometheus_client import CollectorRegistry

    from psctl.cluster.metrics import serve_metrics
    from psctl.cluster.spec import load_cluster_file
    from psctl.coordinator.operations.metrics import CoordinatorMetrics

    cluster = load_cluster_file(args.cluster)
    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(
        registry=registry,
        job=JOB,
        num_workers=cluster.num_workers,
        num_ps=cluster.num_ps,
        batch_size=args.batch_size,
    )
    serve_metrics(registry, host="127.0.0.1", port=args.metrics_port)
    result = run_psctl(args, metrics)
    # Proof the metrics were live: what the Trainer counted into them.
    result["metrics_steps_total"] = registry.get_sample_value("psctl_train_steps_total")
    return result


def run_dispatch(args: argparse.Namespace) -> dict[str, Any]:
    """The coordinator's dispatch capacity: ``--steps`` schedules of an almost empty function
    (it returns a constant; no variable, no data), then ``join()``."""
    import tensorflow as tf

    from psctl.cluster.spec import load_cluster_file
    from psctl.coordinator.training.strategy import cluster_resolver

    cluster = load_cluster_file(args.cluster)
    strategy = tf.distribute.experimental.ParameterServerStrategy(cluster_resolver(cluster))
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

    @tf.function
    def noop() -> Any:
        return tf.constant(0, tf.int64)

    t_first = time.monotonic()
    for _ in range(2 * cluster.num_workers):
        coordinator.schedule(noop)  # traced and registered on every worker
    coordinator.join()
    t_traced = time.monotonic()
    for _ in range(args.steps):
        coordinator.schedule(noop)
    coordinator.join()
    t_end = time.monotonic()
    result = _timing(args.steps, t_traced, t_first, t_traced, t_end)
    result.update(setup_s=t_traced - t_first, loss=None, accuracy=None)
    return result


CHILDREN = {
    "dispatch": run_dispatch,
    "psctl": run_psctl,
    "psctl-metrics": run_psctl_metrics,
    "psctl-netns": run_psctl,  # the same run, in a job namespace (--tf-ports-overhead)
    "psctl-tunnel": run_psctl,  # the same run, hosts behind their tunnels (--tunnel-overhead)
    "raw": run_raw,
    "local": run_local,
}


def child_main(args: argparse.Namespace) -> int:
    from psctl.cluster import netns

    netns.enter()  # psctl-netns: where its cluster's TensorFlow ports are, as psctl local's
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    if args.run_mode != "local" and not args.cluster:
        print("throughput: --cluster FILE is required with --run-mode psctl/raw", file=sys.stderr)
        return 2
    if args.run_mode == "psctl-metrics" and not args.metrics_port:
        print("throughput: --metrics-port is required with psctl-metrics", file=sys.stderr)
        return 2
    logging.basicConfig(  # goes to the run's .log file, with times, for a look afterwards
        level=logging.WARNING, format="%(asctime)s.%(msecs)03d %(name)s: %(message)s", datefmt="%X"
    )
    for name in ("bench", "coordinator"):
        logging.getLogger(name).setLevel(logging.INFO)
    log = logging.getLogger("bench")
    log.info("%s@%d: starting", args.run_mode, args.steps_per_execution)
    result = CHILDREN[args.run_mode](args)
    log.info("%s@%d: done: %s", args.run_mode, args.steps_per_execution, result)
    result.update(mode=args.run_mode, steps_per_execution=args.steps_per_execution)
    print(json.dumps(result), flush=True)
    return 0


# --------------------------------------------------------------------------------------------
# Parent: one cluster, every mode in its own subprocess, a table at the end.
# --------------------------------------------------------------------------------------------


class ChildFailed(Exception):
    pass


def _raise_interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def wait_port_released(port: int, *, timeout: float) -> None:
    """The previous coordinator's chief port must be free before the next one binds it."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            # Like gRPC, ignore TIME_WAIT leftovers; only a live listener counts as taken.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
                return
            except OSError as err:
                if err.errno != errno.EADDRINUSE:
                    raise ChildFailed(f"cannot bind the chief port {port}: {err}") from err
                if time.monotonic() >= deadline:
                    raise ChildFailed(
                        f"chief port {port} still in use after {timeout:.0f}s"
                    ) from err
        time.sleep(0.2)


def _num(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.3f}"


def check_window(result: dict[str, Any]) -> None:
    """Warn when psctl's Summary timed another window than the bench times the other modes."""
    if "bench_seconds" not in result:
        return
    ours, theirs = result["bench_seconds"], result["seconds"]
    if abs(ours - theirs) > max(0.25, 0.05 * ours):
        print(
            f"  warning: psctl's Summary timed {theirs:.2f}s, the bench's window (dataset "
            f"creation to join) {ours:.2f}s: the modes are not timed alike; "
            f"from the bench's window psctl ran {result['bench_steps_per_sec']:.1f} steps/s "
            f"(after its loop: {result['after_loop_s']:.2f}s)",
            flush=True,
        )


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"{os.cpu_count()} CPUs, load average {one:.2f} (1 min) {five:.2f} (5 min)"


def _tail(path: Path, count: int = 20) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "    (no log)"
    return "\n".join("    " + line for line in lines[-count:])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Scraper(threading.Thread):
    """GETs /metrics every ``interval`` seconds, as Prometheus would, until stopped.

    Runs in the parent, which otherwise only waits for the child: the cost measured is the
    child's (the HTTP server thread rendering the registry, and the Trainer's updates).
    Connection errors before the child serves are expected and only counted.
    """

    def __init__(self, port: int, interval: float = 1.0) -> None:
        super().__init__(name="scraper", daemon=True)
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.interval = interval
        self.done = threading.Event()
        self.times: list[float] = []  # monotonic start of each successful scrape
        self.latencies: list[float] = []
        self.errors = 0
        self.bytes = 0
        self.steps_seen: float | None = None  # psctl_train_steps_total in the last scrape

    def run(self) -> None:
        due = time.monotonic()
        while not self.done.is_set():
            started = time.monotonic()
            try:
                with urllib.request.urlopen(self.url, timeout=2.0) as response:
                    body = response.read()
            except OSError:
                self.errors += 1
            else:
                self.times.append(started)
                self.latencies.append(time.monotonic() - started)
                self.bytes += len(body)
                for line in body.decode(errors="replace").splitlines():
                    if line.startswith("psctl_train_steps_total "):
                        self.steps_seen = float(line.split()[1])
            due += self.interval
            self.done.wait(max(0.0, due - time.monotonic()))

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=5.0)

    def report(self, result: dict[str, Any]) -> dict[str, Any]:
        start, end = result.get("window_start"), result.get("window_end")
        if start is None or end is None:
            start, end = math.inf, -math.inf
        inside = [t for t in self.times if start <= t <= end]
        return {
            "scrapes": len(self.times),
            "scrapes_in_window": len(inside),
            "scrape_errors": self.errors,
            "scrape_bytes": self.bytes // max(1, len(self.times)),
            "scrape_ms": 1000 * statistics.median(self.latencies) if self.latencies else None,
            "scraped_steps": self.steps_seen,
        }


def run_child(
    mode: Mode, args: argparse.Namespace, cluster: Any, logs: Path, run_id: int, repeat: int
) -> dict[str, Any]:
    """One measured child on ``cluster`` (a LocalCluster, or netlab's LabBench)."""
    cluster_file = cluster.cluster_file
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--run-mode",
        mode.kind,
        "--steps",
        str(args.steps),
        "--steps-per-execution",
        str(mode.k),
        "--batch-size",
        str(args.batch_size),
    ]
    if mode.kind != "local":
        argv += ["--cluster", str(cluster_file)]
    scraper = None
    if mode.kind == "psctl-metrics":
        port = _free_port()
        argv += ["--metrics-port", str(port)]
        scraper = Scraper(port)
    if mode.kind != "local" and hasattr(cluster, "child_argv"):  # on the coordinator's host
        argv = cluster.child_argv(argv)
    out_path = logs / f"run{run_id:02d}-{mode.kind}-{mode.k}.out"
    started = time.monotonic()
    if scraper is not None:
        scraper.start()
    try:
        result = run_measured(mode.label, argv, out_path, timeout=args.timeout)
    finally:
        if scraper is not None:
            scraper.stop()
    wall = time.monotonic() - started
    result.update(label=mode.label, wall_s=wall, repeat=repeat)
    if scraper is not None:
        result.update(scraper.report(result))
    return result


def run_measured(label: str, argv: list[str], out_path: Path, *, timeout: float) -> dict[str, Any]:
    """Run one measured child (this benchmark's or tta's) in its own session, killed with the
    parent; stdout to ``out_path``, stderr beside it (``.log``). Its last JSON line."""
    err_path = out_path.with_suffix(".log")
    with out_path.open("wb") as out, err_path.open("wb") as err:
        proc = spawn(argv, stdout=out, stderr=err)  # Ctrl-C: the bench kills the child
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ChildFailed(
                f"{label} did not finish in {timeout:.0f}s; "
                f"last lines of {err_path}:\n{_tail(err_path)}"
            ) from None
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
    if code != 0:
        raise ChildFailed(
            f"{label} exited with status {code}; last lines of {err_path}:\n{_tail(err_path)}"
        )
    for line in reversed(out_path.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            result: dict[str, Any] = json.loads(line)
            return result
    raise ChildFailed(f"{label} printed no result; see {out_path} and {err_path}")


def summarize(modes: list[Mode], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median, min and max steps/s per mode, and each median over raw TF's at the same K."""
    medians: dict[str, float] = {}
    rows = []
    for mode in modes:
        mine = [r for r in runs if r["label"] == mode.label]
        rates = [r["steps_per_sec"] for r in mine]
        steady = [r["steps_per_sec_excl_setup"] for r in mine if r["steps_per_sec_excl_setup"]]
        medians[mode.label] = statistics.median(rates)
        rows.append(
            {
                "mode": mode.kind,
                "steps_per_execution": mode.k,
                "median": medians[mode.label],
                "min": min(rates),
                "max": max(rates),
                "runs": len(rates),
                "median_setup_s": statistics.median(r["setup_s"] for r in mine),
                "median_excl_setup": statistics.median(steady) if steady else None,
            }
        )
    for row in rows:
        raw = medians.get(f"raw@{row['steps_per_execution']}")
        row["vs_raw"] = row["median"] / raw if raw else None
    return rows


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print()
    print(
        f"{JOB} job, {args.ps} ps + {args.workers} workers, batch {args.batch_size}/worker, "
        f"{args.steps} steps/run, {args.repeats} repeat(s)"
    )
    header = (
        f"{'mode':<6} {'steps/call':>10} {'steps/s':>9} {'range':>15} {'vs raw':>7} "
        f"{'setup s':>8} {'excl. setup':>12}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        span = f"{row['min']:.1f}-{row['max']:.1f}"
        rel = f"{row['vs_raw']:.2f}x" if row["vs_raw"] is not None else "-"
        steady = f"{row['median_excl_setup']:.1f}" if row["median_excl_setup"] else "-"
        print(
            f"{row['mode']:<6} {row['steps_per_execution']:>10} {row['median']:>9.1f} "
            f"{span:>15} {rel:>7} {row['median_setup_s']:>8.2f} {steady:>12}"
        )
    print(
        "steps/s: median over repeats (psctl: its Summary.steps_per_sec), timed from creating "
        "the\n  per-worker dataset until every call has finished: data set-up, tracing and "
        "warm-up\n  included in every mode; range = min-max; vs raw = over raw TF at the same "
        "steps/call;\n  setup s = dataset + tracing (local: + the first call); "
        "excl. setup = steps/s after it"
    )
    print()


def overhead(rows: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Metrics on vs off: 1 - on/off of the median steps/s (positive = slower with metrics),
    plus the same per round (both modes ran back to back in every round) for the spread."""
    off = next(r for r in rows if r["mode"] == "psctl")
    on = next(r for r in rows if r["mode"] == "psctl-metrics")
    rounds = []
    for repeat in sorted({r["repeat"] for r in runs}):
        pair = {r["mode"]: r["steps_per_sec"] for r in runs if r["repeat"] == repeat}
        if "psctl" in pair and "psctl-metrics" in pair:
            rounds.append(100.0 * (1.0 - pair["psctl-metrics"] / pair["psctl"]))
    steady = None
    if off["median_excl_setup"] and on["median_excl_setup"]:
        steady = 100.0 * (1.0 - on["median_excl_setup"] / off["median_excl_setup"])
    cpu = {}
    for mode in ("psctl", "psctl-metrics"):
        per_step = [
            1e3 * r["cpu_s"] / r["steps"] for r in runs if r["mode"] == mode and "cpu_s" in r
        ]
        cpu[mode] = statistics.median(per_step) if per_step else None
    cpu_pct = None
    if cpu["psctl"] and cpu["psctl-metrics"]:
        cpu_pct = 100.0 * (cpu["psctl-metrics"] / cpu["psctl"] - 1.0)
    return {
        "overhead_pct": 100.0 * (1.0 - on["median"] / off["median"]),
        "cpu_ms_per_step": cpu,
        "cpu_overhead_pct": cpu_pct,
        "overhead_excl_setup_pct": steady,
        "per_round_pct": rounds,
        "median_per_round_pct": statistics.median(rounds) if rounds else None,
    }


def print_overhead(
    rows: list[dict[str, Any]], runs: list[dict[str, Any]], result: dict[str, Any], args: Any
) -> None:
    print()
    print(
        f"{JOB} job, {args.ps} ps + {args.workers} workers, batch {args.batch_size}/worker, "
        f"{args.steps} steps/run, {args.repeats} repeat(s), psctl with coordinator metrics "
        "off vs on"
    )
    header = (
        f"{'metrics':<8} {'steps/call':>10} {'steps/s':>9} {'range':>15} {'setup s':>8} "
        f"{'excl. setup':>12} {'scrapes/run':>12}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        on = row["mode"] == "psctl-metrics"
        span = f"{row['min']:.1f}-{row['max']:.1f}"
        steady = f"{row['median_excl_setup']:.1f}" if row["median_excl_setup"] else "-"
        mine = [r for r in runs if r["mode"] == row["mode"]]
        scrapes = f"{statistics.median(r['scrapes_in_window'] for r in mine):.0f}" if on else "-"
        print(
            f"{'on' if on else 'off':<8} {row['steps_per_execution']:>10} {row['median']:>9.1f} "
            f"{span:>15} {row['median_setup_s']:>8.2f} {steady:>12} {scrapes:>12}"
        )
    print(
        "steps/s: median of psctl's Summary.steps_per_sec (window as in the default run); "
        "on = a\n  CoordinatorMetrics on its own registry served on /metrics, GET every 1 s "
        "by the\n  parent (scrapes/run: median successful scrapes inside the timed window)"
    )
    scraped = [r for r in runs if r["mode"] == "psctl-metrics"]
    if scraped:
        latency = statistics.median(r["scrape_ms"] or 0.0 for r in scraped)
        size = statistics.median(r["scrape_bytes"] for r in scraped)
        counted = {r["metrics_steps_total"] for r in scraped}
        print(
            f"scrapes: median {latency:.1f} ms and {size:.0f} bytes each; "
            f"psctl_train_steps_total at the end: {sorted(counted)}"
        )
    rounds = " ".join(f"{x:+.1f}%" for x in result["per_round_pct"])
    print(f"per round (1 - on/off, back to back): {rounds}")
    if result["median_per_round_pct"] is not None:
        print(f"median of the per-round overheads: {result['median_per_round_pct']:.1f}%")
    if result["overhead_excl_setup_pct"] is not None:
        print(f"overhead of the steps/s excl. setup: {result['overhead_excl_setup_pct']:.1f}%")
    cpu = result["cpu_ms_per_step"]
    if result["cpu_overhead_pct"] is not None:
        print(
            f"coordinator CPU per step (median, all its threads, timed window): off "
            f"{cpu['psctl']:.2f} ms, on {cpu['psctl-metrics']:.2f} ms: "
            f"{result['cpu_overhead_pct']:+.1f}%"
        )
    print()


def parent_main(args: argparse.Namespace) -> int:
    from bench.harness.netlab import LabError
    from psctl.cluster.processes.logs import quiet_tensorflow
    from psctl.coordinator.launch.local import ServerFailed

    quiet_tensorflow()  # inherited by the servers and every child
    k = args.steps_per_execution
    modes = [Mode("psctl", k), Mode("raw", k), Mode("raw", 1), Mode("local", k), Mode("local", 1)]
    modes = list(dict.fromkeys(modes))  # K = 1: no duplicates
    if args.metrics_overhead:
        modes = [Mode("psctl", k), Mode("psctl-metrics", k)]
    elif args.tf_ports_overhead:
        modes = [Mode("psctl", k), Mode("psctl-netns", k)]
    elif args.tunnel_overhead:
        modes = [Mode("psctl", k), Mode("psctl-tunnel", k)]
    elif args.capacity:
        modes = [Mode("dispatch", 1), Mode("psctl", k)]
    elif args.skip_local:
        modes = [m for m in modes if m.kind != "local"]
    workdir = Path(args.workdir or REPO / "psctl-work" / time.strftime("bench-%Y%m%d-%H%M%S"))
    logs = workdir / "bench-logs"
    local, chief_port = open_bench(
        args, workdir, logs, [m.label for m in modes], f"work dir {workdir}"
    )
    width = max(9, *(len(m.label) for m in modes))
    runs: list[dict[str, Any]] = []
    kept = contextlib.ExitStack()  # --tf-ports-overhead: a second cluster, in a namespace
    clusters = {}
    try:
        local.start()
        started = time.monotonic()
        local.wait_serving(timeout=args.start_timeout)
        print(
            f"{len(local.servers)} servers SERVING in {time.monotonic() - started:.1f}s",
            flush=True,
        )
        if args.tf_ports_overhead:
            clusters["psctl-netns"] = kept.enter_context(namespaced_cluster(args, workdir))
        if args.tunnel_overhead:
            clusters["psctl-tunnel"] = kept.enter_context(tunnelled_cluster(args, workdir))
        for repeat in range(args.repeats):
            shift = repeat % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                if chief_port:
                    wait_port_released(chief_port, timeout=30.0)
                cluster = clusters.get(mode.kind, local)
                with job_namespace_of(cluster):
                    result = run_child(mode, args, cluster, logs, len(runs) + 1, repeat)
                runs.append(result)
                scrapes = (
                    f"; {result['scrapes_in_window']} scrapes in the window"
                    if "scrapes_in_window" in result
                    else ""
                )
                if args.metrics_overhead:
                    scrapes = f"; CPU {result['cpu_s']:.1f}s" + scrapes
                print(
                    f"[{repeat + 1}/{args.repeats}] {mode.label:<{width}} "
                    f"{result['steps_per_sec']:8.1f} steps/s  ({result['steps']} steps in "
                    f"{result['seconds']:.1f}s, setup {result['setup_s']:.2f}s; process "
                    f"{result['wall_s']:.1f}s; loss {_num(result['loss'])}{scrapes})",
                    flush=True,
                )
                check_window(result)
    except (ChildFailed, ServerFailed, LabError) as err:
        print(f"throughput: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("throughput: interrupted", file=sys.stderr)
        return 130
    finally:
        kept.close()
        close_bench(local)

    print(_load(), flush=True)
    rows = summarize(modes, runs)
    if args.metrics_overhead:
        return report_overhead(rows, runs, args)
    if args.tf_ports_overhead:
        what = ("TF ports", "job namespace (default)", "namespace cost")
        return report_pair(rows, runs, "psctl-netns", what)
    if args.tunnel_overhead:
        label = "TLS (stunnel4, --keys)" if args.transport == "tls" else "WireGuard tunnel (--keys)"
        what = ("between hosts", label, "tunnel cost")
        return report_pair(rows, runs, "psctl-tunnel", what)
    print_table(rows, args)
    if args.capacity:
        capacity = next(r for r in rows if r["mode"] == "dispatch")["median"]
        print(f"dispatch capacity = {capacity:.0f} scheduled functions/s", flush=True)
        return 0
    psctl = next(r for r in rows if r["mode"] == "psctl")
    ratio = psctl["vs_raw"]
    if args.json:
        report = {
            "job": JOB,
            "config": {
                "ps": args.ps,
                "workers": args.workers,
                "steps": args.steps,
                "steps_per_execution": k,
                "batch_size": args.batch_size,
                "repeats": args.repeats,
                "timing": "creating the per-worker dataset to the last call's end; incl. tracing",
            },
            "runs": runs,
            "summary": rows,
            "psctl_over_raw_tf": ratio,
        }
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"results written to {args.json}")
    print(f"psctl/raw_tf = {ratio:.2f}", flush=True)
    return 0


@contextlib.contextmanager
def namespaced_cluster(args: argparse.Namespace, workdir: Path) -> Iterator[Any]:
    """A second LocalCluster like the first, its TensorFlow ports in a job namespace of its
    own as psctl local makes one (cluster/netns.py); ``job_namespace_of`` it names the
    namespace to the children started for it."""
    from psctl.cluster import netns
    from psctl.coordinator.launch.local import LocalCluster

    space = netns.JobNamespace()
    cluster = LocalCluster(num_ps=args.ps, num_workers=args.workers, workdir=workdir / "netns")
    cluster.job_namespace = space  # type: ignore[attr-defined]
    try:
        with space.named():
            cluster.start()
        cluster.wait_serving(timeout=args.start_timeout)
        print(f"{len(cluster.servers)} servers SERVING in a job namespace", flush=True)
        yield cluster
    finally:
        cluster.stop()
        space.close()


@contextlib.contextmanager
def tunnelled_cluster(args: argparse.Namespace, workdir: Path) -> Iterator[Any]:
    """A second network-namespace cluster like the first, every host behind its tunnel
    (--transport) as the units of `psctl deploy render --keys` run (bench/harness/netlab.py)."""
    from bench.harness.netlab import LabBench

    cluster = LabBench(
        args.ps,
        args.workers,
        rtt_ms=args.rtt,
        work=workdir / "tunnel",
        tunnel=True,
        transport=args.transport,
        mtu=args.mtu,
    )
    try:
        cluster.start(timeout=args.start_timeout)
        print(f"{len(cluster.servers)} servers SERVING behind their tunnels", flush=True)
        yield cluster
    finally:
        cluster.stop()


def job_namespace_of(cluster: Any) -> contextlib.AbstractContextManager[None]:
    """The processes started meanwhile join ``cluster``'s job namespace, if it has one
    (the open cluster's children must not: the name is set only around its own)."""
    space = getattr(cluster, "job_namespace", None)
    return contextlib.nullcontext() if space is None else space.named()


def report_pair(
    rows: list[dict[str, Any]], runs: list[dict[str, Any]], other: str, what: tuple[str, ...]
) -> int:
    """psctl on the open cluster vs the same run in mode ``other``, side by side; ``what``:
    (the table's title, the other side's label, the name of the cost in the last line)."""
    title, label, cost_name = what
    medians = {r["mode"]: r["median"] for r in rows}
    rounds = []
    for repeat in sorted({r["repeat"] for r in runs}):
        pair = {r["mode"]: r["steps_per_sec"] for r in runs if r["repeat"] == repeat}
        if "psctl" in pair and other in pair:
            rounds.append(100.0 * (1.0 - pair[other] / pair["psctl"]))
    print()
    print(f"{title:<28} {'steps/s (median)':>17}")
    print(f"{'open (--open-tf-ports)':<28} {medians['psctl']:>17.1f}")
    print(f"{label:<28} {medians[other]:>17.1f}")
    print(f"per round (1 - {cost_name.split()[0]}/open): " + " ".join(f"{x:+.1f}%" for x in rounds))
    cost = 100.0 * (1.0 - medians[other] / medians["psctl"])
    print(f"{cost_name} = {cost:.1f}%", flush=True)
    return 0


def report_overhead(
    rows: list[dict[str, Any]], runs: list[dict[str, Any]], args: argparse.Namespace
) -> int:
    result = overhead(rows, runs)
    print_overhead(rows, runs, result, args)
    if args.json:
        report = {
            "job": JOB,
            "config": {
                "ps": args.ps,
                "workers": args.workers,
                "steps": args.steps,
                "steps_per_execution": args.steps_per_execution,
                "batch_size": args.batch_size,
                "repeats": args.repeats,
                "scrape_interval_s": 1.0,
            },
            "runs": runs,
            "summary": rows,
            **result,
        }
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"results written to {args.json}")
    print(f"metrics overhead = {result['overhead_pct']:.1f}%", flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Steps/s of psctl vs the raw TF parameter-server tutorial loop vs local.",
    )
    parser.add_argument("--ps", type=int, default=1, help="ps servers (default 1)")
    parser.add_argument("--workers", type=int, default=2, help="worker servers (default 2)")
    parser.add_argument(
        "--steps", type=int, default=1500, help="steps per measured run (default 1500)"
    )
    parser.add_argument(
        "--steps-per-execution", type=int, default=20, help="K steps per call (default 20)"
    )
    parser.add_argument("--batch-size", type=int, default=64, help="per worker (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over all modes")
    parser.add_argument(
        "--skip-local", action="store_true", help="leave out the one-process modes (faster)"
    )
    parser.add_argument(
        "--metrics-overhead",
        action="store_true",
        help="instead: psctl with coordinator metrics on (served, scraped every 1 s) vs off; "
        "the last line is 'metrics overhead = X.X%%'",
    )
    parser.add_argument(
        "--tf-ports-overhead",
        action="store_true",
        help="instead: psctl on a cluster with TensorFlow's ports open vs on one in a job "
        "network namespace (psctl local's default), interleaved; the last line is "
        "'namespace cost = X.X%%'",
    )
    parser.add_argument(
        "--tunnel-overhead",
        action="store_true",
        help="instead: psctl across network-namespace hosts (bench/harness/netlab.py; the direct "
        "network, or --rtt MS) with TensorFlow's ports open vs every host behind its "
        "tunnel (psctl deploy render --keys; --transport), interleaved; needs root and the "
        "transport's packages (tools/ensure-systemd-tools.sh); the "
        "last line is 'tunnel cost = X.X%%'",
    )
    parser.add_argument(
        "--capacity",
        action="store_true",
        help="instead: the coordinator's dispatch capacity (--steps schedules of an almost "
        "empty function) and psctl's steps/s on this cluster; the last line is "
        "'dispatch capacity = N scheduled functions/s'",
    )
    parser.add_argument(
        "--rtt",
        type=float,
        metavar="MS",
        help="run the cluster as network-namespace hosts with MS of round-trip time added "
        "between them (bench/harness/netlab.py; 0: the relay with no delay; needs root, iproute2, "
        "cc); default: loopback",
    )
    add_mtu_flag(parser)
    add_transport_flag(parser)
    parser.add_argument("--json", metavar="PATH", help="write every run and the summary here")
    parser.add_argument("--workdir", help="cluster file and logs (default psctl-work/bench-*)")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds per measured run (default 300)"
    )
    parser.add_argument(
        "--start-timeout", type=float, default=60.0, help="seconds for servers to start"
    )
    # Internal: one measured run in this process.
    parser.add_argument("--run-mode", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    parser.add_argument("--metrics-port", type=int, default=0, help=argparse.SUPPRESS)
    return parser


def open_bench(
    args: argparse.Namespace, workdir: Path, logs: Path, labels: list[str], where: str
) -> tuple[Any, int]:
    """The benchmarks' one local cluster (not started yet) and its chief port; prints what
    will run and the machine's load, and turns SIGINT/SIGTERM into KeyboardInterrupt."""
    from psctl.coordinator.launch.local import LocalCluster

    logs.mkdir(parents=True, exist_ok=True)
    local: Any
    if getattr(args, "rtt", None) is not None or getattr(args, "tunnel_overhead", False):
        from bench.harness.netlab import LabBench  # namespace hosts (through the delaying relay)

        mtu = getattr(args, "mtu", 1500)
        local = LabBench(args.ps, args.workers, rtt_ms=args.rtt, work=workdir, mtu=mtu)
        chief_port = 0  # in the coordinator's own namespace: never held by an earlier run here
        if args.rtt is None:
            where += "; network: namespace hosts, direct"
        else:
            where += f"; network: namespace hosts, {args.rtt:g} ms added round-trip time"
        if mtu != 1500:
            where += f", links of MTU {mtu}"
    else:
        local = LocalCluster(num_ps=args.ps, num_workers=args.workers, workdir=workdir)
        chief_port = local.cluster.task_address("chief", 0).port
    print(
        f"{where}; {len(labels)} modes x {args.repeats} repeat(s): " + ", ".join(labels),
        flush=True,
    )
    print(f"{_load()} (other work on this machine skews every mode)", flush=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _raise_interrupt)
    return local, chief_port


def close_bench(local: Any) -> None:
    """Stop ``open_bench``'s cluster, SIGINT/SIGTERM ignored meanwhile (let nothing cut the
    clean-up short), then back to their defaults."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    local.stop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("ps", "workers", "steps", "steps_per_execution", "batch_size", "repeats"):
        if getattr(args, name) < 1:
            build_parser().error(f"--{name.replace('_', '-')} must be >= 1")
    if args.rtt is not None and not 0 <= args.rtt <= 1000:
        build_parser().error(f"--rtt {args.rtt:g}: milliseconds from 0 to 1000")
    if args.run_mode:
        return child_main(args)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
