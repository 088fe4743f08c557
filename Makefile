# The README's two commands: `make demo` (install, then train the default job on a local
# cluster) and `make test` (install, lint, type-check, run every test).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.psctl-installed
# Which TensorFlow, as a psctl extra: cpu (tensorflow-cpu, the smaller x86_64 wheel; CI), tf
# (tensorflow: aarch64 Linux, macOS arm64) or gpu (tensorflow[and-cuda]). One per .venv:
# the wheels overwrite each other's files, so `make clean` before switching.
TF_EXTRA ?= cpu

.PHONY: demo test install lint unit integration chaos bench soak clean prometheus systemd-tools \
	package-check

# dev: the protobuf code generator (the drift test); test: pytest, ruff, mypy, ...
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[$(TF_EXTRA),dev,test]'
	touch $(STAMP)

# Byte-compile psctl's own modules (an editable install reads them from this checkout):
# with PYTHONDONTWRITEBYTECODE set, as on many CI images, every psctl process would compile
# them again at start (`psctl status` took 0.15 s of CPU instead of 0.10 s).
install: $(STAMP)
	$(BIN)/python -m compileall -q psctl cluster coordinator jobs protos/psctl ps_server worker_server

demo: install
	$(BIN)/psctl local

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Real Prometheus/promtool for the metrics tests (Debian package; installed when missing).
prometheus:
	sh tools/ensure-prometheus.sh

# systemd-analyze (unit verification) and ip (network-namespace hosts) for the deploy tests.
systemd-tools:
	sh tools/ensure-systemd-tools.sh

test: lint prometheus systemd-tools
	$(BIN)/pytest -q

unit: install systemd-tools
	$(BIN)/pytest -q tests/unit

integration: install prometheus systemd-tools
	$(BIN)/pytest -q tests/integration

# Kill and freeze real processes of running jobs; prints the measured table.
chaos: install systemd-tools
	$(BIN)/pytest -q -s tests/chaos

bench: install
	$(BIN)/python bench/throughput.py

# One job through 30 minutes of random, overlapping faults; invariants checked at the end
# (SEED=N for another schedule; NETNS=1: every task on a network-namespace host, link cuts).
soak: install prometheus
	$(BIN)/python bench/soak.py --minutes 30 --seed $(or $(SEED),1) $(if $(NETNS),--netns)

# Builds the wheel and checks it against the package index (not part of `make test`): its
# contents, the protobuf floor in a fresh venv, and that it resolves for aarch64 Linux.
package-check: install
	$(BIN)/python tools/check_package.py

clean:
	rm -rf $(VENV) psctl-work .pytest_cache .mypy_cache .ruff_cache .hypothesis *.egg-info
