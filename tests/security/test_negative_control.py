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

# case -> the weakening that must make it fail
MUST_FAIL = {
    f"{SYSCALLS}[container-mount]": "no seccomp, CAP_SYS_ADMIN",
    f"{SYSCALLS}[container-namespaces]": "no seccomp",
    f"{SYSCALLS}[container-clone-namespace-flags]": "no seccomp",
    f"{SYSCALLS}[container-io_uring]": "no seccomp",
    f"{SYSCALLS}[container-tracing]": "no seccomp, CAP_SYS_PTRACE",
    f"{SYSCALLS}[container-bpf-perf]": "no seccomp",
    f"{SYSCALLS}[container-keyrings]": "no seccomp",
    f"{SYSCALLS}[container-numa]": "no seccomp",
    f"{SYSCALLS}[container-host-wide-state]": "no seccomp",
    f"{SYSCALLS}[container-secret-memory-remap]": "no seccomp",
    "tests/security/test_syscalls.py::test_raw_packet_and_exotic_sockets[container]": "CAP_NET_RAW, no seccomp",
    "tests/security/test_escapes.py::test_setuid_root_binary_gains_nothing_for_an_unprivileged_user[container]": (
        "no no_new_privs"
    ),
    "tests/security/test_escapes.py::test_the_control_api_is_neither_visible_nor_reachable[container]": (
        "host network namespace: /proc/net/unix lists the daemon's socket"
    ),
    "tests/security/test_network.py::test_port_scan_of_every_host_address[container]": "host network namespace",
    "tests/security/test_network.py::test_the_metadata_address_is_unreachable[container]": "host network namespace",
}


def _failed(junit: Path) -> set[str]:
    failed = set()
    for case in ET.parse(junit).iter("testcase"):
        if any(child.tag in ("failure", "error") for child in case):
            module = str(case.get("classname", "")).replace(".", "/")
            failed.add(f"{module}.py::{case.get('name')}")
    return failed


def test_the_suite_fails_against_a_weakened_daemon(tmp_path: Path) -> None:
    if WEAK:
        pytest.skip("this is the control itself")
    junit = tmp_path / "weak.xml"
    selected = sorted(MUST_FAIL)
    env = {**os.environ, "DSEC_SECURITY_WEAK": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *selected],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode != 0, proc.stdout[-3000:]
    failed = _failed(junit)
    passed_anyway = {case: why for case, why in MUST_FAIL.items() if case not in failed}
    assert not passed_anyway, f"cases that did not fail against the weakened daemon: {passed_anyway}"
