"""Suite-wide rules: every test has a deadline, and under CI (``CI=true``) nothing may be skipped.

A skip is allowed only where a facility is truly absent on the machine running the suite, and says so
in its reason; ``.ci/run`` runs on a machine where ``make`` installed everything, so there a skip can
only hide a failure, and it is reported as one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Generator
from typing import Any

import pytest

# Every test's deadline (setup, call and teardown together) is the ini's `timeout`; tests that boot
# VMs (TCG here: seconds per boot, and a module fixture may boot several) get this one.
VM_TIMEOUT = 900
_VM = re.compile(r"(^|[^a-z])(micro)?vm([^a-z]|$)")


def strict() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("timeout") is None and _VM.search(item.nodeid):
            item.add_marker(pytest.mark.timeout(VM_TIMEOUT))


def _failed_skip(report: Any) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped under CI (CI=true), where make installed every facility: {reason}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    if strict() and report.skipped and not hasattr(report, "wasxfail"):
        _failed_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, Any]:
    report = yield
    if strict() and report.skipped:  # a module-level skip (importorskip, a skipif pytestmark)
        _failed_skip(report)
    return report
