"""A temporary directory of this process's own, removed when it ends, however it ends.

TensorFlow's autograph writes a ``__autograph_generated_file*.py`` into the temporary
directory for every function it converts and removes them from an ``atexit`` handler. A
training process never runs those: it ends by ``os._exit`` (TensorFlow's cluster threads
can hold up interpreter shutdown for minutes), or is killed. So every training process
left its files in /tmp, for good (thousands on a host after a day of restarts and tests).

``use_private_tempdir()`` points this process's ``tempfile`` at a directory of its own
inside the usual one; ``remove_private_tempdir()``, called just before ``os._exit``, deletes
it. The directories of processes that died without removing theirs (SIGKILL, OOM) are
removed by the next process that starts one.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

PREFIX = "psctl-scratch-"
_OWN = re.compile(rf"{re.escape(PREFIX)}(\d+)-")
_current: Path | None = None


def use_private_tempdir(base: str | None = None) -> Path:
    """Make a directory of this process's own in ``base`` (default: the usual temporary
    directory) the one ``tempfile`` uses here; first remove those that dead processes of
    this user left there."""
    global _current
    parent = Path(base or tempfile.gettempdir())
    sweep(parent)
    _current = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=parent))
    tempfile.tempdir = str(_current)
    return _current


def remove_private_tempdir() -> None:
    """Delete this process's directory (and what it holds), if it made one."""
    global _current
    if _current is not None:
        shutil.rmtree(_current, ignore_errors=True)
        _current = None


def sweep(parent: Path) -> list[Path]:
    """Remove the private directories in ``parent`` of processes no longer running (this
    user's: another user's are not ours to remove, and ``rmtree`` could not). Returns them."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in parent.iterdir():
            found = _OWN.match(entry.name)
            if not found or _running(int(found[1])):
                continue
            with contextlib.suppress(OSError):
                if entry.is_dir() and not entry.is_symlink() and entry.stat().st_uid == os.getuid():
                    shutil.rmtree(entry)
                    removed.append(entry)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
