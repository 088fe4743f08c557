#!/usr/bin/env python3
"""A server's start: TensorFlow's server modules alone (what ps-server and worker-server
import, cluster/tf_runtime.py) against ``import tensorflow`` whole (what they imported
before), side by side in one run.

Each start is a fresh process that imports one way, starts a one-task tf.distribute.Server
on a free loopback port and reports its import's CPU seconds and its resident memory then;
the parent times the whole process (Python's start, the import, the server's, the exit).
The two ways run ``--repeats`` times each, interleaved; the table shows each one's median
and range.

    .venv/bin/python bench/server_start.py               # 5 starts each, ~40 s on 2 cores
    .venv/bin/python bench/server_start.py --repeats 9
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

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, socket, sys, time
way = sys.argv[1]
from psctl.cluster.processes.logs import tensorflow_import_quietly
from psctl.cluster.tf_runtime import server_api, without_plotting
cpu = time.process_time()
with tensorflow_import_quietly():
    if way == "server modules":
        api = server_api()
        assert not api.whole, "TensorFlow was imported whole: see cluster/tf_runtime.py"
        Server, ClusterSpec, ConfigProto = api.Server, api.ClusterSpec, api.ConfigProto
    else:
        with without_plotting():
            import tensorflow as tf
        Server, ClusterSpec = tf.distribute.Server, tf.train.ClusterSpec
        ConfigProto = tf.compat.v1.ConfigProto
import_cpu = time.process_time() - cpu
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
server = Server(ClusterSpec({"worker": [f"127.0.0.1:{port}"]}), job_name="worker",
                task_index=0, protocol="grpc",
                config=ConfigProto(inter_op_parallelism_threads=16), start=True)
rss_kb = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))
print(json.dumps({"import_cpu": import_cpu, "rss_mb": rss_kb / 1024,
                  "modules": len(sys.modules)}), flush=True)
"""

WAYS = ("server modules", "import tensorflow")


def start_once(way: str) -> dict[str, float]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(REPO)}
    began = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, way],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    wall = time.monotonic() - began
    if proc.returncode != 0:
        raise SystemExit(f"server_start: the {way!r} start failed:\n{proc.stderr[-2000:]}")
    return {**json.loads(proc.stdout.splitlines()[-1]), "wall": wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="starts of each way (default 5)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    print(f"load average {os.getloadavg()[0]:.2f}; {args.repeats} starts of each, interleaved")
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    for i in range(args.repeats):
        for way in WAYS if i % 2 == 0 else WAYS[::-1]:
            runs[way].append(start_once(way))

    def cell(way: str, key: str, fmt: str) -> str:
        values = [run[key] for run in runs[way]]
        low, mid, high = min(values), statistics.median(values), max(values)
        return f"{mid:{fmt}} ({low:{fmt}}-{high:{fmt}})"

    print(f"{'import':<18} {'import CPU s':>20} {'process wall s':>20} {'RSS MB':>16} modules")
    for way in WAYS:
        modules = int(statistics.median(run["modules"] for run in runs[way]))
        print(
            f"{way:<18} {cell(way, 'import_cpu', '.2f'):>20} {cell(way, 'wall', '.2f'):>20} "
            f"{cell(way, 'rss_mb', '.0f'):>16} {modules}"
        )

    def ratio(key: str) -> float:
        ours, before = (statistics.median(run[key] for run in runs[w]) for w in WAYS)
        return ours / before

    print(
        f"server start, server modules/import tensorflow: import CPU = {ratio('import_cpu'):.2f}, "
        f"process wall = {ratio('wall'):.2f}, RSS = {ratio('rss_mb'):.2f}"
    )
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
