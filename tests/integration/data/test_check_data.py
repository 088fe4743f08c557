"""`psctl check-data` end to end: a real subprocess checking small generated files in two
processes; a good glob is one summary line and exit 0, a bad line one error line and 78."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import child_env, psctl_argv

pytestmark = pytest.mark.integration

IDS = [f"{i:08x}" for i in range(26)]


def tsv_line(label: int, first: int | str) -> str:
    return "\t".join([str(label), str(first), *map(str, range(12)), *IDS])


@pytest.mark.timeout(60)
def test_check_data_names_the_first_bad_line_or_sums_up(run_cli, tmp_path: Path):
    for part in range(3):
        lines = [tsv_line(i % 2, i) for i in range(1000)]
        (tmp_path / f"day_{part}.tsv").write_text("".join(f"{text}\n" for text in lines))
    argv = psctl_argv("check-data", str(tmp_path / "day_*.tsv"), "--job", "ctr", "--jobs", "2")
    proc = run_cli(argv, timeout=45, env=child_env())
    assert proc.returncode == 0, proc.stderr
    summary = proc.stdout.strip()
    assert summary.startswith("check-data: ok: 3 Criteo TSV file(s), 3,000 records, ")
    assert "\n" not in summary and " MB in " in summary

    lines = [tsv_line(i % 2, i) for i in range(1000)]
    lines[876] = tsv_line(1, "n/a")
    (tmp_path / "day_1.tsv").write_text("".join(f"{text}\n" for text in lines))
    (tmp_path / "day_2.tsv").write_text("bad\n")  # later in the sorted order: not named
    proc = run_cli(argv, timeout=45, env=child_env())
    assert proc.returncode == 78, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.strip() == (
        f"psctl: error: check-data: {tmp_path / 'day_1.tsv'} line 877, column I1: 'n/a' is "
        "not an integer (or empty); write the label (0 or 1), 13 integers and 26 hexadecimal "
        "ids, tab-separated (or remove it)"
    )
