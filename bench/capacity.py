"""Capacity of psctl's tables: what a large model costs each process, and how long its
checkpoints take, now that every ps saves its own shards (coordinator/training/
training/saving/sharded_save.py).

1. **Fixed table** (the built-in ctr job, ``CTR_ROWS`` rows x 16, Adam, 2 ps + 2 workers,
   ``--max-shards 2``): ``psctl local --steps 400 --checkpoint-every 100`` at ``--rows``
   (10M) and at ``--small-rows`` (10k), side by side: the coordinator's (the training
   process's) and each ps's peak RSS (VmHWM from /proc, sampled every 0.5 s), and every
   checkpoint's seconds and files from its log line. With ``--baseline REV``, the same
   ``--rows`` run of the code at git revision REV (a worktree) beside it.
2. **Dynamic table** (bench/table_memory.py's cluster run: 2 ps, Adam, 16 floats): bytes
   per live key on the ps at ``--keys`` live keys; the largest table that fits 2 ps of this
   machine is estimated from it (``MemAvailable`` x 0.8 / bytes per key), not trained.

    .venv/bin/python bench/capacity.py                      # 10M rows, 10M keys (~15 min)
    .venv/bin/python bench/capacity.py --quick              # 1M rows, 1M keys (~3 min)
    .venv/bin/python bench/capacity.py --baseline e486614   # and the code before, beside

Last line: ``capacity: coordinator peak X GB at 10M rows (Y at 10k), checkpoint S s, B
bytes/key, largest dynamic table K keys on 2 ps``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.table_memory import cluster_run, count

REPO = Path(__file__).resolve().parent.parent
CHECKPOINT = re.compile(r"training\.saving\.checkpoints: checkpoint (\S+) \((\d+\.\d+)s")


def peak_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def pids(workdir: Path) -> dict[str, int]:
    """The run's processes: the training process (``chief``) and each ps, by command line."""
    found: dict[str, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not any(str(workdir).encode() in part for part in cmd):
            continue
        if b"train" in cmd and b"psctl" in cmd:
            found["chief"] = int(entry)
        elif any(part.endswith(b"ps_server.main") for part in cmd):
            found[f"ps:{cmd[cmd.index(b'--index') + 1].decode()}"] = int(entry)
    return found


class Peaks(threading.Thread):
    """Every 0.5 s: each process's VmHWM (the kernel's own peak), kept at its highest."""

    def __init__(self, workdir: Path) -> None:
        super().__init__(daemon=True)
        self.workdir = workdir
        self.peaks: dict[str, int] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            for name, pid in pids(self.workdir).items():
                kb = peak_kb(pid)
                if kb is not None:
                    self.peaks[name] = max(self.peaks.get(name, 0), kb * 1024)


def fixed_run(rows: str, steps: int, every: int, work: Path, code: Path) -> dict[str, Any]:
    """``psctl local`` of the ctr job at ``rows``, run from ``code`` (a checkout)."""
    workdir = work / f"fixed-{rows}-{code.name}"
    argv = [
        sys.executable, "-m", "psctl", "local", "--workdir", str(workdir),
        "--control-address", "127.0.0.1:0", "--job", "ctr", "--ps", "2", "--max-shards", "2",
        "--steps", str(steps), "--checkpoint-every", str(every),
        "--checkpoint-dir", str(workdir / "ckpt"), "--summary-json", str(workdir / "s.json"),
    ]  # fmt: skip
    env = {**os.environ, "CTR_ROWS": rows, "TF_CPP_MIN_LOG_LEVEL": "2"}
    peaks = Peaks(workdir)
    peaks.start()
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=code, env=env, capture_output=True, text=True, timeout=3600)
    peaks.done.set()
    peaks.join(timeout=5)
    if proc.returncode != 0:
        raise SystemExit(f"psctl local ({rows}, {code}) failed ({proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")  # fmt: skip
    saves = [(m.group(1), float(m.group(2))) for m in CHECKPOINT.finditer(proc.stderr)]
    files = {
        Path(path).name: sorted(p.name for p in (workdir / "ckpt").glob(Path(path).name + ".*"))
        for path, _ in saves
    }
    skipped = proc.stderr.count("checkpoint skipped")
    said = "training.saving.checkpoints: checkpoint"
    lines = [ln for ln in proc.stderr.splitlines() if said in ln]
    return {
        "rows": rows,
        "code": str(code),
        "coordinator_peak_bytes": peaks.peaks.get("chief", 0),
        "ps_peak_bytes": {k: v for k, v in sorted(peaks.peaks.items()) if k.startswith("ps:")},
        "checkpoint_seconds": [s for _, s in saves],
        "checkpoints_skipped": skipped,
        "checkpoint_lines": lines,
        "checkpoint_files": {name: len(f) for name, f in files.items()},
        "wall_seconds": time.monotonic() - started,
    }


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def show(run: dict[str, Any], label: str) -> None:
    ps = ", ".join(f"{k} {gb(v)}" for k, v in run["ps_peak_bytes"].items())
    seconds = ", ".join(f"{s:.2f}" for s in run["checkpoint_seconds"])
    skipped = run["checkpoints_skipped"]
    coordinator = gb(run["coordinator_peak_bytes"])
    print(f"{label:<28} coordinator {coordinator} | {ps} | checkpoints {seconds} s "
          f"(skipped {skipped})", flush=True)  # fmt: skip
    for line in run["checkpoint_lines"][-1:]:
        print(f"{'':<28} {line.split('training.saving.checkpoints: ')[-1]}", flush=True)


def worktree(rev: str, work: Path) -> Path:
    path = work / f"baseline-{rev}"
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(path), rev], cwd=REPO,
                   check=True)  # fmt: skip
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="10M", help="the large fixed table's rows")
    parser.add_argument("--small-rows", default="10k", help="the small fixed table's rows")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--keys", type=count, default=count("10M"), help="dynamic table keys")
    parser.add_argument("--quick", action="store_true", help="1M rows and 1M keys")
    parser.add_argument("--baseline", metavar="REV", help="also run --rows at git revision REV")
    parser.add_argument("--out", type=Path, help="results JSON")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.keys = "1M", count("1M")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="psctl-capacity-") as tmp:
        work = Path(tmp)
        small = fixed_run(args.small_rows, args.steps, args.checkpoint_every, work, REPO)
        large = fixed_run(args.rows, args.steps, args.checkpoint_every, work, REPO)
        results.update(small=small, large=large)
        print(f"fixed ctr table x 16, Adam, 2 ps + 2 workers, {args.steps} steps, "
              f"--checkpoint-every {args.checkpoint_every}:")  # fmt: skip
        show(small, f"psctl {args.small_rows} rows")
        show(large, f"psctl {args.rows} rows")
        if args.baseline:
            code = worktree(args.baseline, work)
            try:
                base = fixed_run(args.rows, args.steps, args.checkpoint_every, work, code)
            finally:
                subprocess.run(["git", "worktree", "remove", "--force", str(code)], cwd=REPO,
                               check=False)  # fmt: skip
            results["baseline"] = base
            show(base, f"{args.baseline} {args.rows} rows")
        (work / "dynamic").mkdir()
        dynamic = cluster_run(args.keys, 16, 4096, work / "dynamic")
        results["dynamic"] = dynamic
    available = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    per_key = dynamic["bytes_per_key"]
    largest = int(available * 0.8 / per_key) if per_key > 0 else 0
    results["largest_dynamic_keys_estimated"] = largest
    ratio = large["coordinator_peak_bytes"] / max(1, small["coordinator_peak_bytes"])
    seconds = statistics.mean(large["checkpoint_seconds"]) if large["checkpoint_seconds"] else 0
    print(f"dynamic table: {dynamic['rows']:,} live keys on 2 ps, {per_key:.0f} bytes/key on "
          f"the ps at its peak (the final checkpoint; "
          f"{dynamic['training_bytes_per_key']:.0f} while training), "
          f"{dynamic['steps_per_sec']:.1f} steps/s")  # fmt: skip
    print(f"coordinator peak at {args.rows} rows / at {args.small_rows}: {ratio:.2f}x")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(
        f"capacity: coordinator peak {gb(large['coordinator_peak_bytes'])} at {args.rows} rows "
        f"({gb(small['coordinator_peak_bytes'])} at {args.small_rows}), checkpoint "
        f"{seconds:.1f} s, {per_key:.0f} bytes/key, largest dynamic table {largest:,} keys on "
        f"2 ps (estimated from bytes/key and {gb(available)} available)"
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
