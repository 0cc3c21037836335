"""The ``vm`` kind: a full QEMU machine (q35) that boots the image's own init, with dsec's agent beside it.

Everything but the machine and the hand-over is the ``microvm`` kind's: the image's EROFS layers as
read-only disks stacked with overlayfs over a tmpfs, the helper disk with the agent, the same exec and
file protocol on virtio-serial, the host owning the timeouts. The initramfs of this kind starts the agent
in the new root and then switches root to the image's init (``/sbin/init``, ``/etc/init`` or
``/bin/init``, where the kernel looks): systemd where the image has it, busybox's init in dsec/busybox.
A create returns once that init has finished booting (systemd: ``is-system-running --wait``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import ClassVar

from ...errors import BackendError, DsecError, InvalidRequest
from ...images.store import ImageRef
from ...store.records import SandboxRecord
from ..microvm import guest, qemu
from ..microvm.backend import MicroVMBackend
from ..microvm.channel import GuestChannel
from . import image_init

log = logging.getLogger("dsec.vm")

# How long the image's init may take to finish booting once the agent answers. Measured here under TCG
# (2 cores, one of them busy with another guest): Debian 12's systemd with udev reached "running" 33-41 s
# after the agent answered; a more loaded host takes several times that.
SETTLE_TIMEOUT = {"kvm": 60.0, "tcg": 300.0}

# Run by the guest's own busybox: waits until pid 1 is the image's init (its root is the agent's: the
# initramfs has switched root) and, if that init is systemd, until systemd says its boot is over.
SETTLE = r"""
bb=/.dsec/busybox
n=0
until [ "$($bb stat -L -c %d:%i /proc/1/root/ 2>/dev/null)" = "$($bb stat -c %d:%i /)" ]; do
  n=$((n + 1))
  [ "$n" -lt 600 ] || { echo "pid 1 never became the image's init" >&2; exit 3; }
  $bb sleep 0.05
done
exe=$($bb readlink /proc/1/exe)
echo "init=$exe"
case "$exe" in */systemd) ;; *) exit 0;; esac
until [ -S /run/systemd/private ]; do $bb sleep 0.05; done
echo "state=$(systemctl is-system-running --wait 2>&1 | $bb tail -n 1)"
"""


class VMBackend(MicroVMBackend):
    kind: ClassVar[str] = "vm"
    machine: ClassVar[str] = "q35"

    async def _prepare(self) -> guest.GuestAssets:
        assets = await super()._prepare()
        # every VM this backend starts (boots, templates, forks) takes its initramfs from self.assets;
        # no await since super() returned, so no other create sees the microvm initramfs in between
        if assets.initrd != assets.image_init_initrd:
            assets = dataclasses.replace(assets, initrd=assets.image_init_initrd)
            self.assets = assets
        return assets

    async def create(self, rec: SandboxRecord, image: ImageRef) -> None:
        if image.layers and all(await asyncio.to_thread(lambda: [p.is_dir() for p in image.layers])):
            found = await asyncio.to_thread(image_init.find, image.layers)
            if found is None:
                raise InvalidRequest(
                    f"kind 'vm' boots the image's own init, and image {image.name} has none "
                    f"({', '.join(image_init.CANDIDATES)}); build one with an init system "
                    "(e.g. apt systemd-sysv udev on dsec/debian:12), or use kind 'microvm'"
                )
        # without mounted layers the guest's initramfs makes the same check and says so on the console
        await super().create(rec, image)

    async def _settle(self, chan: GuestChannel, spec: qemu.VMSpec) -> None:
        """After a cold boot: wait until the image's init is pid 1 and, if it is systemd, has finished
        booting (``running`` or ``degraded``)."""
        started = time.monotonic()
        timeout = SETTLE_TIMEOUT[self.accel]
        try:
            status, out, err = await chan.run_bytes(["/.dsec/busybox", "sh", "-c", SETTLE], None, timeout)
        except (DsecError, OSError) as e:
            status, out, err = -1, b"", f"{type(e).__name__}: {e}"
        if status != 0:
            tail = qemu.console_tail(spec.bundle)
            raise BackendError(
                f"the image's init did not come up within {timeout:g}s ({err.strip() or f'status {status}'}); "
                f"console ends with: {tail[-800:]}"
            )
        lines = out.decode(errors="replace").splitlines()
        report = dict(line.partition("=")[::2] for line in lines if "=" in line)
        log.info(
            "%s: %.200s is pid 1%.200s, %.1fs after the agent answered",
            spec.name,
            report.get("init", "?"),
            f" (systemd: {report['state']})" if "state" in report else "",
            time.monotonic() - started,
        )
