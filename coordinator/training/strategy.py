"""Connecting to the cluster: ParameterServerStrategy and its ClusterCoordinator."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from psctl.cluster.spec import ClusterConfig
from psctl.coordinator.embeddings.sharded import partitioner
from psctl.coordinator.settings import TrainSettings


def cluster_resolver(cluster: ClusterConfig) -> Any:
    """The coordinator's view of the cluster: task type ``chief`` (TensorFlow requires it)."""
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster.as_dict()), task_type="chief", task_id=0, rpc_layer="grpc"
    )


def connect(cluster: ClusterConfig, settings: TrainSettings) -> tuple[Any, Any]:
    """(strategy, ClusterCoordinator) for ``cluster``; with ``--max-shards`` above 1,
    embedding tables of at least ``--min-shard-bytes`` are split over the ps tasks
    (embeddings/sharded.py)."""
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        cluster_resolver(cluster), variable_partitioner=partitioner(settings)
    )
    return strategy, tf.distribute.coordinator.ClusterCoordinator(strategy)
