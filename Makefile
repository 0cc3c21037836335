# Two entry points: `make demo` and `make test`. Each installs what it needs, idempotently.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# docker-registry, skopeo, apache2-utils (htpasswd) and openssl: the registry client's tests run real registries;
# podman runs what `dsec image push` wrote, as a Docker user would;
# e2fsprogs: named volumes are ext4 images; chromium: the web console's browser tests (Playwright drives it)
APT_PACKAGES := crun runc criu busybox-static catatonit mmdebstrap ca-certificates gcc libc6-dev erofs-utils e2fsprogs qemu-system-x86 nftables iproute2 postgresql docker-registry skopeo apache2-utils openssl podman chromium
# node and npm build the web console; a machine that has them already (any packaging) keeps its own
NODE_PACKAGES := nodejs npm
STAMP := $(VENV)/.installed

.PHONY: demo test lint unit integration install system-deps clean bench e2b-conformance console console-screenshots

install: system-deps $(STAMP)

system-deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	command -v npm >/dev/null 2>&1 || missing="$$missing $(NODE_PACKAGES)"; \
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

demo: install console
	$(VENV)/bin/dsec demo

# the web console (src/dsec/console/assets/, served at /ui): npm packages pinned by console/package-lock.json,
# bundled by esbuild; nothing is fetched by the page at run time
CONSOLE_BUILT := src/dsec/console/assets/app.js
CONSOLE_SOURCES := console/package-lock.json console/build.mjs console/index.html $(wildcard console/src/*.js console/src/*/*.js console/src/*.css)
console: $(CONSOLE_BUILT)
$(CONSOLE_BUILT): $(CONSOLE_SOURCES) | system-deps
	cd console && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
	node console/build.mjs

console-screenshots: install console
	$(PY) tools/console_screenshots.py --out docs/console

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
test: lint console
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
