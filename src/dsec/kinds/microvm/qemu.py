"""QEMU for one sandbox: its command line, its process, and its console (drained into a capped log)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import math
import os
import shutil
import socket
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ...errors import BackendError
from ...proc import spawn
from . import jail, launcher_build, network

QEMU = "qemu-system-x86_64"
MIN_MEMORY_MIB = 128  # measured here: 64 MB guests reboot-loop under TCG
CONSOLE_CAP = 1 << 20  # bytes kept per console log file; one older generation is kept beside it
QEMU_LOG_CAP = 1 << 20
LOG_CHECK_S = 2.0
# QEMU's descriptors: 3 is the incoming memory snapshot; the daemon binds the sockets and QEMU listens on
# them; 7 is the NIC's tap (see .network)
INCOMING_FD, CONSOLE_FD, AGENT_FD, QMP_FD, TAP_FD = 3, 4, 5, 6, 7


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
    cpu_request: float = 1.0  # cores: the VM's cpu weight against its neighbours follows it

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


@functools.cache
def host_tsc_khz() -> int | None:
    """The host's TSC frequency when it is constant (a TCG guest's TSC runs at it); None if unknown.

    Measured here: without it, 4 of 6 TCG boots beside one busy guest hung for good right after the
    guest kernel's "Unable to calibrate against PIT"; given it as ``tsc_early_khz``, 6 of 6 booted.
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
        if not {"constant_tsc", "nonstop_tsc"} <= set(flags):
            return None
        res = subprocess.run(
            [str(launcher_build.build()), "--tsc-khz"], capture_output=True, text=True, timeout=5, check=False
        )
        khz = int(res.stdout.strip()) if res.returncode == 0 else 0
    except (OSError, ValueError, subprocess.TimeoutExpired, BackendError):
        return None
    return khz if 100_000 <= khz <= 10_000_000 else None


def argv(spec: VMSpec, tsc_khz: int | None = None) -> list[str]:
    mmio = spec.machine == "microvm"
    blk = "virtio-blk-device" if mmio else "virtio-blk-pci"
    # init_on_free: pages the guest frees are zeroed, so saved memory leaves them out and a restored VM
    # holds only what its guest uses. Measured here (192 MiB busybox microVM, TCG): template 89 -> 55 MB,
    # restored QEMU RSS 184 -> 154 MB, for ~0.5 s more of a cold boot (~10% under TCG).
    cmdline = (
        f"console=ttyS0 panic=-1 reboot=t quiet init_on_free=1 dsec.layers={len(spec.layers)} "
        f"dsec.disk={spec.disk_bytes}"
    )
    if tsc_khz is not None and spec.accel == "tcg":
        cmdline += f" tsc_early_khz={tsc_khz}"
    # TCG's translated-code buffer defaults to 1 GiB, resident as it fills: capped, it fits the VM's cgroup
    accel = f"tcg,tb-size={jail.TCG_TB_MIB}" if spec.accel == "tcg" else spec.accel
    args = [
        binary(),
        "-name", f"dsec-{spec.name}",
        "-machine", spec.machine + (",x-option-roms=off,rtc=on" if mmio else ""),
        "-accel", accel,
        "-cpu", "host" if spec.accel == "kvm" else "max",
        "-m", str(spec.memory_mib),
        "-smp", str(spec.cpus),
        "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
        "-kernel", str(spec.kernel), "-initrd", str(spec.initrd), "-append", cmdline,
        "-chardev", f"socket,id=console,fd={CONSOLE_FD},server=on,wait=off",
        "-serial", "chardev:console",
        "-chardev", f"socket,id=agent,fd={AGENT_FD},server=on,wait=off",
        "-device", "virtio-serial-device" if mmio else "virtio-serial-pci",
        "-device", "virtserialport,chardev=agent,name=dsec.agent",
        "-device", "virtio-rng-device" if mmio else "virtio-rng-pci",
        "-chardev", f"socket,id=qmp,fd={QMP_FD},server=on,wait=off",
        "-mon", "chardev=qmp,mode=control",
        # QEMU's own seccomp filter: no new programs, no privilege changes, no obsolete syscalls
        "-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
    ]  # fmt: skip
    nic = "virtio-net-device" if mmio else "virtio-net-pci,romfile="
    args += ["-netdev", f"tap,id=net0,fd={TAP_FD}", "-device", f"{nic},netdev=net0,mac={network.GUEST_MAC}"]
    disks = [*((f"dsec-l{i}", layer) for i, layer in enumerate(spec.layers)), ("dsec-helper", spec.helper)]
    for serial, path in disks:
        args += ["-drive", f"id={serial},file={path},format=raw,if=none,readonly=on"]
        args += ["-device", f"{blk},drive={serial},serial={serial}"]
    return args


def start(spec: VMSpec, incoming: Path | None = None) -> int:
    """Start QEMU jailed (see :mod:`.jail`) in a session of its own (it outlives the daemon, as containers
    do); returns its pid. The bundle's sockets are bound here and handed over, so they are the daemon's
    files at the usual paths while QEMU, which sees none of the bundle, only listens on them.

    ``incoming``: a memory snapshot to restore from instead of booting (handed over as fd 3).
    """
    if os.geteuid() != 0:
        raise BackendError("the microvm kind needs root: QEMU is jailed (namespaces, cgroups, its own user)")
    vm_key = jail.key(spec.name, spec.bundle)
    if jail.running(vm_key):
        raise BackendError(f"a QEMU for {spec.name} in {spec.bundle} is already running")
    launcher = launcher_build.build()
    owned: list[int] = []
    socks: list[socket.socket] = []
    try:
        uid = jail.lease_uid(vm_key)
        groups = jail.make_cgroup(vm_key, jail.limits(spec.memory_mib, spec.cpus, spec.accel, spec.cpu_request))
        for path in (spec.console_sock, spec.agent_sock, spec.qmp_sock):
            socks.append(_listen(path))
        mounts = jail.plan(
            binary(),
            (spec.kernel, spec.initrd, spec.helper, *spec.layers),
            spec.accel,
            jail.host_roots(),
            jail.existing(jail.EXTRA),
        )
        qemu_args = argv(spec, host_tsc_khz() if spec.accel == "tcg" else None)
        args = jail.launcher_argv(launcher, mounts, spec.bundle, uid, groups, qemu_args)
        log_fd = os.open(spec.bundle / "qemu.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        owned.append(log_fd)
        null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        owned.append(null)
        sources = {0: null, 1: log_fd, 2: log_fd}
        sources |= {CONSOLE_FD: socks[0].fileno(), AGENT_FD: socks[1].fileno(), QMP_FD: socks[2].fileno()}
        tap = network.open_tap(network.tap_name(spec.name))
        owned.append(tap)
        sources[TAP_FD] = tap
        if incoming is not None:
            mem = os.open(incoming, os.O_RDONLY | os.O_CLOEXEC)
            owned.append(mem)
            sources[INCOMING_FD] = mem
            args += ["-incoming", f"fd:{INCOMING_FD}"]
        # the child's dup2s run in order: a source numbered like an earlier target would be overwritten
        fds: dict[int, int] = {}
        for target, src in sources.items():
            high = fcntl.fcntl(src, fcntl.F_DUPFD_CLOEXEC, 64)
            owned.append(high)
            fds[target] = high
        # an empty environment: the daemon's (tokens, proxies) is none of QEMU's business
        return spawn(args, fds, env={})
    except BaseException as e:
        with contextlib.suppress(OSError):
            jail.release(vm_key)
        if isinstance(e, OSError):
            raise BackendError(f"cannot start QEMU for {spec.name}: {e}") from e
        raise
    finally:
        for fd in owned:
            os.close(fd)
        for s in socks:
            s.close()


def _listen(path: Path) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)  # a previous QEMU's, in a reused bundle
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(str(path))
        os.chmod(path, 0o600)
        s.listen(16)
    except BaseException:
        s.close()
        raise
    return s


def release(name: str, bundle: Path) -> bool:
    """Undo what :func:`start` set up around the VM: kill anything left in its cgroup, remove the cgroup,
    free its uid. Idempotent; call it once the VM is meant to be gone (the bundle may already be removed).
    False if the cgroup would not go (it is retried on the next call)."""
    return jail.release(jail.key(name, bundle))


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
    QEMU's own log beside it (``qemu.log``, its stderr, where some devices report what a guest did to them)
    is capped the same way every few seconds while the VM runs.
    """
    qemu_log = log.with_name("qemu.log")
    for _ in range(200):
        if stop.is_set() or await asyncio.to_thread(sock.exists):
            break
        await asyncio.sleep(0.05)
    try:
        reader, writer = await asyncio.open_unix_connection(str(sock))
    except OSError:
        return
    f = await asyncio.to_thread(open, log, "ab")
    next_check = 0.0
    try:
        size = f.tell()
        while not stop.is_set():
            loop_time = asyncio.get_running_loop().time()
            if loop_time >= next_check:
                await asyncio.to_thread(cap_appended_log, qemu_log, QEMU_LOG_CAP)
                next_check = loop_time + LOG_CHECK_S
            try:
                data = await asyncio.wait_for(reader.read(65536), LOG_CHECK_S)
            except TimeoutError:
                continue
            except OSError:  # QEMU went away mid-read: the console ends here as at EOF
                break
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
        with contextlib.suppress(OSError):
            cap_appended_log(qemu_log, QEMU_LOG_CAP)


def cap_appended_log(path: Path, cap: int) -> None:
    """A file another process appends to (O_APPEND), kept under ``cap``: past it, its last ``cap // 2``
    bytes go to ``path.1`` and the file is emptied in place (the writer's next append lands at 0)."""
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return
    if size <= cap:
        return
    with open(path, "r+b") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - cap // 2))
        tail = f.read(cap // 2)
        f.truncate(0)
    with open(path.with_name(path.name + ".1"), "wb") as old:
        old.write(tail)


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


def panic_line(bundle: Path) -> str | None:
    """The guest kernel's panic message, if the end of its console shows one."""
    tail = console_tail(bundle, 16384)
    at = tail.rfind("Kernel panic")
    if at < 0:
        return None
    return tail[at:].splitlines()[0].strip()[:300]


def processes_named(name: str) -> list[int]:
    """Pids of processes whose QEMU ``-name`` starts with ``name``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.startswith(name.encode()) for a in args):
            found.append(int(entry.name))
    return found
