"""cluster.ports.free_ports: distinct free ports, never one the caller reserved."""

from __future__ import annotations

import socket

from psctl.cluster.ports import free_ports


def test_ports_are_distinct_free_and_avoid_the_reserved():
    reserved = free_ports(40)  # just released: the ports the kernel is likeliest to hand out
    found = free_ports(40, avoid=reserved)
    assert len(set(found)) == 40
    assert not set(found) & set(reserved)
    for port in found[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free


def test_ipv6_loopback_gets_ports_too():
    """`--control-address '[::1]:0'`: a free port on the IPv6 loopback, not gaierror."""
    (port,) = free_ports(1, "::1")
    with socket.socket(socket.AF_INET6) as sock:
        sock.bind(("::1", port))  # free
