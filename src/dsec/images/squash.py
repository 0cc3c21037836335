"""Squash a build's step layers when a later step deleted what an earlier one wrote.

Each build step is packed as a layer of its own, so a file that step 2 writes and step 5 deletes stays in
step 2's layer, hidden by step 5's whiteout: invisible in a sandbox, but its bytes ship with the image and
anyone holding the layer (or a tool that reads layers one by one) finds them. That is how a build leaves
its own answer key behind. When a build's layers shadow each other this way, the published version gets
one layer instead: the steps' layers applied in order into one overlayfs-format tree, where a deleted
file is gone and only its whiteout (no data) remains to hide what the base image had there.

Layers are read from their mounted EROFS directories (overlayfs format: a whiteout is a 0/0 character
device, an opaque directory has ``trusted.overlay.opaque=y``).
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Sequence
from pathlib import Path

OPAQUE_XATTR = "trusted.overlay.opaque"


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _opaque(path: Path) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


def _paths(layer: Path) -> dict[str, bool]:
    """Every path a layer carries (whiteouts included), relative to its root: whether it is a directory."""
    found = {}
    for top, dirs, files in os.walk(layer):
        rel = os.path.relpath(top, layer)
        for names, is_dir in ((dirs, True), (files, False)):
            for name in names:
                found[name if rel == "." else f"{rel}/{name}"] = is_dir
    return found


def shadowed(layers: Sequence[Path]) -> list[str]:
    """Paths whose content an earlier layer of ``layers`` (lowest first) carries and a later one hides:
    deleted (a whiteout), under an opaque directory, or replaced (a file over a file, any type over a
    non-directory). Those bytes are the residue a squash removes."""
    hits: list[str] = []
    below: dict[str, bool] = {}
    for layer in layers:
        here_paths = _paths(layer)
        for path, is_dir in here_paths.items():
            if path not in below:
                continue
            if not below[path] or not is_dir:  # a file replaced, or a directory replaced by a file
                hits += [p for p in below if p == path or p.startswith(path + "/")]
            elif _opaque(layer / path):
                hits += [p for p in below if p.startswith(path + "/")]
        below.update(here_paths)
    return sorted(set(hits))


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


def _copy_meta(src: Path, dst: Path, st: os.stat_result) -> None:
    os.lchown(dst, st.st_uid, st.st_gid)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dst, stat.S_IMODE(st.st_mode))
    for name in os.listxattr(src, follow_symlinks=False):
        os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False), follow_symlinks=False)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _apply(layer: Path, dst: Path) -> None:
    """Apply one layer onto the tree ``dst`` as overlayfs would stack it."""
    for top, _dirs, files in os.walk(layer):
        rel = os.path.relpath(top, layer)
        target = dst if rel == "." else dst / rel
        src = Path(top)
        if rel != ".":
            present = target.exists() or target.is_symlink()
            was_whiteout = present and _is_whiteout(os.lstat(target))
            if present and (_opaque(src) or not target.is_dir() or target.is_symlink()):
                _remove(target)
            if not target.is_dir():
                target.mkdir()
            _copy_meta(src, target, os.lstat(src))
            if was_whiteout:  # recreated over a deletion: what lay below stays hidden, as overlayfs does
                os.setxattr(target, OPAQUE_XATTR, b"y", follow_symlinks=False)
        for name in files:
            s, d = src / name, target / name
            st = os.lstat(s)
            if d.is_symlink() or d.exists():
                _remove(d)
            if stat.S_ISREG(st.st_mode):
                shutil.copyfile(s, d, follow_symlinks=False)
            elif stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(s), d)
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) or stat.S_ISFIFO(st.st_mode):
                os.mknod(d, st.st_mode, st.st_rdev)  # whiteouts; packing refuses any other device
            else:
                continue  # sockets are not layer content
            _copy_meta(s, d, st)
    # directory times last: creating entries above moved them
    for top, _dirs, _files in os.walk(layer):
        rel = os.path.relpath(top, layer)
        st = os.lstat(top)
        os.utime(dst if rel == "." else dst / rel, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def squash(layers: Sequence[Path], dst: Path) -> None:
    """Apply ``layers`` (lowest first) into the empty directory ``dst``: one layer with the same effect
    on whatever lies below them, without the bytes of anything they deleted."""
    for layer in layers:
        _apply(layer, dst)
