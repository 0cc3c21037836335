"""What a VM boots: a Debian kernel, an initramfs dsec builds, and a read-only helper disk.

- The kernel and its modules come from Debian's ``linux-image-*-cloud-amd64-unsigned`` package of the
  pinned series (``KERNEL_SERIES``, or ``DSEC_GUEST_KERNEL``), downloaded once with ``apt-get
  download`` and unpacked, never installed on the host.
- The initramfs holds busybox, ``/init`` and the few modules the guest needs (virtio transports,
  block, console, rng; EROFS; overlayfs), dependencies resolved from each module's own modinfo.
- The helper disk is an EROFS image of the guest agent, a static busybox and ``pack-upper``. ``/init``
  mounts the image's layers (read-only disks, EROFS) under overlayfs with a tmpfs upper, mounts the
  helper disk read-only at ``/.dsec`` (the workload cannot replace the agent) and the tmpfs at
  ``/.dsec/rw`` (the writable layer, for the daemon's own tools), then switches root:
  - kind ``microvm``: to the agent, as pid 1;
  - kind ``vm`` (an initramfs that holds ``/etc/dsec-init`` = ``image``): to the image's own init,
    with the agent started beside it first.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import lzma
import os
import re
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ...errors import BackendError
from . import agent_build

KERNEL_FLAVOUR = "cloud-amd64"
# The guest kernel line VMs boot: Debian 12's linux-6.12 packages, the newest of them when first needed.
# DSEC_GUEST_KERNEL picks another series (6.1) or one exact version (6.12.118+deb12).
KERNEL_SERIES = "6.12"
MODULES = (
    "virtio_mmio",
    "virtio_pci",
    "virtio_blk",
    "virtio_console",
    "virtio_rng",
    "virtio_net",
    "erofs",
    "overlay",
)
_DEPENDS = re.compile(rb"depends=([^\0]*)\0")

# Run by the daemon after a VM starts (booted or restored): the image's working directory $2, made if
# the image lacks it (as crun does for a container), and the sandbox's pids limit $1 on the cgroup under
# which the agent makes each exec's own (microvm: /sys/fs/cgroup/dsec; kind vm: the same under the
# image's init, or the agent's private cgroup2 mount beside an init that mounts none).
PREPARE = r"""
/.dsec/busybox mkdir -p "$2" || exit 1
for d in /sys/fs/cgroup/dsec /dev/.dsec-cgroup/dsec; do
  [ -d "$d" ] || continue
  echo +pids > "${d%/dsec}/cgroup.subtree_control" 2>/dev/null
  echo "$1" > "$d/pids.max" && exit 0
done
echo "no exec cgroup in the guest to bound" >&2
exit 1
"""

INIT = r"""#!/bin/busybox sh
# dsec's initramfs: mount the image's layers, stack them, hand over to the agent on the helper disk
# (microvm), or to the image's own init with the agent beside it (vm: /etc/dsec-init says "image").
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
case " $(cat /proc/cmdline) " in *" dsec.probe=1 "*) echo dsec-probe-ok > /dev/console; poweroff -f;; esac
for m in $(cat /modules.order); do insmod "/modules/$m.ko" 2>/dev/null; done
# loopback, as on any machine (network=None means loopback only; exposed ports are reached on it)
ip link set lo up 2>/dev/null
say() { echo "dsec-init: $*" > /dev/console 2>/dev/null || echo "dsec-init: $*" > /newroot/dev/console; }
fail() { say "$*"; sleep 1; poweroff -f; }
arg() { for w in $(cat /proc/cmdline); do case "$w" in "$1="*) echo "${w#*=}";; esac; done; }
layers=$(arg dsec.layers)
disk=$(arg dsec.disk)
# disks are found by their serial (dsec-l0 .. dsec-lN, dsec-helper), whatever order they probed in
find_disk() {
  for i in $(seq 1 100); do
    for d in /sys/block/vd*; do
      [ -e "$d/serial" ] && [ "$(cat "$d/serial")" = "$1" ] && { echo "/dev/${d##*/}"; return 0; }
    done
    sleep 0.05
  done
  return 1
}
lower=""
i=0
while [ "$i" -lt "$layers" ]; do
  dev=$(find_disk "dsec-l$i") || fail "layer disk $i is missing"
  mkdir -p "/layers/$i"
  mount -t erofs -o ro "$dev" "/layers/$i" || fail "cannot mount layer $i"
  lower="/layers/$i${lower:+:$lower}"
  i=$((i + 1))
done
mkdir -p /rw /newroot
# an inode per 4 KiB of the disk limit, within [16384, 4Mi]: as a container's writable layer (rootfs.py)
inodes=$((disk / 4096))
[ "$inodes" -lt 16384 ] && inodes=16384
[ "$inodes" -gt 4194304 ] && inodes=4194304
mount -t tmpfs -o "size=$disk,nr_inodes=$inodes,mode=0755" tmpfs /rw || fail "cannot make the writable layer"
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o "lowerdir=$lower,upperdir=/rw/upper,workdir=/rw/work" /newroot || fail "overlay failed"
helper=$(find_disk dsec-helper) || fail "helper disk is missing"
mkdir -p /newroot/.dsec /newroot/proc /newroot/sys /newroot/dev
mount -t erofs -o ro "$helper" /newroot/.dsec || fail "cannot mount the helper disk"
# the overlay keeps its upper layer wherever the tmpfs is mounted; the daemon's tools read it there
mount --move /rw /newroot/.dsec/rw || fail "cannot expose the writable layer"
if [ "$(cat /etc/dsec-init 2>/dev/null)" = image ]; then
  # the image's own init, looked for where the kernel looks for one (a shell is no init system)
  init=""
  for c in /sbin/init /etc/init /bin/init; do
    chroot /newroot /.dsec/busybox test -f "$c" -a -x "$c" && { init=$c; break; }
  done
  [ -n "$init" ] || fail "kind vm boots the image's own init; this image has none (/sbin/init, /etc/init, /bin/init)"
  # the init finds /proc, /sys and /dev mounted, as after any initramfs; the agent needs them at once
  for d in proc sys dev; do mount --move "/$d" "/newroot/$d" || fail "cannot move /$d"; done
  # returns once the agent's daemon runs with the new root as its own: it moves with the switch
  chroot /newroot /.dsec/agent --image-init || fail "the guest agent did not start"
  exec switch_root /newroot "$init"
fi
umount /proc /sys /dev
exec switch_root /newroot /.dsec/agent
"""
IMAGE_INIT = b"image\n"  # /etc/dsec-init in the initramfs of kind vm


@dataclass(frozen=True)
class GuestAssets:
    kernel: Path
    initrd: Path
    helper: Path  # EROFS image: agent, busybox, pack-upper, an empty rw/
    kernel_version: str
    image_init_initrd: Path  # the initramfs of kind vm: the image's own init becomes pid 1


def _module_files(root: Path) -> dict[str, Path]:
    found = {}
    for path in [*root.rglob("*.ko"), *root.rglob("*.ko.xz")]:
        found[path.name.split(".ko")[0].replace("-", "_")] = path
    return found


def _module_bytes(path: Path) -> bytes:
    """A module as insmod takes it (newer Debian kernels ship them xz-compressed)."""
    data = path.read_bytes()
    return lzma.decompress(data) if path.name.endswith(".xz") else data


def _load_order(files: dict[str, Path], wanted: tuple[str, ...]) -> list[str]:
    """Modules to insmod, dependencies first."""
    order: list[str] = []

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if name in order or name in chain:
            return
        path = files.get(name)
        if path is None:
            return  # built into this kernel
        match = _DEPENDS.search(_module_bytes(path))
        for dep in match.group(1).decode().split(",") if match and match.group(1) else []:
            visit(dep.replace("-", "_"), (*chain, name))
        order.append(name)

    for name in wanted:
        visit(name, ())
    return order


def _cpio(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A newc cpio archive of (path, mode, data); symlinks carry their target as data."""
    out = io.BytesIO()
    for ino, (name, mode, data) in enumerate([*entries, ("TRAILER!!!", 0, b"")], start=1):
        encoded = name.encode() + b"\0"
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(encoded), 0]
        out.write(b"070701" + b"".join(f"{v:08x}".encode() for v in fields) + encoded)
        out.write(b"\0" * (-(110 + len(encoded)) % 4))
        out.write(data)
        out.write(b"\0" * (-len(data) % 4))
    return out.getvalue()


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise BackendError(f"{name} is not installed; VMs need it to fetch their kernel from Debian's packages")
    return path


def _sh(argv: list[str], what: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise BackendError(f"{what} failed: {(result.stdout + result.stderr)[-800:]}")
    return result.stdout


def kernel_pin() -> str:
    """The guest kernel: a series (the newest of it) or an exact version, from DSEC_GUEST_KERNEL."""
    return os.environ.get("DSEC_GUEST_KERNEL", "").strip() or KERNEL_SERIES


def version_key(version: str) -> tuple[int, ...]:
    """Order of Debian kernel versions: by their numbers (6.12.118+deb12 after 6.12.99+deb12, and every
    6.12 after every 6.1.0-N), which a sort of the text gets wrong."""
    return tuple(int(n) for n in re.findall(r"\d+", version))


def matches(version: str, pin: str) -> bool:
    return version == pin or version.startswith(pin + ".")


def choose_kernel(versions: list[str], pin: str) -> str:
    """The newest version the pin admits (a series such as 6.12, or one exact version)."""
    chosen = sorted((v for v in versions if matches(v, pin)), key=version_key)
    if not chosen:
        raise BackendError(
            f"no guest kernel {pin} (linux-image-{pin}*-{KERNEL_FLAVOUR}-unsigned) is available from apt; "
            f"available: {', '.join(sorted(versions, key=version_key)) or 'none'} (set DSEC_GUEST_KERNEL)"
        )
    return chosen[-1]


def _fetch_kernel(root: Path) -> tuple[Path, Path, str]:
    """Unpack Debian's cloud kernel package of the pinned series under ``root`` (once: a kernel unpacked
    earlier that the pin admits is kept, so VMs do not change kernel under a running fleet); returns
    (vmlinuz, modules dir, version)."""
    pin = kernel_pin()
    root.mkdir(parents=True, exist_ok=True)
    unpacked = {d.name.removeprefix("unpacked-"): d for d in root.glob("unpacked-*") if (d / "boot").is_dir()}
    have = [v for v in unpacked if matches(v, pin)]
    if have:
        version = max(have, key=version_key)
    else:
        suffix = f"-{KERNEL_FLAVOUR}-unsigned"
        out = _sh([_tool("apt-cache"), "search", "--names-only", f"^linux-image-.*{suffix}$"], "apt-cache search")
        names = [line.split()[0] for line in out.splitlines() if line.strip()]
        version = choose_kernel([n.removeprefix("linux-image-").removesuffix(suffix) for n in names], pin)
        _unpack(root, f"linux-image-{version}{suffix}", root / f"unpacked-{version}")
    done = root / f"unpacked-{version}"
    kernels = sorted((done / "boot").glob("vmlinuz-*"))
    if len(kernels) != 1:
        raise BackendError(f"the kernel package unpacked in {done} holds {len(kernels)} vmlinuz files, not one")
    release = kernels[0].name.removeprefix("vmlinuz-")
    return kernels[0], done / "lib" / "modules" / release, release


def _unpack(root: Path, package: str, done: Path) -> None:
    work = root / "download"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    _sh(
        [_tool("sh"), "-c", 'cd "$1" && exec apt-get download "$2"', "sh", str(work), package],
        f"apt-get download {package}",
    )
    debs = list(work.glob("*.deb"))
    if not debs:
        raise BackendError(f"apt-get download {package} left no package")
    tmp = root / "unpacking"
    shutil.rmtree(tmp, ignore_errors=True)
    _sh([_tool("dpkg-deb"), "-x", str(debs[0]), str(tmp)], f"unpacking {debs[0].name}")
    shutil.rmtree(work, ignore_errors=True)
    os.rename(tmp, done)


async def prepare(root: Path, agent: Path) -> GuestAssets:
    """Kernel, initramfs and helper disk under ``root``, rebuilt only when an input changed."""
    kernel, modules_dir, version = await asyncio.to_thread(_fetch_kernel, root / "kernel")
    return await asyncio.to_thread(_build, root, agent, kernel, modules_dir, version)


def _build(root: Path, agent: Path, kernel: Path, modules_dir: Path, version: str) -> GuestAssets:
    busybox = shutil.which("busybox")
    if busybox is None:
        raise BackendError("busybox is not installed (apt-get install busybox-static)")
    files = _module_files(modules_dir)
    order = _load_order(files, MODULES)
    missing = [m for m in ("virtio_blk", "virtio_console", "erofs", "overlay") if m not in order]
    if missing and not (modules_dir.parent / version / "modules.builtin").exists():
        raise BackendError(f"the guest kernel {version} lacks modules {missing}")
    bb = Path(busybox).read_bytes()
    entries: list[tuple[str, int, bytes]] = [
        (d, stat.S_IFDIR | 0o755, b"") for d in ("bin", "sbin", "proc", "sys", "dev", "modules", "layers", "rw")
    ]
    entries += [("bin/busybox", stat.S_IFREG | 0o755, bb), ("bin/sh", stat.S_IFLNK | 0o777, b"busybox")]
    entries += [("init", stat.S_IFREG | 0o755, INIT.encode())]
    entries += [("modules.order", stat.S_IFREG | 0o644, "\n".join(order).encode() + b"\n")]
    entries += [(f"modules/{m}.ko", stat.S_IFREG | 0o644, _module_bytes(files[m])) for m in order]
    # the initramfs of kind vm differs by one file; both are built together, named by one digest
    image_init = [("etc", stat.S_IFDIR | 0o755, b""), ("etc/dsec-init", stat.S_IFREG | 0o644, IMAGE_INIT)]
    archives = {"initrd": _cpio(entries), "initrd-vm": _cpio(entries + image_init)}
    tools = {"agent": agent, "busybox": Path(busybox)}
    pack_upper = agent_build.build_pack_upper(agent.parent)
    if pack_upper is not None:
        tools["pack-upper"] = pack_upper
    h = hashlib.sha256(archives["initrd"])
    for name, path in tools.items():
        h.update(name.encode() + b"\0" + path.read_bytes())
    digest = h.hexdigest()[:16]
    for prefix, archive in archives.items():
        initrd = root / f"{prefix}-{digest}.gz"
        if not initrd.exists():
            tmp = root / f"{prefix}-{digest}.{os.getpid()}.tmp"
            tmp.write_bytes(gzip.compress(archive, compresslevel=6))
            os.rename(tmp, initrd)
    helper = root / f"helper-{digest}.erofs"
    if not helper.exists():
        src = root / f"helper-src-{digest}-{os.getpid()}"
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir()
        for name, path in tools.items():
            shutil.copy2(path, src / name)
        (src / "rw").mkdir()  # where /init moves the writable layer's tmpfs
        tmp = root / f"helper-{digest}.{os.getpid()}.tmp"
        result = subprocess.run(["mkfs.erofs", "--quiet", str(tmp), str(src)], capture_output=True, text=True)
        shutil.rmtree(src, ignore_errors=True)
        if result.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise BackendError(f"cannot build the VM helper disk: {result.stderr[-500:]}")
        os.rename(tmp, helper)
    return GuestAssets(
        kernel=kernel,
        initrd=root / f"initrd-{digest}.gz",
        helper=helper,
        kernel_version=version,
        image_init_initrd=root / f"initrd-vm-{digest}.gz",
    )
