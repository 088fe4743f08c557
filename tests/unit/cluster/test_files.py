"""cluster.files: JSON written whole, then renamed over the old file."""

from __future__ import annotations

import json
from pathlib import Path

from psctl.cluster.processes.files import write_json_atomic


def test_writes_the_callers_format(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    write_json_atomic(path, {"b": 1, "a": [1]})
    assert path.read_text() == json.dumps({"b": 1, "a": [1]}, indent=2)
    write_json_atomic(str(path), {"b": 1, "a": 2}, sort_keys=True, newline=True)
    assert path.read_text() == '{\n  "a": 2,\n  "b": 1\n}\n'


def test_replaces_whole_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "dir" / "tasks.json"  # parents are created
    write_json_atomic(path, ["old"])
    write_json_atomic(path, ["new"])
    assert json.loads(path.read_text()) == ["new"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["tasks.json"]
