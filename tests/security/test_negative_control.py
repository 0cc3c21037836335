"""The negative control: the suite's container cases against a deliberately weakened daemon must fail.

``weak_daemon.py`` removes seccomp, grants every capability, drops no_new_privs, unmasks /proc and
/sys and shares the host's network namespace. Each case named in MUST_FAIL claims to test one of
those layers, so each must fail against it: a case that passes there cannot fail, and is a defect.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from .conftest import WEAK

ROOT = Path(__file__).resolve().parent.parent.parent
SYSCALLS = "tests/security/test_syscalls.py::test_dangerous_syscall_family_refused_by_raw_number"

# case -> (the weakening that must make it fail, the safety assertions it must fail on). Only a failure
# of one of those statements counts: a setup error, a heartbeat overrun or a failed precondition says
# nothing about the layer the case claims to test.
NOT_ALLOWED = ("assert not allowed",)
MUST_FAIL: dict[str, tuple[str, tuple[str, ...]]] = {
    f"{SYSCALLS}[container-mount]": ("no seccomp, CAP_SYS_ADMIN", NOT_ALLOWED),
    f"{SYSCALLS}[container-namespaces]": ("no seccomp", NOT_ALLOWED),
    f"{SYSCALLS}[container-clone-namespace-flags]": ("no seccomp", NOT_ALLOWED),
    f"{SYSCALLS}[container-io_uring]": ("no seccomp", NOT_ALLOWED),
    f"{SYSCALLS}[container-tracing]": ("no seccomp, CAP_SYS_PTRACE", NOT_ALLOWED),
    f"{SYSCALLS}[container-bpf-perf]": ("no seccomp", NOT_ALLOWED),
    f"{SYSCALLS}[container-keyrings]": ("no seccomp", NOT_ALLOWED),
    f"{SYSCALLS}[container-numa]": ("no seccomp", NOT_ALLOWED),
    f"{SYSCALLS}[container-host-wide-state]": ("no seccomp", NOT_ALLOWED),
    f"{SYSCALLS}[container-secret-memory-remap]": ("no seccomp", NOT_ALLOWED),
    "tests/security/test_syscalls.py::test_raw_packet_and_exotic_sockets[container]": (
        "CAP_NET_RAW, no seccomp",
        ("assert all(ret == -1 and err in (*REFUSED, 97)",),
    ),
    "tests/security/test_escapes.py::test_setuid_root_binary_gains_nothing_for_an_unprivileged_user[container]": (
        "no no_new_privs",
        ('assert res.stdout == "uid=65534 euid=65534\\n"',),
    ),
    "tests/security/test_escapes.py::test_the_control_api_is_neither_visible_nor_reachable[container]": (
        "host network namespace: /proc/net/unix lists the daemon's socket",
        ("assert sec_daemon.token not in out", "assert sock not in res.stdout", 'assert "dsec.sock" not in res.stdout'),
    ),
    "tests/security/test_network.py::test_port_scan_of_every_host_address[container]": (
        "host network namespace",
        ("assert listener.hits == []", 'assert f" {listener.port}\\n" not in res.stdout'),
    ),
    "tests/security/test_network.py::test_the_metadata_address_is_unreachable[container]": (
        "host network namespace",
        ("assert md.hits == []",),
    ),
}


def _failures(junit: Path) -> dict[str, str]:
    """Each failed case's report (failures only: an error is a setup or teardown that broke)."""
    failed = {}
    for case in ET.parse(junit).iter("testcase"):
        for child in case:
            if child.tag == "failure":
                module = str(case.get("classname", "")).replace(".", "/")
                failed[f"{module}.py::{case.get('name')}"] = child.text or ""
    return failed


def failing_statement(report: str) -> str:
    """The statement a long traceback marks as failing: its last line starting with '>'."""
    marked = [line[1:].strip() for line in report.splitlines() if line.startswith(">")]
    return marked[-1] if marked else ""


def test_the_suite_fails_against_a_weakened_daemon(tmp_path: Path) -> None:
    if WEAK:
        pytest.skip("this is the control itself")
    junit = tmp_path / "weak.xml"
    selected = sorted(MUST_FAIL)
    # the control judges each case's own failure: CI's rule that a skip fails (tests/conftest.py) would
    # turn a skipped case into a failure it did not earn
    env = {**os.environ, "DSEC_SECURITY_WEAK": "1", "CI": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *selected],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode != 0, proc.stdout[-3000:]
    failures = _failures(junit)
    not_caught = {}
    for case, (why, safety) in MUST_FAIL.items():
        statement = failing_statement(failures.get(case, ""))
        if not statement.startswith(safety):
            not_caught[case] = f"{why}: {'passed or errored' if case not in failures else 'failed on ' + statement!r}"
    assert not not_caught, f"cases that did not fail their safety assertion against the weakened daemon: {not_caught}"
