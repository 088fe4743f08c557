"""``--strategy sync``'s pure logic: the failure it adds, the settings it refuses, the
cluster it reads, how it tells a lost peer, how it honours AutoShardPolicy.DATA, and the
units `psctl deploy render --strategy sync` writes."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from psctl.cluster.errors import ConfigError
from psctl.cluster.ports import HealthAddresses
from psctl.cluster.spec import SYNC_REQUIRED, load_cluster_file
from psctl.coordinator.failures import (
    EXIT_RESTART,
    JOIN_DEADLINE,
    Decision,
    Failure,
    FailurePolicy,
    PeerLost,
    Scope,
    classify,
    classify_exit,
    exit_status,
    unstaged,
)
from psctl.coordinator.launch.sync import resolve_sync_cluster, sync_tasks, workers_only
from psctl.coordinator.settings import resolve_settings
from tests.fakes import FakeOpError

WORKERS = {"worker": ["127.0.0.1:2001", "127.0.0.1:2002"]}


def write(path: Path, body: dict) -> str:
    path.write_text(json.dumps(body))
    return str(path)


def test_peer_lost_restarts_the_process_in_every_scope():
    policy = FailurePolicy()
    assert classify(PeerLost("all-reduce failed")) is Failure.PEER_LOST
    for scope in Scope:
        assert policy.decide(Failure.PEER_LOST, scope=scope) is Decision.RESTART
    assert exit_status(Decision.RESTART) == EXIT_RESTART


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        ({"update_mode": "local"}, "--update-mode"),
        ({"max_shards": "4"}, "--max-shards"),
    ],
)
def test_sync_refuses_settings_of_the_ps_mode(flags, field):
    with pytest.raises(ConfigError) as info:
        resolve_settings(flags={"strategy": "sync", **flags}, config_file=None, environ={})
    assert field in str(info.value) and "strategy sync" in str(info.value)
    # The same settings are fine in the default mode.
    assert resolve_settings(flags=flags, config_file=None, environ={}).strategy == "async"


def test_sync_takes_eval_every():
    settings = resolve_settings(
        flags={"strategy": "sync", "eval_every": "100"}, config_file=None, environ={}
    )
    assert settings.evaluation.eval_every == 100


def test_a_cluster_without_ps_is_read_only_for_sync(tmp_path):
    path = write(tmp_path / "c.json", {"cluster": WORKERS})
    with pytest.raises(ConfigError, match="ps"):
        load_cluster_file(path)
    assert load_cluster_file(path, required=SYNC_REQUIRED).num_workers == 2


def test_cluster_file_needs_the_task_index(tmp_path):
    path = write(tmp_path / "c.json", {"cluster": {**WORKERS, "ps": ["127.0.0.1:2003"]}})
    with pytest.raises(ConfigError, match="--task-index"):
        resolve_sync_cluster(path, None)
    cluster, index, source = resolve_sync_cluster(path, 1)
    assert (index, source, cluster.num_ps) == (1, path, 1)
    assert workers_only(cluster).num_ps == 0
    with pytest.raises(ConfigError, match="give 0 to 1"):
        resolve_sync_cluster(path, 2)


def test_tf_config_must_name_a_worker(monkeypatch):
    config = {"cluster": WORKERS, "task": {"type": "worker", "index": 1}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    cluster, index, source = resolve_sync_cluster(None, None)
    assert (index, source, cluster.num_workers) == (1, "TF_CONFIG", 2)
    assert resolve_sync_cluster(None, 0)[1] == 0  # --task-index overrides
    chief = {
        "cluster": {**WORKERS, "chief": ["127.0.0.1:2000"]},
        "task": {"type": "chief", "index": 0},
    }
    monkeypatch.setenv("TF_CONFIG", json.dumps(chief))
    with pytest.raises(ConfigError, match=r"task\.type"):
        resolve_sync_cluster(None, None)


def test_peer_lost_tells_a_lost_peer_from_the_jobs_own_errors():
    from psctl.coordinator.training.sync import peer_lost

    assert peer_lost(FakeOpError(14, "Collective ops is aborted by: connection refused"))
    assert peer_lost(FakeOpError(4, "Collective ops timed out"))
    assert peer_lost(FakeOpError(9, "Peer /job:worker/task:1 restarted: incarnation differs"))
    assert not peer_lost(FakeOpError(9, "the job's own failed precondition"))
    assert not peer_lost(FakeOpError(3, "Incompatible shapes"))
    assert not peer_lost(ValueError("not an op error"))


def test_auto_shard_policy_data_shards_the_batches():
    import tensorflow as tf

    from psctl.coordinator.training.steps.programs import shard_for
    from psctl.coordinator.training.sync import count_batches

    batches = tf.data.Dataset.range(10).batch(2)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = batches.with_options(options)
    mine = [b.numpy().tolist() for b in shard_for(data, 1, 2)]
    assert mine == [[2, 3], [6, 7]]
    assert count_batches(shard_for(data, 0, 2)) == 3
    # The parameter-server mode's per-worker function has the worker's index as a tensor.
    by_tensor = [b.numpy().tolist() for b in shard_for(data, tf.constant(1, tf.int64), 2)]
    assert by_tensor == mine

    # ... and there the dataset is made while a function is traced: options() read in graph
    # mode still sees the policy (and TensorFlow's warning about it is not shown).
    def traced(index: tf.Tensor) -> tf.Tensor:
        made = tf.data.Dataset.range(10).batch(2).with_options(options)
        return shard_for(made, index, 2).reduce(
            tf.constant(0, tf.int64), lambda a, b: a + tf.reduce_sum(b)
        )

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        total = tf.function(traced, autograph=False)(tf.constant(1, tf.int64))
    assert int(total) == 2 + 3 + 6 + 7
    # Without the policy the job shards itself: the dataset is left as it is.
    assert count_batches(shard_for(batches, 1, 2)) == 5
    assert count_batches(batches.filter(lambda b: tf.reduce_sum(b) > 4)) == 4  # counted


def test_deploy_render_sync_writes_a_training_unit_per_worker_host(tmp_path):
    from psctl.coordinator.deploy.plan import SYNC_UNIT
    from psctl.coordinator.deploy.render import render_sync

    cluster = {"ps": ["10.0.0.1:2222"], "worker": ["10.0.0.2:2222", "10.0.0.3:2222"]}
    path = write(tmp_path / "c.json", {"cluster": cluster})
    out = tmp_path / "out"
    hosts = render_sync(
        cluster_file=path,
        out=out,
        bin_dir="/opt/psctl/venv/bin",
        keys=None,
        config_dir="/etc/psctl",
        force=False,
    )
    assert hosts == [("10.0.0.2", [0]), ("10.0.0.3", [1])]
    assert not (out / "10.0.0.1").exists()  # the ps host runs nothing
    files = sorted(p.name for p in (out / "10.0.0.3").iterdir())
    assert files == sorted(
        ["README.md", "cluster.json", "psctl.env", "sync.env", SYNC_UNIT, "psctl.target"]
    )
    unit = (out / "10.0.0.3" / SYNC_UNIT).read_text()
    assert "psctl train --strategy sync --cluster ${PSCTL_CLUSTER} --task-index %i" in unit
    assert "worker-server" not in unit
    assert "systemctl start psctl-sync@1.service" in (out / "10.0.0.3" / "README.md").read_text()
    assert "chief" in (out / "10.0.0.2" / "README.md").read_text()


def test_every_strategy_has_its_launchers_in_the_one_dispatch_table():
    from psctl.coordinator.launch.strategy import LAUNCHERS
    from psctl.coordinator.settings import STRATEGIES

    assert sorted(LAUNCHERS) == sorted(STRATEGIES)


def test_status_lists_sync_workers_at_the_cluster_files_health_addresses(tmp_path):
    """The cluster file's "health" section and this worker's own --health-port and
    --worker-metrics-port: status showed every worker UNREACHABLE at TF port + 1000 while
    `psctl health` found them SERVING where the file said."""
    path = tmp_path / "cluster.json"
    health = {"worker": ["127.0.0.1:7120", "127.0.0.1:7121"]}
    path.write_text(json.dumps({"cluster": WORKERS, "health": health}))
    cluster = workers_only(load_cluster_file(path, required=SYNC_REQUIRED))
    tasks = sync_tasks(
        cluster,
        1,
        chief_metrics_port=9940,
        health=HealthAddresses.of_file(str(path)),
        own_health_port=7221,
        own_metrics_port=7321,
    )
    assert [t.health_address for t in tasks] == ["127.0.0.1:7120", "127.0.0.1:7221"]
    assert [t.metrics_url for t in tasks] == [
        "http://127.0.0.1:9940/metrics",
        "http://127.0.0.1:7321/metrics",
    ]
    # Without a section: TF port + 1000, as the servers' default.
    plain = sync_tasks(
        cluster,
        0,
        chief_metrics_port=0,
        health=HealthAddresses(),
        own_health_port=0,
        own_metrics_port=0,
    )
    assert [t.health_address for t in plain] == ["", "127.0.0.1:3002"]
    assert plain[0].metrics_url == ""


def test_a_training_process_ended_by_the_join_deadline_is_unreachable():
    """Sync mode: the signal that ends a worker whose group did not form within
    --connect-timeout is exit 69's failure, never restarted."""
    assert classify_exit(-JOIN_DEADLINE) is Failure.UNREACHABLE
    decision = FailurePolicy().decide(Failure.UNREACHABLE, scope=Scope.PROCESS)
    assert exit_status(decision) == 69


def test_a_config_error_raised_in_a_traced_function_is_itself():
    """Autograph re-raises an exception whose constructor takes more than a message as a
    StagingError, the original in its __context__: it is still a configuration error."""
    import tensorflow as tf

    def dataset() -> object:
        raise ConfigError("--eval-data", "1 examples for 2 workers", "give more")

    @tf.function
    def traced() -> object:
        dataset()
        return tf.constant(1)

    with pytest.raises(Exception) as caught:
        traced()
    assert type(caught.value).__name__ == "StagingError"
    assert isinstance(unstaged(caught.value), ConfigError)
    assert classify(caught.value) is Failure.CONFIG_ERROR
