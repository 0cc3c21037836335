"""The platform DNS resolver: what sandboxes with a network ask for names.

It knows each sandbox by its source address (anti-spoofing in the ruleset makes that trustworthy). In
allowlist mode it answers only the names on that sandbox's list, refusing the rest and counting them
(names are a channel out: a resolver that forwards any name lets a sandbox exfiltrate through DNS);
every address it hands out is added to that sandbox's allow set, with the entry's ports, for longer than
the TTL it gives. In full mode it answers any name. Only A records are answered (IPv6 is not routed to
sandboxes: AAAA gets an empty answer). Upstream is the host's resolver plus static entries
(``dsec serve --resolve NAME=IP``). Work is bounded per sandbox and in total so a hostile sandbox cannot
starve the others or the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import dns.exception
import dns.flags
import dns.message
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from ...protocol.network import valid_name

log = logging.getLogger("dsec.network")

PORT = 53
TTL = 60  # what answers say; allow-set entries live longer (ALLOW_TIMEOUT)
ALLOW_TIMEOUT = 10 * TTL
MAX_INFLIGHT_PER_SANDBOX = 8
MAX_INFLIGHT = 128
MAX_TCP_PER_SANDBOX = 4
MAX_TCP_QUERIES = 64
TCP_IDLE_S = 10.0
UPSTREAM_TIMEOUT_S = 5.0
MAX_ADDRESSES = 16


@dataclass
class Client:
    """One sandbox as the resolver sees it."""

    sandbox_id: str
    mode: str  # "full", "allow" or "deny" (full but some networks; names may be allowed past them)
    names: dict[str, set[int | None]] = field(default_factory=dict)  # allowed name -> its ports
    denied: int = 0
    inflight: int = 0
    tcp: int = 0


# (client, addresses, ports): make the addresses reachable before the answer is sent
OnResolved = Callable[[Client, list[str], set[int | None]], Awaitable[None]]
Upstream = Callable[[str], Awaitable[list[str]]]


def decide(client: Client | None, qname: str) -> str:
    """``"resolve"`` or ``"refuse"`` for a question about ``qname`` from ``client``."""
    if client is None:
        return "refuse"
    try:
        name = valid_name(qname)
    except ValueError:
        return "refuse"
    if client.mode in ("full", "deny") or name in client.names:
        return "resolve"
    return "refuse"


def reply(
    query: dns.message.Message, rcode: dns.rcode.Rcode, addresses: list[str] | None = None
) -> dns.message.Message:
    response = dns.message.make_response(query)
    response.set_rcode(rcode)
    response.flags |= dns.flags.RA
    if addresses:
        q = query.question[0]
        response.answer.append(dns.rrset.from_text_list(q.name, TTL, "IN", "A", addresses))
    return response


async def host_lookup(name: str) -> list[str]:
    """The host's resolver (getaddrinfo), IPv4 only."""
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(name, None, family=socket.AF_INET, type=socket.SOCK_STREAM), UPSTREAM_TIMEOUT_S
        )
    except (socket.gaierror, TimeoutError, UnicodeError):
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))[:MAX_ADDRESSES]


class Resolver:
    def __init__(self, address: str, on_resolved: OnResolved, static: dict[str, list[str]] | None = None) -> None:
        self.address = address
        self.on_resolved = on_resolved
        self.static = {valid_name(k): v for k, v in (static or {}).items()}
        self.upstream: Upstream = host_lookup
        self.clients: dict[str, Client] = {}  # by source address
        self._inflight = 0
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        resolver = self

        class Udp(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
                resolver._spawn(resolver._udp_query(data, addr))

        transport, _ = await loop.create_datagram_endpoint(Udp, local_addr=(self.address, PORT))
        self._udp = transport
        self._tcp = await asyncio.start_server(self._tcp_conn, self.address, PORT, reuse_address=True)

    async def close(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
        for task in list(self._tasks):
            task.cancel()

    def _spawn(self, coro: Awaitable[None]) -> None:
        if len(self._tasks) >= MAX_INFLIGHT:
            if hasattr(coro, "close"):
                coro.close()
            return
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _udp_query(self, data: bytes, addr: tuple[str, int]) -> None:
        answer = await self.answer(data, addr[0])
        if answer is not None and self._udp is not None:
            self._udp.sendto(answer, addr)

    async def _tcp_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        client = self.clients.get(peer[0]) if peer else None
        if client is None or client.tcp >= MAX_TCP_PER_SANDBOX:
            writer.close()
            return
        client.tcp += 1
        try:
            for _ in range(MAX_TCP_QUERIES):
                head = await asyncio.wait_for(reader.readexactly(2), TCP_IDLE_S)
                (size,) = struct.unpack("!H", head)
                data = await asyncio.wait_for(reader.readexactly(size), TCP_IDLE_S)
                answer = await self.answer(data, peer[0], tcp=True)
                if answer is None:
                    break
                writer.write(struct.pack("!H", len(answer)) + answer)
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            client.tcp -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def answer(self, data: bytes, source: str, tcp: bool = False) -> bytes | None:
        """The wire answer to one query from ``source``; None: not worth an answer (garbage)."""
        try:
            query = dns.message.from_wire(data)
        except (dns.exception.DNSException, ValueError):
            return None
        if query.flags & dns.flags.QR:
            return None
        client = self.clients.get(source)
        response = await self._respond(query, client)
        try:
            return response.to_wire(max_size=65535 if tcp else 512)
        except dns.exception.TooBig:
            small = dns.message.make_response(query)
            small.flags |= dns.flags.TC
            return small.to_wire()

    async def _respond(self, query: dns.message.Message, client: Client | None) -> dns.message.Message:
        if query.opcode() != dns.opcode.QUERY:
            return reply(query, dns.rcode.NOTIMP)
        if len(query.question) != 1:
            return reply(query, dns.rcode.FORMERR)
        q = query.question[0]
        qname = q.name.to_text(omit_final_dot=True)
        if decide(client, qname) == "refuse" or q.rdclass != dns.rdataclass.IN:
            if client is not None:
                client.denied += 1
            return reply(query, dns.rcode.REFUSED)
        assert client is not None
        if q.rdtype != dns.rdatatype.A:
            return reply(query, dns.rcode.NOERROR)  # AAAA and the rest: no such records here
        if client.inflight >= MAX_INFLIGHT_PER_SANDBOX:
            return reply(query, dns.rcode.SERVFAIL)
        client.inflight += 1
        self._inflight += 1
        try:
            name = valid_name(qname)
            addresses = self.static.get(name) or await self.upstream(name)
            if not addresses:
                return reply(query, dns.rcode.NXDOMAIN)
            if name in client.names:  # an allowed name: its addresses open (past a deny list too)
                await self.on_resolved(client, addresses, client.names.get(name, set()))
            return reply(query, dns.rcode.NOERROR, addresses)
        except Exception:
            log.exception("resolving %s for %s failed", qname, client.sandbox_id)
            return reply(query, dns.rcode.SERVFAIL)
        finally:
            client.inflight -= 1
            self._inflight -= 1
