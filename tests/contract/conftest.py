"""One suite, every kind: the same calls must give the same observable results.

A daemon of its own; one sandbox per kind per module (VMs boot in seconds under TCG, so they are few
and shared). A kind whose prerequisite this node's probe found missing is skipped with that reason (never under CI).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import dsec

from ..integration.conftest import SKIP, Daemon, require_kind, shut_down, start_daemon

# "vm" boots dsec/busybox's own init (busybox init, /bin/init) on a q35 machine
KINDS = ("container", "function", "microvm", "vm")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "contract" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
            if SKIP:
                item.add_marker(pytest.mark.skip(reason=SKIP))


@pytest.fixture(scope="session")
def contract_daemon(request: pytest.FixtureRequest) -> Iterator[Daemon]:
    state = Path(tempfile.mkdtemp(prefix="dsec-contract-"))
    d = start_daemon(state)
    try:
        yield d
    finally:
        shut_down(d)
        if request.session.testsfailed:  # the daemon's log and the VMs' consoles say what went wrong
            print(f"\n[dsec] contract daemon state kept: {state}")
        else:
            shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="module", params=KINDS)
def sb(request: pytest.FixtureRequest, contract_daemon: Daemon) -> Iterator[dsec.Sandbox]:
    kind = str(request.param)
    require_kind(contract_daemon.client(), kind)
    box = dsec.Sandbox.create(image="dsec/busybox", kind=kind, client=contract_daemon.client(), timeout=1800)
    yield box
    box.kill()
