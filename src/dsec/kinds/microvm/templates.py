"""The node's memory-snapshot templates: a directory per template key, kept within a byte budget.

A template is worth keeping while VMs of its shape keep being made; one whose guest assets (kernel,
initramfs, helper disk) were rebuilt can never be restored again (its key cannot come up) and goes at
once. Beyond the budget the least recently used go first. Use is recorded by the memory file's atime,
set explicitly (file systems mounted noatime or relatime would not).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

log = logging.getLogger("dsec.microvm")

MEMORY = "memory.bin"
# run in a template's guest before it is saved: its page cache dropped and free memory zeroed, so the
# saved memory is small
TRIM = r"""
b=/.dsec/busybox
$b sync
echo 3 > /proc/sys/vm/drop_caches
free=$($b awk '/^MemFree:/ { print int($2 / 1024) - 32 }' /proc/meminfo)
[ "$free" -gt 0 ] && $b dd if=/dev/zero of=/dev/null bs="${free}M" count=1 2>/dev/null
exit 0
"""
META = "template.json"
BUDGET = int(os.environ.get("DSEC_VM_TEMPLATE_BYTES", str(8 << 30)))


def record(root: Path, key: str, assets: list[str], layers: tuple[str, ...]) -> None:
    """Note what a freshly saved template was made of, for pruning and for people reading the node."""
    meta = {"key": key, "assets": assets, "layers": list(layers), "saved_at": time.time()}
    tmp = root / key / (META + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, root / key / META)


def used(root: Path, key: str) -> None:
    path = root / key / MEMORY
    try:
        os.utime(path, (time.time(), path.stat().st_mtime))
    except OSError:
        pass


def prune(root: Path, assets: list[str], budget: int = BUDGET, keep: frozenset[str] = frozenset()) -> list[str]:
    """Remove templates of other guest assets, then the least recently used beyond ``budget`` bytes.

    ``keep``: keys being built or restored now. Returns the keys removed."""
    entries: list[tuple[float, int, str]] = []
    removed: list[str] = []
    try:
        dirs = [d for d in root.iterdir() if d.is_dir()]
    except OSError:
        return removed
    for d in dirs:
        if d.name in keep:
            continue
        try:
            meta = json.loads((d / META).read_text())
            st = (d / MEMORY).stat()
        except (OSError, ValueError):
            # a template from before this file existed, or a save that died: unusable either way when old
            if time.time() - d.stat().st_mtime > 3600:
                removed.append(d.name)
                shutil.rmtree(d, ignore_errors=True)
            continue
        if meta.get("assets") != assets:
            removed.append(d.name)
            shutil.rmtree(d, ignore_errors=True)
            continue
        entries.append((st.st_atime, st.st_size, d.name))
    total = sum(size for _, size, _ in entries)
    for _, size, key in sorted(entries):
        if total <= budget:
            break
        removed.append(key)
        shutil.rmtree(root / key, ignore_errors=True)
        total -= size
    if removed:
        log.info("VM templates removed: %s", ", ".join(k[:12] for k in removed))
    return removed
