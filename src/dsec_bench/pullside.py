"""What the pull bench measures on each side besides time: bytes written by the side's processes, the growth
of its storage, and podman driven on a storage of its own.

Bytes written are the kernel's per-process I/O accounting (``/proc/PID/io``: ``write_bytes``, what reached
or will reach the block device, less ``cancelled_write_bytes``, dirty pages dropped before writeback, as for
a file deleted at once). A process's figures include those of the children it has reaped, so dsec's side is
the daemon (with its crun and mkfs.erofs children) plus the layer fetcher it leaves running, and each podman
command is run under a shell that reads its own figures once it has reaped podman.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .lifecycle import PODMAN_FLAGS, PODMAN_RUN_FLAGS

IO_FIELDS = ("read_bytes", "write_bytes", "cancelled_write_bytes")
# runs podman ("$@"), then writes its own I/O figures, which now include podman's, where $DSEC_BENCH_IO says
IO_WRAPPER = '"$@"; status=$?; cat /proc/$$/io > "$DSEC_BENCH_IO"; exit $status'
PODMAN_TIMEOUT = 1800.0


def parse_proc_io(text: str) -> dict[str, int]:
    """The byte counters of a ``/proc/PID/io`` text."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in IO_FIELDS:
            out[key.strip()] = int(value)
    return out


def written(io: Mapping[str, int]) -> int:
    """Bytes that went to disk: written, less what was dropped before writeback."""
    return max(0, io.get("write_bytes", 0) - io.get("cancelled_write_bytes", 0))


def read_io(pid: int) -> dict[str, int] | None:
    try:
        return parse_proc_io(Path(f"/proc/{pid}/io").read_text())
    except (OSError, ValueError):
        return None  # gone, or not ours to read


def io_snapshot(pids: Iterable[int]) -> dict[int, dict[str, int]]:
    return {pid: io for pid in pids if (io := read_io(pid)) is not None}


def io_delta(before: Mapping[int, Mapping[str, int]], after: Mapping[int, Mapping[str, int]]) -> dict[str, int]:
    """The sum over processes of what each did between two snapshots (one that appeared since: all of it)."""
    total = dict.fromkeys(IO_FIELDS, 0)
    for pid, now in after.items():
        then = before.get(pid, {})
        for key in IO_FIELDS:
            total[key] += max(0, now.get(key, 0) - then.get(key, 0))
    return total


def add_io(a: Mapping[str, int], b: Mapping[str, int]) -> dict[str, int]:
    return {key: a.get(key, 0) + b.get(key, 0) for key in IO_FIELDS}


def tree_bytes(*roots: Path) -> int:
    """Disk blocks used under ``roots``, staying on each root's file system (a lazy layer mount or a
    sandbox's tmpfs is not disk) and counting a hard-linked file once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root in roots:
        try:
            device = root.stat().st_dev
        except OSError:
            continue
        for dirpath, dirs, files in os.walk(root):
            for name in (*dirs, *files):
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue
                if st.st_dev != device or (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
            # not into other file systems
            dirs[:] = [d for d in dirs if _same_device(os.path.join(dirpath, d), device)]
    return total


def _same_device(path: str, device: int) -> bool:
    try:
        return os.lstat(path).st_dev == device
    except OSError:
        return False


def unescape_mountinfo(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes."""
    for code in ("040", "011", "012", "134"):
        field = field.replace("\\" + code, chr(int(code, 8)))
    return field


def mounts_under(mountinfo: str, root: Path) -> list[str]:
    """Mount points at or under ``root`` (from a /proc/self/mountinfo text), deepest first: the order to
    unmount them in."""
    prefix = str(root).rstrip("/")
    found = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4:
            point = unescape_mountinfo(fields[4])
            if point == prefix or point.startswith(prefix + "/"):
                found.append(point)
    return sorted(set(found), key=lambda p: (-p.count("/"), p))


def unmount_tree(root: Path) -> None:
    """Detach whatever is mounted under ``root`` (podman's overlay mounts and its storage's own bind)."""
    with contextlib.suppress(OSError):
        for point in mounts_under(Path("/proc/self/mountinfo").read_text(), root):
            subprocess.run(["umount", "-l", point], capture_output=True, timeout=60, check=False)


@dataclass
class Podman:
    """podman on a storage of the bench's own: graph root and downloads on the disk, run root and libpod's
    temporary files on a tmpfs (where podman keeps them by default), none of them the host's."""

    binary: str
    root: Path  # containers/storage's graph root: the layers (on disk)
    downloads: Path  # TMPDIR: where podman stages the blobs it pulls (on disk, as /var/tmp is by default)
    runroot: Path
    tmpdir: Path
    logs: Path  # each command's stderr and I/O figures

    @classmethod
    def fresh(cls, binary: str, disk: Path, volatile: Path) -> Podman:
        dirs = cls(binary, disk / "root", disk / "downloads", volatile / "runroot", volatile / "tmp", disk / "logs")
        for d in (dirs.root, dirs.downloads, dirs.runroot, dirs.tmpdir, dirs.logs):
            d.mkdir(parents=True, exist_ok=True)
        return dirs

    def argv(self, *args: str) -> list[str]:
        base = [self.binary, *PODMAN_FLAGS, "--root", str(self.root), "--runroot", str(self.runroot)]
        return [*base, "--tmpdir", str(self.tmpdir), *args]

    def pull_argv(self, ref: str) -> list[str]:
        return self.argv("pull", "--quiet", "--tls-verify=false", ref)

    def run_argv(self, ref: str, pull: str) -> list[str]:
        # --rm: the container is removed when it exits, as dsec's side kills its sandbox
        return self.argv("run", "--rm", f"--pull={pull}", "--tls-verify=false", *PODMAN_RUN_FLAGS, ref, "/bin/true")

    async def run(self, argv: list[str], tag: str) -> tuple[int, dict[str, int]]:
        """One podman command under the I/O wrapper: its exit status and its I/O figures (children reaped
        by podman included). Cancelled, the command is killed."""
        io_file, err_file = self.logs / f"{tag}.io", self.logs / f"{tag}.err"
        env = {**os.environ, "TMPDIR": str(self.downloads), "DSEC_BENCH_IO": str(io_file)}
        with err_file.open("wb") as err:
            # never a pipe for its output: a container inherits it and could hold it open past podman
            # a session of its own, so that a cancelled command is killed with podman under it (the shell
            # alone would leave podman running against the storage about to be removed)
            proc = await asyncio.create_subprocess_exec(
                "/bin/sh", "-c", IO_WRAPPER, "sh", *argv,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True,
            )  # fmt: skip
            try:
                status = await asyncio.wait_for(proc.wait(), PODMAN_TIMEOUT)
            finally:
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    await proc.wait()
        try:
            io = parse_proc_io(io_file.read_text())
        except OSError:
            io = {}
        return status, io

    def error_tail(self, tag: str) -> str:
        with contextlib.suppress(OSError):
            return (self.logs / f"{tag}.err").read_text(errors="replace").strip()[-300:]
        return ""

    def remove_all(self) -> None:
        """Every container and image of this storage, then its mounts: nothing of it stays running or
        mounted (the caller removes the directories)."""
        for args in (("rm", "--all", "--force", "--time", "0"), ("rmi", "--all", "--force")):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(self.argv(*args), capture_output=True, timeout=300, check=False)
        for d in (self.root, self.runroot, self.tmpdir):
            unmount_tree(d)

    def storage_driver(self) -> str:
        """The graph driver podman chose for this storage (overlay, or vfs where overlay cannot be used:
        then every image's layers are copied whole, which the disk figures would show)."""
        argv = self.argv("info", "--format", "{{.Store.GraphDriverName}}")
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout.strip()
        return ""

    def version(self) -> str:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run([self.binary, "--version"], capture_output=True, text=True, timeout=30).stdout
            return out.strip()
        return ""


def remove_dirs(*dirs: Path) -> None:
    for d in dirs:
        unmount_tree(d)
        shutil.rmtree(d, ignore_errors=True)
