"""Dynamic tables against hashed fixed tables on a drifting click stream.

The built-in ``ctr`` job on its drifting synthetic workload (``CTR_VOCABULARY`` ids live at
a time, each for ``CTR_DRIFT`` examples before a new id takes its place: jobs/ctr.py), on
``--ps`` (2) ps + ``--workers`` (2) workers, batch ``--batch-size`` (256) per worker, the
same ``--steps`` in every run, one ``psctl local`` each (a fresh cluster: a ps keeps its
memory), in this order:

``dynamic-ttl``
    ``CTR_TABLE=dynamic``: one ``DynamicEmbedding`` keyed by the raw (feature, id) pairs,
    ids admitted after 2 sightings, evicted after ``--ttl-steps`` global steps unseen.
``hashed``
    ``CTR_TABLE=fixed`` with ``CTR_ROWS`` = the live rows ``dynamic-ttl`` ended with (equal
    memory by rows), ids hashed into them, split over the ps (``--max-shards``). Printed
    with it: the collision rate hashing gives at that size, the fraction of the dynamic
    table's live ids that share a row with another live id (the live keys read from the
    dynamic run's last checkpoint, matched against the stream's ids made again here).
``dynamic``
    As ``dynamic-ttl`` without eviction: the table keeps every id it admitted.
``fixed-1M``
    ``CTR_TABLE=fixed`` with ``CTR_ROWS=1M`` (``--fixed-rows``), split over the ps.

Per run: the final eval AUC (on held-out draws from the stream's last window:
``CTR_TRAIN_EXAMPLES`` is steps x batch), steps/s (the summary's training window), the
table's live rows at the end, and each ps's RSS (``VmRSS`` of the ps processes named in the
run's ``tasks.json``, sampled every ``--sample-every`` s): at the start, its peak, at the end.

The last two lines::

    dynamic/hashed eval auc gain at equal memory = +0.00XX
    dynamic/fixed steps/s = R.RR

(``dynamic-ttl``'s eval AUC less ``hashed``'s; ``dynamic-ttl``'s steps/s over
``fixed-1M``'s). ``table.md`` and ``results.json`` (every run, RSS samples included) go to
``--out`` (default ``bench/results/dynamic-<time>/``), the runs' work dirs under it.

    .venv/bin/python bench/dynamic.py                 # 2000 steps a run, 6-11 min on 2 cores
    .venv/bin/python bench/dynamic.py --steps 3000
    .venv/bin/python bench/dynamic.py --quick         # smoke test: 100 steps, small stream
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import throughput
from bench.embeddings import memory_mb
from bench.harness import results_dir, spawn

REPO = throughput.REPO
BLOCK = 512  # the ctr job's synthetic block (jobs/ctr.py, BLOCK)
KEY_SUFFIX = "embeddings_table/.ATTRIBUTES/table-keys"  # a dynamic table's keys, checkpointed
GAIN_LINE = "dynamic/hashed eval auc gain at equal memory"
RATE_LINE = "dynamic/fixed steps/s"


@dataclass
class Run:
    name: str
    env: dict[str, str]
    flags: list[str] = field(default_factory=list)


def workload_env(args: argparse.Namespace) -> dict[str, str]:
    """The drifting stream every run reads: the same ids, labels and eval window."""
    return {
        "CTR_VOCABULARY": str(args.vocabulary),
        "CTR_DRIFT": str(args.drift),
        "CTR_TRAIN_EXAMPLES": str(args.steps * args.batch_size),
        "CTR_EVAL_EXAMPLES": str(args.eval_examples),
        "CTR_OPTIMIZER": "adam",
    }


def dynamic_run(name: str, args: argparse.Namespace, *, ttl: bool) -> Run:
    env = {**workload_env(args), "CTR_TABLE": "dynamic", "CTR_ADMIT_AFTER": "2"}
    if ttl:
        env["CTR_TTL_STEPS"] = str(args.ttl_steps)
    return Run(name, env)


def fixed_run(name: str, args: argparse.Namespace, rows: int) -> Run:
    env = {**workload_env(args), "CTR_TABLE": "fixed", "CTR_ROWS": str(rows)}
    return Run(name, env, ["--max-shards", str(args.max_shards)])


# -- one run --------------------------------------------------------------------------------


class RssSampler(threading.Thread):
    """Every ``every`` seconds: each ps's VmRSS, its pid from the run's tasks.json (rewritten
    when a server restarts)."""

    def __init__(self, tasks: Path, every: float) -> None:
        super().__init__(name="rss", daemon=True)
        self.tasks, self.every = tasks, every
        self.samples: list[tuple[float, list[float | None]]] = []
        self.done = threading.Event()
        self.started_at = time.monotonic()

    def pids(self) -> list[int]:
        try:
            tasks = json.loads(self.tasks.read_text())
        except (OSError, ValueError):
            return []
        ps = sorted((t for t in tasks if t.get("type") == "ps"), key=lambda t: t["index"])
        return [int(t["pid"]) for t in ps if "pid" in t]

    def run(self) -> None:
        while not self.done.wait(self.every):
            pids = self.pids()
            if pids:
                at = time.monotonic() - self.started_at
                self.samples.append((round(at, 2), [memory_mb(pid, "VmRSS") for pid in pids]))

    def stop(self) -> dict[str, Any]:
        self.done.set()
        self.join(timeout=5)
        alive = [s for _, s in self.samples if all(v is not None for v in s)]
        if not alive:
            return {"ps_rss_mb": None}
        columns = list(zip(*alive, strict=True))
        return {
            "ps_rss_mb": {
                "start": list(alive[0]),
                "peak": [max(c) for c in columns],  # type: ignore[type-var]
                "end": list(alive[-1]),
            },
            "rss_samples": self.samples,
        }


def run_one(run: Run, args: argparse.Namespace, out: Path, n: int) -> dict[str, Any]:
    """One ``psctl local`` of ``run``: its summary's numbers and the ps RSS."""
    from psctl.coordinator.argv import psctl_argv

    label = f"run{n}-{run.name}"
    workdir, summary_path, log_path = out / label, out / f"{label}.json", out / f"{label}.log"
    argv = psctl_argv(
        "local",
        "--job", "ctr",
        "--ps", str(args.ps),
        "--workers", str(args.workers),
        "--steps", str(args.steps),
        "--batch-size", str(args.batch_size),
        "--steps-per-execution", str(args.steps_per_execution),
        "--seed", str(throughput.SEED),
        "--workdir", str(workdir),
        "--control-address", "127.0.0.1:0",
        "--summary-json", str(summary_path),
        *run.flags,
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTR_")}
    env.update(run.env)
    sampler = RssSampler(workdir / "tasks.json", args.sample_every)
    started, load = time.monotonic(), os.getloadavg()[0]
    with log_path.open("wb") as log:
        proc = spawn(argv, stdout=log, env=env)
        sampler.start()
        try:
            code: int | None = proc.wait(timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            memory = sampler.stop()
    record: dict[str, Any] = {
        "name": run.name,
        "env": run.env,
        "flags": run.flags,
        "wall_s": time.monotonic() - started,
        "load": [load, os.getloadavg()[0]],  # 1-minute load average at its start and end
        **memory,
    }
    if code != 0 or not summary_path.is_file():
        why = "timed out" if code is None else f"exit status {code}"
        record.update(status="failed", error=f"{why}; last lines of {log_path}:\n"
                      f"{throughput._tail(log_path)}")  # fmt: skip
        return record
    summary = json.loads(summary_path.read_text())
    checkpoints = sorted(
        (workdir / "checkpoints").glob("ckpt-*.index"), key=lambda p: int(p.stem.split("-")[1])
    )
    record.update(
        status="ok",
        steps=summary["global_step"],
        steps_per_sec=summary["steps_per_sec"],
        eval_auc=summary["eval_auc"],
        eval_loss=summary["eval_loss"],
        tables=summary.get("tables", {}),
        checkpoint=str(checkpoints[-1].with_suffix("")) if checkpoints else None,
    )
    table = record["tables"].get("embedding")
    record["rows"] = table["rows"] if table else int(run.env["CTR_ROWS"])
    return record


# -- collisions -------------------------------------------------------------------------------


def collision_rate(record: dict[str, Any], rows: int, args: argparse.Namespace) -> dict[str, Any]:
    """The fraction of the dynamic table's live ids (its last checkpoint's keys) that share a
    row with another live id when hashed into ``rows`` rows as the fixed table hashes them.
    The keys are one-way fingerprints: the stream's ids are made again here, keyed and
    hashed both ways, and matched."""
    import numpy as np
    import tensorflow as tf

    from psctl.coordinator.data import criteo
    from psctl.jobs import ctr

    checkpoint = record.get("checkpoint")
    if not checkpoint:
        return {"collision_rate": None, "why": "no checkpoint"}
    name = next(n for n, _ in tf.train.list_variables(checkpoint) if n.endswith(KEY_SUFFIX))
    live = np.unique(tf.train.load_checkpoint(checkpoint).get_tensor(name))
    source = ctr.SyntheticData(ctr.CtrConfig.from_env(record["env"]))

    def keyed(index: Any) -> tuple[Any, Any]:
        cells = ctr.hex_ids(source.draw(index).raw)
        keys = criteo.hash_ids(cells, criteo.KEY_SPACE)
        return tf.reshape(keys, [-1]), tf.reshape(criteo.hash_ids(cells, rows), [-1])

    # Every block the workers may have read: the steps' examples and their prefetch.
    blocks = math.ceil(args.steps * args.batch_size / BLOCK) + 16 * args.workers
    data = tf.data.Dataset.range(blocks).map(keyed, num_parallel_calls=tf.data.AUTOTUNE)
    found: dict[int, int] = {}
    for keys, hashed in data.batch(64).prefetch(2).as_numpy_iterator():
        keys, hashed = keys.reshape(-1), hashed.reshape(-1)
        mask = np.isin(keys, live)
        found.update(zip(keys[mask].tolist(), hashed[mask].tolist(), strict=True))
    if not found:
        return {"collision_rate": None, "why": "no live key matched the stream"}
    _, counts = np.unique(np.fromiter(found.values(), np.int64), return_counts=True)
    shared = int(counts[counts > 1].sum())
    return {
        "collision_rate": shared / len(found),
        "live_ids": int(live.size),
        "matched": len(found),
        "rows": rows,
    }


# -- the report -------------------------------------------------------------------------------


def _mb(values: list[float] | None) -> str:
    return "-" if not values else "/".join(f"{v:.0f}" for v in values)


def table(
    records: list[dict[str, Any]], collisions: dict[str, Any], args: argparse.Namespace
) -> str:
    names = "/".join(f"ps{i}" for i in range(args.ps))
    lines = [
        f"| run | table | eval AUC | steps/s | rows at the end | ps RSS MB {names}: start "
        "| peak | end |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        env = r["env"]
        if env.get("CTR_TABLE") == "dynamic":
            what = "dynamic, " + (
                f"ttl {env['CTR_TTL_STEPS']} steps" if "CTR_TTL_STEPS" in env else "no eviction"
            )
        else:
            what = f"hashed, {int(env['CTR_ROWS']):,} rows"
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | {what} | failed | - | - | - | - | - |")
            continue
        rss = r.get("ps_rss_mb") or {}
        lines.append(
            f"| {r['name']} | {what} | {r['eval_auc']:.4f} | {r['steps_per_sec']:.2f} | "
            f"{r['rows']:,} | {_mb(rss.get('start'))} | {_mb(rss.get('peak'))} | "
            f"{_mb(rss.get('end'))} |"
        )
    rate = collisions.get("collision_rate")
    loads = [v for r in records for v in r["load"]]
    lines += [
        "",
        f"ctr job, drifting stream: {args.vocabulary:,} ids live at a time, each for "
        f"{args.drift:,} examples; {args.ps} ps + {args.workers} workers, batch "
        f"{args.batch_size}/worker, {args.steps} steps per run, {args.steps_per_execution} "
        "steps per call, a fresh cluster per run. Eval AUC on "
        f"{args.eval_examples:,} held-out examples from the stream's last window. Dynamic: "
        "admit_after 2. Hashed tables split over the ps (--max-shards "
        f"{args.max_shards}). RSS: VmRSS of each ps process, sampled every "
        f"{args.sample_every:g} s (MB = 10^6 bytes). Load average (1 min) over the runs: "
        f"{min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs.",
    ]
    if rate is not None:
        lines.append(
            f"Collisions at equal memory: hashed into {collisions['rows']:,} rows, "
            f"{rate:.1%} of the dynamic table's {collisions['matched']:,} live ids share a "
            "row with another live id."
        )
    return "\n".join(lines) + "\n"


def last_lines(by_name: dict[str, dict[str, Any]]) -> list[str]:
    def ok(name: str) -> dict[str, Any] | None:
        record = by_name.get(name)
        return record if record and record["status"] == "ok" else None

    dynamic, hashed, fixed = ok("dynamic-ttl"), ok("hashed"), ok("fixed-1M")
    if dynamic and hashed:
        gain = f"{dynamic['eval_auc'] - hashed['eval_auc']:+.4f}"
    else:
        gain = "n/a (a run failed)"
    if dynamic and fixed and fixed["steps_per_sec"]:
        rate = f"{dynamic['steps_per_sec'] / fixed['steps_per_sec']:.2f}"
    else:
        rate = "n/a (a run failed)"
    return [f"{GAIN_LINE} = {gain}", f"{RATE_LINE} = {rate}"]


def _run_line(record: dict[str, Any]) -> str:
    if record["status"] != "ok":
        return f"{record['name']:<12} failed: {record['error']}"
    rss = record.get("ps_rss_mb") or {}
    return (
        f"{record['name']:<12} eval_auc {record['eval_auc']:.4f}  {record['steps_per_sec']:7.2f} "
        f"steps/s  rows {record['rows']:>9,}  ps RSS MB peak {_mb(rss.get('peak'))}  "
        f"({record['wall_s']:.0f}s, load {record['load'][0]:.1f}-{record['load'][1]:.1f})"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quick = args.quick
    for name, full, fast in (
        ("steps", 2000, 100),
        ("vocabulary", 1_000_000, 100_000),
        ("drift", 100_000, 10_000),
        ("ttl_steps", 300, 30),
        ("eval_examples", 20_480, 1_024),
        ("run_timeout", 600.0, 240.0),
    ):
        if getattr(args, name) is None:
            setattr(args, name, fast if quick else full)
    from psctl.cluster.processes.logs import quiet_tensorflow

    quiet_tensorflow()  # this process's TensorFlow (the collisions) and every run's
    out = results_dir(args.out, "dynamic")
    print(
        f"results {out}; ctr job, {args.steps} steps per run, {args.ps} ps + {args.workers} "
        f"workers; {throughput._load()}",
        flush=True,
    )
    records: list[dict[str, Any]] = []
    collisions: dict[str, Any] = {}

    def measure(run: Run) -> dict[str, Any]:
        record = run_one(run, args, out, len(records) + 1)
        records.append(record)
        print(_run_line(record), flush=True)
        return record

    first = measure(dynamic_run("dynamic-ttl", args, ttl=True))
    if first["status"] == "ok":
        rows = max(first["rows"], 1_000)  # the fixed table's least (CTR_ROWS)
        collisions = collision_rate(first, rows, args)
        if collisions.get("collision_rate") is not None:
            print(
                f"collision rate hashing {collisions['matched']:,} live ids into {rows:,} rows "
                f"= {collisions['collision_rate']:.4f}",
                flush=True,
            )
        measure(fixed_run("hashed", args, rows))
    measure(dynamic_run("dynamic", args, ttl=False))
    measure(fixed_run("fixed-1M", args, args.fixed_rows))

    by_name = {r["name"]: r for r in records}
    text = table(records, collisions, args)
    lines = last_lines(by_name)
    (out / "table.md").write_text(text + "\n" + "\n".join(lines) + "\n")
    config = {k: v for k, v in vars(args).items()}
    report = {"config": config, "runs": records, "collisions": collisions, "lines": lines}
    (out / "results.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print()
    print(text)
    print(f"table {out / 'table.md'}\nruns {out / 'results.json'}")
    print("\n".join(lines), flush=True)
    return 1 if any(r["status"] != "ok" for r in records) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, help="steps per run (default 2000; --quick 100)")
    parser.add_argument("--quick", action="store_true", help="smoke test: a short, small run")
    parser.add_argument("--out", help="results folder (default bench/results/dynamic-<time>)")
    parser.add_argument("--ps", type=int, default=2, help="ps servers (default 2)")
    parser.add_argument("--workers", type=int, default=2, help="worker servers (default 2)")
    parser.add_argument("--batch-size", type=int, default=256, help="per worker (default 256)")
    parser.add_argument(
        "--steps-per-execution", type=int, default=10, help="steps per call (default 10)"
    )
    parser.add_argument(
        "--vocabulary", type=int, help="ids live at a time (CTR_VOCABULARY; default 1M)"
    )
    parser.add_argument(
        "--drift", type=int, help="examples an id lives (CTR_DRIFT; default 100000)"
    )
    parser.add_argument(
        "--ttl-steps", type=int, help="dynamic-ttl's CTR_TTL_STEPS (default 300; --quick 30)"
    )
    parser.add_argument(
        "--eval-examples", type=int, help="held-out examples (default 20480; --quick 1024)"
    )
    parser.add_argument(
        "--fixed-rows", type=int, default=1_000_000, help="the big fixed table (default 1M)"
    )
    parser.add_argument(
        "--max-shards", type=int, default=2, help="fixed tables' --max-shards (default 2)"
    )
    parser.add_argument(
        "--sample-every", type=float, default=0.5, help="seconds between RSS samples"
    )
    parser.add_argument("--run-timeout", type=float, help="seconds a run may take (600; quick 240)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
