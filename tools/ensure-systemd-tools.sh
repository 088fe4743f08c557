#!/bin/sh
# Make sure `systemd-analyze` (the unit tests verify every rendered unit with it; the package
# also ships systemd-socket-activate and systemd-socket-proxyd, which the multi-host test
# runs), `ip` (the multi-host test and bench/harness/netlab.py build network-namespace hosts with
# it), `cc` (bench/harness/netlab.py compiles its delaying relay, bench/harness/relay.c),
# `stunnel4` and `nft` (the TLS transport between hosts: coordinator/deploy/tls.py), and
# `wireguard-go` and `wg` (the WireGuard transport: coordinator/deploy/tunnel.py) are on
# PATH. Idempotent: does nothing when all are there. Otherwise installs the Debian/Ubuntu
# packages `systemd`, `iproute2`, `gcc`, `stunnel4`, `nftables`, `wireguard-go` and
# `wireguard-tools`, running `apt-get update` first only if the plain install fails. Uses
# sudo only when not root.
#
# Installing the package does not make systemd the init system of a container: the tests
# only run `systemd-analyze verify` and never start a unit.
set -eu

missing=""
command -v systemd-analyze >/dev/null 2>&1 || missing="$missing systemd"
command -v ip >/dev/null 2>&1 || missing="$missing iproute2"
command -v cc >/dev/null 2>&1 || missing="$missing gcc libc6-dev"
command -v wireguard-go >/dev/null 2>&1 || missing="$missing wireguard-go"
command -v wg >/dev/null 2>&1 || missing="$missing wireguard-tools"
command -v stunnel4 >/dev/null 2>&1 || missing="$missing stunnel4"
command -v nft >/dev/null 2>&1 || [ -x /usr/sbin/nft ] || missing="$missing nftables"
if [ -z "$missing" ]; then
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure-systemd-tools: missing$missing and no apt-get here; install systemd" \
        "(systemd-analyze), iproute2 (ip), a C compiler (cc), stunnel4, nftables (nft)," \
        "wireguard-go and wireguard-tools (wg) with your package manager" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
        echo "ensure-systemd-tools: not root and no sudo; run as root:" \
            "apt-get install -y --no-install-recommends$missing" >&2
        exit 1
    fi
    SUDO="sudo"
fi

apt_install() {
    # shellcheck disable=SC2086  # $missing is a list of package names
    $SUDO env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y --no-install-recommends $missing
}

echo "ensure-systemd-tools: installing the Debian package(s)$missing" >&2
if ! apt_install; then
    $SUDO apt-get update
    apt_install
fi

for tool in systemd-analyze ip cc wireguard-go wg stunnel4; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "ensure-systemd-tools: $tool still not on PATH after installing$missing" >&2
        exit 1
    fi
done
