"""`psctl export`'s process: resolve the settings and the checkpoint, then export."""

from __future__ import annotations

import argparse
import json
import logging
import sys
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
    from psctl.coordinator.training.evaluation.sidecar_eval import SidecarEvaluator
    from psctl.coordinator.training.saving.saved_model import READY, SCORED, Exporter

    exporter = Exporter(load_job(settings.job), settings)
    if not args.requests:
        target = exporter.export(args.checkpoint, args.out)
        print(f"exported {target.checkpoint} to {target.path}", flush=True)
        return 0
    print(READY, flush=True)
    scorer: SidecarEvaluator | None = None  # built at the first scoring request
    for line in sys.stdin:  # until the publisher closes it
        request = line.strip()
        try:
            if request.startswith("{"):  # {"score": [prefix...], "eval_data": ..., "metric": ...}
                asked = json.loads(request)
                data = asked["eval_data"]
                if scorer is None:
                    scorer = SidecarEvaluator(exporter.job, settings.replace(eval_data=data))
                scores = {p: scorer.score(p, data, asked["metric"]) for p in asked["score"]}
                print(SCORED + json.dumps(scores), flush=True)
                continue
            target = exporter.export(request, args.out)
        except ConfigError as err:
            print(f"error: {err}", flush=True)
            continue
        print(f"exported {target.checkpoint} to {target.path}", flush=True)
    return 0
