"""The public job API: what a job module imports.

    from psctl.job import DataContext           # what dataset_fn(ctx) is given
    from psctl.job import data                  # CSV/TFRecord readers for --train-data
    from psctl.job import FeatureEmbedding      # hashed, pooled, shared embedding tables

Everything else under ``psctl`` is internal and may move between releases.
"""

from psctl.coordinator import data
from psctl.coordinator.job import DataContext
from psctl.coordinator.layers import FeatureEmbedding

__all__ = ["DataContext", "FeatureEmbedding", "data"]
