"""The full check of input files (coordinator/data/checks.py, coordinator/data/files.py):
files cut into pieces at line starts, errors naming the line in the file whatever piece
found them, the first bad file in sorted order, and statistics added up over pieces. In this
process (pieces of a few hundred bytes); tests/integration/data/test_check_data.py runs the
processes through ``psctl check-data``."""

from __future__ import annotations

import gzip
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from psctl.cluster.errors import ConfigError
from psctl.coordinator.data import checks, table_scan
from psctl.coordinator.data.files import Piece, cut, in_order, read_piece
from tests.conftest import child_env

pytestmark = pytest.mark.timeout(60)

IDS = [f"{i:08x}" for i in range(26)]


def tsv_line(label: int | str = 1, first: int | str = 0) -> str:
    return "\t".join([str(label), str(first), *map(str, range(12)), *IDS])


def write(path: Path, lines: list[str]) -> str:
    path.write_text("".join(f"{text}\n" for text in lines))
    return str(path)


def test_pieces_start_at_line_starts_and_cover_every_byte(tmp_path: Path):
    path = write(tmp_path / "a.tsv", [tsv_line(i % 2, i) for i in range(100)])
    pieces, total = cut([path], splittable=True, piece_bytes=1000)
    assert total == Path(path).stat().st_size and len(pieces) > 5
    assert [p.last for p in pieces] == [False] * (len(pieces) - 1) + [True]
    parts = [read_piece(p) for p in pieces]
    assert b"".join(parts) == Path(path).read_bytes()
    assert all(part.endswith(b"\n") for part in parts)
    whole, _ = cut([path], splittable=False, piece_bytes=1000)
    assert len(whole) == 1 and whole[0].end == -1


@pytest.mark.parametrize("piece_bytes", [300, 1000, 1 << 20])
def test_criteo_counts_and_names_the_line_in_the_file(tmp_path: Path, piece_bytes: int):
    lines = [tsv_line(int(i % 3 == 0), i) for i in range(60)]
    good = write(tmp_path / "a-0.tsv", lines)
    write(tmp_path / "a-1.tsv", lines[:7])
    info = checks.scan_criteo(str(tmp_path / "a-*.tsv"), field="f", piece_bytes=piece_bytes)
    assert info.records_per_file == (60, 7) and info.positives == 20 + 3
    assert info.paths == (good, str(tmp_path / "a-1.tsv"))
    lines[47] = tsv_line(1, "4x")
    write(tmp_path / "a-0.tsv", lines)
    with pytest.raises(ConfigError) as err:
        checks.scan_criteo(str(tmp_path / "a-*.tsv"), field="f", piece_bytes=piece_bytes)
    assert str(err.value).startswith(f"f: {good} line 48, column I1: '4x' is not an integer")


def test_the_first_bad_file_in_sorted_order_is_named(tmp_path: Path):
    write(tmp_path / "b-0.tsv", [tsv_line()] * 20)
    (tmp_path / "b-1.tsv").write_text("")
    write(tmp_path / "b-2.tsv", [tsv_line(), "bad"])
    with pytest.raises(ConfigError) as err:
        checks.scan_criteo(str(tmp_path / "b-*.tsv"), field="f", piece_bytes=200)
    assert f"{tmp_path / 'b-1.tsv'} is empty" in str(err.value)


def test_gzipped_criteo_files_are_one_piece_each(tmp_path: Path):
    body = "".join(f"{tsv_line(1, i)}\n" for i in range(50)) + "1\tx\n"
    (tmp_path / "c.tsv.gz").write_bytes(gzip.compress(body.encode()))
    with pytest.raises(ConfigError) as err:
        checks.scan_criteo(str(tmp_path / "c.tsv.gz"), field="f", piece_bytes=100)
    assert "c.tsv.gz line 51" in str(err.value)


def csv_text(rows: range, header: str = "a,label,b") -> str:
    return header + "\n" + "".join(f"{i},{i % 4},{-i * 0.5}\n" for i in rows)


@pytest.mark.parametrize("piece_bytes", [40, 1 << 20])
def test_csv_pieces_add_up_to_the_whole_files(tmp_path: Path, piece_bytes: int):
    (tmp_path / "d-0.csv").write_text(csv_text(range(30)))
    (tmp_path / "d-1.csv").write_text(csv_text(range(30, 41)))
    info = table_scan.scan_table(str(tmp_path / "d-*.csv"), field="f", piece_bytes=piece_bytes)
    assert info.records_per_file == (30, 11) and info.columns == ("a", "label", "b")
    assert info.integer_labels and (info.label_min.value, info.label_max.value) == (0, 3)
    assert (info.label_min.path, info.label_min.line) == (str(tmp_path / "d-0.csv"), 2)
    text = csv_text(range(30, 41)).replace("38,", "38x,")
    (tmp_path / "d-1.csv").write_text(text)
    with pytest.raises(ConfigError) as err:
        table_scan.scan_table(str(tmp_path / "d-*.csv"), field="f", piece_bytes=piece_bytes)
    assert f"{tmp_path / 'd-1.csv'} line 10, column 'a': '38x' is not a number" in str(err.value)
    (tmp_path / "d-1.csv").write_text(csv_text(range(3), header="a,label,c"))
    with pytest.raises(ConfigError) as err:
        table_scan.scan_table(str(tmp_path / "d-*.csv"), field="f", piece_bytes=piece_bytes)
    assert "d-1.csv line 1: header [a, label, c] differs from" in str(err.value)


def test_trimmed_lines_are_counted_over_pieces_and_the_first_is_named(tmp_path: Path, caplog):
    lines = [tsv_line(1, i) for i in range(40)]
    lines[25] = lines[25].rsplit("\t", 2)[0]  # 38 cells: C25 and C26 trimmed
    lines[33] = "0\t5"
    path = write(tmp_path / "e.tsv", lines)
    for piece_bytes in (300, 1 << 20):
        caplog.clear()
        info = checks.scan_criteo(path, field="f", piece_bytes=piece_bytes)
        assert (info.num_records, info.trimmed, info.positives) == (40, 2, 39)
        assert f"(the first: {path} line 26)" in caplog.text
    lines[30] = tsv_line() + "\t"  # 41 cells: still an error
    write(tmp_path / "e.tsv", lines)
    with pytest.raises(ConfigError, match=r"e.tsv line 31: 41 tab-separated cells, the Criteo"):
        checks.scan_criteo(path, field="f", piece_bytes=300)


def test_paths_with_a_scheme_go_through_tensorflows_file_systems(tmp_path: Path):
    import tensorflow as tf

    from psctl.coordinator.data import readers as data
    from psctl.coordinator.data.context import DataContext

    tf.io.gfile.makedirs("ram://checks/csv")
    text = csv_text(range(50))
    for part in range(2):
        with tf.io.gfile.GFile(f"ram://checks/csv/d-{part}.csv", "w") as out:
            out.write(text)
    info = table_scan.scan_table("ram://checks/csv", field="f", piece_bytes=64)  # a directory
    assert info.files == ("ram://checks/csv/d-0.csv", "ram://checks/csv/d-1.csv")
    assert info.records_per_file == (50, 50)
    with tf.io.gfile.GFile("ram://checks/csv/d-2.csv", "w") as out:  # (ram:// appends)
        out.write(text.replace("\n33,", "\n33x,"))
    with pytest.raises(ConfigError, match=r"ram://checks/csv/d-2.csv line 35, column 'a'"):
        table_scan.scan_table("ram://checks/csv/*.csv", field="f", piece_bytes=64)

    body = "".join(f"{tsv_line(i % 2, i)}\n" for i in range(30)) + "1\t5\n"  # one trimmed
    with tf.io.gfile.GFile("ram://checks/day.tsv.gz", "wb") as out:
        out.write(gzip.compress(body.encode()))
    tsv = checks.scan_criteo("ram://checks/day.tsv.gz", field="f")
    assert (tsv.num_records, tsv.trimmed, tsv.positives) == (31, 1, 16)

    local = tmp_path / "e.csv"
    local.write_text(text)
    found = data.inspect_files(f"file://{local}", field="f")  # a scheme TensorFlow has
    assert found.files == (f"file://{local}",)
    ctx = DataContext(worker_index=0, num_workers=1, batch_size=64, seed=1)
    batches = list(data.make_dataset(f"file://{local}", ctx, training=False, field="f"))
    assert sum(len(y) for _, y in batches) == 50

    with pytest.raises(ConfigError, match=r"^f: no files match 'ram://checks/none-\*'"):
        table_scan.scan_table("ram://checks/none-*", field="f")
    with pytest.raises(ConfigError, match=r"^f: cannot list 'nope://x/\*': File system scheme"):
        table_scan.scan_table("nope://x/*", field="f")


def _dies_in_a_child(piece: Piece) -> str:
    if multiprocessing.parent_process() is not None:
        os._exit(3)  # as a child of a script without a main guard does
    return piece.path


def test_a_broken_process_pool_falls_back_to_this_process(caplog):
    pieces = [Piece(f"p{i}", i) for i in range(3)]
    found = list(in_order(_dies_in_a_child, pieces, jobs=2, total_bytes=-1))
    assert found == ["p0", "p1", "p2"]
    assert "checking them in this one" in caplog.text


def test_a_script_without_a_main_guard_is_checked_in_its_own_process(tmp_path: Path):
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import multiprocessing\n"
        "from psctl.coordinator.data.files import Piece, in_order\n"
        "def where(piece):\n"
        "    return piece.path, multiprocessing.parent_process() is None\n"
        "pieces = [Piece('a', 0), Piece('b', 1)]\n"
        "print(list(in_order(where, pieces, jobs=2, total_bytes=-1)))\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=30, env=child_env()
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[('a', True), ('b', True)]"


@pytest.mark.parametrize("gzipped", [False, True])
@pytest.mark.parametrize(
    ("cells", "column"), [({5: "-"}, "I5"), ({13: "-"}, "I13"), ({14: "-a"}, "C1")]
)
def test_the_quick_line_pattern_refuses_what_the_full_one_does(
    tmp_path: Path, gzipped: bool, cells: dict[int, str], column: str
):
    good = tsv_line(0, -12).split("\t")
    bad = list(good)
    for index, cell in cells.items():
        bad[index] = cell
    body = "".join(f"{line}\n" for line in ["\t".join(good)] * 3 + ["\t".join(bad)])
    path = tmp_path / ("q.tsv.gz" if gzipped else "q.tsv")
    path.write_bytes(gzip.compress(body.encode()) if gzipped else body.encode())
    with pytest.raises(ConfigError) as err:
        checks.scan_criteo(str(path), field="f")
    shown = cells[next(iter(cells))]
    assert f"{path} line 4, column {column}: {shown!r} is not " in str(err.value)
