"""Freshness: from a partition's ``_SUCCESS`` marker to a serving version trained on it.

A writer lands a Criteo-format partition (``--rows`` rows) every ``--every`` seconds,
``--partitions`` of them: the file is moved into ``DIR/hour=NNNN/part-0`` whole, then its
``_SUCCESS`` marker is written, the time the partition counts as landed. The rows are the
``ctr`` job's drifting synthetic stream (ids live ``--drift`` examples, then others take
their place: jobs/ctr.py), or real Criteo rows cut in order from ``--seed-file``. Both
runs train the ``ctr`` job with a dynamic table (``CTR_TABLE=dynamic``, ids evicted after
``--ttl-seconds`` unseen) on ``--ps`` ps + ``--workers`` workers, batch ``--batch-size``:

``follow``
    One ``psctl local --follow --export-every E --export-dir EXP``: a partition trains
    once its marker is there, and a serving version follows within ``E``. A partition's
    freshness: the first version in EXP holding it (its global step at or after the
    partition's round in the run's ``follow.json``), seen appear, less its marker's time.
    It ends ``--idle-timeout`` seconds (default ``--every`` + 30) after its last round.
``restarts``
    What a team runs today: a standing cluster (ps and worker servers started once, warm
    machine) and, per partition as it lands, ``psctl train --steps`` (the partition's
    batches more than the last run, restoring its checkpoint) then ``psctl export``. Its
    freshness: the export's end, less the marker's time (a partition that lands while the
    previous one is still being trained waits its turn, as under cron).

Quality: each run's checkpoint after partition p evaluated on partition p + 1 (``psctl
evaluate``: the ctr job's AUC), averaged over p. Memory: each ps's RSS in the follow run
(sampled every 5 s), its slope over the first 5 minutes and over the whole run (a long
run: ``--partitions 60`` is 30 minutes at 30 s).

The last line::

    freshness: p50 S1 s, p95 S2 s (per-partition restarts: p50 S3 s); next-partition auc A1 vs A2

``results.json`` and each run's logs go to ``--out`` (default ``bench/results/freshness-<time>/``).

    .venv/bin/python bench/freshness.py                  # 6 partitions every 30 s: ~8 min
    .venv/bin/python bench/freshness.py --partitions 60  # 30 minutes, and the memory slope
    .venv/bin/python bench/freshness.py --quick          # smoke test: 2 small partitions
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.dynamic import RssSampler
from bench.harness import results_dir, spawn
from psctl.cluster.ports import free_ports
from psctl.coordinator.argv import psctl_argv, server_argv

LAST_LINE = "freshness:"
WAITING = "follow mode: waiting for new input"  # the follow run's log, once it is up


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--partitions", type=int, default=6, help="partitions landed (default 6)")
    p.add_argument("--every", type=float, default=30.0, help="seconds between them (30)")
    p.add_argument("--rows", type=int, default=20_000, help="rows per partition (20000)")
    p.add_argument("--seed-file", help="real Criteo TSV rows to cut partitions from, in order")
    p.add_argument("--drift", type=int, default=100_000, help="synthetic ids' lifetime (100000)")
    p.add_argument("--ps", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256, help="per worker (256)")
    p.add_argument("--export-every", default="10s", help="follow run's cadence (10s)")
    p.add_argument(
        "--idle-timeout", type=float,
        help="seconds the follow run waits with no new partition before it ends (default "
        "--every + 30); more than --every, or it ends before the next partition lands",
    )  # fmt: skip
    p.add_argument("--ttl-seconds", type=int, default=600, help="dynamic table ttl (600)")
    p.add_argument("--skip-baseline", action="store_true", help="the follow run alone")
    p.add_argument(
        "--skip-quality", action="store_true", help="no next-partition AUC (long memory runs)"
    )
    p.add_argument("--quick", action="store_true", help="smoke test: 2 partitions of 2048 rows")
    p.add_argument("--out", help="results directory (default bench/results/freshness-TIME)")
    args = p.parse_args(argv)
    if args.quick:
        args.partitions, args.every, args.rows, args.export_every = 2, 6.0, 2048, "2s"
    if args.partitions < 2:
        p.error("--partitions: give at least 2 (quality is measured on the next partition)")
    if args.idle_timeout is None:
        args.idle_timeout = args.every + 30
    elif args.idle_timeout <= args.every:
        p.error("--idle-timeout: give more than --every (the wait for the next partition)")
    return args


def job_env(args: argparse.Namespace) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTR_")}
    env.update(
        CTR_TABLE="dynamic",
        CTR_TTL_SECONDS=str(args.ttl_seconds),
        CTR_EVAL_EXAMPLES="2048",  # the runs' own final evaluation: kept short
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    return env


# -- the partitions -----------------------------------------------------------------------


def make_partitions(args: argparse.Namespace, staging: Path) -> list[Path]:
    """Every partition's file, written before the clock starts (writing is not measured)."""
    staging.mkdir(parents=True, exist_ok=True)
    paths = [staging / f"part-{p:04d}.tsv" for p in range(args.partitions)]
    if args.seed_file:
        with open(args.seed_file) as seed:
            for path in paths:
                lines = [line for _, line in zip(range(args.rows), seed, strict=False)]
                if len(lines) < args.rows:
                    raise SystemExit(
                        f"--seed-file: fewer than {args.partitions} x {args.rows} rows"
                    )
                path.write_text("".join(lines))
        return paths
    script = (
        "import sys\n"
        "from psctl.jobs import ctr\n"
        f"cfg = ctr.CtrConfig(table='dynamic', drift={args.drift})\n"
        f"blocks = -(-{args.rows} // 512)\n"
        "for p, path in enumerate(sys.argv[1:]):\n"
        "    ctr.write_tsv(path, cfg, first_block=p * blocks, blocks=blocks)\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, *map(str, paths)],
        check=True,
        timeout=1800,
        env=job_env(args),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return paths


class Writer(threading.Thread):
    """Lands partition p at ``start + p * every``: its file moved in, then ``_SUCCESS``."""

    def __init__(self, staged: list[Path], data: Path, every: float) -> None:
        super().__init__(name="writer", daemon=True)
        self.staged, self.data, self.every = staged, data, every
        self.landed: list[float] = []  # the markers' times (Unix)
        self.start_at = time.monotonic()

    def directory(self, p: int) -> Path:
        return self.data / f"hour={p:04d}"

    def run(self) -> None:
        for p, source in enumerate(self.staged):
            time.sleep(max(0.0, self.start_at + p * self.every - time.monotonic()))
            target = self.directory(p)
            target.mkdir(parents=True)
            shutil.copyfile(source, target / ".part-0.tmp")
            os.rename(target / ".part-0.tmp", target / "part-0")
            (target / "_SUCCESS").touch()
            self.landed.append((target / "_SUCCESS").stat().st_mtime)


class VersionWatch(threading.Thread):
    """When each serving version appeared in ``base`` (polled every 0.2 s)."""

    def __init__(self, base: Path) -> None:
        super().__init__(name="versions", daemon=True)
        self.base = base
        self.seen: dict[int, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            with contextlib.suppress(OSError):
                for name in os.listdir(self.base):
                    if name.isdigit():
                        self.seen.setdefault(int(name), time.time())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# -- follow ---------------------------------------------------------------------------------


def follow_run(args: argparse.Namespace, out: Path, staged: list[Path]) -> dict[str, Any]:
    work, data, exported = out / "follow", out / "follow-data", out / "follow-serving"
    data.mkdir(parents=True)
    argv = psctl_argv(
        "local", "--job", "ctr", "--ps", str(args.ps), "--workers", str(args.workers),
        "--workdir", str(work), "--control-address", "127.0.0.1:0",
        "--batch-size", str(args.batch_size), "--keep-checkpoints", "1000",
        "--train-data", str(data / "*" / "part-*"), "--follow",
        "--idle-timeout", str(args.idle_timeout), "--export-every", args.export_every,
        "--export-dir", str(exported), "--export-keep", "1000",
        "--summary-json", str(out / "follow-summary.json"),
    )  # fmt: skip
    writer, versions = Writer(staged, data, args.every), VersionWatch(exported)
    sampler = RssSampler(work / "tasks.json", 5.0)
    code: int | None = None
    with (out / "follow.log").open("wb") as log:
        proc = spawn(argv, stdout=log, env=job_env(args))
        try:
            # The clock starts once the job waits for input: a partition landed while it
            # starts would measure psctl local's start-up, which a long-running job pays once.
            wait_for(lambda: WAITING in (out / "follow.log").read_text(errors="replace"), proc, 300)
            writer.start_at = time.monotonic()
            writer.start()
            versions.start()
            sampler.start()
            code = proc.wait(timeout=args.partitions * args.every + 600)
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            versions.done.set()
            memory = sampler.stop() if sampler.ident is not None else {}
    if code != 0:
        raise SystemExit(f"follow run: exit status {code}; see {out / 'follow.log'}")
    rounds = json.loads((work / "checkpoints" / "follow.json").read_text())["rounds"]
    step_of = {f: r["step"] for r in rounds for f in r["files"]}
    fresh, steps = [], []
    for p, landed in enumerate(writer.landed):
        step = step_of[str(writer.directory(p) / "part-0")]
        first = min((v for v in versions.seen if v >= step), default=None)
        if first is None:
            raise SystemExit(f"follow run: no serving version holds partition {p}")
        fresh.append(versions.seen[first] - landed)
        steps.append(step)
    return {
        "freshness_s": fresh,
        "checkpoints": [str(work / "checkpoints" / f"ckpt-{s}") for s in steps],
        "versions": sorted(versions.seen),
        **memory,
    }


def wait_for(ready: Any, proc: subprocess.Popen[Any], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the run ended (or hung) before its cluster started")
        time.sleep(0.2)


# -- restarts -------------------------------------------------------------------------------


def accepts(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=1):
        return True
    return False


def standing_cluster(args: argparse.Namespace, out: Path) -> tuple[Path, list[Any]]:
    """ps and worker servers started once, from a cluster file, as hosts run them."""
    n = 1 + 2 * (args.ps + args.workers)
    ports = free_ports(n)
    tf_ports, health = ports[: 1 + args.ps + args.workers], ports[1 + args.ps + args.workers :]
    addr = [f"127.0.0.1:{port}" for port in tf_ports]
    cluster = {
        "cluster": {
            "chief": addr[:1],
            "ps": addr[1 : 1 + args.ps],
            "worker": addr[1 + args.ps :],
        },
        "health": {
            "ps": [f"127.0.0.1:{port}" for port in health[: args.ps]],
            "worker": [f"127.0.0.1:{port}" for port in health[args.ps :]],
        },
    }
    path = out / "restarts-cluster.json"
    path.write_text(json.dumps(cluster, indent=2))
    servers = []
    for kind, count in (("ps", args.ps), ("worker", args.workers)):
        for index in range(count):
            log = (out / f"restarts-{kind}-{index}.log").open("wb")
            argv = server_argv(kind, ["--cluster", str(path), "--index", str(index)])
            argv += ["--metrics-port", "0"]
            servers.append(spawn(argv, stdout=log, env=job_env(args)))
    return path, servers


def restarts_run(args: argparse.Namespace, out: Path, staged: list[Path]) -> dict[str, Any]:
    data, exported, checkpoints = (
        out / "restarts-data",
        out / "restarts-serving",
        out / "restarts-ckpt",
    )
    data.mkdir(parents=True)
    cluster, servers = standing_cluster(args, out)
    writer = Writer(staged, data, args.every)
    fresh, made, target = [], [], 0
    env = job_env(args)
    try:
        # Warm: the clock starts once every server's TensorFlow port accepts connections.
        addresses = [
            a for kind in ("ps", "worker") for a in json.loads(cluster.read_text())["cluster"][kind]
        ]
        wait_for(lambda: all(accepts(a) for a in addresses), servers[0], 300)
        writer.start()
        for p in range(args.partitions):
            while len(writer.landed) <= p:
                time.sleep(0.1)
            files = str(writer.directory(p) / "part-0")
            target += -(-args.rows // args.batch_size)  # this partition's batches, once
            log = out / f"restarts-{p:04d}.log"
            for command in (
                psctl_argv(
                    "train", "--cluster", str(cluster), "--job", "ctr", "--train-data", files,
                    "--steps", str(target), "--batch-size", str(args.batch_size),
                    "--checkpoint-dir", str(checkpoints), "--keep-checkpoints", "1000",
                    "--control-address", "127.0.0.1:0",
                ),
                psctl_argv("export", "--job", "ctr", "--checkpoint-dir", str(checkpoints),
                           "--out", str(exported), "--train-data", files),
            ):  # fmt: skip
                with log.open("ab") as sink:
                    done = subprocess.run(
                        command,
                        stdout=sink,
                        stderr=subprocess.STDOUT,
                        env=env,
                        timeout=900,
                        stdin=subprocess.DEVNULL,
                    )
                if done.returncode != 0:
                    raise SystemExit(f"restarts run, partition {p}: see {log}")
            fresh.append(time.time() - writer.landed[p])
            made.append(str(checkpoints / f"ckpt-{target}"))
    finally:
        for server in servers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGTERM)
        for server in servers:
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
    return {"freshness_s": fresh, "checkpoints": made}


# -- quality --------------------------------------------------------------------------------


def next_partition_auc(
    checkpoints: list[str], staged: list[Path], out: Path, name: str, args: argparse.Namespace
) -> list[float]:
    """Checkpoint after partition p on partition p + 1, for every p but the last."""
    aucs = []
    for p, checkpoint in enumerate(checkpoints[:-1]):
        summary = out / f"{name}-eval-{p:04d}.json"
        command = psctl_argv(
            "evaluate", "--job", "ctr", "--checkpoint", checkpoint,
            "--eval-data", str(staged[p + 1]), "--summary-json", str(summary),
        )  # fmt: skip
        with (out / f"{name}-eval.log").open("ab") as log:
            subprocess.run(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=job_env(args),
                timeout=600,
                check=True,
                stdin=subprocess.DEVNULL,
            )
        aucs.append(float(json.loads(summary.read_text())["eval_metrics"]["auc"]))
    return aucs


def rss_slopes(samples: list[tuple[float, list[float | None]]]) -> dict[str, list[float]] | None:
    """Each ps's RSS slope (MB/min), over the first 5 minutes and over the whole run."""
    rows = [(t, v) for t, v in samples if all(x is not None for x in v)]
    if len(rows) < 3:
        return None

    def slope(part: list[tuple[float, list[Any]]]) -> list[float]:
        ts = [t / 60 for t, _ in part]
        return [
            statistics.linear_regression(ts, [v[i] for _, v in part]).slope
            for i in range(len(part[0][1]))
        ]

    first = [r for r in rows if r[0] <= 300] or rows
    return {"first_5min": slope(first if len(first) >= 3 else rows), "whole": slope(rows)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = results_dir(args.out, "freshness")
    staged = make_partitions(args, out / "staging")
    print(
        f"{args.partitions} partitions of {args.rows} rows, one every {args.every:g}s; "
        f"ctr, {args.ps} ps + {args.workers} workers, batch {args.batch_size}",
        flush=True,
    )
    follow = follow_run(args, out, staged)
    follow["auc"] = (
        []
        if args.skip_quality
        else next_partition_auc(follow["checkpoints"], staged, out, "follow", args)
    )
    results: dict[str, Any] = {"args": vars(args), "follow": follow}
    memory = rss_slopes(follow.get("rss_samples", []))
    print(f"follow:   freshness per partition (s): {[round(s, 1) for s in follow['freshness_s']]}")
    if memory:
        first, whole = ([round(s, 2) for s in memory[k]] for k in ("first_5min", "whole"))
        print(f"follow:   ps RSS slope MB/min, first 5 min {first}, whole run {whole}")
        results["rss_slopes"] = memory
    line = (
        f"{LAST_LINE} p50 {percentile(follow['freshness_s'], 0.5):.1f} s, "
        f"p95 {percentile(follow['freshness_s'], 0.95):.1f} s"
    )
    auc = f"next-partition auc {statistics.mean(follow['auc']):.4f}" if follow["auc"] else ""
    if not args.skip_baseline:
        restarts = restarts_run(args, out, staged)
        if not args.skip_quality:
            restarts["auc"] = next_partition_auc(
                restarts["checkpoints"], staged, out, "restarts", args
            )
            auc += f" vs {statistics.mean(restarts['auc']):.4f}"
        results["restarts"] = restarts
        print(
            f"restarts: freshness per partition (s): "
            f"{[round(s, 1) for s in restarts['freshness_s']]}"
        )
        line += f" (per-partition restarts: p50 {percentile(restarts['freshness_s'], 0.5):.1f} s)"
    if auc:
        line += f"; {auc}"
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"results in {out}")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
