"""One daemon's network side: its nftables table, its resolver, and each sandbox's veth.

Nothing exists until the first sandbox with a network needs it (sandboxes without one cost nothing).
The table and the resolver's address outlive a daemon restart, so enforcement never pauses and a
re-adopted sandbox's resolv.conf stays valid; a daemon that stops with no sandbox on the network
removes them. IPv4 forwarding is turned on when first needed; if it was off, the table also drops
every forwarded packet that neither comes from nor goes to a sandbox veth, so turning it on opens
nothing else on the host (documented in docs/security.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from ...errors import BackendError
from ...protocol.network import NetworkAllow, NetworkDeny, NetworkSpec
from . import addresses, nft
from .options import NetworkOptions
from .resolver import ALLOW_TIMEOUT, Client, Resolver

log = logging.getLogger("dsec.network")

RUN_DIR = Path("/run/dsec/net")
FORWARD_SYSCTL = Path("/proc/sys/net/ipv4/ip_forward")
# inside the sandbox: no IPv6 at all (fd00:ec2::254 and every other v6 address unreachable)
NETNS_SETUP = (
    "echo 1 >/proc/sys/net/ipv6/conf/all/disable_ipv6 && echo 1 >/proc/sys/net/ipv6/conf/default/disable_ipv6 "
    "&& exec ip -batch -"
)


@dataclass
class Attached:
    index: int
    address: str
    gen: int


def _mode(policy: NetworkSpec) -> tuple[str, dict[str, set[int | None]]]:
    if isinstance(policy, NetworkAllow | NetworkDeny):
        names: dict[str, set[int | None]] = {}
        for e in policy.entries():
            if e.name is not None:
                names.setdefault(e.name, set()).add(e.port)
        return "deny" if isinstance(policy, NetworkDeny) else "allow", names
    return "full", {}


class NetworkHost:
    def __init__(self, state_dir: Path, options: NetworkOptions | None = None) -> None:
        self.table = nft.table_name(str(state_dir.resolve()))
        self.tag = self.table.removeprefix("dsec_")
        self.label = "lo:" + self.tag  # the resolver's address sits on lo under this label
        self.options = options or NetworkOptions()
        self.static = self.options.static
        self.error: str | None = None  # why this node cannot enforce network policies, if it cannot
        self.resolver: Resolver | None = None
        self._ready_lock = asyncio.Lock()
        self._adopted: set[str] = set()

    # ---- the daemon's part ----------------------------------------------------------------------

    async def start(self) -> None:
        """At daemon start: clear what dead daemons and dead sandboxes left; bring our table back up if
        a previous run of this daemon left sandboxes on it. A node without nftables or ip still runs
        sandboxes, with loopback only (``error`` says why)."""
        try:
            await self._start()
        except (BackendError, OSError) as e:
            self.error = str(e)

    async def _start(self) -> None:
        for tool in ("nft", "ip", "nsenter"):
            nft.which(tool)
        await asyncio.to_thread(addresses.sweep)
        with contextlib.suppress(BackendError):
            await self._sweep_dead_daemons()
        if await self._table_exists(self.table):
            await self._ready()
            await self._sweep_own()

    async def close(self) -> None:
        if self.resolver is not None:
            await self.resolver.close()
            self.resolver = None
        if not await self._table_exists(self.table):
            return
        if await self._interfaces(self.table):
            return  # sandboxes live on: the kernel keeps enforcing their policy
        await self._drop_daemon(self.table)

    async def _ready(self) -> str:
        """The table, forwarding and the resolver, once; returns the resolver's address."""
        async with self._ready_lock:
            if self.resolver is not None:
                return self.resolver.address
            pair = await asyncio.to_thread(addresses.lease, self.label)
            guard = await asyncio.to_thread(self._enable_forwarding)
            await nft.apply(nft.base(self.table, pair.host, guard))
            await nft.run(["ip", "addr", "replace", f"{pair.host}/32", "dev", "lo", "label", self.label])
            await asyncio.to_thread(_write, RUN_DIR / f"{self.tag}.pid", str(os.getpid()))
            resolver = Resolver(pair.host, self._allow_resolved, self.static)
            await resolver.start()
            self.resolver = resolver
            log.info("network: table %s, resolver on %s", self.table, pair.host)
            return pair.host

    @staticmethod
    def _enable_forwarding() -> bool:
        """Turn IPv4 forwarding on; True if it was off before dsec turned it on (on this boot)."""
        orig = RUN_DIR / "ip_forward.orig"
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        if not orig.exists():
            tmp = RUN_DIR / f".ip_forward.{os.getpid()}"
            tmp.write_text(FORWARD_SYSCTL.read_text().strip())
            with contextlib.suppress(FileExistsError):
                os.link(tmp, orig)
            tmp.unlink()
        FORWARD_SYSCTL.write_text("1")
        return orig.read_text().strip() == "0"

    async def _table_exists(self, table: str) -> bool:
        try:
            await nft.run(["nft", "list", "table", "inet", table])
        except BackendError:
            return False
        return True

    async def _interfaces(self, table: str) -> list[str]:
        """The sandbox veths registered in a table that still exist."""
        try:
            items = await nft.list_json(table, "set", "ifs")
        except BackendError:
            return []
        names = [str(e) for i in items for e in i.get("set", {}).get("elem", [])]
        return [n for n in names if addresses.interface_exists(n)]

    async def _sweep_own(self) -> None:
        """Take out of our table every sandbox whose veth is gone (it died while we were away)."""
        items = await nft.list_json(self.table, "set", "owners")
        owners = {}
        for i in items:
            for e in i.get("set", {}).get("elem", []):
                name, addr = e["concat"]
                owners[str(name)] = str(addr)
        for name in list(owners):
            if not addresses.interface_exists(name):
                await nft.apply(nft.remove(self.table, "sb-" + name[len(nft.IFACE_PREFIX) :], owners[name]))

    async def _sweep_dead_daemons(self) -> None:
        out = json.loads(await nft.run(["nft", "-j", "list", "tables", "inet"]))
        for item in out.get("nftables", []):
            table = item.get("table", {}).get("name", "")
            if not table.startswith("dsec_") or table == self.table:
                continue
            tag = table.removeprefix("dsec_")
            if _daemon_alive(RUN_DIR / f"{tag}.pid") or await self._interfaces(table):
                continue
            log.info("network: removing %s, left by a daemon that is gone", table)
            await self._drop_daemon(table)

    async def _drop_daemon(self, table: str) -> None:
        with contextlib.suppress(BackendError):
            await nft.run(["nft", "delete", "table", "inet", table])
        tag = table.removeprefix("dsec_")
        address = await asyncio.to_thread(addresses.label_address, "lo:" + tag)
        if address is not None:
            with contextlib.suppress(BackendError):
                await nft.run(["ip", "addr", "del", f"{address}/32", "dev", "lo"])
            await asyncio.to_thread(addresses.release, "lo:" + tag, addresses.index_of(address))
        with contextlib.suppress(FileNotFoundError):
            (RUN_DIR / f"{tag}.pid").unlink()
        await asyncio.to_thread(addresses.sweep)
        await self._restore_forwarding()

    async def _restore_forwarding(self) -> None:
        """Forwarding back off when dsec turned it on and no dsec table is left."""
        orig = RUN_DIR / "ip_forward.orig"
        out = json.loads(await nft.run(["nft", "-j", "list", "tables", "inet"]))
        left = [i for i in out.get("nftables", []) if i.get("table", {}).get("name", "").startswith("dsec_")]
        if left or not orig.exists():
            return
        await asyncio.to_thread(_restore, orig)

    # ---- sandboxes --------------------------------------------------------------------------------

    async def attach(self, sandbox_id: str, pid: int, policy: NetworkSpec) -> Attached:
        """Give a running sandbox (its init ``pid``) a veth, an address and ``policy``."""
        assert policy is not None
        await self._ready()
        started = time.monotonic()
        name = nft.ifname(sandbox_id)
        pair = await asyncio.to_thread(addresses.lease, name)
        gen = secrets.randbits(31) | 1
        inside = (
            f"link add eth0 type veth peer name {name} netns {os.getpid()}\n"
            f"addr add {pair.sandbox}/31 dev eth0\nlink set eth0 up\n"
            f"route add default via {pair.host} dev eth0 src {pair.sandbox}\n"
        )
        try:
            # concurrently: no packet passes before the host side is up, which is last
            await asyncio.gather(
                self._install(sandbox_id, pair.sandbox, policy, gen),
                nft.run(["nsenter", f"--net=/proc/{pid}/ns/net", "sh", "-c", NETNS_SETUP], inside),
            )
            with contextlib.suppress(OSError):
                await asyncio.to_thread(_write, Path(f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6"), "1")
            await nft.run(["ip", "-batch", "-"], f"addr add {pair.host}/31 dev {name}\nlink set {name} up\n")
        except BaseException:
            await self.detach(sandbox_id, pair.index)
            raise
        log.debug("sandbox %s: network attached in %.1f ms", sandbox_id, 1000 * (time.monotonic() - started))
        return Attached(pair.index, pair.sandbox, gen)

    async def attach_tap(self, sandbox_id: str, policy: NetworkSpec) -> Attached:
        """Give a VM's tap (made when its QEMU started, named ``nft.ifname``, down until now) its
        address and ``policy``; the guest then configures its side through its agent."""
        assert policy is not None
        await self._ready()
        name = nft.ifname(sandbox_id)
        if not addresses.interface_exists(name):
            raise BackendError(f"sandbox {sandbox_id} has no network interface (its VM has no tap)")
        pair = await asyncio.to_thread(addresses.lease, name)
        gen = secrets.randbits(31) | 1
        try:
            await self._install(sandbox_id, pair.sandbox, policy, gen)
            with contextlib.suppress(OSError):
                await asyncio.to_thread(_write, Path(f"/proc/sys/net/ipv6/conf/{name}/disable_ipv6"), "1")
            script = f"addr flush dev {name}\naddr add {pair.host}/31 dev {name}\nlink set {name} up\n"
            await nft.run(["ip", "-batch", "-"], script)
        except BaseException:
            await self.detach(sandbox_id, pair.index, keep_interface=True)
            raise
        return Attached(pair.index, pair.sandbox, gen)

    async def _install(self, sandbox_id: str, address: str, policy: NetworkSpec, gen: int, keep: bool = False) -> None:
        mode, names = _mode(policy)
        entries = policy.entries() if isinstance(policy, NetworkAllow | NetworkDeny) else []
        denied = policy.denied() if isinstance(policy, NetworkDeny) else []
        rules = nft.SandboxRules(sandbox_id, address, mode, gen, entries, self.options.full_deny, denied)
        await nft.apply(nft.install(self.table, rules, keep))
        assert self.resolver is not None
        self.resolver.clients[address] = Client(sandbox_id, mode, names)

    async def change(self, sandbox_id: str, index: int, policy: NetworkSpec) -> int:
        """A new policy for a sandbox already attached; returns its new generation (open connections
        are checked against the new policy from their next packet)."""
        await self._ready()
        gen = secrets.randbits(31) | 1
        old = self.resolver.clients.get(addresses.Pair(index).sandbox) if self.resolver else None
        await self._install(sandbox_id, addresses.Pair(index).sandbox, policy, gen)
        if old is not None and self.resolver is not None:
            self.resolver.clients[addresses.Pair(index).sandbox].denied = old.denied
        return gen

    async def adopt(self, sandbox_id: str, index: int, policy: NetworkSpec, gen: int) -> None:
        """After a daemon restart: the sandbox's rules and resolver entry as they were (resolved names
        stay in its sets until they expire)."""
        if sandbox_id in self._adopted:
            return
        await self._ready()
        await asyncio.to_thread(addresses.lease, nft.ifname(sandbox_id))  # refreshes it
        await self._install(sandbox_id, addresses.Pair(index).sandbox, policy, gen, keep=True)
        self._adopted.add(sandbox_id)

    async def detach(self, sandbox_id: str, index: int | None, keep_interface: bool = False) -> None:
        """Take the sandbox off the network. ``keep_interface``: a VM's tap, which its QEMU holds, is
        only emptied and set down (a later policy brings it back)."""
        name = nft.ifname(sandbox_id)
        address = addresses.Pair(index).sandbox if index is not None else None
        if address is not None and self.resolver is not None:
            self.resolver.clients.pop(address, None)
        if await self._table_exists(self.table):
            await nft.apply(nft.remove(self.table, sandbox_id, address))
        if addresses.interface_exists(name):
            with contextlib.suppress(BackendError):
                if keep_interface:
                    await nft.run(["ip", "-batch", "-"], f"link set {name} down\naddr flush dev {name}\n")
                else:
                    await nft.run(["ip", "link", "del", name])
        if index is not None:
            await asyncio.to_thread(addresses.release, name, index)
        self._adopted.discard(sandbox_id)

    async def status(self, sandbox_id: str, index: int) -> tuple[int, int, list[str]]:
        """(denied packets, denied DNS queries, allowed destinations now)."""
        await self._ready()
        client = self.resolver.clients.get(addresses.Pair(index).sandbox) if self.resolver else None
        dropped = await nft.counter(self.table, sandbox_id)
        return dropped, client.denied if client else 0, await nft.allowed(self.table, sandbox_id)

    async def resolver_address(self) -> str:
        return await self._ready()

    async def _allow_resolved(self, client: Client, found: list[str], ports: set[int | None]) -> None:
        if ports:
            await nft.apply(
                nft.resolved(self.table, client.sandbox_id, found, sorted(ports, key=_port_key), ALLOW_TIMEOUT)
            )


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _restore(orig: Path) -> None:
    if orig.read_text().strip() == "0":
        FORWARD_SYSCTL.write_text("0")
    orig.unlink()


def _port_key(port: int | None) -> int:
    return -1 if port is None else port


def _daemon_alive(pid_file: Path) -> bool:
    try:
        pid = int(pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return False
    return b"dsec" in cmdline
