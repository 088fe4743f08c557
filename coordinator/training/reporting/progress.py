"""Progress output: fixed-width lines when piped, a redrawn bar on a terminal."""

from __future__ import annotations

from typing import TextIO


def format_line(
    step: int,
    total: int,
    examples_per_sec: float,
    values: dict[str, float],
    tables: dict[str, dict[str, int]] | None = None,
) -> str:
    """``tables``: the dynamic tables' counts (``table_counts``), each as its live rows
    and the rows evicted so far."""
    # total 0: not known in advance (--epochs)
    parts = [f"train | step: {step:6d}/{total}" if total else f"train | step: {step:6d}"]
    parts += [f"{name}: {value:.4f}" for name, value in values.items()]
    parts.append(f"{examples_per_sec:7.0f} ex/s")
    for name, counts in (tables or {}).items():
        parts.append(
            f"{name}: {counts.get('rows', 0):,} rows, {counts.get('evicted', 0):,} evicted"
        )
    return " | ".join(parts)


class Progress:
    def __init__(self, *, total: int, start: int, stream: TextIO, width: int = 24) -> None:
        self.total = total
        self.start = start
        self.stream = stream
        self.width = width
        self.tty = stream.isatty()

    def _bar(self, step: int) -> str:
        frac = min(1.0, step / self.total) if self.total else 1.0
        filled = int(frac * self.width)
        return f"[{'#' * filled}{'.' * (self.width - filled)}] {frac * 100:3.0f}% "

    def report(
        self,
        step: int,
        examples_per_sec: float,
        values: dict[str, float],
        tables: dict[str, dict[str, int]] | None = None,
    ) -> None:
        line = format_line(step, self.total, examples_per_sec, values, tables)
        if self.tty:
            self.stream.write("\r\x1b[2K" + self._bar(step) + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def finish(self, step: int, examples_per_sec: float, values: dict[str, float]) -> None:
        self.report(step, examples_per_sec, values)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
