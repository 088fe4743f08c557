"""`psctl export --requests`'s loop (what the publisher talks to): every request line gets
one answer line, and a request it cannot read is answered ``error: ...`` while the next one
is served (it used to end the helper with a traceback)."""

from __future__ import annotations

from dataclasses import dataclass

from psctl.cluster.errors import ConfigError
from psctl.coordinator.launch.serving import serve_requests


@dataclass
class Exported:
    checkpoint: str
    path: str


class FakeExporter:
    job = None

    def __init__(self) -> None:
        self.asked: list[str] = []

    def export(self, prefix: str, out: str) -> Exported:
        self.asked.append(prefix)
        if "missing" in prefix:
            raise ConfigError("checkpoint", f"{prefix} does not exist", "give a ckpt-N prefix")
        return Exported(prefix, f"{out}/{prefix.rsplit('-', 1)[-1]}")


def test_each_request_gets_one_answer_and_bad_ones_an_error(capsys):
    exporter = FakeExporter()
    lines = [
        "/ckpt/ckpt-10\n",
        "{not json\n",
        '{"score": ["/ckpt/ckpt-10"]}\n',
        '{"score": "/ckpt/ckpt-10", "eval_data": "e", "metric": "auc"}\n',
        "/ckpt/missing-3\n",
        "/ckpt/ckpt-20\n",
    ]
    serve_requests(lines, exporter, settings=None, out="/out")
    answers = capsys.readouterr().out.splitlines()
    assert len(answers) == len(lines), answers
    assert answers[0] == "exported /ckpt/ckpt-10 to /out/10"
    assert answers[1].startswith("error: request: is not JSON (")
    assert answers[2] == (
        "error: request: has no eval_data, metric; give score, eval_data and metric"
    )
    assert answers[3].startswith("error: request score: is not a list of checkpoint prefixes")
    assert answers[4].startswith("error: checkpoint: /ckpt/missing-3 does not exist")
    assert answers[5] == "exported /ckpt/ckpt-20 to /out/20"
    assert exporter.asked == ["/ckpt/ckpt-10", "/ckpt/missing-3", "/ckpt/ckpt-20"]
