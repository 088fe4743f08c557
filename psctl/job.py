"""The public job API: everything a job module imports from psctl.

    from psctl.job import DataContext           # what dataset_fn(ctx) is given
    from psctl.job import data                  # CSV/TFRecord readers for --train-data
    from psctl.job import criteo                # the Criteo TSV reader (the ctr job's)
    from psctl.job import FeatureEmbedding      # hashed, pooled, shared embedding tables
    from psctl.job import DynamicEmbedding      # tables keyed by raw ids, grow and evict
    from psctl.job import ConfigError           # a one-line error naming a setting (exit 78)

Everything else under ``psctl`` is internal and may move between releases (tools that
measure the training loop have ``psctl.hooks``).
"""

from psctl.cluster.errors import ConfigError
from psctl.coordinator.data import criteo
from psctl.coordinator.data import readers as data
from psctl.coordinator.data.context import DataContext
from psctl.coordinator.embeddings.dynamic import DynamicEmbedding
from psctl.coordinator.embeddings.layers import FeatureEmbedding

__all__ = ["ConfigError", "DataContext", "DynamicEmbedding", "FeatureEmbedding", "criteo", "data"]
