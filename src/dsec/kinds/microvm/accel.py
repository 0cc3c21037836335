"""KVM where it works, TCG otherwise: decided once per host by booting a probe guest, and cached.

``/dev/kvm`` opening is not enough: on this development machine it is KVM-PVM, which cannot run stock
guest kernels (QEMU stops with an emulation failure). The probe boots dsec's own guest kernel and
initramfs with ``dsec.probe=1``; its ``/init`` prints a marker and powers off. The verdict is kept in
``accel.json`` beside the guest assets, keyed by the QEMU binary, the host kernel and the guest kernel.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from pathlib import Path

from ...proc import run
from . import qemu
from .guest import GuestAssets

PROBE_MARKER = "dsec-probe-ok"
PROBE_TIMEOUT = 10.0  # a guest that works boots the probe in well under a second on KVM


def _key(assets: GuestAssets) -> str:
    binary = shutil.which(qemu.QEMU) or qemu.QEMU
    stamp = os.stat(binary).st_mtime if os.path.exists(binary) else 0
    return f"{binary}:{stamp}:{os.uname().release}:{assets.kernel_version}"


async def probe_kvm(assets: GuestAssets) -> tuple[bool, str]:
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "/dev/kvm is absent or not accessible"
    with tempfile.TemporaryDirectory(prefix="dsec-kvm-probe-") as d:
        console = Path(d) / "console.log"
        argv = [
            qemu.binary(), "-machine", "microvm,accel=kvm", "-cpu", "host", "-m", "128", "-nodefaults",
            "-no-user-config", "-nographic", "-no-reboot", "-kernel", str(assets.kernel), "-initrd",
            str(assets.initrd), "-append", "console=ttyS0 panic=-1 quiet dsec.probe=1",
            "-serial", f"file:{console}",
        ]  # fmt: skip
        status, out = await run(argv, timeout=PROBE_TIMEOUT)
        text = console.read_text(errors="replace") if console.exists() else ""
    if PROBE_MARKER in text:
        return True, "a probe guest booted under KVM"
    reason = (out.decode(errors="replace").strip().splitlines() or [f"status {status}"])[-1][:200]
    return False, f"a probe guest did not boot under KVM ({reason})"


async def choose(cache: Path, assets: GuestAssets) -> tuple[str, str]:
    """("kvm" | "tcg", why), probing once per host and caching the verdict."""
    path = cache / "accel.json"
    key = _key(assets)
    try:
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            return str(cached["accel"]), f"{cached['why']} (cached)"
    except (OSError, ValueError, KeyError):
        pass
    ok, why = await probe_kvm(assets)
    verdict = {"key": key, "accel": "kvm" if ok else "tcg", "why": why}
    tmp = path.with_suffix(".tmp")
    await asyncio.to_thread(tmp.write_text, json.dumps(verdict))
    os.replace(tmp, path)
    return str(verdict["accel"]), why
