# Two entry points: `make demo` and `make test`. Each installs what it needs, idempotently.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# docker-registry, skopeo, apache2-utils (htpasswd) and openssl: the registry client's tests run real registries;
# podman runs what `dsec image push` wrote, as a Docker user would;
# e2fsprogs: named volumes are ext4 images
APT_PACKAGES := crun runc busybox-static catatonit mmdebstrap ca-certificates gcc libc6-dev erofs-utils e2fsprogs qemu-system-x86 nftables iproute2 postgresql docker-registry skopeo apache2-utils openssl podman
STAMP := $(VENV)/.installed

.PHONY: demo test lint unit integration install system-deps clean bench e2b-conformance

install: system-deps $(STAMP)

system-deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi

# constraints.txt pins every transitive dependency too (regenerate: pip freeze --exclude-editable)
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,bench,cluster,minisweagent,swerex,openenv,harbor,fusion,e2bcode]'
	touch $(STAMP)

demo: install
	$(VENV)/bin/dsec demo

lint: install
	$(VENV)/bin/ruff format --check src tests tools examples
	$(VENV)/bin/ruff check src tests tools examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

unit: install
	$(VENV)/bin/pytest -q tests/unit

integration: install
	$(VENV)/bin/pytest -q tests/integration

# the unit and parser-fuzz tests on every core; the suites that start daemons, VMs and clusters one
# test at a time (they measure and account for the node they run on)
test: lint
	$(VENV)/bin/pytest -q -ra -n auto --durations=10 tests/unit tests/fuzz
	$(VENV)/bin/pytest -q -ra --durations=25 tests/contract tests/integration tests/security

bench: install
	$(VENV)/bin/dsec bench lifecycle --n 100 --json bench-lifecycle.json

# E2B's own Python SDK suite against this checkout's E2B API (docs/e2b.md): nothing is fetched from E2B,
# the checkout is given: E2B_REPO=/path/to/e2b make e2b-conformance
e2b-conformance: install
	@test -n "$(E2B_REPO)" || { echo "set E2B_REPO to a checkout of e2b-dev/E2B"; exit 2; }
	$(PY) tools/e2b_conformance.py --repo "$(E2B_REPO)" --json e2b-conformance.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
