"""Root in a sandbox is not root on the host: each sandbox has its own host uid range."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import dsec

from .conftest import Daemon
from .sandbox_mounts import sandbox_bundle


def host_ids(daemon: Daemon, sb: dsec.Sandbox) -> tuple[int, int]:
    root = daemon.state_dir / "run" / "crun"
    runtime = "crun" if root.exists() else "runc"
    if not root.exists():
        root = daemon.state_dir / "run" / "runc"
    state = json.loads(
        subprocess.run([runtime, "--root", str(root), "state", sb.id], capture_output=True, text=True).stdout
    )
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{state['pid']}/status").read_text().splitlines())
    return int(fields["Uid"].split()[0]), int(fields["Gid"].split()[0])


def test_sandbox_root_is_an_unprivileged_host_uid(daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    a, b = make_sandbox(), make_sandbox()
    assert a.exec("id -u").stdout == "0\n"
    uid_a, gid_a = host_ids(daemon, a)
    uid_b, _ = host_ids(daemon, b)
    assert uid_a >= 65536 and gid_a == uid_a
    assert abs(uid_a - uid_b) >= 65536, "two sandboxes share a host uid range"
    mapping = a.exec("cat /proc/self/uid_map").stdout.split()
    assert mapping == ["0", str(uid_a), "65536"]


def test_files_are_owned_right_on_both_sides(daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox()
    uid, _ = host_ids(daemon, sb)
    sb.exec("echo inside > /made-inside; echo 'u:x:1000:1000::/:/bin/sh' >> /etc/passwd; chown 1000:1000 /made-inside")
    with sandbox_bundle(daemon, sb) as bundle:
        upper = bundle / "disk" / "upper"
        st = os.stat(upper / "made-inside")
        assert (st.st_uid, st.st_gid) == (uid + 1000, uid + 1000)  # never a host id outside the sandbox's range
        assert os.stat(upper / "etc" / "passwd").st_uid == uid  # copy-up of an image file: the sandbox root's
    sb.files.write("/api/made.txt", b"x")
    assert sb.exec("stat -c '%u:%g' /api /api/made.txt").stdout.split() == ["0:0", "0:0"]
    assert sb.exec("echo more >> /api/made.txt && cat /api/made.txt").stdout == "xmore\n"


def test_host_root_files_stay_out_of_reach(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox()
    # the read-only helper mount belongs to host root: unmapped, so nobody inside
    assert sb.exec("stat -c '%u' /.dsec/busybox").stdout.strip() == "65534"
    assert sb.exec("touch /.dsec/x").exit_code != 0
