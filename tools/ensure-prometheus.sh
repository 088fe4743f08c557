#!/bin/sh
# Make sure `prometheus` and `promtool` are on PATH (the tests run a real Prometheus server
# and promtool). Idempotent: does nothing when both are already there. Otherwise installs
# the Debian/Ubuntu package `prometheus` (which ships both binaries), running
# `apt-get update` first only if the plain install fails. Uses sudo only when not root.
#
# The package's postinst may start the system prometheus service on :9090; the tests do
# not use it (they start their own server on a free loopback port), so it is left alone.
set -eu

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure-prometheus: prometheus/promtool not on PATH and no apt-get here;" \
        "install Prometheus (https://prometheus.io/download/) and put both on PATH" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
        echo "ensure-prometheus: not root and no sudo; run as root:" \
            "apt-get install -y --no-install-recommends prometheus" >&2
        exit 1
    fi
    SUDO="sudo"
fi

export DEBIAN_FRONTEND=noninteractive
apt_install() {
    $SUDO env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y --no-install-recommends prometheus
}

echo "ensure-prometheus: installing the Debian package prometheus" >&2
if ! apt_install; then
    $SUDO apt-get update
    apt_install
fi

for tool in prometheus promtool; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "ensure-prometheus: $tool still not on PATH after installing the package" >&2
        exit 1
    fi
done
