"""Point-to-point addresses for sandbox veths, leased host-wide.

The pool (10.201.0.0/16) is cut into /31 pairs: pair ``i`` gives the host side ``base + 2i`` and the
sandbox ``base + 2i + 1``. Several daemons share the host, so a lease is a symlink in
``/run/dsec/net/by-index`` named by the pair and pointing at the interface that holds it (creating a
symlink is atomic: the first daemon to name a pair owns it). A lease whose interface is gone (its
sandbox's network namespace died with its veth, or its daemon died first) is stale once it is older
than a grace period, which covers the moments between leasing and creating the interface.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ...errors import BackendError

POOL = ipaddress.IPv4Network("10.201.0.0/16")
LEASES = Path("/run/dsec/net/by-index")
LEASE_GRACE_S = 60.0
PAIRS = POOL.num_addresses // 2


@dataclass(frozen=True)
class Pair:
    index: int

    @property
    def host(self) -> str:
        return str(POOL.network_address + 2 * self.index)

    @property
    def sandbox(self) -> str:
        return str(POOL.network_address + 2 * self.index + 1)


def index_of(address: str) -> int:
    return (int(ipaddress.IPv4Address(address)) - int(POOL.network_address)) // 2


def interface_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def label_address(label: str) -> str | None:
    """The IPv4 address carrying ``label`` (``lo:TAG``: a daemon's resolver address), if any."""
    out = subprocess.run(
        ["ip", "-o", "-4", "addr", "show", "dev", label.split(":")[0], "label", label],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    fields = out.split()
    return fields[fields.index("inet") + 1].split("/")[0] if "inet" in fields else None


def held(owner: str) -> bool:
    """Whether the owner of a lease still uses it: a sandbox veth, or a labelled resolver address."""
    return label_address(owner) is not None if ":" in owner else interface_exists(owner)


def _stale(link: Path, owner: str) -> bool:
    try:
        young = time.time() - os.lstat(link).st_mtime < LEASE_GRACE_S
    except FileNotFoundError:
        return True
    return not young and not held(owner)


def lease(ifname: str, root: Path = LEASES) -> Pair:
    """The pair leased to interface ``ifname``: its existing lease, or a free one."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    start = int.from_bytes(hashlib.sha256(ifname.encode()).digest()[:8], "big") % (PAIRS - 1)
    for i in range(PAIRS - 1):
        index = 1 + (start + i) % (PAIRS - 1)  # pair 0 holds the pool's network address: never used
        link = root / str(index)
        for _ in range(2):
            try:
                os.symlink(ifname, link)
                return Pair(index)
            except FileExistsError:
                owner = _readlink(link)
                if owner == ifname:
                    os.utime(link, follow_symlinks=False)
                    return Pair(index)
                if owner is None or not _stale(link, owner):
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(link)
    raise BackendError(f"no free sandbox address left in {POOL}")


def find(ifname: str, index: int, root: Path = LEASES) -> Pair | None:
    """The pair ``index`` if ``ifname`` still holds it."""
    return Pair(index) if _readlink(root / str(index)) == ifname else None


def release(ifname: str, index: int, root: Path = LEASES) -> None:
    link = root / str(index)
    if _readlink(link) == ifname:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(link)


def sweep(root: Path = LEASES) -> int:
    """Remove stale leases host-wide; returns how many."""
    removed = 0
    for link in root.iterdir() if root.is_dir() else []:
        owner = _readlink(link)
        if owner is not None and _stale(link, owner):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(link)
                removed += 1
    return removed


def _readlink(path: Path) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None
