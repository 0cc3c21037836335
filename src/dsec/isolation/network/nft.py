"""The nftables ruleset of one daemon: text generation (pure, unit-tested) and applying it.

One ``inet`` table per daemon (named by a hash of its state dir, so concurrent daemons never clash).
What comes from a sandbox's veth goes through, in order:

- prerouting (raw): IPv6 and packets not carrying the sandbox's own source address are dropped
  (anti-spoofing; it also makes the resolver's "who is asking" trustworthy);
- input: to the host itself only DNS to the platform resolver passes; every host address, loopback and
  the daemon's port are dropped;
- forward: loopback, link-local (metadata), multicast, reserved and the whole sandbox pool (other
  sandboxes, any daemon's) are dropped; then the sandbox's own chain: ``full`` accepts, an allowlist
  accepts ``daddr . dport`` in its sets; the rest is dropped and counted in its named counter.

Accepted flows carry the sandbox's policy generation in their conntrack mark: established packets of
the current generation pass at once, and a policy change (a new generation) re-checks every open
connection. Nothing enters a sandbox that it did not start. An accept here never overrides another
table's drop, so concurrent daemons' tables compose.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ...errors import BackendError
from ...proc import spawn, wait
from ...protocol.network import FORBIDDEN_NETS, AllowEntry
from .addresses import POOL

IFACE_PREFIX = "dv"  # every sandbox veth on the host, whichever daemon made it
PROTOS = "meta l4proto { tcp, udp }"
UNREACHABLE = ", ".join(str(n) for n in (*FORBIDDEN_NETS, POOL))


def table_name(state_dir: str) -> str:
    return "dsec_" + hashlib.sha256(state_dir.encode()).hexdigest()[:10]


def ifname(sandbox_id: str) -> str:
    """The host side of a sandbox's veth: ≤15 characters, unique host-wide (ids are random)."""
    return IFACE_PREFIX + sandbox_id.removeprefix("sb-")[:13]


def key(sandbox_id: str) -> str:
    return sandbox_id.removeprefix("sb-")[:13]


@dataclass
class SandboxRules:
    """What the ruleset holds for one sandbox."""

    sandbox_id: str
    address: str
    mode: str  # "full", "allow" or "deny" (full but the denied networks)
    gen: int
    entries: list[AllowEntry] = field(default_factory=list)
    full_deny: tuple[str, ...] = ()  # networks "full" does not reach (private ranges by default)
    denied: list[AllowEntry] = field(default_factory=list)  # "deny": networks it does not reach

    @property
    def key(self) -> str:
        return key(self.sandbox_id)

    @property
    def ifname(self) -> str:
        return ifname(self.sandbox_id)


def base(table: str, resolver: str, guard_forwarding: bool) -> str:
    """The daemon's table: declared if missing, base chains rewritten; sandboxes' objects kept."""
    t = f"inet {table}"
    lines = [
        f"add table {t}",
        f"add set {t} ifs {{ type ifname; }}",
        f"add set {t} owners {{ type ifname . ipv4_addr; }}",
        f"add map {t} cnt {{ type ifname : counter; }}",
        f"add map {t} pol {{ type ifname : verdict; }}",
        f"add chain {t} deny",
        f"add chain {t} to_host",
        f"add chain {t} egress",
        f"add chain {t} prerouting {{ type filter hook prerouting priority raw; policy accept; }}",
        f"add chain {t} input {{ type filter hook input priority filter; policy accept; }}",
        f"add chain {t} forward {{ type filter hook forward priority filter; policy accept; }}",
        f"add chain {t} postrouting {{ type nat hook postrouting priority srcnat; policy accept; }}",
    ]
    for chain in ("deny", "to_host", "egress", "prerouting", "input", "forward", "postrouting"):
        lines.append(f"flush chain {t} {chain}")
    rules = {
        "deny": ["counter name iifname map @cnt drop"],
        "prerouting": [
            "iifname @ifs meta nfproto ipv6 jump deny",
            "iifname @ifs iifname . ip saddr != @owners jump deny",
        ],
        "to_host": [f"ip daddr {resolver} {PROTOS} th dport 53 accept", "jump deny"],
        "input": ["iifname @ifs jump to_host"],
        "egress": [f"ip daddr {{ {UNREACHABLE} }} jump deny", "iifname vmap @pol", "jump deny"],
        "forward": [
            "oifname @ifs ct state established,related accept",
            "iifname @ifs jump egress",
            "oifname @ifs drop",
        ],
        "postrouting": ["iifname @ifs oifname != @ifs masquerade"],
    }
    if guard_forwarding:
        # forwarding was off before dsec turned it on: nothing but sandbox traffic is forwarded
        rules["forward"].append(f'iifname != "{IFACE_PREFIX}*" oifname != "{IFACE_PREFIX}*" drop')
    for chain, body in rules.items():
        lines += [f"add rule {t} {chain} {rule}" for rule in body]
    return "\n".join(lines) + "\n"


def _elements(table: str, pair_set: str, any_set: str, entries: Iterable[AllowEntry]) -> list[str]:
    """The commands that fill a sandbox's (address . port) set and its any-port set from ``entries``."""
    pairs, anys = _static_elements(entries)
    lines = [f"add element {table} {pair_set} {{ {', '.join(pairs)} }}"] if pairs else []
    if anys:
        lines.append(f"add element {table} {any_set} {{ {', '.join(anys)} }}")
    return lines


def _static_elements(entries: Iterable[AllowEntry]) -> tuple[list[str], list[str]]:
    """(``addr . port`` elements, any-port address elements), disjoint as interval sets need them."""
    by_port: dict[int, list[ipaddress.IPv4Network]] = {}
    any_port: list[ipaddress.IPv4Network] = []
    for e in entries:
        if e.net is None:
            continue
        if e.port is None:
            any_port.append(e.net)
        else:
            by_port.setdefault(e.port, []).append(e.net)
    pairs = [f"{net} . {port}" for port, nets in sorted(by_port.items()) for net in ipaddress.collapse_addresses(nets)]
    return pairs, [str(n) for n in ipaddress.collapse_addresses(any_port)]


def _objects(t: str, k: str) -> list[str]:
    return [
        f"add counter {t} deny_{k}",
        f"add set {t} allow_{k} {{ type ipv4_addr . inet_service; flags interval; }}",
        f"add set {t} allany_{k} {{ type ipv4_addr; flags interval; }}",
        f"add set {t} dyn_{k} {{ type ipv4_addr . inet_service; flags timeout; }}",
        f"add set {t} dynall_{k} {{ type ipv4_addr; flags timeout; }}",
        f"add set {t} blk_{k} {{ type ipv4_addr . inet_service; flags interval; }}",
        f"add set {t} blkall_{k} {{ type ipv4_addr; flags interval; }}",
        f"add chain {t} sb_{k}",
    ]


def install(table: str, s: SandboxRules, keep_resolved: bool = False) -> str:
    """Add or replace one sandbox's chain and sets, and register its interface. Idempotent."""
    t, k, name = f"inet {table}", s.key, s.ifname
    lines = _objects(t, k)
    lines += [f"flush chain {t} sb_{k}", f"flush set {t} allow_{k}", f"flush set {t} allany_{k}"]
    lines += [f"flush set {t} blk_{k}", f"flush set {t} blkall_{k}"]
    if not keep_resolved:
        lines += [f"flush set {t} dyn_{k}", f"flush set {t} dynall_{k}"]
    mark = f"ct mark set {s.gen} accept"
    lines.append(f"add rule {t} sb_{k} ct state established,related ct mark {s.gen} accept")
    if s.mode != "full":
        # an allowlist's destinations; under a deny list, the exceptions to it
        lines += _elements(t, f"allow_{k}", f"allany_{k}", s.entries)
        lines += [
            f"add rule {t} sb_{k} {PROTOS} ip daddr . th dport @allow_{k} {mark}",
            f"add rule {t} sb_{k} {PROTOS} ip daddr @allany_{k} {mark}",
            f"add rule {t} sb_{k} {PROTOS} ip daddr . th dport @dyn_{k} {mark}",
            f"add rule {t} sb_{k} {PROTOS} ip daddr @dynall_{k} {mark}",
        ]
    if s.mode != "allow":
        if s.full_deny:
            # the node's own networks (a cluster's gateway, other nodes, the layer repository): an
            # allowlist may name them, "full" does not reach them
            lines.append(f"add rule {t} sb_{k} ip daddr {{ {', '.join(s.full_deny)} }} jump deny")
        if s.mode == "deny":
            lines += _elements(t, f"blk_{k}", f"blkall_{k}", s.denied)
            lines += [
                f"add rule {t} sb_{k} {PROTOS} ip daddr . th dport @blk_{k} jump deny",
                f"add rule {t} sb_{k} ip daddr @blkall_{k} jump deny",
            ]
        lines.append(f"add rule {t} sb_{k} {mark}")
    lines += [
        f'add element {t} ifs {{ "{name}" }}',
        f'add element {t} owners {{ "{name}" . {s.address} }}',
        f'add element {t} cnt {{ "{name}" : "deny_{k}" }}',
        f'add element {t} pol {{ "{name}" : jump sb_{k} }}',
    ]
    return "\n".join(lines) + "\n"


def remove(table: str, sandbox_id: str, address: str | None) -> str:
    """Take one sandbox out of the table; each object is declared first so the batch never fails on
    something already gone (nft 1.0.6 has no ``destroy``)."""
    t, k, name = f"inet {table}", key(sandbox_id), ifname(sandbox_id)
    lines = _objects(t, k)
    elements = [("ifs", f'"{name}"', f'"{name}"'), ("cnt", f'"{name}" : "deny_{k}"', f'"{name}"')]
    elements.append(("pol", f'"{name}" : jump sb_{k}', f'"{name}"'))
    if address is not None:
        elements.append(("owners", f'"{name}" . {address}', f'"{name}" . {address}'))
    for set_name, add, delete in elements:
        lines += [f"add element {t} {set_name} {{ {add} }}", f"delete element {t} {set_name} {{ {delete} }}"]
    lines += [f"delete chain {t} sb_{k}", f"delete counter {t} deny_{k}"]
    lines += [f"delete set {t} {s}_{k}" for s in ("allow", "allany", "dyn", "dynall", "blk", "blkall")]
    return "\n".join(lines) + "\n"


def resolved(table: str, sandbox_id: str, addresses: Iterable[str], ports: Iterable[int | None], timeout: int) -> str:
    """Allow ``addresses`` on ``ports`` (None: any port) for ``timeout`` seconds, refreshing entries
    already there (add, delete, add: the first add makes the delete safe)."""
    t, k = f"inet {table}", key(sandbox_id)
    lines = []
    for addr in addresses:
        for port in ports:
            set_name, elem = (f"dynall_{k}", addr) if port is None else (f"dyn_{k}", f"{addr} . {port}")
            lines += [
                f"add element {t} {set_name} {{ {elem} timeout {timeout}s }}",
                f"delete element {t} {set_name} {{ {elem} }}",
                f"add element {t} {set_name} {{ {elem} timeout {timeout}s }}",
            ]
    return "\n".join(lines) + "\n"


async def run(args: list[str], stdin: str | None = None, timeout: float = 30.0) -> str:
    """A host tool (nft, ip, nsenter) to completion; stdout, or BackendError with its stderr.

    Through posix_spawn: forking the daemon (asyncio's subprocesses) costs milliseconds per call here."""
    exe = which(args[0])
    with contextlib.ExitStack() as stack:
        inp = os.memfd_create("dsec-in", os.MFD_CLOEXEC)
        stack.callback(os.close, inp)
        if stdin:
            os.write(inp, stdin.encode())
            os.lseek(inp, 0, os.SEEK_SET)
        out, err = (stack.enter_context(tempfile.TemporaryFile()) for _ in range(2))
        pid = spawn([exe, *args[1:]], {0: inp, 1: out.fileno(), 2: err.fileno()})
        try:
            status = await asyncio.wait_for(wait(pid), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
            await wait(pid)
            raise BackendError(f"{args[0]} timed out") from None
        out.seek(0)
        err.seek(0)
        if status != 0:
            why = err.read().decode(errors="replace").strip()[-600:]
            raise BackendError(f"{' '.join(args[:3])} failed: {why}")
        return out.read().decode(errors="replace")


_PATHS: dict[str, str] = {}


def which(tool: str) -> str:
    path = _PATHS.get(tool) or shutil.which(tool)
    if path is None:
        raise BackendError(f"{tool} is not installed (apt-get install nftables iproute2 util-linux)")
    _PATHS[tool] = path
    return path


async def apply(script: str) -> None:
    """One atomic nft transaction: all of it or none."""
    if script.strip():
        await run(["nft", "-f", "-"], script)


async def list_json(table: str, what: str, name: str) -> list[dict[str, Any]]:
    out = await run(["nft", "-j", "list", what, "inet", table, name])
    items = json.loads(out).get("nftables", [])
    return [i for i in items if isinstance(i, dict) and "metainfo" not in i]


async def counter(table: str, sandbox_id: str) -> int:
    """Packets dropped for this sandbox (its named counter)."""
    for item in await list_json(table, "counter", f"deny_{key(sandbox_id)}"):
        return int(item.get("counter", {}).get("packets", 0))
    return 0


def _elem_text(e: Any) -> str:
    if isinstance(e, dict) and "elem" in e:
        inner = e["elem"]
        return _elem_text(inner.get("val")) + (f" (expires in {inner['expires']}s)" if "expires" in inner else "")
    if isinstance(e, dict) and "concat" in e:
        addr, port = (_elem_text(p) for p in e["concat"])
        return f"{addr}:{port}"
    if isinstance(e, dict) and "prefix" in e:
        return f"{e['prefix']['addr']}/{e['prefix']['len']}"
    if isinstance(e, dict) and "range" in e:
        lo, hi = e["range"]
        return "*" if (lo, hi) in ((0, 65535), (1, 65535)) else f"{lo}-{hi}"
    return str(e)


async def allowed(table: str, sandbox_id: str) -> list[str]:
    """What the sandbox may reach now: its static entries and resolved names' addresses."""
    k = key(sandbox_id)
    found: list[str] = []
    for set_name, any_port in (
        (f"allow_{k}", False),
        (f"allany_{k}", True),
        (f"dyn_{k}", False),
        (f"dynall_{k}", True),
    ):
        for item in await list_json(table, "set", set_name):
            for e in item.get("set", {}).get("elem", []):
                text = _elem_text(e)
                if any_port:
                    addr, sep, rest = text.partition(" (")
                    text = f"{addr}:*" + (f" ({rest}" if sep else "")
                found.append(text)
    return found
