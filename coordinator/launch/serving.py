"""`psctl export`'s process: resolve the settings and the checkpoint, then export."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterable
from typing import Any

from psctl.cluster.errors import ConfigError
from psctl.coordinator.settings import resolve_settings

log = logging.getLogger("psctl.export")


def export_main(args: argparse.Namespace, flags: dict[str, Any]) -> int:
    settings = resolve_settings(flags=flags, config_file=args.config)
    if not settings.checkpoints.checkpoint_dir and not args.checkpoint and not args.requests:
        raise ConfigError(
            "--checkpoint-dir", "is required", "give the training run's checkpoint directory"
        )
    from psctl.coordinator.job import load_job
    from psctl.coordinator.training.saving.saved_model import READY, Exporter

    exporter = Exporter(load_job(settings.job), settings)
    if not args.requests:
        target = exporter.export(args.checkpoint, args.out)
        print(f"exported {target.checkpoint} to {target.path}", flush=True)
        return 0
    print(READY, flush=True)
    serve_requests(sys.stdin, exporter, settings, args.out)
    return 0


def serve_requests(lines: Iterable[str], exporter: Any, settings: Any, out: str) -> None:
    """``--requests``: one answer line per request line, until ``lines`` ends (the publisher
    closes it). A request it cannot read or serve is answered ``error: ...``; the next one
    is served as usual."""
    from psctl.coordinator.training.evaluation.sidecar_eval import SidecarEvaluator
    from psctl.coordinator.training.saving.saved_model import SCORED

    scorer: SidecarEvaluator | None = None  # built at the first scoring request
    for line in lines:
        request = line.strip()
        try:
            if request.startswith("{"):  # {"score": [prefix...], "eval_data": ..., "metric": ...}
                asked = _score_request(request)
                data = asked["eval_data"]
                if scorer is None:
                    scorer = SidecarEvaluator(exporter.job, settings.replace(eval_data=data))
                scores = {p: scorer.score(p, data, asked["metric"]) for p in asked["score"]}
                print(SCORED + json.dumps(scores), flush=True)
                continue
            target = exporter.export(request, out)
        except ConfigError as err:
            print(f"error: {err}", flush=True)
            continue
        print(f"exported {target.checkpoint} to {target.path}", flush=True)


def _score_request(request: str) -> dict[str, Any]:
    """A scoring request's JSON, checked: a ConfigError naming what is wrong."""
    try:
        asked = json.loads(request)
    except ValueError as err:
        raise ConfigError(
            "request", f"is not JSON ({err})", "send one JSON object a line"
        ) from None
    missing = [key for key in ("score", "eval_data", "metric") if key not in asked]
    if missing:
        raise ConfigError(
            "request", f"has no {', '.join(missing)}", "give score, eval_data and metric"
        )
    if not isinstance(asked["score"], list) or not all(isinstance(p, str) for p in asked["score"]):
        raise ConfigError("request score", "is not a list of checkpoint prefixes", "give a list")
    return asked
