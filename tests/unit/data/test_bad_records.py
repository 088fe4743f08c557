"""Large inputs checked on the workers (coordinator/data/bad_records.py,
criteo.checked_lines): the workers' RE2 pattern accepts exactly the lines the coordinator's
full check accepts; a large input is checked only in its first lines; a reader's assertion
becomes one line naming the file and line."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import tensorflow as tf
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from psctl.cluster.errors import ConfigError
from psctl.coordinator.data import bad_records, checks, criteo
from psctl.coordinator.failures import Failure, classify

pytestmark = pytest.mark.timeout(120)

GOOD = "\t".join(["1", *map(str, range(13)), *(f"{i:x}" for i in range(26))])

cells = st.one_of(
    st.sampled_from(["", "0", "1", "-", "-7", "12", "ab", "AbC9", "x", " ", "1.5", "-0", "2"]),
    st.from_regex(r"-?[0-9]{17,20}", fullmatch=True),
    st.from_regex(r"[0-9a-fA-F]{15,18}", fullmatch=True),
    st.text(alphabet="0123456789abcdefxX-\r ", max_size=4),
)
lines = st.lists(cells, min_size=1, max_size=42).map("\t".join)


def python_accepts(line: bytes) -> bool:
    """The coordinator's full check (coordinator/data/checks.py) of one line."""
    quick = checks._QUICK_LINE.fullmatch(line) is not None and checks._LONE_MINUS not in line
    return quick or checks._trimmed(line)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(lines, min_size=1, max_size=20))
def test_the_workers_pattern_accepts_what_the_full_check_does(batch: list[str]) -> None:
    raw = [line.encode() for line in batch]
    found = tf.strings.regex_full_match(tf.constant(raw), checks.CRITEO_LINE_RE2).numpy()
    expected = [python_accepts(line) for line in raw]
    event(f"{sum(expected)} of {len(expected)} good")
    assert list(found) == expected


def test_the_pattern_takes_good_trimmed_and_refuses_bad_lines() -> None:
    cells = GOOD.split("\t")
    good = [GOOD, "\t".join(cells[:38]), "0", "1\t\t5", "\t".join(cells[:14])]
    bad = ["2" + GOOD[1:], "\t".join([*cells, "ab"]), "1\t-", "\t".join([*cells[:20], "zz"])]
    found = tf.strings.regex_full_match(tf.constant(good + bad), checks.CRITEO_LINE_RE2)
    assert list(found.numpy()) == [True] * len(good) + [False] * len(bad)


def write_lines(path: Path, count: int, bad_at: int = 0) -> None:
    with path.open("w") as out:
        for number in range(1, count + 1):
            out.write(("1\t3\tx7" if number == bad_at else GOOD) + "\n")


def test_a_large_input_is_checked_in_its_first_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "big.tsv"
    lines = 2 * checks.HEAD_BYTES // len(GOOD) + 100
    write_lines(path, lines, bad_at=lines - 3)  # past the first HEAD_BYTES
    with pytest.raises(ConfigError, match=rf"big\.tsv line {lines - 3}, column I2"):
        checks.scan_criteo(str(path), field="--train-data")  # every line
    head = checks.scan_criteo(str(path), field="--train-data", full_below=1000)
    assert not head.complete and head.field == "--train-data"
    assert 0 < head.num_records < lines / 2 and head.total_bytes == path.stat().st_size
    write_lines(path, lines)
    assert checks.scan_criteo(str(path), field="f", full_below=1 << 30).complete
    write_lines(path, lines, bad_at=10)  # within the first lines: refused at once
    with pytest.raises(ConfigError, match=r"big\.tsv line 10, column I2"):
        checks.scan_criteo(str(path), field="--train-data", full_below=1000)


def test_a_gzipped_large_input_is_checked_in_its_first_lines(tmp_path: Path) -> None:
    path = tmp_path / "big.tsv.gz"
    body = "".join(f"{GOOD}\n" for _ in range(checks.HEAD_LINES + 5)) + "1\tzz\n"
    path.write_bytes(gzip.compress(body.encode()))
    head = checks.scan_criteo(str(path), field="f", full_below=10)
    assert not head.complete and head.num_records == checks.HEAD_LINES


def test_the_readers_assertion_becomes_one_line_naming_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "d.tsv"
    write_lines(path, 30, bad_at=17)
    lines = tf.constant([GOOD, "1\t3\tx7"])
    paths = tf.constant([str(path)] * 2)
    numbers = tf.constant([16, 17], tf.int64)

    @tf.function
    def check(skip: bool) -> tf.Tensor:
        return criteo.checked_lines(paths, numbers, lines, field="--train-data", skip=skip)

    assert check(True).numpy().tolist() == [GOOD.encode()]  # skipped
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        check(False)
    err = raised.value
    assert bad_records.found_in(err) == bad_records.BadRecord(
        "--train-data", "criteo", str(path), 17
    )
    assert classify(err) is Failure.CONFIG_ERROR
    config = bad_records.as_config_error(err)
    assert config is not None and config.field == "--train-data"
    assert config.problem.startswith(f"{path} line 17, column I2: 'x7' is not an integer")
    assert "--bad-records skip" in config.fix
    assert bad_records.as_config_error(ValueError("other")) is None
