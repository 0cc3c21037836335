"""QEMU for one sandbox: its command line, its process, and its console (drained into a capped log)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ...proc import spawn

QEMU = "qemu-system-x86_64"
MIN_MEMORY_MIB = 128  # measured here: 64 MB guests reboot-loop under TCG
CONSOLE_CAP = 1 << 20  # bytes kept per console log file; one older generation is kept beside it


@dataclass(frozen=True)
class VMSpec:
    name: str  # the sandbox id: also how the process is recognised after a daemon restart
    machine: str  # "microvm" or "q35"
    accel: str  # "kvm" or "tcg"
    memory_mib: int
    cpus: int
    kernel: Path
    initrd: Path
    helper: Path
    layers: tuple[Path, ...]  # EROFS images, lowest first
    disk_bytes: int
    bundle: Path

    @property
    def agent_sock(self) -> Path:
        return self.bundle / "agent.sock"

    @property
    def console_sock(self) -> Path:
        return self.bundle / "console.sock"

    @property
    def qmp_sock(self) -> Path:
        return self.bundle / "qmp.sock"


def binary() -> str:
    """QEMU's full path (processes are spawned without a PATH search)."""
    return shutil.which(QEMU) or f"/usr/bin/{QEMU}"


def memory_mib(limit_bytes: int) -> int:
    return max(MIN_MEMORY_MIB, limit_bytes >> 20)


def vcpus(cpu: float, cpu_limit: float | None) -> int:
    wanted = cpu_limit if cpu_limit is not None else cpu
    return max(1, min(os.cpu_count() or 1, math.ceil(wanted)))


def argv(spec: VMSpec) -> list[str]:
    mmio = spec.machine == "microvm"
    blk = "virtio-blk-device" if mmio else "virtio-blk-pci"
    cmdline = f"console=ttyS0 panic=-1 reboot=t quiet dsec.layers={len(spec.layers)} dsec.disk={spec.disk_bytes}"
    args = [
        binary(),
        "-name", f"dsec-{spec.name}",
        "-machine", f"{spec.machine},accel={spec.accel}" + (",x-option-roms=off,rtc=on" if mmio else ""),
        "-cpu", "host" if spec.accel == "kvm" else "max",
        "-m", str(spec.memory_mib),
        "-smp", str(spec.cpus),
        "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
        "-kernel", str(spec.kernel), "-initrd", str(spec.initrd), "-append", cmdline,
        "-chardev", f"socket,id=console,path={spec.console_sock},server=on,wait=off",
        "-serial", "chardev:console",
        "-chardev", f"socket,id=agent,path={spec.agent_sock},server=on,wait=off",
        "-device", "virtio-serial-device" if mmio else "virtio-serial-pci",
        "-device", "virtserialport,chardev=agent,name=dsec.agent",
        "-device", "virtio-rng-device" if mmio else "virtio-rng-pci",
        "-qmp", f"unix:{spec.qmp_sock},server=on,wait=off",
        # QEMU's own seccomp filter: no new programs, no privilege changes, no obsolete syscalls
        "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
    ]  # fmt: skip
    disks = [*((f"dsec-l{i}", layer) for i, layer in enumerate(spec.layers)), ("dsec-helper", spec.helper)]
    for serial, path in disks:
        args += ["-drive", f"id={serial},file={path},format=raw,if=none,readonly=on"]
        args += ["-device", f"{blk},drive={serial},serial={serial}"]
    return args


def start(spec: VMSpec, incoming: Path | None = None) -> int:
    """Start QEMU in a session of its own (it outlives the daemon, as containers do); returns its pid.

    ``incoming``: a memory snapshot to restore from instead of booting (handed over as fd 3).
    """
    log_fd = os.open(spec.bundle / "qemu.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    fds = {0: null, 1: log_fd, 2: log_fd}
    args = ["/usr/bin/setsid", *argv(spec)]
    mem = -1
    try:
        if incoming is not None:
            mem = os.open(incoming, os.O_RDONLY | os.O_CLOEXEC)
            fds[3] = mem
            args += ["-incoming", "fd:3"]
        return spawn(args, fds)
    finally:
        os.close(log_fd)
        os.close(null)
        if mem >= 0:
            os.close(mem)


def is_ours(pid: int, name: str) -> bool:
    """Whether ``pid`` is the QEMU of sandbox ``name`` (pids are reused)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f"dsec-{name}".encode() in f.read().split(b"\0")
    except OSError:
        return False


async def drain_console(sock: Path, log: Path, stop: asyncio.Event) -> None:
    """Keep reading the guest's console into ``log``, capped: a flood costs neither memory nor disk.

    When the log reaches CONSOLE_CAP it becomes ``log.1`` (replacing the older one) and a new one starts.
    """
    for _ in range(200):
        if stop.is_set() or await asyncio.to_thread(sock.exists):
            break
        await asyncio.sleep(0.05)
    try:
        reader, writer = await asyncio.open_unix_connection(str(sock))
    except OSError:
        return
    f = await asyncio.to_thread(open, log, "ab")
    try:
        size = f.tell()
        while not stop.is_set():
            data = await reader.read(65536)
            if not data:
                break
            if size + len(data) > CONSOLE_CAP:
                f.close()
                await asyncio.to_thread(os.replace, log, log.with_name(log.name + ".1"))
                f = await asyncio.to_thread(open, log, "wb")
                size = 0
            f.write(data[:CONSOLE_CAP])
            f.flush()
            size += min(len(data), CONSOLE_CAP)
    finally:
        f.close()
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def log_tail(bundle: Path, limit: int = 2000) -> str:
    try:
        return (bundle / "qemu.log").read_bytes()[-limit:].decode(errors="replace").strip()
    except OSError:
        return ""


def console_tail(bundle: Path, limit: int = 2000) -> str:
    try:
        return (bundle / "console.log").read_bytes()[-limit:].decode(errors="replace")
    except OSError:
        return ""
