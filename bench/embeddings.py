"""Large embedding tables: psctl's sharded tables against the raw TF loop with plain Keras 3.

Trains the built-in ``ctr`` job (DLRM-style: 26 ids per example looking up one
``keras.layers.Embedding(rows, 16)`` table, 13 counts, a top MLP) at several table sizes
(``--rows``, default 10k,1M,10M) and optimizers (``--optimizers``, default adam,adagrad), on
``--ps`` (2) ps + ``--workers`` (2) workers, batch ``--batch-size`` (256) per worker, K =
``--steps-per-execution`` (10) steps per scheduled call, in two modes:

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

    .venv/bin/python bench/embeddings.py             # 3 sizes x 2 optimizers x 2 modes
    .venv/bin/python bench/embeddings.py --rows 1M --optimizers adam
    .venv/bin/python bench/embeddings.py --rows 10M --modes psctl  # one mode only
    .venv/bin/python bench/embeddings.py --quick     # smoke test: 10k rows, adam, 100 steps
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import throughput

JOB = "ctr"
REPO = throughput.REPO
MODES = ("psctl", "raw")
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

    settings = TrainSettings(
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


def run_raw(args: argparse.Namespace) -> dict[str, Any]:
    """The TF tutorial loop (throughput.py's ``run_raw``): every call scheduled, then
    ``join()``, watched against the budget. At the budget the steps done so far are read
    off the optimizer's step counter on the ps, the result is printed, and the process
    exits at once (the calls left would take as long again; the cluster goes with it)."""
    k = args.steps_per_execution
    raw = throughput.build_raw(args.cluster, batch_size=args.batch_size, k=k, job_name=JOB)
    table = raw.model.get_layer("embedding").embeddings  # the ctr job's one table
    tables = [{"rows": int(table.shape[0]), "shards": 1}]
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


CHILDREN = {"psctl": run_psctl, "raw": run_raw}


def _emit(args: argparse.Namespace, result: dict[str, Any]) -> None:
    result.update(
        mode=args.run_mode,
        rows=args.table_rows,
        optimizer=args.optimizer,
        coordinator_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6,
    )
    print(json.dumps(result), flush=True)


def child_main(args: argparse.Namespace) -> int:
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


def _restore_interrupts() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, throughput._raise_interrupt)


def measure(
    mode: str, rows: int, optimizer: str, args: argparse.Namespace, work: Path, n: int
) -> dict[str, Any]:
    """One run on its own fresh cluster: the child's result, each ps's RSS when SERVING and
    its peak at the end, and a status: ok, budget (stopped by --max-seconds), too slow,
    failed."""
    from psctl.coordinator.launch.local import LocalCluster

    name = f"{rows_label(rows)}-{optimizer}-{mode}"
    workdir = work / name
    local = LocalCluster(num_ps=args.ps, num_workers=args.workers, workdir=workdir)
    record: dict[str, Any] = {"mode": mode, "rows": rows, "optimizer": optimizer}
    try:
        local.start()
        local.wait_serving(timeout=args.start_timeout)
        ps = sorted((s for s in local.servers if s.task_type == "ps"), key=lambda s: s.index)
        record["ps_start_mb"] = [memory_mb(s.proc.pid, "VmRSS") for s in ps]
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--run-mode", mode,
            "--cluster", str(local.cluster_file),
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
                name, argv, workdir / f"run{n:02d}-{name}.out", timeout=timeout
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
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # nothing cuts the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        local.stop()
        _restore_interrupts()
    return record


def _rate(record: dict[str, Any] | None) -> str:
    if record is None:
        return "-"
    status = record["status"]
    if status in ("too slow", "failed"):
        return status
    return f"{record['steps_per_sec']:.2f}" + ("*" if status == "budget" else "")


def _ratio(psctl: dict[str, Any] | None, raw: dict[str, Any] | None) -> float | None:
    if not psctl or not raw or psctl["status"] not in ("ok", "budget"):
        return None
    if raw["status"] not in ("ok", "budget") or not raw.get("steps_per_sec"):
        return None
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
    """One row per (rows, optimizer): both modes side by side."""
    rows = []
    for size in args.row_counts:
        for optimizer in args.optimizer_list:
            pair = {
                r["mode"]: r for r in records if r["rows"] == size and r["optimizer"] == optimizer
            }
            if not pair:
                continue
            rows.append(
                {
                    "rows": size,
                    "optimizer": optimizer,
                    "psctl": pair.get("psctl"),
                    "raw": pair.get("raw"),
                    "ratio": _ratio(pair.get("psctl"), pair.get("raw")),
                    "expected_mb": expected_mb(size, optimizer, args.ps),
                }
            )
    return rows


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    names = "/".join(f"ps{i}" for i in range(args.ps))
    lines = [
        f"| rows | optimizer | psctl steps/s | raw steps/s | psctl/raw | psctl peak RSS MB "
        f"{names} (growth) | raw peak RSS MB {names} (growth) | expected MB per ps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        lines.append(
            f"| {rows_label(row['rows'])} | {row['optimizer']} | {_rate(row['psctl'])} | "
            f"{_rate(row['raw'])} | {ratio} | {_memory(row['psctl'])} | "
            f"{_memory(row['raw'])} | {row['expected_mb']:.1f} |"
        )
    lines += [
        "",
        f"{JOB} job, {args.ps} ps + {args.workers} workers, batch {args.batch_size}/worker, "
        f"{args.steps_per_execution} steps per call, up to {args.steps} steps or "
        f"{args.max_seconds:g} s per run, one run each, a fresh cluster per run. psctl: "
        f"Trainer with --max-shards {args.max_shards} (table split over the ps, sparse "
        "updates); raw: the TF tutorial loop with plain Keras 3 (table whole on one ps, "
        "Keras's apply_gradients). steps/s: from creating the per-worker datasets until "
        "every call finished (set-up and tracing included; psctl: its Summary); * = the "
        "--max-seconds budget ran out: steps/s over the steps done by then; too slow = no "
        "step done in the budget, or the process outlived it by --setup-timeout. Peak RSS: "
        "VmHWM of each ps server process, (growth) over its RSS when it was SERVING; "
        "expected = table bytes x (1 + optimizer slots) / number of ps (MB = 10^6 bytes).",
    ]
    return "\n".join(lines) + "\n"


def ratio_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's last line, at 1M rows with Adam; else at the configuration nearest to
    it that was run (Adam first, then the nearest size), said so the line before."""
    if not rows:
        return ["psctl/raw_keras steps/s = n/a (nothing was run)"]

    def distance(row: dict[str, Any]) -> tuple[bool, float]:
        return row["optimizer"] != "adam", abs(math.log(row["rows"] / 1_000_000))

    chosen = min(rows, key=distance)
    lines = []
    if chosen["rows"] != 1_000_000 or chosen["optimizer"] != "adam":
        lines.append(
            f"(1M rows with adam was not run: the ratio below is at "
            f"{rows_label(chosen['rows'])} rows with {chosen['optimizer']})"
        )
    label = f"psctl/raw_keras steps/s at {rows_label(chosen['rows'])} rows ({chosen['optimizer']})"
    if chosen["ratio"] is None:
        why = ", ".join(
            f"{mode}: {chosen[mode]['status'] if chosen[mode] else 'not run'}" for mode in MODES
        )
        lines.append(f"{label} = n/a ({why})")
    else:
        lines.append(f"{label} = {chosen['ratio']:.2f}")
    return lines


def _run_line(record: dict[str, Any], n: int, total: int) -> str:
    size = rows_label(record["rows"])
    what = f"[{n}/{total}] {size:>4} {record['optimizer']:<7} {record['mode']:<5}"
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
    from psctl.cluster.logs import quiet_tensorflow
    from psctl.coordinator.launch.local import ServerFailed

    quiet_tensorflow()  # inherited by the servers and every child
    stamp = time.strftime("embeddings-%Y%m%d-%H%M%S")
    results = Path(args.results or REPO / "bench" / "results" / stamp)
    work = results / "work"
    work.mkdir(parents=True, exist_ok=True)
    plan = [
        (rows, optimizer, mode)
        for rows in args.row_counts
        for optimizer in args.optimizer_list
        for mode in args.mode_list
    ]
    print(
        f"results {results}; {len(plan)} runs ({', '.join(rows_label(r) for r in args.row_counts)}"
        f" rows x {', '.join(args.optimizer_list)} x {', '.join(args.mode_list)}), each on a "
        "fresh cluster of "
        f"{args.ps} ps + {args.workers} workers, up to {args.max_seconds:g} s",
        flush=True,
    )
    print(f"{throughput._load()} (other work on this machine skews every mode)", flush=True)
    _restore_interrupts()
    records: list[dict[str, Any]] = []
    try:
        for n, (rows, optimizer, mode) in enumerate(plan, start=1):
            record = measure(mode, rows, optimizer, args, work, n)
            records.append(record)
            print(_run_line(record, n, len(plan)), flush=True)
    except ServerFailed as err:
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
    lines = ratio_lines(rows)
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
        "--rows", default="10k,1M,10M", help="table sizes, comma-separated (default 10k,1M,10M)"
    )
    parser.add_argument(
        "--optimizers", default="adam,adagrad", help="ctr optimizers (default adam,adagrad)"
    )
    parser.add_argument(
        "--modes", default="psctl,raw", help="what to run, comma-separated (default psctl,raw)"
    )
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
    for name, default, fast in (
        ("steps", 2000, 100),
        ("max_seconds", 60.0, 30.0),
        ("setup_timeout", 300.0, 90.0),
    ):
        if getattr(args, name) is None:
            setattr(args, name, fast if quick else default)
    for name in ("ps", "workers", "steps", "steps_per_execution", "batch_size", "max_shards"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.max_seconds > 0 or not args.setup_timeout > 0:
        parser.error("--max-seconds and --setup-timeout must be > 0")
    if args.run_mode:
        if not args.cluster or not args.table_rows or not args.optimizer:
            parser.error("--run-mode needs --cluster, --table-rows and --optimizer")
        return child_main(args)
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
