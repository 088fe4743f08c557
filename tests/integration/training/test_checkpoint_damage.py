"""Damaged checkpoints through real `psctl local` runs: a scrambled newest data file, a
garbage state file, an unwritable --checkpoint-dir (training/saving/checkpoint_files.py)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import processes_mentioning, psctl_argv, read_json

pytestmark = pytest.mark.integration


def local_argv(workdir: Path, *args: str) -> list[str]:
    return psctl_argv(
        "local", "--workdir", str(workdir), "--control-address", "127.0.0.1:0", "--log-every", "1",
        *args,
    )  # fmt: skip


def steps_saved(ckpt: Path) -> list[int]:
    return sorted(int(p.name[len("ckpt-") : -len(".index")]) for p in ckpt.glob("ckpt-*.index"))


def scramble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data)):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


@pytest.mark.timeout(240)
def test_damaged_checkpoints_resume_from_the_newest_usable_one(workdir, run_cli, tmp_path):
    ckpt = workdir / "ckpt"

    def run(name: str, steps: int, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict]:
        proc = run_cli(
            local_argv(
                workdir / name,
                "--steps", str(steps),
                "--checkpoint-dir", str(ckpt),
                "--checkpoint-every", "100",
                "--keep-checkpoints", "5",
                "--summary-json", str(workdir / f"{name}.json"),
                *extra,
            ),
            timeout=100,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc, read_json(workdir / f"{name}.json")

    run("a", 300)
    saved = steps_saved(ckpt)
    assert len(saved) >= 2 and saved[-1] == 300, saved
    previous = saved[-2]

    # The newest checkpoint's biggest data file (the ps's shard) scrambled: the previous
    # checkpoint is restored, the bad files named.
    data = max(ckpt.glob("ckpt-300.data-*"), key=lambda p: p.stat().st_size)
    scramble(data)
    proc, summary = run("b", 300)
    assert summary["start_step"] == previous and summary["global_step"] == 300
    (line,) = [ln for ln in proc.stderr.splitlines() if "is unusable" in ln]
    assert "checkpoint ckpt-300 is unusable" in line and data.name in line, line
    assert "ckpt-300.index" in line and "restoring it failed" in line, line

    # Garbage in the state file: the newest checkpoint (the one run b wrote) is found anyway,
    # and the state file is written again from the files present.
    (ckpt / "checkpoint").write_text("model_checkpoint_path: {{{ garbage\n")
    proc, summary = run("c", 300)
    assert summary["start_step"] == 300, proc.stderr[-3000:]
    assert "rewritten from the checkpoint files present" in proc.stderr
    assert 'model_checkpoint_path: "ckpt-300"' in (ckpt / "checkpoint").read_text()
    assert (ckpt / "checkpoint.unreadable").is_file()

    # psctl export skips a damaged newest checkpoint too, and leaves the directory alone.
    newest = steps_saved(ckpt)
    assert len(newest) >= 2, newest
    intact = {path: path.read_bytes() for path in ckpt.glob(f"ckpt-{newest[-1]}.data-*")}
    for path in intact:
        scramble(path)
    state = (ckpt / "checkpoint").read_text()
    out = tmp_path / "export"
    proc = run_cli(
        psctl_argv("export", "--checkpoint-dir", str(ckpt), "--out", str(out)), timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"checkpoint ckpt-{newest[-1]} is unusable" in proc.stderr, proc.stderr[-3000:]
    assert (out / str(newest[-2]) / "saved_model.pb").is_file()
    assert (ckpt / "checkpoint").read_text() == state
    for path, data in intact.items():  # as it was, for the next case
        path.write_bytes(data)

    # Every checkpoint damaged: not step 0, and not a restart loop, but one line and exit 78.
    for path in ckpt.glob("ckpt-*.data-*"):
        scramble(path)
    proc = run_cli(
        local_argv(workdir / "e", "--steps", "300", "--checkpoint-dir", str(ckpt)), timeout=100
    )
    assert proc.returncode == 78, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("psctl: error:")]
    assert f"--checkpoint-dir: none of the {len(steps_saved(ckpt))} checkpoint(s)" in line
    assert "restarting" not in proc.stderr and "Traceback" not in proc.stderr
    assert "train | step:" not in proc.stderr

    # An unwritable --checkpoint-dir: one line and exit 78, before any server starts.
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    started = time.monotonic()
    proc = run_cli(
        local_argv(workdir / "d", "--steps", "300", "--checkpoint-dir", str(blocker / "ckpt")),
        timeout=60,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert proc.stderr.strip() == (
        f"psctl: error: --checkpoint-dir: cannot write to {blocker / 'ckpt'} (Not a directory); "
        "give a directory this user can create and write to"
    )
    assert elapsed < 15, elapsed
    assert not (workdir / "d").exists()  # no server was started
    assert processes_mentioning(str(workdir)) == []
