"""Checkpoints' layers on the node's disk: one directory per sandbox, one per checkpoint in it.

A checkpoint is a stack of packed layers (EROFS files) that goes on top of the sandbox's image: the
layers the sandbox ran on above its image when the checkpoint was taken (after a rollback, or in a
fork's copy, there are some), then the writable layer packed at that moment. Each directory holds its
whole stack as hard links, so removing one checkpoint never takes a layer another still needs, and
nothing is copied: ``<root>/<sandbox>/c3/0.erofs`` may be the same file as ``.../base/0.erofs``.

``base`` is the stack the sandbox runs on now (absent: its image alone). A VM's checkpoint is one file
instead, its saved memory (``memory``), which holds its writable layer as well. Every function here blocks
(disk work): the core calls them on a thread.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from pathlib import Path

BASE = "base"
MEMORY = "memory"


class CheckpointFiles:
    def __init__(self, root: Path) -> None:
        self.root = root
        # sandboxes with a directory here: the others' ends cost nothing (a removal only for these)
        self.holding: set[str] = set()

    def sandbox_dir(self, sid: str) -> Path:
        return self.root / sid

    def scratch(self, sid: str) -> Path:
        """Where a new layer is packed before it joins a checkpoint (same file system: renamed, not copied)."""
        d = self.root / sid
        d.mkdir(parents=True, exist_ok=True)
        self.holding.add(sid)
        return d

    def stack(self, sid: str, name: str = BASE) -> list[Path]:
        """The layers of a checkpoint (or of the base), lowest first; [] when there is none."""
        d = self.root / sid / name
        try:
            files = [p for p in d.iterdir() if p.suffix == ".erofs" and p.stem.isdigit()]
        except FileNotFoundError:
            return []
        return sorted(files, key=lambda p: int(p.stem))

    def holds_same(self, sid: str, name: str, layers: list[Path]) -> bool:
        """Whether ``name`` holds exactly these layer files (links of the same files): the base after a
        second rollback to one checkpoint."""
        have = self.stack(sid, name)
        try:
            return len(have) == len(layers) and all(os.path.samefile(a, b) for a, b in zip(have, layers, strict=True))
        except OSError:
            return False

    def stack_and_base(self, sid: str, name: str) -> tuple[list[Path], bool]:
        """``name``'s layers, and whether the base holds them already (one call: a rollback's)."""
        layers = self.stack(sid, name)
        return layers, self.holds_same(sid, BASE, layers)

    def exists(self, sid: str, name: str) -> bool:
        return (self.root / sid / name).is_dir()

    def memory(self, sid: str, name: str) -> Path:
        """A VM checkpoint's saved memory (its files and processes are in it)."""
        return self.root / sid / name / MEMORY

    def save(self, sid: str, name: str, below: list[Path], packed: Path | None, as_name: str | None = None) -> None:
        """Make ``name`` hold ``below`` and then ``packed`` (moved in, as ``as_name`` if given), atomically:
        a crash leaves it whole or absent."""
        d = self.root / sid
        self.holding.add(sid)
        tmp = d / f".new-{secrets.token_hex(4)}"
        tmp.mkdir(parents=True)
        try:
            for i, layer in enumerate(below):
                os.link(layer, tmp / f"{i}.erofs")
            if packed is not None:
                os.rename(packed, tmp / (as_name or f"{len(below)}.erofs"))
            old = d / f".old-{secrets.token_hex(4)}"
            with contextlib.suppress(FileNotFoundError):
                os.rename(d / name, old)
            os.rename(tmp, d / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(old, ignore_errors=True)

    def remove(self, sid: str, name: str) -> None:
        shutil.rmtree(self.root / sid / name, ignore_errors=True)

    def remove_all(self, sid: str) -> None:
        shutil.rmtree(self.root / sid, ignore_errors=True)
        self.holding.discard(sid)

    def size(self, sid: str) -> int:
        """Bytes the sandbox's checkpoints hold on disk, each file counted once however many link it."""
        seen: set[int] = set()
        total = 0
        try:
            dirs = list((self.root / sid).iterdir())
        except FileNotFoundError:
            return 0
        for d in dirs:
            if not d.is_dir() or d.name.startswith("."):
                continue
            for f in d.iterdir():
                with contextlib.suppress(FileNotFoundError):
                    st = f.stat()
                    if st.st_ino not in seen:
                        seen.add(st.st_ino)
                        total += st.st_blocks * 512  # on disk: a saved memory has holes
        return total

    def sweep(self, live: set[str]) -> int:
        """Remove the directories of sandboxes no longer live (a daemon that stopped before it could)."""
        try:
            dirs = list(self.root.iterdir())
        except FileNotFoundError:
            return 0
        gone = [d for d in dirs if d.name not in live]
        for d in gone:
            shutil.rmtree(d, ignore_errors=True)
        self.holding = {d.name for d in dirs if d.name in live}
        return len(gone)
