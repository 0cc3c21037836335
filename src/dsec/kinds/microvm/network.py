"""A VM sandbox's network interface: a tap on the host, handed to QEMU as a descriptor.

Every VM has one virtio-net NIC, so a memory snapshot (a template, a fork) restores into any VM whatever
its policy. The NIC's backend is a tap in the host's network namespace that the daemon creates and passes
to QEMU (which, in its jail, could open no device itself); while the sandbox's policy is None the tap has
no address and is down, so nothing the guest sends leaves QEMU. A policy gives the tap the host side of
the sandbox's address pair, and the same nftables rules as a container's veth apply to it (the node's
``NetworkHost``); the guest's side is configured through its agent. The tap dies with its QEMU.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import struct

from ...errors import BackendError
from ...isolation.network import nft

# The same in every VM: each tap is a link of its own, and a restored VM keeps its template's address.
GUEST_MAC = "52:54:00:d5:ec:01"
_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000


def tap_name(vm_name: str) -> str:
    """A sandbox's tap is named like a container's veth (the ruleset knows it by that name); a template
    VM, which never gets a policy, by a hash of its name."""
    if vm_name.startswith("sb-"):
        return nft.ifname(vm_name)
    return nft.IFACE_PREFIX + "t" + hashlib.sha256(vm_name.encode()).hexdigest()[:12]


def open_tap(name: str) -> int:
    """Create the tap ``name`` (down, no address) and return its descriptor (close-on-exec)."""
    try:
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise BackendError(f"cannot open /dev/net/tun for the VM's network interface: {e}") from e
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", name.encode(), _IFF_TAP | _IFF_NO_PI))
    except OSError as e:
        os.close(fd)
        raise BackendError(f"cannot create tap {name}: {e}") from e
    return fd


def guest_setup(address: str, gateway: str, resolver: str) -> list[str]:
    """The argv, run as root in the guest by its agent, that gives the guest's NIC (found by its MAC:
    systemd renames it) the sandbox's address, route and resolver. IPv6 goes off: the host drops it anyway."""
    script = f"""
b=/.dsec/busybox
dev=
for d in /sys/class/net/*; do
  [ "$($b cat "$d/address" 2>/dev/null)" = "{GUEST_MAC}" ] && dev=${{d##*/}}
done
[ -n "$dev" ] || {{ echo "no network interface with MAC {GUEST_MAC}" >&2; exit 1; }}
for f in all default "$dev"; do echo 1 > "/proc/sys/net/ipv6/conf/$f/disable_ipv6" 2>/dev/null; done
$b ip addr flush dev "$dev" &&
$b ip addr add {address}/31 dev "$dev" &&
$b ip link set "$dev" up &&
$b ip route replace default via {gateway} dev "$dev" src {address} || exit 1
$b rm -f /etc/resolv.conf && printf 'nameserver %s\\n' {resolver} > /etc/resolv.conf
"""
    return ["/.dsec/busybox", "sh", "-c", script]
