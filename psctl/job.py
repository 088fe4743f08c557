"""The public job API: what a job module imports.

    from psctl.job import DataContext           # what dataset_fn(ctx) is given
    from psctl.job import data                  # CSV/TFRecord readers for --train-data

Everything else under ``psctl`` is internal and may move between releases.
"""

from psctl.coordinator import data
from psctl.coordinator.job import DataContext

__all__ = ["DataContext", "data"]
