"""What /proc, /sys and the environment tell a sandbox about the host and its neighbours."""

from __future__ import annotations

import ctypes
import pwd
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import dsec

from ..integration.conftest import IMAGES_DIR
from .conftest import Daemon, heartbeat, nonce

libc = ctypes.CDLL(None, use_errno=True)
KEY_SPEC_USER_KEYRING = -4
KEYCTL_UNLINK = 9


def _host_symbol(name: str) -> str:
    for line in Path("/proc/kallsyms").read_text().splitlines():
        addr, _, sym = line.split()[:3]
        if sym == name:
            return addr
    raise AssertionError(f"{name} not in the host's kallsyms")


@pytest.fixture
def host_key() -> Iterator[str]:
    """A key in the host root user's keyring, named so a leak of /proc/keys would show it."""
    desc = "dsec-host-key-" + nonce()
    key = libc.syscall(248, b"user", desc.encode(), b"payload", 7, KEY_SPEC_USER_KEYRING)
    if key < 0:
        pytest.skip(f"cannot add a key on the host (errno {ctypes.get_errno()})")
    yield desc
    libc.syscall(250, KEYCTL_UNLINK, key, KEY_SPEC_USER_KEYRING)


def test_kernel_addresses_and_keys_do_not_leak(attacker: dsec.Sandbox, neighbour: dsec.Sandbox, host_key: str) -> None:
    host_addr = _host_symbol("commit_creds")
    assert int(host_addr, 16) != 0  # the host (root, kptr visible) knows the real address
    script = (
        "grep -w commit_creds /proc/kallsyms; head -c 4096 /proc/kcore | wc -c; cat /proc/keys /proc/key-users; "
        "cat /proc/timer_list | head -5; cat /sys/kernel/notes | head -c 64 | od -An -tx1 | head -2; "
        "grep -rs commit_creds /boot /lib/modules 2>/dev/null | head -1"
    )
    with heartbeat(neighbour):
        res = attacker.exec(script, timeout=30)
    assert host_addr not in res.stdout
    assert host_key not in res.stdout
    for line in res.stdout.splitlines():
        m = re.match(r"([0-9a-f]{16}) \w commit_creds", line)
        if m:  # a guest kernel's own symbol, or a zeroed one: never the host's address
            assert m.group(1) != host_addr


def _host_usernames() -> set[str]:
    return {p.pw_name for p in pwd.getpwall() if p.pw_uid >= 1000 and p.pw_name != "nobody"}


def test_mountinfo_cgroups_and_environment_show_no_host_paths(
    sec_daemon: Daemon, attacker: dsec.Sandbox, neighbour: dsec.Sandbox
) -> None:
    script = (
        "cat /proc/self/mountinfo /proc/mounts /proc/1/mountinfo /proc/self/cgroup /proc/1/cgroup; "
        "tr '\\0' '\\n' < /proc/self/environ; tr '\\0' '\\n' < /proc/1/environ; env; "
        "ls -R /sys/fs/cgroup 2>/dev/null | head -2000; cat /etc/hostname /etc/hosts /etc/resolv.conf"
    )
    with heartbeat(neighbour):
        res = attacker.exec(script, timeout=60, output_limit=4 << 20)
    out = res.stdout
    forbidden = {
        str(sec_daemon.state_dir),
        str(IMAGES_DIR),
        "/var/lib/dsec",
        sec_daemon.token,
        neighbour.id,
        *(u for u in _host_usernames() if len(u) >= 4),
    }
    leaks = {f: [line for line in out.splitlines() if f in line][:3] for f in forbidden if f in out}
    assert not leaks, f"host paths or names visible inside: {leaks}"


def test_other_sandboxes_are_not_listed_anywhere(
    sec_daemon: Daemon, attacker: dsec.Sandbox, neighbour: dsec.Sandbox
) -> None:
    others = [info.id for info in sec_daemon.client().list() if info.id != attacker.id]
    assert neighbour.id in others
    script = (
        "find /sys/fs/cgroup /proc /run /var/run /tmp -maxdepth 4 -name 'sb-*' 2>/dev/null; "
        "cat /proc/[0-9]*/cgroup 2>/dev/null | sort -u; ps -o pid,args"
    )
    with heartbeat(neighbour):
        res = attacker.exec(script, timeout=60)
    assert not [sid for sid in others if sid in res.stdout], res.stdout
