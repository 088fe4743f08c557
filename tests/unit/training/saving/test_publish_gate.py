"""--export-if-better: the verdict, the kept checkpoints, and the publisher holding back a
version that scores worse than the one in serving (the export process faked: it scores and
exports as told)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from psctl.cluster.errors import ConfigError
from psctl.coordinator.operations.job_state import JobControl
from psctl.coordinator.settings import TrainSettings, resolve_settings
from psctl.coordinator.training.saving.checkpoint_files import Found
from psctl.coordinator.training.saving.publish_gate import (
    PINNED,
    Verdict,
    check_metric,
    lower_is_better,
)
from psctl.coordinator.training.saving.publishing import VersionPublisher

pytestmark = pytest.mark.timeout(60)


def test_lower_is_better_for_losses_and_errors_only():
    assert lower_is_better("loss") and lower_is_better("binary_crossentropy")
    assert lower_is_better("mean_squared_error") and lower_is_better("mse")
    assert not lower_is_better("auc") and not lower_is_better("accuracy")


@pytest.mark.parametrize(
    ("metric", "score", "serving", "publish"),
    [
        ("auc", 0.71, 0.70, True),
        ("auc", 0.70, 0.70, True),  # not worse is enough
        ("auc", 0.69, 0.70, False),
        ("loss", 0.40, 0.41, True),
        ("loss", 0.42, 0.41, False),
        ("auc", float("nan"), 0.70, False),  # a model that scores NaN never goes out
        ("auc", 0.5, None, True),  # nothing to compare with
        ("auc", None, None, True),  # the first version, no held-out file yet
    ],
)
def test_the_verdict(metric, score, serving, publish):
    verdict = Verdict(metric, 200, score, 100 if serving is not None else 0, serving, 3)
    assert verdict.publish is publish
    assert verdict.line.startswith(f"version 200 {'published' if publish else 'held back'}: ")


def test_an_unknown_metric_is_refused_before_training():
    class Metric:
        name = "auc"

    check_metric("auc", [Metric])
    check_metric("loss", [Metric])
    with pytest.raises(ConfigError, match=r"--export-if-better: .*no metric 'aucc'.*loss, auc"):
        check_metric("aucc", [Metric])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"export_if_better": "auc", "eval_data": "e/*"}, "has no --export-every"),
        (
            {"export_if_better": "auc", "export_every": "30s", "export_dir": "x"},
            "has no --eval-data",
        ),
        (
            {"export_if_better": "a b", "export_every": "30s", "export_dir": "x", "eval_data": "e"},
            "is not a metric name",
        ),
    ],
)
def test_gate_settings_are_refused_in_one_line(flags, message):
    with pytest.raises(ConfigError, match=f"--export-if-better: .*{message}"):
        resolve_settings(flags=flags, config_file=None, environ={})


class FakeExporter:
    """The export process: scores from a table (by step), exports by making the version's
    directory."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.scores: dict[int, float] = {}
        self.asked: list[list[str]] = []

    def score(self, checkpoints: list[str], files: list[str]) -> dict[str, float]:
        self.asked.append(checkpoints)
        assert files and all(f.endswith("part-0") for f in files)
        return {p: self.scores[int(p.rsplit("-", 1)[1])] for p in checkpoints}

    def export(self, checkpoint: str) -> None:
        assert os.path.exists(checkpoint + ".index"), checkpoint  # the kept copy is readable
        (self.base / checkpoint.rsplit("-", 1)[1]).mkdir(parents=True)

    def close(self) -> None:
        pass


class NoSave:
    def save(self) -> None:
        pass


def _publisher(
    settings: TrainSettings, checkpointer: object, exported: Path
) -> tuple[VersionPublisher, JobControl, FakeExporter]:
    """A publisher over a real JobControl, its export process faked."""
    control = JobControl(
        job="j", target_steps=10, steps_per_execution=1, tasks=[], can_checkpoint=True
    )
    publisher = VersionPublisher(
        settings=settings, checkpointer=checkpointer, control=control, metrics=None,  # type: ignore[arg-type]
        train_data=lambda: "",
    )  # fmt: skip
    fake = FakeExporter(exported)
    publisher.exporter = fake  # type: ignore[assignment]
    return publisher, control, fake


def _checkpoint(directory: Path, step: int) -> None:
    for suffix in (".index", ".data-00000-of-00001"):
        (directory / f"ckpt-{step}{suffix}").write_text(f"{step}")


def _kept(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory / PINNED) if n.endswith(".index"))


def test_a_worse_version_is_held_back_and_a_better_one_published(tmp_path):
    ckpt, exported, held_out = tmp_path / "ckpt", tmp_path / "exp", tmp_path / "eval" / "d=1"
    ckpt.mkdir()
    held_out.mkdir(parents=True)
    (held_out / "part-0").write_text("x")
    (held_out / "_SUCCESS").write_text("")
    settings = TrainSettings.of(
        checkpoint_dir=str(ckpt), export_every=60.0, export_dir=str(exported),
        eval_data=str(tmp_path / "eval" / "*" / "part-*"), export_if_better="auc",
    )  # fmt: skip
    publisher, control, fake = _publisher(settings, NoSave(), exported)
    fake.scores = {100: 0.70, 200: 0.69, 300: 0.72}

    _checkpoint(ckpt, 100)
    assert publisher.publish() == 100  # nothing serves: scored alone, published
    assert fake.asked == [[str(ckpt / PINNED / "ckpt-100")]]
    assert _kept(ckpt) == ["ckpt-100.index"]

    _checkpoint(ckpt, 200)
    assert publisher.publish() is None  # 0.69 < serving's 0.70
    assert fake.asked[-1] == [str(ckpt / PINNED / "ckpt-200"), str(ckpt / PINNED / "ckpt-100")]
    decision = control.view().board.publish_decision
    assert decision.startswith("version 200 held back: auc 0.6900 against serving version 100")
    assert sorted(os.listdir(exported)) == ["100"] and _kept(ckpt) == ["ckpt-100.index"]
    assert publisher.publish() is None and len(fake.asked) == 2  # judged once

    for name in os.listdir(ckpt):  # the trainer rotates 100 away: the kept one still scores
        if name.startswith("ckpt-100."):
            os.remove(ckpt / name)
    _checkpoint(ckpt, 300)
    assert publisher.publish() == 300
    assert control.view().board.publish_decision.startswith("version 300 published: auc 0.7200")
    assert sorted(os.listdir(exported)) == ["100", "300"] and _kept(ckpt) == ["ckpt-300.index"]
    assert control.view().board.published_version == 300


def test_a_checkpoint_rotated_away_before_it_is_kept_is_skipped(tmp_path):
    """The trainer's rotation may remove a checkpoint between the listing and the links: the
    publisher logs it and judges the next one; its thread does not die."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    settings = TrainSettings.of(
        checkpoint_dir=str(ckpt), export_every=60.0, export_dir=str(tmp_path / "exp"),
        eval_data=str(tmp_path / "eval" / "*"), export_if_better="loss",
    )  # fmt: skip
    publisher, _, _ = _publisher(settings, NoSave(), tmp_path / "exp")
    gone = Found(100, str(ckpt / "ckpt-100"), ("ckpt-100.index",))
    assert publisher._publish_if_better(gone) is None
    assert not os.listdir(ckpt / PINNED)


class FailsOnce:
    """A checkpointer whose first save fails (a ps lost in the middle, a full disk)."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.saves = directory, 0

    def save(self) -> None:
        self.saves += 1
        if self.saves == 1:
            raise OSError("No space left on device")
        _checkpoint(self.directory, 100 * self.saves)


def test_a_failed_turn_does_not_stop_the_cadence(tmp_path):
    """An error in one turn is logged; the publishing thread goes on with the next."""
    ckpt, exported = tmp_path / "ckpt", tmp_path / "exp"
    ckpt.mkdir()
    settings = TrainSettings.of(
        checkpoint_dir=str(ckpt), export_every=0.05, export_dir=str(exported)
    )
    publisher, control, _ = _publisher(settings, FailsOnce(ckpt), exported)
    publisher.start()
    deadline = time.monotonic() + 20
    while control.view().board.published_version == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    publisher.finish()
    assert control.view().board.published_version >= 200  # after the failed first turn
