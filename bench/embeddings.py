"""Large embedding tables: psctl's sharded tables against the raw TF loop with plain Keras 3.

Trains the built-in ``ctr`` job (DLRM-style: 26 ids per example looking up one
``keras.layers.Embedding(rows, 16)`` table, 13 counts, a top MLP) at several table sizes
(``--rows``, default 1M; ``--full``: 10k,1M,10M) and optimizers (``--optimizers``, default
adam; ``--full``: adam,adagrad), on
``--ps`` (2) ps + ``--workers`` (2) workers, batch ``--batch-size`` (256) per worker, K =
``--steps-per-execution`` (10) steps per scheduled call, in two modes by default (``--full``
adds tf_keras and local):

``psctl``
    psctl's ``Trainer`` with ``--max-shards`` (2): the table is split over the ps tasks and
    the optimizer updates only the rows a batch touched, next to each shard. The rate is
    its ``Summary.steps_per_sec``; the Trainer's public loop hooks stop it at the budget.
``raw``
    The TF parameter-server tutorial loop (``bench/throughput.py``'s ``build_raw``) with
    the same Keras 3 model, optimizer, loss and data: the table is one variable on one ps,
    and Keras's own ``apply_gradients`` updates it (Adam and Adagrad: every row, every
    step). ``schedule()`` every call, then ``join()``; steps/s as in throughput.py.

Both are timed alike (throughput.py's window): from creating the per-worker datasets until
every call has finished, set-up and tracing included. Every run has a budget of
``--max-seconds`` (60) of that window: psctl is asked to stop (its calls in flight finish);
the raw loop's steps so far are read off the optimizer's step counter on the ps and the
child exits without waiting for the rest. Steps/s are then over what was done ("*" in the
table); a run that finished no step in its budget, or whose process outlived it by
``--setup-timeout``, is "too slow".

Peak RSS per ps: ``VmHWM`` of each ps server process (``/proc/<pid>/status``). A ps keeps its
memory across runs, so every run (each mode, size and optimizer) gets a fresh
``LocalCluster``; the table shows each ps's peak and, in brackets, its growth over its RSS
when it was SERVING, beside the expected share of one ps: table bytes x (1 + optimizer
slots) / number of ps (Adam keeps 2 slots per row, Adagrad 1).

Writes ``table.md`` and ``results.json`` under ``--results`` (default
``bench/results/embeddings-<time>/``; the servers' and children's logs under ``work/``).
The last line is ``psctl/raw_keras steps/s at 1M rows (adam) = R.RR``; without that
configuration, the same line for the one nearest to it, said so the line before.

    .venv/bin/python bench/embeddings.py             # 1M rows, adam, psctl and raw (minutes)
    .venv/bin/python bench/embeddings.py --full      # 3 sizes x 2 optimizers x 4 modes (24 runs)
    .venv/bin/python bench/embeddings.py --rows 1M --optimizers adam
    .venv/bin/python bench/embeddings.py --rows 10M --modes psctl  # one mode only
    .venv/bin/python bench/embeddings.py --quick     # smoke test: 10k rows, adam, 100 steps
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import throughput
from bench.harness import results_dir
from bench.harness.netlab import add_mtu_flag, add_transport_flag

JOB = "ctr"
REPO = throughput.REPO
MODES = ("psctl", "raw", "tf_keras", "local")
QUICK_MODES = "psctl,raw"
DEFAULT_ROWS, FULL_ROWS = "1M", "10k,1M,10M"
DEFAULT_OPTIMIZERS, FULL_OPTIMIZERS = "adam", "adam,adagrad"
TF_KERAS_ENV = REPO / ".venv-tfkeras"  # tf-keras pulls in its own TensorFlow wheel
TF_KERAS_PINS = ("tensorflow==2.21.0", "tf-keras==2.21.0")  # the TF psctl runs on
LOOPBACK = "loopback"  # no --rtt: LocalCluster on 127.0.0.1, as before
NAMESPACE = "job namespace"  # --tf-ports-overhead: the same, its TF ports as psctl local's
TUNNEL = " + tunnel"  # --tunnel-overhead: each network again, every host behind its tunnel
EMBEDDING_DIM = 16  # the ctr job's (jobs/ctr.py, EMBEDDING_DIM)
ITEM_BYTES = 4  # float32
SLOTS = {"adam": 2, "adagrad": 1}  # optimizer state per table row, in rows
MIN_ROWS, MAX_ROWS = 1_000, 1_000_000_000  # what the ctr job accepts (CTR_ROWS)
EVAL_EXAMPLES = 512  # psctl's final evaluation (after the timed window): one block
READ_TIMEOUT = 30.0  # seconds for the raw child to read the step counter at its budget


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------


def parse_rows(text: str) -> list[int]:
    """``10k,1M,10M`` -> [10000, 1000000, 10000000]; ValueError on anything else."""
    sizes = []
    for part in text.split(","):
        cleaned = part.strip().replace("_", "")
        scale = {"k": 1_000, "m": 1_000_000}.get(cleaned[-1:].lower(), 1)
        number = cleaned[:-1] if scale > 1 else cleaned
        try:
            value = float(number) * scale
        except ValueError:
            raise ValueError(f"{part.strip()!r} is not a row count (e.g. 10k, 1M)") from None
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"{part.strip()!r} is not a whole number of rows")
        if not MIN_ROWS <= value <= MAX_ROWS:
            raise ValueError(f"{part.strip()}: give {MIN_ROWS:,} to {MAX_ROWS:,} rows")
        sizes.append(int(value))
    return list(dict.fromkeys(sizes))


def rows_label(rows: int) -> str:
    for unit, scale in (("M", 1_000_000), ("k", 1_000)):
        if rows % scale == 0:
            return f"{rows // scale}{unit}"
    return str(rows)


def table_mb(rows: int) -> float:
    return rows * EMBEDDING_DIM * ITEM_BYTES / 1e6


def expected_mb(rows: int, optimizer: str, num_ps: int) -> float:
    """What one ps should hold: the table and its optimizer slots, split evenly."""
    return table_mb(rows) * (1 + SLOTS[optimizer]) / num_ps


# --------------------------------------------------------------------------------------------
# Children: one measured run each, one JSON line on stdout.
# --------------------------------------------------------------------------------------------


def ctr_env(*, rows: int, optimizer: str, eval_examples: int) -> None:
    """The ctr job's settings, set in this process's environment (read when the job builds;
    children inherit them). Shared with bench/tta.py's ``--job ctr``."""
    os.environ["CTR_ROWS"] = str(rows)
    os.environ["CTR_OPTIMIZER"] = optimizer
    os.environ["CTR_EVAL_EXAMPLES"] = str(eval_examples)


def run_psctl(args: argparse.Namespace) -> dict[str, Any]:
    """psctl's ``Trainer`` as ``psctl train --max-shards N`` runs it (no checkpoints), stopped
    at the budget through its public loop hooks; the rate is its Summary's."""
    from psctl.cluster.spec import load_cluster_file
    from psctl.coordinator.job import load_job
    from psctl.coordinator.settings import TrainSettings
    from psctl.hooks import LoopHooks

    settings = TrainSettings.of(
        job=JOB,
        steps=args.steps,
        batch_size=args.batch_size,
        steps_per_execution=args.steps_per_execution,
        checkpoint_dir="",
        seed=throughput.SEED,
        max_shards=args.max_shards,
        stall_timeout=max(60.0, args.max_seconds + args.setup_timeout),
    )
    stamps: dict[str, float] = {}

    class Budget(LoopHooks):
        """Time stamps of the window, and a stop request when the budget is spent."""

        def before_dataset(self) -> None:
            stamps.setdefault("data", time.monotonic())

        def after_schedule(self, steps: int) -> None:
            stamps.setdefault("traced", time.monotonic())

        def after_call(self, steps: int, seconds: float) -> None:
            stamps.setdefault("first_call", time.monotonic())

        def on_poll(self, controller: Any) -> None:
            started = stamps.get("data")
            if "budget" in stamps or started is None:
                return
            if time.monotonic() - started >= args.max_seconds:
                stamps["budget"] = time.monotonic()
                controller.request_stop()  # the calls in flight finish, then the usual end

    trainer = throughput._new_trainer(
        load_job(JOB), load_cluster_file(args.cluster), settings, hooks=Budget()
    )
    tables = [
        {"rows": t.rows, "shards": len(t.shards), "shard_rows": [int(s.shape[0]) for s in t.shards]}
        for t in trainer.state.tables
    ]
    summary = trainer.run()
    trained = summary.global_step - summary.start_step
    return {
        "steps": trained,
        "seconds": summary.train_seconds,
        "steps_per_sec": summary.steps_per_sec,
        "setup_s": stamps.get("traced", math.nan) - stamps.get("data", math.nan),
        "first_call_s": stamps.get("first_call", math.nan) - stamps.get("data", math.nan),
        "budget_hit": "budget" in stamps and trained < args.steps,
        "loss": summary.loss,
        "eval_auc": summary.eval_auc,
        "tables": tables,
    }


def _read_steps(iterations: Any) -> int | None:
    """The optimizer's step counter on the ps, or None if it does not answer in time."""
    box: list[int] = []

    def read() -> None:
        box.append(int(iterations.numpy()))

    reader = threading.Thread(target=read, name="read-steps", daemon=True)
    reader.start()
    reader.join(READ_TIMEOUT)
    return box[0] if box else None


def run_raw(args: argparse.Namespace, **build: Any) -> dict[str, Any]:
    """The TF tutorial loop (throughput.py's ``run_raw``): every call scheduled, then
    ``join()``, watched against the budget. At the budget the steps done so far are read
    off the optimizer's step counter on the ps, the result is printed, and the process
    exits at once (the calls left would take as long again; the cluster goes with it).
    ``build``: throughput.build_raw's stand-ins (the tf-keras mode's)."""
    k = args.steps_per_execution
    raw = throughput.build_raw(args.cluster, batch_size=args.batch_size, k=k, job_name=JOB, **build)
    table = raw.model.get_layer("embedding").embeddings  # the ctr job's one table
    shards = len(getattr(table, "variables", [table]))  # tf-keras: a ShardedVariable
    tables = [{"rows": int(table.shape[0]), "shards": shards}]
    coordinator, train_fn = raw.coordinator, raw.train_fn
    num_calls = math.ceil(args.steps / k)
    raw.warm_up()  # as psctl does before its clock starts
    t_data = time.monotonic()
    iterator = iter(coordinator.create_per_worker_dataset(raw.per_worker_dataset_fn))
    t_first = time.monotonic()
    last = coordinator.schedule(train_fn, args=(iterator,))
    t_traced = time.monotonic()  # schedule() traces the function before it returns
    for _ in range(num_calls - 1):
        last = coordinator.schedule(train_fn, args=(iterator,))

    joined: list[float] = []
    failed: list[BaseException] = []

    def join() -> None:
        try:
            coordinator.join()
            joined.append(time.monotonic())
        except BaseException as err:  # re-raised below, in the main thread
            failed.append(err)

    joiner = threading.Thread(target=join, name="join", daemon=True)
    joiner.start()
    joiner.join(max(0.0, t_data + args.max_seconds - time.monotonic()))
    if failed:
        raise failed[0]
    if joined:
        result = throughput._timing(num_calls * k, t_data, t_first, t_traced, joined[0])
        result.update(budget_hit=False, loss=float(last.fetch()), tables=tables)
        return result
    t_stop = time.monotonic()
    steps = _read_steps(raw.iterations)
    seconds = t_stop - t_data
    result = {
        "steps": steps,
        "seconds": seconds,
        "steps_per_sec": steps / seconds if steps is not None else None,
        "setup_s": t_traced - t_data,
        "budget_hit": True,
        "loss": None,
        "tables": tables,
    }
    _emit(args, result)
    os._exit(0)  # not join(): the calls still queued would take as long again


def tf_keras_ctr_model() -> Any:
    """The ctr job's model (jobs/ctr.py ``create_model``) in tf-keras: the same layers, names
    and sizes, TF ops where it uses ``keras.ops``."""
    import tensorflow as tf

    from jobs import ctr

    keras = tf.keras  # tf-keras: TF_USE_LEGACY_KERAS=1
    features = keras.Input((ctr.NUM_INPUTS,), dtype="int64", name="features")
    counts = tf.cast(features[:, : ctr.NUM_DENSE], tf.float32)
    bottom = tf.math.log1p(tf.maximum(counts, 0.0))
    bottom = keras.layers.Dense(64, activation="relu", name="bottom_1")(bottom)
    bottom = keras.layers.Dense(ctr.EMBEDDING_DIM, activation="relu", name="bottom_2")(bottom)
    table = keras.layers.Embedding(ctr.config().rows, ctr.EMBEDDING_DIM, name="embedding")
    embedded = table(features[:, ctr.NUM_DENSE :])
    vectors = tf.concat([bottom[:, None, :], embedded], axis=1)
    dots = tf.matmul(vectors, vectors, transpose_b=True)
    n = ctr.NUM_SPARSE + 1
    upper = [i * n + j for i in range(n) for j in range(i + 1, n)]
    pairs = tf.gather(tf.reshape(dots, (-1, n * n)), upper, axis=1)
    top = tf.concat([bottom, pairs], axis=1)
    top = keras.layers.Dense(128, activation="relu", name="top_1")(top)
    top = keras.layers.Dense(64, activation="relu", name="top_2")(top)
    logit = keras.layers.Dense(1, name="logit")(top)
    return keras.Model(features, logit, name="ctr")


def tf_keras_optimizer(name: str) -> Any:
    import tensorflow as tf

    if name == "adagrad":  # the ctr job's learning rates
        return tf.keras.optimizers.Adagrad(learning_rate=0.1)
    return tf.keras.optimizers.Adam(learning_rate=1e-3)


def run_tf_keras(args: argparse.Namespace) -> dict[str, Any]:
    """The official path: TensorFlow's parameter-server tutorial with tf-keras (Keras 2), the
    table split by the strategy's ``variable_partitioner`` (``MinSizePartitioner``, at most
    one shard per ps) and tf-keras's own optimizers (sparse applies where they have them).
    The same loop, data and timing as ``raw``."""
    import tensorflow as tf

    if not tf.keras.__name__.startswith("tf_keras"):
        raise SystemExit("tf_keras mode: run with TF_USE_LEGACY_KERAS=1 and tf-keras installed")
    partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=256 << 10, max_shards=args.max_shards
    )
    return run_raw(
        args,
        create_model=tf_keras_ctr_model,
        create_optimizer=lambda: tf_keras_optimizer(args.optimizer),
        variable_partitioner=partitioner,
    )


def run_local(args: argparse.Namespace) -> dict[str, Any]:
    """psctl's own step (the same replica step, its sparse updates on the table) in one
    process with no cluster: the no-network limit of this machine. K steps per
    ``tf.function`` call, like a scheduled call; timed like the others."""
    import tensorflow as tf

    from psctl.coordinator.data.context import DataContext
    from psctl.coordinator.job import load_job
    from psctl.coordinator.settings import TrainSettings
    from psctl.coordinator.training.job_model.model import TrainState
    from psctl.coordinator.training.steps.programs import make_replica_step

    job = load_job(JOB)
    settings = TrainSettings.of(
        job=JOB, batch_size=args.batch_size, max_shards=args.max_shards, checkpoint_dir=""
    )
    data = job.dataset_fn(DataContext(0, 1, args.batch_size, throughput.SEED))
    x_spec, y_spec = data.element_spec[0], data.element_spec[1]
    strategy = tf.distribute.get_strategy()
    state = TrainState(job, x_spec, y_spec, settings=settings, strategy=strategy)
    replica_step = make_replica_step(state, job.loss_fn)
    k = args.steps_per_execution

    @tf.function
    def call(iterator: Any) -> Any:
        for _ in tf.range(k):
            replica_step(next(iterator))
        return state.optimizer.iterations

    tables = [{"rows": t.rows, "shards": len(t.shards)} for t in state.tables]
    t_data = time.monotonic()
    iterator = iter(job.dataset_fn(DataContext(0, 1, args.batch_size, throughput.SEED)))
    t_first = time.monotonic()
    call(iterator)
    t_traced = time.monotonic()
    done = k
    while done < args.steps and time.monotonic() - t_data < args.max_seconds:
        call(iterator)
        done += k
    result = throughput._timing(done, t_data, t_first, t_traced, time.monotonic(), ran=k)
    result.update(budget_hit=done < args.steps, loss=None, tables=tables)
    return result


CHILDREN = {"psctl": run_psctl, "raw": run_raw, "tf_keras": run_tf_keras, "local": run_local}


def _emit(args: argparse.Namespace, result: dict[str, Any]) -> None:
    result.update(
        mode=args.run_mode,
        rows=args.table_rows,
        optimizer=args.optimizer,
        coordinator_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6,
    )
    print(json.dumps(result), flush=True)


def child_main(args: argparse.Namespace) -> int:
    from psctl.cluster import netns

    netns.enter()  # on a cluster in a job namespace: where its TF ports are
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    logging.basicConfig(  # to the run's .log file
        level=logging.WARNING, format="%(asctime)s.%(msecs)03d %(name)s: %(message)s", datefmt="%X"
    )
    for name in ("bench", "coordinator", "psctl"):
        logging.getLogger(name).setLevel(logging.INFO)
    ctr_env(rows=args.table_rows, optimizer=args.optimizer, eval_examples=EVAL_EXAMPLES)
    result = CHILDREN[args.run_mode](args)
    _emit(args, result)
    return 0


# --------------------------------------------------------------------------------------------
# Parent: a fresh cluster per run, a table at the end.
# --------------------------------------------------------------------------------------------


def memory_mb(pid: int, field: str) -> float | None:
    """``VmHWM`` (peak) or ``VmRSS`` of a live process, in MB (10^6 bytes)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        return None
    return None


def _ignore_interrupts() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _restore_interrupts() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, throughput._raise_interrupt)


@contextlib.contextmanager
def _cluster(args: argparse.Namespace, rtt: str, workdir: Path) -> Iterator[Any]:
    """A fresh cluster for one run: ``LocalCluster`` on loopback, else a NetLab (``rtt``:
    "direct", or "N ms" through the delaying relay). Yields (cluster file, the ps servers
    (their ``proc``), a function that wraps the child's argv to run on the coordinator's
    host). SIGINT/SIGTERM are ignored while it stops: nothing cuts the clean-up short."""
    with contextlib.ExitStack() as stack:
        stack.callback(_restore_interrupts)  # the last thing on the way out
        if rtt == NAMESPACE:  # the servers and the child join it (cluster/netns.py)
            from psctl.cluster import netns

            stack.enter_context(netns.job_namespace())
        if rtt in (LOOPBACK, NAMESPACE):
            from psctl.coordinator.launch.local import LocalCluster

            local = LocalCluster(num_ps=args.ps, num_workers=args.workers, workdir=workdir)
            stack.callback(local.stop)
            stack.callback(_ignore_interrupts)
            local.start()
            local.wait_serving(timeout=args.start_timeout)
            ps = sorted((s for s in local.servers if s.task_type == "ps"), key=lambda s: s.index)
            yield local.cluster_file, ps, list
            return
        from bench.harness.netlab import lab_cluster

        lab = stack.enter_context(
            lab_cluster(
                args.ps,
                args.workers,
                rtt_ms=_ms(rtt),
                work=workdir,
                timeout=args.start_timeout,
                tunnel=rtt.endswith(TUNNEL),
                transport=args.transport,
                mtu=args.mtu,
            )
        )
        stack.callback(_ignore_interrupts)
        yield lab.cluster_file, [s for s in lab.servers if s.task_type == "ps"], lab.child_argv


def tf_keras_python() -> Path:
    """The tf-keras environment's Python (``.venv-tfkeras``), built on first use."""
    python = TF_KERAS_ENV / "bin" / "python"
    if python.exists():
        return python
    print(
        f"building the tf-keras environment in {TF_KERAS_ENV} (once: {', '.join(TF_KERAS_PINS)})",
        flush=True,
    )
    subprocess.run([sys.executable, "-m", "venv", str(TF_KERAS_ENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", *TF_KERAS_PINS]
    if subprocess.run(pip).returncode != 0:
        shutil.rmtree(TF_KERAS_ENV, ignore_errors=True)
        raise throughput.ChildFailed(f"could not install {' '.join(TF_KERAS_PINS)}")
    return python


def measure(
    mode: str,
    rows: int,
    optimizer: str,
    args: argparse.Namespace,
    work: Path,
    n: int,
    rtt: str = LOOPBACK,
) -> dict[str, Any]:
    """One run on its own fresh cluster (``local``: none): the child's result, each ps's RSS
    when SERVING and its peak at the end, and a status: ok, budget (stopped by
    --max-seconds), too slow, failed."""
    name = f"{rows_label(rows)}-{optimizer}-{mode}" + ("" if rtt == LOOPBACK else f"-{rtt}")
    workdir = work / name.replace(" ", "")
    workdir.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"mode": mode, "rows": rows, "optimizer": optimizer, "rtt": rtt}
    python = sys.executable
    env_prefix: list[str] = []
    if mode == "tf_keras":
        try:
            python = str(tf_keras_python())
        except (OSError, subprocess.SubprocessError, throughput.ChildFailed) as err:
            record.update(status="failed", error=f"tf-keras environment: {err}", wall_s=0.0)
            return record
        env_prefix = ["env", "TF_USE_LEGACY_KERAS=1", f"PYTHONPATH={REPO}"]
    with contextlib.ExitStack() as stack:
        if mode == "local":
            cluster_file, ps, wrap = "", [], list
        else:
            cluster_file, ps, wrap = stack.enter_context(_cluster(args, rtt, workdir))
        record["ps_start_mb"] = [memory_mb(s.proc.pid, "VmRSS") for s in ps]
        argv = [
            *env_prefix,
            python,
            str(Path(__file__).resolve()),
            "--run-mode", mode,
            "--cluster", str(cluster_file),
            "--table-rows", str(rows),
            "--optimizer", optimizer,
            "--steps", str(args.steps),
            "--steps-per-execution", str(args.steps_per_execution),
            "--batch-size", str(args.batch_size),
            "--max-shards", str(args.max_shards),
            "--max-seconds", str(args.max_seconds),
            "--setup-timeout", str(args.setup_timeout),
        ]  # fmt: skip
        timeout = args.max_seconds + args.setup_timeout
        started = time.monotonic()
        try:
            result = throughput.run_measured(
                name, wrap(argv), workdir / f"run{n:02d}.out", timeout=timeout
            )
        except throughput.ChildFailed as err:
            wall = time.monotonic() - started
            killed = wall >= timeout - 1.0
            record.update(status="too slow" if killed else "failed", error=str(err), wall_s=wall)
        else:
            record.update(result, wall_s=time.monotonic() - started)
            if not result.get("steps"):
                record["status"] = "too slow"
            else:
                record["status"] = "budget" if result.get("budget_hit") else "ok"
        record["ps_peak_mb"] = [memory_mb(s.proc.pid, "VmHWM") for s in ps]
        exited = [f"{s.name} exited ({s.proc.returncode})" for s in ps if s.proc.poll() is not None]
        if exited:
            record["ps_exited"] = exited
            if record["status"] != "failed":
                record.update(status="failed", error="; ".join(exited))
    return record


def _rate(record: dict[str, Any] | None) -> str:
    if record is None:
        return "-"
    status = record["status"]
    if status in ("too slow", "failed"):
        return status
    return f"{record['steps_per_sec']:.2f}" + ("*" if status == "budget" else "")


def _ratio(psctl: dict[str, Any] | None, raw: dict[str, Any] | None) -> float | None:
    if not _ok(psctl) or not _ok(raw):
        return None
    assert psctl is not None and raw is not None
    return float(psctl["steps_per_sec"] / raw["steps_per_sec"])


def _memory(record: dict[str, Any] | None) -> str:
    if record is None or not record.get("ps_peak_mb"):
        return "-"
    peaks = record["ps_peak_mb"]
    starts = record.get("ps_start_mb") or [None] * len(peaks)
    peak = "/".join("?" if p is None else f"{p:.0f}" for p in peaks)
    growth = "/".join(
        "?" if p is None or s is None else f"{p - s:+.0f}"
        for p, s in zip(peaks, starts, strict=True)
    )
    return f"{peak} ({growth})"


def summarize(records: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (rtt, rows, optimizer): every mode side by side (``local`` has no network:
    its one run shows in every rtt's row)."""
    rows = []
    for rtt in args.rtt_list:
        for size in args.row_counts:
            for optimizer in args.optimizer_list:
                same = [r for r in records if r["rows"] == size and r["optimizer"] == optimizer]
                runs = {
                    mode: median_run(
                        [
                            r
                            for r in same
                            if r["mode"] == mode and (r["rtt"] == rtt or mode == "local")
                        ]
                    )
                    for mode in MODES
                }
                runs = {mode: run for mode, run in runs.items() if run is not None}
                if not runs:
                    continue
                rows.append(
                    {
                        "rtt": rtt,
                        "rows": size,
                        "optimizer": optimizer,
                        **{mode: runs.get(mode) for mode in MODES},
                        "ratio": _ratio(runs.get("psctl"), runs.get("raw")),
                        "ratio_tf_keras": _ratio(runs.get("psctl"), runs.get("tf_keras")),
                        "ratio_local": _ratio(runs.get("psctl"), runs.get("local")),
                        "expected_mb": expected_mb(size, optimizer, args.ps),
                    }
                )
    for row in rows:
        row["round_trips"] = round_trips(row, rows, args.workers)
    return rows


def _runs_each(args: argparse.Namespace) -> str:
    repeats = getattr(args, "repeats", 1)
    return (
        "one run each" if repeats == 1 else f"{repeats} runs each (interleaved; the median shown)"
    )


def repeats_note(repeats: int) -> str:
    return "" if repeats == 1 else f" ({repeats} repeats of the plan, interleaved)"


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A configuration's row (--repeats): its median run by steps/s (the lower of the two
    middle ones), of those that finished; else its last run, whose status shows."""
    ok = sorted((r for r in runs if _ok(r)), key=lambda r: float(r["steps_per_sec"]))
    if ok:
        return ok[(len(ok) - 1) // 2]
    return runs[-1] if runs else None


def repeat_ratio_lines(records: list[dict[str, Any]], transport: str) -> list[str]:
    """--repeats with --tunnel-overhead or --tf-ports-overhead: psctl's protected/open ratio
    of each repeat, in the order run (the i-th protected run over the i-th open one)."""
    rates: dict[tuple[str, int, str], list[float | None]] = {}
    for r in records:
        if r["mode"] == "psctl":
            key = (r["rtt"], r["rows"], r["optimizer"])
            rates.setdefault(key, []).append(float(r["steps_per_sec"]) if _ok(r) else None)
    lines = []
    for (rtt, size, optimizer), inside in rates.items():
        protected = _protected(rtt, transport)
        if protected is None or len(inside) < 2:
            continue
        open_network, what = protected
        outside = rates.get((open_network, size, optimizer), [])
        ratios = [
            f"{a / b:.2f}" if a and b else "n/a" for a, b in zip(inside, outside, strict=False)
        ]
        lines.append(
            f"each repeat: psctl steps/s, {what} at {rows_label(size)} rows ({optimizer}) = "
            + ", ".join(ratios)
        )
    return lines


def _ms(rtt: str) -> float | None:
    rtt = rtt.removesuffix(TUNNEL)
    return float(rtt.split()[0]) if rtt.endswith(" ms") else None


def round_trips(row: dict[str, Any], rows: list[dict[str, Any]], workers: int) -> dict[str, float]:
    """Sequential round trips per step on a worker's critical path, per mode: the slope of a
    worker's step time (workers / steps/s) against the added round-trip time, from this
    row's rtt and the 0 ms row (the same relay, no delay). Empty without both."""
    ms = _ms(row["rtt"])
    base = next(
        (
            r
            for r in rows
            if (r["rtt"], r["rows"], r["optimizer"]) == ("0 ms", row["rows"], row["optimizer"])
        ),
        None,
    )
    if not ms or base is None:
        return {}
    out = {}
    for mode in ("psctl", "raw", "tf_keras"):
        now, zero = row.get(mode), base.get(mode)
        if not _ok(now) or not _ok(zero):
            continue
        assert now is not None and zero is not None
        slope = workers / now["steps_per_sec"] - workers / zero["steps_per_sec"]
        out[mode] = slope / (ms / 1000)
    return out


def _ok(record: dict[str, Any] | None) -> bool:
    return bool(record and record["status"] in ("ok", "budget") and record.get("steps_per_sec"))


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    names = "/".join(f"ps{i}" for i in range(args.ps))
    lines = [
        "| network | rows | optimizer | psctl steps/s | raw steps/s | tf_keras steps/s | local "
        "steps/s | psctl/raw | psctl/tf_keras | psctl/local | round trips/step psctl, raw, "
        f"tf_keras | psctl peak RSS MB {names} (growth) | raw peak RSS MB {names} (growth) | "
        "expected MB per ps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def times(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    for row in rows:
        trips = row["round_trips"]
        trip_text = ", ".join(
            "-" if m not in trips else f"{trips[m]:.1f}" for m in ("psctl", "raw", "tf_keras")
        )
        lines.append(
            f"| {row['rtt']} | {rows_label(row['rows'])} | {row['optimizer']} | "
            f"{_rate(row['psctl'])} | {_rate(row['raw'])} | {_rate(row['tf_keras'])} | "
            f"{_rate(row['local'])} | {times(row['ratio'])} | {times(row['ratio_tf_keras'])} | "
            f"{times(row['ratio_local'])} | {trip_text} | {_memory(row['psctl'])} | "
            f"{_memory(row['raw'])} | {row['expected_mb']:.1f} |"
        )
    lines += [
        "",
        f"{JOB} job, {args.ps} ps + {args.workers} workers, batch {args.batch_size}/worker, "
        f"{args.steps_per_execution} steps per call, up to {args.steps} steps or "
        f"{args.max_seconds:g} s per run, {_runs_each(args)}, a fresh cluster per run. network: "
        "loopback (no --rtt), or network-namespace hosts through a router "
        "(bench/harness/netlab.py): "
        "direct = forwarded by the kernel, N ms = through a relay that delays each direction "
        "by N/2 ms. psctl: Trainer with "
        f"--max-shards {args.max_shards} (table split over the ps, sparse updates); raw: the "
        "TF tutorial loop with plain Keras 3 (table whole on one ps, Keras's apply_gradients); "
        "tf_keras: the same loop with tf-keras (TF_USE_LEGACY_KERAS=1), the table split by "
        "the strategy's variable_partitioner, tf-keras's optimizers; local: psctl's step and "
        "sparse updates in one process, no cluster (its one run shows in every network's "
        "row). steps/s: from creating the per-worker datasets until every call finished "
        "(set-up and tracing included; psctl: its Summary); * = the --max-seconds budget ran "
        "out: steps/s over the steps done by then; too slow = no step done in the budget, or "
        "the process outlived it by --setup-timeout. psctl/local compares examples/s (a "
        "step is one batch everywhere). round trips/step: (workers / steps/s at N ms - the "
        "same at 0 ms) / N ms, the sequential round trips on a worker's critical path. Peak "
        "RSS: VmHWM of each ps server process, (growth) over its RSS when it was SERVING; "
        "expected = table bytes x (1 + optimizer slots) / number of ps (MB = 10^6 bytes).",
    ]
    return "\n".join(lines) + "\n"


def ratio_lines(rows: list[dict[str, Any]], transport: str = "wireguard") -> list[str]:
    """The issue's last lines, per network run (the last one's last): psctl over raw Keras 3
    at 1M rows with Adam and over tf-keras at 1M rows with Adagrad; else at the configuration
    nearest to it that was run (same optimizer first, then the nearest size), said so the
    line before."""
    if not rows:
        return ["psctl/raw_keras steps/s = n/a (nothing was run)"]
    lines = []
    for rtt in dict.fromkeys(r["rtt"] for r in rows):
        mine = [r for r in rows if r["rtt"] == rtt]
        lines += _ratio_line(mine, "local", "adam", "ratio_local", "psctl/local examples/s")
        lines += _ratio_line(mine, "raw", "adam", "ratio", "psctl/raw_keras steps/s")
        lines += _ratio_line(
            mine, "tf_keras", "adagrad", "ratio_tf_keras", "psctl/tf_keras steps/s"
        )
    return lines + namespace_lines(rows, transport)


def _protected(rtt: str, transport: str) -> tuple[str, str] | None:
    """For a protected network (--tf-ports-overhead, --tunnel-overhead): the open network
    it is compared with, and the words for the comparison; else None."""
    if rtt == NAMESPACE:
        return LOOPBACK, "TF ports in a job namespace/open"
    if rtt.endswith(TUNNEL):
        open_network = rtt.removesuffix(TUNNEL)
        return open_network, f"hosts behind their {transport} tunnels/open ({open_network})"
    return None


def namespace_lines(rows: list[dict[str, Any]], transport: str = "wireguard") -> list[str]:
    """--tf-ports-overhead, --tunnel-overhead: psctl's steps/s protected over the same
    configuration open, one line per configuration run both ways."""
    rate = {
        (r["rtt"], r["rows"], r["optimizer"]): (r["psctl"] or {}).get("steps_per_sec") for r in rows
    }
    lines = []
    for (rtt, size, optimizer), inside in rate.items():
        protected = _protected(rtt, transport)
        if protected is None:
            continue
        open_network, what = protected
        outside = rate.get((open_network, size, optimizer))
        if inside and outside:
            lines.append(
                f"psctl steps/s, {what} at {rows_label(size)} rows "
                f"({optimizer}) = {inside / outside:.2f} ({inside:.1f} / {outside:.1f})"
            )
    return lines


def _ratio_line(
    rows: list[dict[str, Any]], mode: str, optimizer: str, key: str, what: str
) -> list[str]:
    """One ratio line at 1M rows with ``optimizer`` (or the nearest run); nothing when
    ``mode`` was not run at all."""
    if not any(r[mode] for r in rows):
        return []

    def distance(row: dict[str, Any]) -> tuple[bool, bool, float]:
        return row[mode] is None, row["optimizer"] != optimizer, abs(math.log(row["rows"] / 1e6))

    chosen = min(rows, key=distance)
    lines = []
    if chosen["rows"] != 1_000_000 or chosen["optimizer"] != optimizer:
        lines.append(
            f"(1M rows with {optimizer} was not run: the ratio below is at "
            f"{rows_label(chosen['rows'])} rows with {chosen['optimizer']})"
        )
    network = "" if chosen["rtt"] == LOOPBACK else f", rtt {chosen['rtt']}"
    label = f"{what} at {rows_label(chosen['rows'])} rows ({chosen['optimizer']}{network})"
    if chosen[key] is None:
        why = ", ".join(
            f"{m}: {chosen[m]['status'] if chosen[m] else 'not run'}" for m in ("psctl", mode)
        )
        lines.append(f"{label} = n/a ({why})")
    else:
        lines.append(f"{label} = {chosen[key]:.2f}")
    return lines


def _run_line(record: dict[str, Any], n: int, total: int) -> str:
    size = rows_label(record["rows"])
    network = "" if record["rtt"] == LOOPBACK or record["mode"] == "local" else record["rtt"]
    what = f"[{n}/{total}] {network:>6} {size:>4} {record['optimizer']:<7} {record['mode']:<8}"
    if record["status"] in ("too slow", "failed") and "error" in record:
        first = record["error"].splitlines()[0]
        return f"{what} {record['status']}: {first}"
    steps = record.get("steps")
    shards = ",".join(str(t["shards"]) for t in record.get("tables", [])) or "?"
    return (
        f"{what} {_rate(record):>9} steps/s  ({steps} steps in {record['seconds']:.1f}s, setup "
        f"{record['setup_s']:.2f}s, {record['status']}; table shards {shards}; process "
        f"{record['wall_s']:.0f}s; ps peak RSS MB {_memory(record)})"
    )


def parent_main(args: argparse.Namespace) -> int:
    from bench.harness.netlab import LabError
    from psctl.cluster.processes.logs import quiet_tensorflow
    from psctl.coordinator.launch.local import ServerFailed

    quiet_tensorflow()  # inherited by the servers and every child
    results = results_dir(args.results, "embeddings")
    work = results / "work"
    work.mkdir(parents=True, exist_ok=True)
    plan = [
        (rtt, rows, optimizer, mode)
        for i, rtt in enumerate(args.rtt_list)
        for rows in args.row_counts
        for optimizer in args.optimizer_list
        for mode in args.mode_list
        if mode != "local" or i == 0  # no network: once
    ] * args.repeats
    networks = ", ".join(args.rtt_list)
    print(
        f"results {results}; {len(plan)} runs{repeats_note(args.repeats)} "
        f"({', '.join(rows_label(r) for r in args.row_counts)}"
        f" rows x {', '.join(args.optimizer_list)} x {', '.join(args.mode_list)}; network "
        f"{networks}), each on a fresh cluster of "
        f"{args.ps} ps + {args.workers} workers, up to {args.max_seconds:g} s",
        flush=True,
    )
    print(f"{throughput._load()} (other work on this machine skews every mode)", flush=True)
    _restore_interrupts()
    records: list[dict[str, Any]] = []
    try:
        for n, (rtt, rows, optimizer, mode) in enumerate(plan, start=1):
            record = measure(mode, rows, optimizer, args, work, n, rtt)
            records.append(record)
            print(_run_line(record, n, len(plan)), flush=True)
    except (ServerFailed, LabError) as err:
        print(f"embeddings: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("embeddings: interrupted", file=sys.stderr)
        return 130
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)

    print(throughput._load(), flush=True)
    rows = summarize(records, args)
    text = table(rows, args)
    lines = repeat_ratio_lines(records, args.transport) + ratio_lines(rows, args.transport)
    (results / "table.md").write_text(text + "\n" + "\n".join(lines) + "\n")
    config = {k: v for k, v in vars(args).items() if k not in ("run_mode", "cluster")}
    report = {"config": config, "runs": records, "summary": rows}
    (results / "results.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print()
    print(text)
    print(f"table {results / 'table.md'}\nruns {results / 'results.json'}")
    print("\n".join(lines), flush=True)
    return 1 if any(r["status"] == "failed" for r in records) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows", help=f"table sizes, comma-separated (default {DEFAULT_ROWS}; --full: {FULL_ROWS})"
    )
    parser.add_argument(
        "--optimizers",
        help=f"ctr optimizers (default {DEFAULT_OPTIMIZERS}; --full: {FULL_OPTIMIZERS})",
    )
    parser.add_argument(
        "--modes",
        help="what to run, comma-separated, of psctl, raw, tf_keras and local (default and "
        f"--quick: {QUICK_MODES}; --full: all four)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help=f"the whole grid: {FULL_ROWS} rows x {FULL_OPTIMIZERS} x all four modes (24 "
        "runs: more than 30 minutes on 2 cores); --rows, --optimizers and --modes still apply",
    )
    parser.add_argument(
        "--rtt",
        help="run the cluster as network-namespace hosts with this much round-trip time "
        "added between them, in ms (0: through the delaying relay with no delay; direct: no "
        "relay), comma-separated for several (needs root, iproute2, cc); default: loopback",
    )
    parser.add_argument(
        "--tf-ports-overhead",
        action="store_true",
        help="run every configuration on loopback twice: TensorFlow's ports open, and in a "
        "job network namespace as psctl local runs them; the last line is psctl's steps/s "
        "in the namespace over open (not with --rtt)",
    )
    parser.add_argument(
        "--tunnel-overhead",
        action="store_true",
        help="run every configuration on network-namespace hosts twice (bench/harness/netlab.py; "
        "the direct network, or each --rtt): TensorFlow's ports open, and every host behind "
        "its tunnel (--transport) as psctl deploy render --keys runs them (root, the "
        "transport's packages); the last line is psctl's steps/s behind the tunnels over open",
    )
    add_mtu_flag(parser)
    add_transport_flag(parser)
    parser.add_argument("--ps", type=int, default=2, help="ps servers (default 2)")
    parser.add_argument("--workers", type=int, default=2, help="worker servers (default 2)")
    parser.add_argument(
        "--steps", type=int, help="steps per run at most (default 2000; --quick: 100)"
    )
    parser.add_argument(
        "--steps-per-execution", type=int, default=10, help="K steps per call (default 10)"
    )
    parser.add_argument("--batch-size", type=int, default=256, help="per worker (default 256)")
    parser.add_argument(
        "--max-shards", type=int, default=2, help="psctl's --max-shards (default 2)"
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        help="budget per run, of the timed window (default 60; --quick: 30)",
    )
    parser.add_argument(
        "--setup-timeout",
        type=float,
        help="seconds a run's process may take beyond its budget (start, building the "
        "tables, final evaluation) before it is killed as too slow (default 300; --quick: 90)",
    )
    parser.add_argument("--start-timeout", type=float, default=120.0, help="servers' start (s)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the whole plan N times, interleaved; each configuration's row is its "
        "median run, and the protected/open lines list every repeat's ratio (default 1)",
    )
    parser.add_argument("--results", help="results folder (default bench/results/embeddings-*)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 10k rows, adam, 100 steps, 30 s budget (--steps, --max-seconds "
        "and --setup-timeout still apply)",
    )
    # Internal: one measured run in this process.
    parser.add_argument("--run-mode", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    parser.add_argument("--table-rows", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--optimizer", choices=sorted(SLOTS), help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    quick = args.quick and not args.run_mode
    if quick:  # a smoke test of the whole path (the suite runs it): not a measurement
        args.rows, args.optimizers = "10k", "adam"
    full = args.full and not quick
    args.rows = args.rows or (FULL_ROWS if full else DEFAULT_ROWS)
    args.optimizers = args.optimizers or (FULL_OPTIMIZERS if full else DEFAULT_OPTIMIZERS)
    args.modes = args.modes or (",".join(MODES) if full else QUICK_MODES)
    for name, default, fast in (
        ("steps", 2000, 100),
        ("max_seconds", 60.0, 30.0),
        ("setup_timeout", 300.0, 90.0),
    ):
        if getattr(args, name) is None:
            setattr(args, name, fast if quick else default)
    for name in (
        "ps",
        "workers",
        "steps",
        "steps_per_execution",
        "batch_size",
        "max_shards",
        "repeats",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.max_seconds > 0 or not args.setup_timeout > 0:
        parser.error("--max-seconds and --setup-timeout must be > 0")
    if args.run_mode:
        if (not args.cluster and args.run_mode != "local") or not args.table_rows:
            parser.error("--run-mode needs --cluster, --table-rows and --optimizer")
        if not args.optimizer:
            parser.error("--run-mode needs --cluster, --table-rows and --optimizer")
        return child_main(args)
    from bench.harness.netlab import parse_rtt, rtt_label

    try:
        args.rtt_list = [rtt_label(r) for r in parse_rtt(args.rtt)] if args.rtt else [LOOPBACK]
    except ValueError as err:
        parser.error(str(err))
    if args.tf_ports_overhead:
        if args.rtt:
            parser.error("--tf-ports-overhead runs on loopback: leave --rtt out")
        args.rtt_list = [LOOPBACK, NAMESPACE]
    if args.tunnel_overhead:
        if args.tf_ports_overhead:
            parser.error("--tunnel-overhead and --tf-ports-overhead: one at a time")
        networks = args.rtt_list if args.rtt else ["direct"]
        args.rtt_list = [n for network in networks for n in (network, network + TUNNEL)]
    try:
        args.row_counts = parse_rows(args.rows)
    except ValueError as err:
        parser.error(f"--rows: {err}")
    args.optimizer_list = parse_names(parser, "--optimizers", args.optimizers, SLOTS)
    args.mode_list = parse_names(parser, "--modes", args.modes, MODES)
    return parent_main(args)


def parse_names(
    parser: argparse.ArgumentParser, flag: str, text: str, known: Collection[str]
) -> list[str]:
    """``a,b`` -> [a, b] (lower case, each once, in order); exits with a usage error naming
    ``flag`` for a name not in ``known``."""
    names = list(dict.fromkeys(n.strip().lower() for n in text.split(",")))
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"{flag}: {', '.join(unknown)} unknown; use {' or '.join(known)}")
    return names


if __name__ == "__main__":
    sys.exit(main())
