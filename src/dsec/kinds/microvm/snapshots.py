"""Memory snapshots: a template VM per (image layers, size, guest assets) booted once, paused and saved;
new VMs of that template restore from its memory instead of booting.

Saving and restoring go through QMP with file descriptors (``getfd`` + ``migrate fd:``, ``-incoming
fd:N``), never ``exec:`` URIs, so QEMU's seccomp sandbox can keep forbidding it to spawn programs.
The template's agent is disconnected before the save, so a restored agent greets its new host; the
host then sets the guest's clock and reseeds its CRNG (VMs restored from one snapshot must not share
random output).
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from ...errors import BackendError
from .qemu import VMSpec


class QMP:
    """A blocking QMP connection (used from a thread: a save or restore makes a handful of calls)."""

    def __init__(self, path: Path, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(timeout)
                self.sock.connect(str(path))
                break
            except OSError as e:
                self.sock.close()
                if time.monotonic() > deadline:
                    raise BackendError(f"cannot reach QEMU's QMP socket {path}: {e}") from e
                time.sleep(0.02)
        self.file = self.sock.makefile("rb")
        self._read()  # the greeting
        self.execute("qmp_capabilities")

    def _read(self) -> dict[str, Any]:
        line = self.file.readline()
        if not line:
            raise BackendError("QEMU closed its QMP socket")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def execute(self, command: str, arguments: dict[str, Any] | None = None, fds: list[int] | None = None) -> Any:
        message = json.dumps({"execute": command, **({"arguments": arguments} if arguments else {})}).encode()
        if fds:
            self.sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())])
        else:
            self.sock.sendall(message)
        while True:
            reply = self._read()
            if "return" in reply:
                return reply["return"]
            if "error" in reply:
                raise BackendError(f"QMP {command} failed: {reply['error'].get('desc', reply['error'])}")
            # asynchronous events (STOP, RESUME, MIGRATION...) are not answers

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
            self.sock.close()


# the VM's device set beyond what VMSpec says (a snapshot restores only into the same devices)
DEVICES = "nic1"


def template_key(spec: VMSpec, layer_digests: tuple[str, ...]) -> str:
    """What a restored VM must share with its template: machine, size, guest assets, layers."""
    parts = [
        DEVICES,
        spec.machine,
        spec.accel,
        str(spec.memory_mib),
        str(spec.cpus),
        str(spec.disk_bytes),
        *(p.name for p in (spec.kernel, spec.initrd, spec.helper)),
        *layer_digests,
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def save(qmp_path: Path, memory: Path, timeout: float = 300.0) -> int:
    """Pause the VM and write its whole state to ``memory``; returns the file's size. The VM stays paused."""
    tmp = memory.with_suffix(".tmp")
    qmp = QMP(qmp_path)
    try:
        qmp.execute("stop")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            qmp.execute("getfd", {"fdname": "dsec-save"}, fds=[fd])
        finally:
            os.close(fd)
        qmp.execute("migrate", {"uri": "fd:dsec-save"})
        deadline = time.monotonic() + timeout
        while True:
            status = qmp.execute("query-migrate").get("status")
            if status == "completed":
                break
            if status in ("failed", "cancelled") or time.monotonic() > deadline:
                raise BackendError(f"saving the VM's memory ended {status or 'in a timeout'}")
            time.sleep(0.02)
    finally:
        qmp.close()
    os.replace(tmp, memory)
    return memory.stat().st_size


def resume_restored(qmp_path: Path, timeout: float = 120.0) -> None:
    """Wait until QEMU has loaded the incoming state, then let the VM run."""
    qmp = QMP(qmp_path, timeout=timeout)
    try:
        deadline = time.monotonic() + timeout
        while True:
            status = qmp.execute("query-status").get("status")
            if status in ("paused", "postmigrate", "prelaunch"):
                break
            if status == "running":
                return
            if status not in ("inmigrate", "restore-vm") or time.monotonic() > deadline:
                raise BackendError(f"the VM did not load its snapshot (status {status})")
            time.sleep(0.005)
        qmp.execute("cont")
    finally:
        qmp.close()


def command(qmp_path: Path, name: str, arguments: dict[str, Any] | None = None) -> Any:
    """One QMP command on a fresh connection (pause, resume, status)."""
    qmp = QMP(qmp_path, timeout=10.0)
    try:
        return qmp.execute(name, arguments)
    finally:
        qmp.close()
