"""Connecting to the cluster: ParameterServerStrategy and its ClusterCoordinator."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from psctl.cluster.spec import ClusterConfig
from psctl.coordinator.settings import TrainSettings


def cluster_resolver(cluster: ClusterConfig) -> Any:
    """The coordinator's view of the cluster: task type ``chief`` (TensorFlow requires it)."""
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster.as_dict()), task_type="chief", task_id=0, rpc_layer="grpc"
    )


def connect(cluster: ClusterConfig, settings: TrainSettings) -> tuple[Any, Any]:
    """(strategy, ClusterCoordinator) for ``cluster``; variables larger than
    ``--min-shard-bytes`` are split over up to ``--max-shards`` ps tasks."""
    partitioner = None
    if settings.max_shards > 1:
        partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=settings.min_shard_bytes, max_shards=settings.max_shards
        )
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        cluster_resolver(cluster), variable_partitioner=partitioner
    )
    return strategy, tf.distribute.coordinator.ClusterCoordinator(strategy)
