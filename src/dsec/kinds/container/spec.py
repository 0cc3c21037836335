"""The OCI runtime config of a container sandbox."""

from __future__ import annotations

import os
import resource
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...images.store import DEFAULT_PATH, ImageRef
from ...isolation.seccomp import oci_profile
from ...protocol.build import BUILDER_CA, HOST_CA_BUNDLE
from ...store.records import SandboxRecord
from .state import ContainerState

HELPER_MOUNT = "/.dsec"

# Docker's default set minus NET_RAW (raw sockets), MKNOD, SETFCAP and AUDIT_WRITE: enough for apt, pip
# and git run as root, nothing that reaches beyond the sandbox's namespaces.
CAPABILITIES = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
]

MASKED_PATHS = [
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/kallsyms",
    "/proc/modules",
    "/proc/sysrq-trigger",
    "/proc/config.gz",
    "/sys/firmware",
    "/sys/kernel",
    "/sys/devices/virtual/powercap",
]

READONLY_PATHS = [
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
]

CPU_PERIOD_US = 100_000
SHM_SIZE = 64 << 20


def sandbox_env(rec: SandboxRecord, image: ImageRef) -> dict[str, str]:
    """The environment every process of the sandbox starts with (an exec may add to it)."""
    return {"PATH": DEFAULT_PATH, "HOME": "/root", "TERM": "xterm", **image.env, **rec.env}


NAMESPACES = ("pid", "network", "ipc", "uts", "mount", "cgroup")


def _full_network_mounts(rec: SandboxRecord) -> list[dict[str, Any]]:
    """A sandbox with full network (builders) trusts the CAs the host trusts (a TLS-intercepting
    proxy's, say): read-only and never packed into a layer. Its resolv.conf names the platform resolver."""
    if rec.network != "full" or not os.path.exists(HOST_CA_BUNDLE):
        return []
    real = os.path.realpath(HOST_CA_BUNDLE)
    return [{"destination": BUILDER_CA, "type": "bind", "source": real, "options": ["bind", "ro"]}]


def _cgroup_or_scratch_mounts(
    rec: SandboxRecord, rootfs: str, cgroups_path: str, hierarchies: Sequence[str]
) -> list[dict[str, Any]]:
    """A function worker (issue 6) serves one user after another: its cgroup's counters (peak memory,
    CPU time, OOM events) would tell the next user about the last, and cannot be reset, so it has no
    cgroup file system; its /tmp is a directory beside its writable layer that the daemon empties between users.

    ``hierarchies`` (a hybrid host's v1 and v2 mounts under /sys/fs/cgroup): each is shown by a bind of
    the sandbox's own group, not mounted afresh by the runtime. A fresh cgroup v1 mount walks every group
    of the host's v2 tree, where each held sandbox has one: at 3,000 held those walks were 14% of the
    host's CPU in a burst of creations. Seen from the sandbox's cgroup namespace, a bind of its own group
    is what a fresh mount shows (the same root, "/", in mountinfo: what the JVM reads its limits by)."""
    if not ContainerState(rec).worker:
        if not hierarchies:
            return [
                {
                    "destination": "/sys/fs/cgroup",
                    "type": "cgroup",
                    "source": "cgroup",
                    "options": ["nosuid", "noexec", "nodev", "relatime", "ro"],
                }
            ]
        own = cgroups_path.strip("/")
        return [
            {
                "destination": "/sys/fs/cgroup",
                "type": "tmpfs",
                "source": "cgroup",
                "options": ["nosuid", "noexec", "nodev", "mode=755", "size=64k"],
            },
            *(
                {
                    "destination": f"/sys/fs/cgroup/{name}",
                    "type": "bind",
                    "source": f"/sys/fs/cgroup/{name}/{own}",
                    "options": ["rbind", "ro", "nosuid", "noexec", "nodev"],
                }
                for name in hierarchies
            ),
        ]
    # the worker's /tmp sits on the tmpfs of its writable layer (rootfs.py): one disk limit for both
    scratch = str(Path(rootfs).parent / "disk" / "tmp")
    return [{"destination": "/tmp", "type": "bind", "source": scratch, "options": ["rbind", "nosuid", "nodev"]}]


def memory_high(limit: int) -> int:
    """Where throttling starts: 90% of the limit, at least 4 MiB below it (page-aligned)."""
    return max(4096, (min(limit * 9 // 10, limit - (4 << 20)) // 4096) * 4096)


def config(
    rec: SandboxRecord,
    image: ImageRef,
    rootfs: str,
    helper_dir: str,
    cgroups_path: str,
    init: list[str],
    seccomp_bpf: str | None = None,
    uid_base: int | None = None,
    cgroup_v2: bool = False,
    cgroup_hierarchies: Sequence[str] = (),
) -> dict[str, Any]:
    """``seccomp_bpf``: the profile already compiled (base64), which crun loads as is instead of compiling
    the ``seccomp`` section again (~20 ms per container here). The section stays for other runtimes.

    Memory: the request is the reservation (v1 soft limit, v2 memory.low), which host-wide reclaim
    pushes a sandbox back to first; on v2, memory.high below the limit throttles and reclaims a
    sandbox that grows before the OOM killer at the limit has to act."""
    annotations = {"run.oci.seccomp_bpf_data": seccomp_bpf} if seccomp_bpf else {}
    return {
        "ociVersion": "1.0.2",
        "annotations": annotations,
        "process": _process(rec, image, init),
        "root": {"path": rootfs, "readonly": False},
        "hostname": "sandbox",
        "mounts": _mounts(rec, rootfs, helper_dir, cgroups_path, cgroup_hierarchies),
        "linux": _linux(rec, cgroups_path, uid_base, cgroup_v2),
    }


def _process(rec: SandboxRecord, image: ImageRef, init: list[str]) -> dict[str, Any]:
    env = sandbox_env(rec, image)
    limits = rec.limits
    caps = list(CAPABILITIES)
    # Raising a hard limit needs CAP_SYS_RESOURCE, which the daemon may lack (nested sandboxes).
    nofile = min(limits.nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    return {
        "terminal": False,
        "user": {"uid": 0, "gid": 0},
        # dsec-agent (or catatonit in pause mode without it): reaps orphans, holds the namespaces.
        "args": init,
        "env": [f"{k}={v}" for k, v in env.items()],
        "cwd": image.workdir or "/",
        "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
        "rlimits": [
            {"type": "RLIMIT_NOFILE", "hard": nofile, "soft": nofile},
            {"type": "RLIMIT_CORE", "hard": 0, "soft": 0},
            # inherited by every exec (the agent forks them); a write past it gets SIGXFSZ / EFBIG
            {"type": "RLIMIT_FSIZE", "hard": limits.fsize(), "soft": limits.fsize()},
        ],
        "noNewPrivileges": True,
        "oomScoreAdj": 500,
    }


def _mounts(
    rec: SandboxRecord, rootfs: str, helper_dir: str, cgroups_path: str, hierarchies: Sequence[str]
) -> list[dict[str, Any]]:
    return [
        {
            "destination": "/proc",
            "type": "proc",
            "source": "proc",
            "options": ["nosuid", "noexec", "nodev"],
        },
        {
            "destination": "/dev",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
        },
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
        },
        {
            "destination": "/dev/shm",
            "type": "tmpfs",
            "source": "shm",
            "options": ["nosuid", "noexec", "nodev", "mode=1777", f"size={SHM_SIZE}"],
        },
        {
            "destination": "/dev/mqueue",
            "type": "mqueue",
            "source": "mqueue",
            "options": ["nosuid", "noexec", "nodev"],
        },
        {
            "destination": "/sys",
            "type": "sysfs",
            "source": "sysfs",
            "options": ["nosuid", "noexec", "nodev", "ro"],
        },
        *_cgroup_or_scratch_mounts(rec, rootfs, cgroups_path, hierarchies),
        {
            "destination": HELPER_MOUNT,
            "type": "bind",
            "source": helper_dir,
            "options": ["rbind", "ro", "nosuid", "nodev"],
        },
        *_full_network_mounts(rec),
        *_volume_mounts(rec, rootfs),
    ]


def _volume_mounts(rec: SandboxRecord, rootfs: str) -> list[dict[str, Any]]:
    """Named volumes, bound from their views in the bundle (rootfs.bind_volumes), after every other
    mount: the protocol keeps their paths off /proc, /sys, /dev and the helper mount."""
    bundle = Path(rootfs).parent
    return [
        {
            "destination": v.path,
            "type": "bind",
            "source": str(bundle / f"volume-{i}"),
            "options": ["bind", "ro" if v.read_only else "rw", "nosuid", "nodev"],
        }
        for i, v in enumerate(rec.volumes)
    ]


def _linux(rec: SandboxRecord, cgroups_path: str, uid_base: int | None, cgroup_v2: bool) -> dict[str, Any]:
    limits = rec.limits
    cpu: dict[str, Any] = {"shares": max(2, min(262144, int(limits.cpu * 1024)))}
    if limits.cpu_limit is not None:
        cpu["quota"] = int(limits.cpu_limit * CPU_PERIOD_US)
        cpu["period"] = CPU_PERIOD_US
    # Every sandbox has a network namespace of its own: loopback only, or a veth added once it runs.
    namespaces = [{"type": t} for t in NAMESPACES]
    id_maps: dict[str, Any] = {}
    if uid_base is not None:
        # root in the sandbox is uid_base on the host; the sandbox's 65536 ids are its own
        namespaces.append({"type": "user"})
        mapping = [{"containerID": 0, "hostID": uid_base, "size": 65536}]
        id_maps = {"uidMappings": mapping, "gidMappings": mapping}
    return {
        "cgroupsPath": cgroups_path,
        "namespaces": namespaces,
        **id_maps,
        "resources": {
            "devices": [{"allow": False, "access": "rwm"}],
            "memory": {"limit": limits.memory, "swap": limits.memory, "reservation": limits.mem_request()},
            "cpu": cpu,
            "pids": {"limit": limits.pids},
            **({"unified": {"memory.high": str(memory_high(limits.memory))}} if cgroup_v2 else {}),
        },
        "maskedPaths": MASKED_PATHS,
        "readonlyPaths": READONLY_PATHS,
        "seccomp": oci_profile(),
    }
