"""Memory of dynamic tables (``DynamicEmbedding``): bytes per live key, and a table of
``--keys`` (default 10M) live keys trained on 2 ps.

1. **In one process** (no cluster): one shard filled with ``--probe-keys`` (1M) keys of
   ``--dim`` (16) floats, for SGD (no slot), Adagrad (1) and Adam (2), in three layouts side
   by side: ``packed`` (psctl's: one ``MutableHashTable``, the key's row with its slots and
   two int32 counters in one allocation), ``three`` (before: vectors, counts and slots
   each a table of their own) and ``dense`` (TensorFlow's ``DenseHashTable``, open
   addressing over contiguous buckets, the packed row as value): the RSS growth per key
   against the payload ``8 + dim x 4 x (1 + slots) + 8`` bytes (key, row, counters).
2. **On a cluster** (``psctl local``, 2 ps + 2 workers, Adam): a job whose every example
   brings 13 ids never seen before and 13 seen 2 steps earlier (so each key is admitted,
   then updated and given its slots; ``admit_after=1``, no eviction) trains until the
   table holds ``--keys`` live rows; each ps's RSS is sampled over the run (``/proc/<pid>/status``
   of the pids ``psctl local`` lists in its ``tasks.json``). Bytes per key on the ps: the
   growth of the two ps's RSS from their first sample, over the live rows, at its peak (the
   final checkpoint, whose export holds the rows once more) and while training (up to the
   last progress line, over the rows at its step).

    .venv/bin/python bench/table_memory.py                  # 1M probe, then 10M on 2 ps
    .venv/bin/python bench/table_memory.py --keys 1M        # a smaller cluster run
    .venv/bin/python bench/table_memory.py --no-cluster     # the one-process probe only

Last line: ``dynamic table: K live keys on 2 ps, B bytes/key on the ps at its peak (the
final checkpoint), T while training (payload P; psctl reports R)``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.dynamic import RssSampler

REPO = Path(__file__).resolve().parent.parent
IDS_PER_EXAMPLE = 26
PROGRESS = re.compile(r"^train \| step:\s+(\d+)/")

JOB = '''
"""Every example brings {new} ids never seen before and {new} ids first seen 2 steps
earlier, so that every key is admitted, then updated (its slots written)."""
import keras
import tensorflow as tf
from psctl.job import DynamicEmbedding

def create_model():
    ids = keras.Input(({ids},), dtype="int64")
    table = DynamicEmbedding({dim}, combiner="sum", name="ids")
    return keras.Model(ids, keras.layers.Dense(1)(table(ids)))

def create_optimizer():
    return keras.optimizers.Adam(0.001)

def loss_fn(y, logits):
    return keras.losses.binary_crossentropy(y, logits, from_logits=True)

def dataset_fn(ctx):
    back = 2 * ctx.num_workers * ctx.batch_size  # the examples of 2 steps ago
    def example(i):
        new = i * {new} + tf.range({new}, dtype=tf.int64)
        old = tf.maximum(i - back, 0) * {new} + tf.range({new}, dtype=tf.int64)
        return tf.concat([new, old], 0), tf.cast(i % 2, tf.float32)[None]
    start = tf.cast(ctx.worker_index, tf.int64)
    data = tf.data.Dataset.range(start, 2**40, ctx.num_workers).map(example)
    return data.batch(ctx.batch_size, drop_remainder=True).prefetch(2)
'''


def count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


PROBE = """
import os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
layout, n, d, slots = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
def table(dt, width):
    zeros = tf.zeros([width], dt)
    return tf.lookup.experimental.MutableHashTable(tf.int64, dt, default_value=zeros)
row = d * (1 + slots) + 2  # + count and last_seen, int32 bits
if layout == "three":
    tables = [(table(tf.float32, d), d, tf.float32), (table(tf.int64, 3), 3, tf.int64)]
    if slots:
        tables.append((table(tf.float32, d * slots), d * slots, tf.float32))
elif layout == "packed":
    tables = [(table(tf.float32, row), row, tf.float32)]
else:
    tables = [(tf.lookup.experimental.DenseHashTable(
        tf.int64, tf.float32, default_value=tf.zeros([row]), empty_key=-1, deleted_key=-2,
        initial_num_buckets=1024), row, tf.float32)]
base, chunk, peak = rss(), 100_000, 0
for start in range(0, n, chunk):
    keys = tf.range(start, start + chunk, dtype=tf.int64) * 7919
    for t, width, dt in tables:
        t.insert(keys, tf.zeros([chunk, width], dt))
    peak = max(peak, rss())
print((rss() - base) / n, (peak - base) / n)
"""


def probe(keys: int, dim: int) -> list[dict[str, float]]:
    rows = []
    for name, slots in (("sgd", 0), ("adagrad", 1), ("adam", 2)):
        payload = 8 + dim * 4 * (1 + slots) + 8
        for layout in ("packed", "three", "dense"):
            out = subprocess.run(
                [sys.executable, "-c", PROBE, layout, str(keys), str(dim), str(slots)],
                capture_output=True, text=True, check=True, timeout=600,
            )  # fmt: skip
            per_key, peak = (float(x) for x in out.stdout.split()[-2:])
            rows.append({"optimizer": name, "layout": layout, "bytes_per_key": per_key,
                         "peak_bytes_per_key": peak, "payload": payload})  # fmt: skip
            print(f"one process, {keys:,} keys, dim {dim}, {name:8} {layout:6}: "
                  f"{per_key:4.0f} bytes/key ({per_key / payload:.2f}x the payload {payload}; "
                  f"peak while growing {peak:.0f})", flush=True)  # fmt: skip
    return rows


def read_progress(
    proc: subprocess.Popen[str], sampler: RssSampler, progress: list[tuple[float, int]],
    lines: list[str],
) -> None:  # fmt: skip
    """psctl local's stderr, line by line: the time of each progress line and its step."""
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line)
        found = PROGRESS.match(line)
        if found:
            progress.append((time.monotonic() - sampler.started_at, int(found.group(1))))


def cluster_run(keys: int, dim: int, batch: int, work: Path) -> dict[str, float]:
    job = work / "memory_job.py"
    new = IDS_PER_EXAMPLE // 2
    job.write_text(textwrap.dedent(JOB.format(ids=IDS_PER_EXAMPLE, new=new, dim=dim)))
    steps = -(-keys // (new * batch))  # global steps: both workers' together
    summary = work / "summary.json"
    argv = [
        sys.executable, "-m", "psctl", "local", "--workdir", str(work / "local"),
        "--control-address", "127.0.0.1:0", "--job", str(job), "--ps", "2",
        "--batch-size", str(batch), "--steps", str(steps), "--steps-per-execution", "1",
        "--summary-json", str(summary),
    ]  # fmt: skip
    print(f"cluster: {steps} steps of {batch} examples x {new} new ids", flush=True)
    started = time.monotonic()
    sampler = RssSampler(work / "local" / "tasks.json", every=0.5)  # MB per ps, None: gone
    sampler.start()
    proc = subprocess.Popen(argv, cwd=REPO, stderr=subprocess.PIPE, text=True)
    progress: list[tuple[float, int]] = []  # (seconds on the sampler's clock, global step)
    lines: list[str] = []
    reader = threading.Thread(target=read_progress, args=(proc, sampler, progress, lines),
                              daemon=True)  # fmt: skip
    reader.start()
    try:
        proc.wait(timeout=3600)
        reader.join(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        sampler.stop()
    if proc.returncode != 0:
        raise SystemExit(f"psctl local failed ({proc.returncode}):\n{''.join(lines)[-3000:]}")
    result = json.loads(summary.read_text())
    rows = result["tables"]["ids"]["rows"]
    sampled = [(t, sum(v * 1e6 for v in mb)) for t, mb in sampler.samples if None not in mb]
    first, peak = sampled[0][1], max(total for _, total in sampled)
    per_key = (peak - first) / rows
    # While training (up to the last progress line, before the final checkpoint's export):
    # the rows then, as every step brings the same number of new keys.
    ended, step = progress[-1] if progress else (math.inf, result["global_step"])
    training = max(total for t, total in sampled if t <= ended or t == sampled[0][0])
    rows_then = rows * min(1.0, step / max(1, result["global_step"]))
    training_per_key = (training - first) / max(1.0, rows_then)
    for t, values in sampler.samples[:: max(1, len(sampler.samples) // 8)]:
        shown = " ".join("gone" if v is None else f"{v * 1e6 / 2**30:.2f} GiB" for v in values)
        print(f"  {t:6.0f} s  ps RSS {shown}")
    return {
        "rows": rows,
        "steps": result["global_step"],
        "steps_per_sec": result["steps_per_sec"],
        "ps_rss_first_bytes": first,
        "ps_rss_peak_bytes": peak,
        "ps_rss_training_bytes": training,
        "bytes_per_key": per_key,
        "training_bytes_per_key": training_per_key,
        "reported_bytes_per_key": result["tables"]["ids"].get("bytes", 0) / max(1, rows),
        "payload": 8 + dim * 4 * 3 + 8,
        "wall_seconds": time.monotonic() - started,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=count, default=count("10M"), help="live keys on 2 ps")
    parser.add_argument("--probe-keys", type=count, default=count("1M"))
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=4096, help="per worker")
    parser.add_argument("--no-cluster", action="store_true", help="the one-process probe only")
    parser.add_argument("--out", type=Path, help="results JSON")
    args = parser.parse_args()
    results: dict[str, object] = {"probe": probe(args.probe_keys, args.dim)}
    if not args.no_cluster:
        with tempfile.TemporaryDirectory(prefix="psctl-table-memory-") as tmp:
            run = cluster_run(args.keys, args.dim, args.batch_size, Path(tmp))
        results["cluster"] = run
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    if not args.no_cluster:
        print(f"dynamic table: {run['rows']:,} live keys on 2 ps, {run['bytes_per_key']:.0f} "
              f"bytes/key on the ps at its peak (the final checkpoint), "
              f"{run['training_bytes_per_key']:.0f} while training (payload {run['payload']}; "
              f"psctl reports {run['reported_bytes_per_key']:.0f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
