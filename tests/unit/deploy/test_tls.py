"""The TLS transport's keys and tunnel.conf (coordinator/deploy/tls.py): what `psctl deploy
keys` (its default transport) and `psctl deploy render --keys` write, and what the tunnel
refuses to read. The running transport is tests/integration/security/test_tls_transport.py."""

from __future__ import annotations

import json
import socket
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from psctl.cluster.errors import EXIT_CONFIG, ConfigError
from psctl.coordinator.cli import main as cli
from psctl.coordinator.deploy.check import grpc_answers
from psctl.coordinator.deploy.render import render
from psctl.coordinator.deploy.tls import (
    is_tls_conf,
    make_psks,
    psk,
    read_tls_conf,
    tf_addresses,
    tls_conf,
)
from psctl.coordinator.deploy.tunnel import Keys

CLUSTER = {
    "cluster": {
        "chief": ["10.0.0.1:2222"],
        "ps": ["10.0.0.2:2222", "10.0.0.3:2222"],
        "worker": ["10.0.0.3:2223", "10.0.0.4:2222"],
    }
}


def keys_argv(tmp_path: Path, *extra: str) -> list[str]:
    cluster = tmp_path / "c.json"
    if not cluster.exists():
        cluster.write_text(json.dumps(CLUSTER))
    return ["deploy", "keys", "--cluster", str(cluster), "--out", str(tmp_path / "k"), *extra]


def test_deploy_keys_makes_a_secret_key_per_host_keeps_them_and_rotates_them(tmp_path, capsys):
    assert cli.run_command(cli.build_parser().parse_args(keys_argv(tmp_path))) == 0
    assert "keys for 4 hosts in" in capsys.readouterr().out
    made = sorted(p.name for p in (tmp_path / "k").iterdir())
    assert made == [f"10.0.0.{n}.psk" for n in range(1, 5)], made
    for path in (tmp_path / "k").iterdir():
        assert path.stat().st_mode & 0o777 == 0o600, path
    first = {h: psk(tmp_path / "k", h) for h in ("10.0.0.1", "10.0.0.2")}
    assert first["10.0.0.1"] != first["10.0.0.2"] and len(first["10.0.0.1"]) == 64
    assert cli.run_command(cli.build_parser().parse_args(keys_argv(tmp_path))) == 0
    assert "0 new, 4 kept" in capsys.readouterr().out
    assert psk(tmp_path / "k", "10.0.0.1") == first["10.0.0.1"]
    assert cli.run_command(cli.build_parser().parse_args(keys_argv(tmp_path, "--rotate"))) == 0
    assert psk(tmp_path / "k", "10.0.0.1") != first["10.0.0.1"]
    # The other transport's keys are not written into the same directory.
    argv = keys_argv(tmp_path, "--transport", "wireguard")
    assert cli.run_command(cli.build_parser().parse_args(argv)) == EXIT_CONFIG
    assert "--transport: " in capsys.readouterr().err
    assert not list((tmp_path / "k").glob("*.key"))


def test_render_writes_each_hosts_tls_conf_with_its_key_and_its_peers(tmp_path: Path):
    (tmp_path / "c.json").write_text(json.dumps(CLUSTER))
    hosts = [f"10.0.0.{n}" for n in range(1, 5)]
    make_psks(hosts, tmp_path / "k")
    render(
        cluster_file=str(tmp_path / "c.json"),
        out=tmp_path / "out",
        bin_dir="/opt/psctl/venv/bin",
        keys=Keys(tmp_path / "k"),
    )
    conf = tmp_path / "out" / "10.0.0.3" / "tunnel.conf"
    assert conf.stat().st_mode & 0o777 == 0o600
    assert is_tls_conf(conf.read_text())
    read = read_tls_conf(conf)
    assert read.address == "10.0.0.3" and read.key == psk(tmp_path / "k", "10.0.0.3")
    assert read.peers == {h: psk(tmp_path / "k", h) for h in hosts if h != "10.0.0.3"}
    # What goes over TLS: every task's address in the cluster file, each worker's tf.data
    # service worker (TF port + 3000) and the dispatcher the file names.
    with_data = {**CLUSTER, "data_service": {"dispatcher": "10.0.0.1:5050"}}
    (tmp_path / "c.json").write_text(json.dumps(with_data))
    assert tf_addresses(str(tmp_path / "c.json")) == {
        ("10.0.0.1", 2222), ("10.0.0.2", 2222), ("10.0.0.3", 2222), ("10.0.0.3", 2223),
        ("10.0.0.4", 2222), ("10.0.0.3", 5223), ("10.0.0.4", 5222), ("10.0.0.1", 5050),
    }  # fmt: skip


def test_a_tls_conf_is_refused_when_others_may_read_it_or_it_lacks_the_hosts_key(tmp_path):
    make_psks(["10.0.0.1", "10.0.0.2"], tmp_path / "k")
    conf = tmp_path / "tunnel.conf"
    conf.write_text(tls_conf("10.0.0.1", ["10.0.0.2"], tmp_path / "k"))
    conf.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        read_tls_conf(conf)
    conf.chmod(0o600)
    assert read_tls_conf(conf).peers == {"10.0.0.2": psk(tmp_path / "k", "10.0.0.2")}
    conf.write_text("[TLS]\nAddress = 10.0.0.1\n")
    with pytest.raises(ConfigError, match=r"has no \[TLS\] Address and Key"):
        read_tls_conf(conf)
    assert not is_tls_conf("[Interface]\nPrivateKey = x\n")  # WireGuard's


def test_tls_keys_need_ipv4_addresses_and_a_key_for_every_host(tmp_path: Path):
    with pytest.raises(ConfigError, match="is not an IP address"):
        make_psks(["ps.example"], tmp_path / "k")
    with pytest.raises(ConfigError, match="IPv6"):
        make_psks(["::1"], tmp_path / "k")
    make_psks(["10.0.0.1"], tmp_path / "k")
    with pytest.raises(ConfigError, match=r"no key for host 10\.0\.0\.2"):
        tls_conf("10.0.0.1", ["10.0.0.2"], tmp_path / "k")
    (tmp_path / "k" / "10.0.0.2.psk").write_text("not a key\n")
    with pytest.raises(ConfigError, match="is not a psctl TLS key"):
        tls_conf("10.0.0.1", ["10.0.0.2"], tmp_path / "k")


def test_deploy_check_counts_a_tf_port_open_only_when_grpc_answers():
    """Behind TLS the job's namespace accepts every connection to another host: a TF port
    is open for `psctl deploy check` only when a gRPC server sends its SETTINGS back."""
    server = grpc.server(futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, says nothing (a tunnel's)
    closing = socket.create_server(("127.0.0.1", 0))
    closer = threading.Thread(target=lambda: closing.accept()[0].close(), daemon=True)
    closer.start()
    try:
        assert grpc_answers("127.0.0.1", port, 2) == "open"
        assert grpc_answers("127.0.0.1", silent.getsockname()[1], 0.5) == "timeout"
        assert grpc_answers("127.0.0.1", closing.getsockname()[1], 2) != "open"  # closed, reset
    finally:
        server.stop(None)
        silent.close()
        closing.close()
