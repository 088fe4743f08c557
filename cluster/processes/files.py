"""Files that other processes read while psctl rewrites them: written whole, then renamed."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json_atomic(
    path: str | os.PathLike[str],
    obj: object,
    *,
    indent: int | None = 2,
    sort_keys: bool = False,
    newline: bool = False,
) -> None:
    """Write ``obj`` as JSON so that a reader sees the old file or the new one, never half of
    one: into ``NAME.tmp`` beside it, then renamed over it. Creates the parent directory.

    ``indent`` and ``sort_keys`` go to ``json.dumps``; ``newline`` ends the file with one.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys)
    tmp.write_text(text + "\n" if newline else text)
    os.replace(tmp, target)
