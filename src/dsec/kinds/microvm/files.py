"""The file API of a VM sandbox, carried out by the guest's own busybox through the agent.

A VM's files live in the guest; the host cannot open them. Each call is one exec of
``/.dsec/busybox`` (read-only helper disk, so the workload cannot swap it) with the path as an
argument, never interpolated into the script. Errors come back as errno values in the exit status.
"""

from __future__ import annotations

import errno
import posixpath
from collections.abc import Awaitable, Callable
from typing import Literal

from ...errors import FileNotFoundInSandbox, InvalidRequest, LimitExceeded
from ...isolation.rootpath import clean_path
from ...protocol.sandbox import FileEntry

BUSYBOX = "/.dsec/busybox"

# Each script exits with an errno value when it refuses; 0 is success, anything else an I/O failure.
READ = r"""
[ -e "$1" ] || [ -L "$1" ] || exit 2
[ -d "$1" ] && exit 21
exec cat -- "$1"
"""
WRITE = r"""
p=$(dirname -- "$1")
[ -d "$p" ] || mkdir -p -- "$p" 2>/dev/null || { [ -e "$p" ] && exit 20; exit 2; }
[ -d "$1" ] && exit 21
cat > "$1" || { df -P "$p" | awk 'NR==2 && $4 < 64 {f=1} END {exit !f}' && exit 28; exit 5; }
chmod "$2" -- "$1"
"""
# one line per entry; after a symlink's, a line ">|TYPE|TARGET" (TYPE of what it resolves to, empty if
# nothing): no entry line starts with ">" (%F is a word)
LIST = r"""
[ -e "$1" ] || exit 2
[ -d "$1" ] || exit 20
cd -- "$1" || exit 13
for f in .* *; do
  case "$f" in .|..) continue;; esac
  [ -e "$f" ] || [ -L "$f" ] || continue
  stat -c '%F|%s|%a|%Y|%u|%g|%n' -- "$f"
  [ -L "$f" ] && printf '>|%s|%s\n' "$(stat -L -c %F -- "$f" 2>/dev/null)" "$(readlink -- "$f")"
done
exit 0
"""
STAT = r"""
[ -e "$1" ] || [ -L "$1" ] || exit 2
stat -c '%F|%s|%a|%Y|%u|%g|%n' -- "$1" || exit 5
[ -L "$1" ] && printf '>|%s|%s\n' "$(stat -L -c %F -- "$1" 2>/dev/null)" "$(readlink -- "$1")"
exit 0
"""
# rename(2) semantics (-T: a directory destination is replaced, not moved into); parents are made
MOVE = r"""
[ -e "$1" ] || [ -L "$1" ] || exit 2
p=$(dirname -- "$2")
[ -d "$p" ] || mkdir -p -- "$p" 2>/dev/null || { [ -e "$p" ] && exit 20; exit 2; }
[ -d "$2" ] && [ ! -L "$2" ] && [ -n "$(ls -A -- "$2")" ] && exit 39
mv -f -T -- "$1" "$2" || exit 5
"""
REMOVE = r"""
[ -e "$1" ] || [ -L "$1" ] || exit 2
if [ -d "$1" ] && [ ! -L "$1" ]; then
  if [ "$2" = 1 ]; then rm -rf -- "$1"; else rmdir -- "$1" 2>/dev/null || exit 39; fi
else
  rm -f -- "$1"
fi
"""
MKDIR = r"""
[ -e "$1" ] && { [ -d "$1" ] && exit 0; exit 17; }
mkdir -p -- "$1" 2>/dev/null || exit 20
"""
UNTAR = r"""
mkdir -p -- "$1" && exec tar -x -f - -C "$1"
"""
TAR = r"""
[ -d "$1" ] || { [ -e "$1" ] && exit 20; exit 2; }
exec tar -c -f - -C "$1" .
"""

# (argv, stdin, timeout) -> (exit status, stdout bytes, stderr text)
Runner = Callable[[list[str], bytes | None, float], Awaitable[tuple[int, bytes, str]]]


def _argv(script: str, *args: str) -> list[str]:
    return [BUSYBOX, "sh", "-c", script, "dsec-files", *args]


def _error(status: int, path: str, stderr: str) -> Exception:
    if status == errno.ENOENT:
        return FileNotFoundInSandbox(f"no such file or directory in the sandbox: {path}")
    if status == errno.EISDIR:
        return InvalidRequest(f"is a directory: {path}")
    if status == errno.ENOTDIR:
        return InvalidRequest(f"not a directory: {path}")
    if status == errno.ENOTEMPTY:
        return InvalidRequest(f"directory not empty (remove it with recursive=True): {path}")
    if status == errno.EEXIST:
        return InvalidRequest(f"exists and is not a directory: {path}")
    if status == errno.ENOSPC:
        return LimitExceeded(f"the sandbox's disk is full while writing {path}")
    return InvalidRequest(f"{path}: {stderr.strip() or f'failed with status {status}'}")


def _kind(word: str) -> Literal["file", "dir", "symlink", "other"]:
    """stat's %F as a FileEntry type."""
    if word == "directory":
        return "dir"
    if word == "symbolic link":
        return "symlink"
    return "file" if word.startswith("regular") else "other"


def _link_kind(word: str) -> Literal["file", "dir", "other"] | None:
    """stat -L's %F of a symlink: what it resolves to (empty: nothing, it dangles)."""
    kind = _kind(word) if word else None
    return "other" if kind == "symlink" else kind


def _entry(line: str, path_of: Callable[[str], str]) -> FileEntry | None:
    """One line of ``stat -c '%F|%s|%a|%Y|%u|%g|%n'``."""
    parts = line.split("|", 6)
    if len(parts) != 7:
        return None
    kind, size, mode, mtime, uid, gid, name = parts
    try:
        return FileEntry(
            name=name,
            path=path_of(name),
            type=_kind(kind),
            size=int(size),
            mode=int(mode, 8),
            mtime=float(mtime),
            uid=int(uid),
            gid=int(gid),
        )
    except ValueError:
        return None


def entries(out: bytes, path_of: Callable[[str], str]) -> list[FileEntry]:
    """The LIST and STAT scripts' output: entry lines, each symlink's followed by its target line."""
    found: list[FileEntry] = []
    for line in out.decode(errors="surrogateescape").splitlines():
        if line.startswith(">|"):
            if found and found[-1].type == "symlink" and found[-1].link_target is None:
                link = found[-1]
                word, _, said = line[2:].partition("|")
                target = posixpath.normpath(posixpath.join(posixpath.dirname(link.path), said))
                found[-1] = link.model_copy(update={"link_target": target, "link_type": _link_kind(word)})
            continue
        entry = _entry(line, path_of)
        if entry is not None:
            found.append(entry)
    return found


def _abs(path: str) -> str:
    rel = clean_path(path)
    return "/" if rel == "." else "/" + rel


class GuestFiles:
    def __init__(self, run: Runner) -> None:
        self._run = run

    async def _call(self, script: str, path: str, *args: str, stdin: bytes | None = None) -> bytes:
        status, out, err = await self._run(_argv(script, path, *args), stdin, 600.0)
        if status != 0:
            raise _error(status, path, err)
        return out

    async def read(self, path: str) -> bytes:
        return await self._call(READ, _abs(path))

    async def write(self, path: str, data: bytes, mode: int) -> None:
        target = _abs(path)
        if target == "/":
            raise InvalidRequest("is a directory: /")
        await self._call(WRITE, target, format(mode & 0o7777, "o"), stdin=data)

    async def list(self, path: str) -> list[FileEntry]:
        base = _abs(path)
        out = await self._call(LIST, base)
        return sorted(entries(out, lambda name: posixpath.join(base, name)), key=lambda e: e.name)

    async def stat(self, path: str) -> FileEntry:
        target = _abs(path)
        out = await self._call(STAT, target)
        found = entries(out, lambda _: target)
        if len(found) != 1:
            raise InvalidRequest(f"{path}: the guest's stat answered {out[:200]!r}")
        return found[0].model_copy(update={"name": posixpath.basename(target) or "/"})

    async def move(self, source: str, destination: str) -> None:
        src, dst = _abs(source), _abs(destination)
        if "/" in (src, dst):
            raise InvalidRequest("cannot move / or move something onto /")
        if dst == src or dst.startswith(src + "/"):
            raise InvalidRequest(f"cannot move {source} into itself")
        status, _, err = await self._run(_argv(MOVE, src, dst), None, 600.0)
        if status == errno.ENOTEMPTY:
            raise InvalidRequest(f"cannot move onto {destination}: a directory that is not empty")
        if status != 0:
            raise _error(status, source if status == errno.ENOENT else destination, err)

    async def remove(self, path: str, recursive: bool) -> None:
        target = _abs(path)
        if target == "/":
            raise InvalidRequest("refusing to remove /")
        await self._call(REMOVE, target, "1" if recursive else "0")

    async def mkdir(self, path: str) -> None:
        await self._call(MKDIR, _abs(path))

    async def upload_tar(self, path: str, data: bytes) -> None:
        await self._call(UNTAR, _abs(path), stdin=data)

    async def download_tar(self, path: str) -> bytes:
        return await self._call(TAR, _abs(path))
