"""Network policy end to end: a real daemon, real veths and nftables, a real "remote" network namespace.

The remote side is a network namespace of its own (not a host address), reached from the root namespace
through a veth with addresses outside the sandbox pool, running TCP and UDP echo servers on a few ports.
Every probe runs inside a sandbox; every verdict comes from the kernel.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import dsec
from dsec.isolation.network import addresses, nft

from .conftest import Daemon, release_node, require_kind, shut_down, start_daemon

X = 100 + os.getpid() % 100
Y = 8 * (os.getpid() % 32)
EXT_NS = f"dsec-test-ext-{os.getpid()}"
EXT_IF = f"dxt{os.getpid() % 100000}"
# the remote's public-looking addresses (TEST-NET-2: outside every range "full" is denied by default),
# and one in a private range, which "full" does not reach unless an allowlist names it
GW, EXT_A, EXT_B = (f"198.51.100.{Y + i}" for i in (1, 2, 3))
GW_P, EXT_P = f"10.202.{X}.1", f"10.202.{X}.2"
PORTS = (8080, 8081)

SERVER = textwrap.dedent(
    """
    import socket, sys, threading
    def tcp(addr, port):
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((addr, port)); s.listen(64)
        while True:
            c, _ = s.accept()
            c.sendall(f"{addr}:{port}\\n".encode()); c.close()
    def udp(addr, port):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((addr, port))
        while True:
            data, peer = s.recvfrom(512); s.sendto(b"udp " + data, peer)
    for addr in sys.argv[1:]:
        for port in (8080, 8081):
            threading.Thread(target=tcp, args=(addr, port), daemon=True).start()
            threading.Thread(target=udp, args=(addr, port), daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()
    """
)

# Run inside a sandbox: one line of JSON per probe, "open" only when the server answered.
PROBE = textwrap.dedent(
    """
    import json, socket, struct, sys
    def tcp(host, port):
        try:
            s = socket.create_connection((host, port), timeout=1.5)
        except socket.timeout:
            return "timeout"
        except OSError as e:
            return type(e).__name__
        try:
            s.settimeout(1.5)
            return "open" if s.recv(64) else "connected"
        except OSError:
            return "connected"
    def udp(host, port):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(1.5)
        try:
            s.sendto(b"ping", (host, port))
            return "open" if s.recv(64).startswith(b"udp") else "closed"
        except socket.timeout:
            return "timeout"
        except OSError as e:
            return type(e).__name__
    def tcp6(host, port):
        try:
            socket.create_connection((host, port), timeout=1.5)
            return "connected"
        except OSError as e:
            return type(e).__name__
    def resolve(name):
        try:
            return socket.gethostbyname(name)
        except OSError as e:
            return type(e).__name__
    def dns_tcp(server, name):
        q = struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0)
        q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\\0" + struct.pack("!HH", 1, 1)
        s = socket.create_connection((server, 53), timeout=3)
        s.sendall(struct.pack("!H", len(q)) + q)
        data = s.recv(2048)[2:]
        return data[3] & 0xF
    out = {}
    for spec in sys.argv[1:]:
        kind, _, rest = spec.partition(":")
        if kind == "dns":
            out[spec] = resolve(rest)
        elif kind == "dnstcp":
            server, _, name = rest.partition("/")
            out[spec] = dns_tcp(server, name)
        else:
            host, _, port = rest.rpartition(":")
            out[spec] = {"tcp": tcp, "udp": udp, "tcp6": tcp6}[kind](host.strip("[]"), int(port))
    print(json.dumps(out))
    """
)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def remote() -> Iterator[None]:
    """A network namespace with three addresses outside the pool, serving TCP and UDP on 8080 and 8081."""
    subprocess.run(["ip", "netns", "del", EXT_NS], capture_output=True)
    ip("netns", "add", EXT_NS)
    server = None
    try:
        ip("link", "add", EXT_IF, "type", "veth", "peer", "name", "eth0", "netns", EXT_NS)
        ip("addr", "add", f"{GW}/29", "dev", EXT_IF)
        ip("addr", "add", f"{GW_P}/29", "dev", EXT_IF)
        ip("link", "set", EXT_IF, "up")
        for cmd in (
            ["addr", "add", f"{EXT_A}/29", "dev", "eth0"],
            ["addr", "add", f"{EXT_B}/29", "dev", "eth0"],
            ["addr", "add", f"{EXT_P}/29", "dev", "eth0"],
            ["link", "set", "eth0", "up"],
            ["link", "set", "lo", "up"],
            ["route", "add", "default", "via", GW],
        ):
            ip("-n", EXT_NS, *cmd)
        server = subprocess.Popen(
            ["ip", "netns", "exec", EXT_NS, sys.executable, "-c", SERVER, EXT_A, EXT_B, EXT_P],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        assert server.stdout is not None and server.stdout.readline().strip() == b"ready"
        yield
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "link", "del", EXT_IF], capture_output=True)
        subprocess.run(["ip", "netns", "del", EXT_NS], capture_output=True)


@pytest.fixture(scope="module")
def netd(remote: None, request: pytest.FixtureRequest) -> Iterator[Daemon]:
    """A daemon of this module's own: its resolver knows the remote's names."""
    state = Path(tempfile.mkdtemp(prefix="dsec-net-"))
    d = start_daemon(state, "--resolve", f"ext.test={EXT_A}", "--resolve", f"other.test={EXT_B}")
    failed = request.session.testsfailed
    try:
        yield d
    finally:
        shut_down(d)
        if request.session.testsfailed > failed:  # its daemon's and fetcher's logs explain a failure here
            print(f"\n[dsec] network daemon state kept: {state} (daemon.log, images/fetcher/fetcher.log)")
        else:
            shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
def make(netd: Daemon) -> Iterator[Callable[..., dsec.Sandbox]]:
    made: list[dsec.Sandbox] = []

    def create(**kwargs: object) -> dsec.Sandbox:
        kwargs.setdefault("image", "dsec/debian:12")
        sb = dsec.Sandbox.create(client=netd.client(), **kwargs)
        made.append(sb)
        return sb

    yield create
    for sb in made:
        try:
            sb.kill()
        except dsec.DsecError:
            pass


def probe(sb: dsec.Sandbox, *specs: str) -> dict[str, object]:
    res = sb.exec(["python3", "-c", PROBE, *specs], timeout=60)
    assert res.exit_code == 0, res.stderr
    result: dict[str, object] = json.loads(res.stdout)
    return result


def table(d: Daemon) -> str:
    return nft.table_name(str(d.state_dir.resolve()))


@pytest.fixture
def host_listener() -> Iterator[int]:
    """A TCP service on every host address (as the daemon's own port would be)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 0))
    s.listen(16)
    stop = threading.Event()

    def serve() -> None:
        s.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = s.accept()
                c.sendall(b"host\n")
                c.close()
            except OSError:
                continue

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield s.getsockname()[1]
    stop.set()
    t.join()
    s.close()


def reached(found: dict[str, object]) -> list[str]:
    """The probes that got through (an answer, or at least a connection)."""
    return [k for k, v in found.items() if v in ("open", "connected")]


def unreachable_specs(status: dsec.NetworkStatus, port: int, neighbour: str) -> list[str]:
    host_side = str(ipaddress.IPv4Address(status.address or "0.0.0.0") - 1)  # the pair's even half
    return [
        f"tcp:192.0.2.2:{port}",
        f"tcp:{host_side}:{port}",
        f"tcp:{status.resolver}:{port}",
        f"tcp:127.0.0.1:{port}",
        "tcp:169.254.169.254:80",
        "udp:169.254.169.254:53",
        f"tcp:{neighbour}:9000",
        "tcp6:[fd00:ec2::254]:80",
        "tcp6:[::1]:80",
    ]


def test_no_network_is_loopback_only(make: Callable[..., dsec.Sandbox], host_listener: int) -> None:
    sb = make()
    assert sb.info().network is None
    assert sb.exec("ls /sys/class/net").stdout.split() == ["lo"]
    found = probe(sb, f"tcp:{EXT_A}:8080", f"tcp:192.0.2.2:{host_listener}", "dns:ext.test")
    assert not reached(found), found
    assert sb.network_status().address is None


def test_allowlist_opens_only_what_it_lists(
    make: Callable[..., dsec.Sandbox], netd: Daemon, host_listener: int
) -> None:
    neighbour = make(network="full")
    neighbour.exec("nohup python3 -m http.server 9000 >/dev/null 2>&1 &")
    for _ in range(50):  # the neighbour serves (so that not reaching it means something)
        if reached(probe(neighbour, "tcp:127.0.0.1:9000")):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the neighbour's server did not start")
    sb = make(network={"allow": [f"{EXT_A}/32:8080", "ext.test:8081", f"{EXT_P}:8080"]})
    status = sb.network_status()
    assert status.policy == dsec.NetworkAllow(allow=[f"{EXT_A}:8080", "ext.test:8081", f"{EXT_P}:8080"])
    assert status.address is not None and ipaddress.IPv4Address(status.address) in addresses.POOL
    assert sb.exec("cat /etc/resolv.conf").stdout == f"nameserver {status.resolver}\n"
    assert sb.exec("cat /proc/net/if_inet6 | wc -l").stdout.strip() == "0"
    before = status.denied_packets
    found = probe(
        sb,
        f"tcp:{EXT_A}:8080",
        f"udp:{EXT_A}:8080",
        f"tcp:{EXT_A}:8081",
        f"tcp:{EXT_B}:8080",
        f"tcp:{EXT_P}:8080",
        *unreachable_specs(status, host_listener, neighbour.network_status().address or ""),
    )
    assert found.pop(f"tcp:{EXT_A}:8080") == "open"
    assert found.pop(f"udp:{EXT_A}:8080") == "open"
    assert found.pop(f"tcp:{EXT_P}:8080") == "open"  # a private network, named by the allowlist
    assert not reached(found), found
    # the name on the list resolves (and opens its port); names not on it are refused and counted
    names = probe(sb, "dns:ext.test", "dns:other.test", "dns:example.com", f"dnstcp:{status.resolver}/other.test")
    assert names["dns:ext.test"] == EXT_A
    assert names["dns:other.test"] == names["dns:example.com"] == "gaierror"
    assert names[f"dnstcp:{status.resolver}/other.test"] == 5  # REFUSED
    assert probe(sb, f"tcp:{EXT_A}:8081")[f"tcp:{EXT_A}:8081"] == "open"
    after = sb.network_status()
    assert after.denied_packets > before
    assert after.denied_dns >= 3
    assert any(a.startswith(f"{EXT_A}:8081") for a in after.allowed)


def test_full_reaches_out_but_never_the_unreachable_set(make: Callable[..., dsec.Sandbox], host_listener: int) -> None:
    neighbour = make(network={"allow": []})
    sb = make(network="full")
    status = sb.network_status()
    found = probe(
        sb,
        f"tcp:{EXT_A}:8081",
        f"tcp:{EXT_B}:8080",
        f"tcp:{EXT_P}:8080",  # private: not "full"'s to reach (dsec serve --full-deny)
        "dns:other.test",
        *unreachable_specs(status, host_listener, neighbour.network_status().address or ""),
    )
    assert found.pop(f"tcp:{EXT_A}:8081") == "open"
    assert found.pop(f"tcp:{EXT_B}:8080") == "open"
    assert found.pop("dns:other.test") == EXT_B
    assert not reached(found), found
    assert sb.network_status().denied_packets > 0


def test_a_deny_list_is_full_but_what_it_denies(make: Callable[..., dsec.Sandbox], host_listener: int) -> None:
    neighbour = make(network={"allow": []})
    sb = make(network={"deny": [f"{EXT_A}:*", f"{EXT_B}:8081"], "allow": ["ext.test:8080"]})
    status = sb.network_status()
    assert status.policy == dsec.NetworkDeny(deny=[f"{EXT_A}:*", f"{EXT_B}:8081"], allow=["ext.test:8080"])
    before = status.denied_packets
    found = probe(
        sb,
        f"tcp:{EXT_A}:8080",  # denied until the allowed name resolves to it
        f"tcp:{EXT_A}:8081",
        f"udp:{EXT_A}:8080",
        f"tcp:{EXT_B}:8080",
        f"udp:{EXT_B}:8080",
        f"tcp:{EXT_B}:8081",
        f"tcp:{EXT_P}:8080",  # private: "full"'s denials hold under a deny list
        "dns:other.test",
        *unreachable_specs(status, host_listener, neighbour.network_status().address or ""),
    )
    assert found.pop(f"tcp:{EXT_B}:8080") == "open"
    assert found.pop(f"udp:{EXT_B}:8080") == "open"
    assert found.pop("dns:other.test") == EXT_B  # names resolve as under "full"
    assert not reached(found), found
    assert sb.network_status().denied_packets > before
    # the allowed name opens its port past the deny list, and only that port
    assert probe(sb, "dns:ext.test")["dns:ext.test"] == EXT_A
    opened = probe(sb, f"tcp:{EXT_A}:8080", f"tcp:{EXT_A}:8081")
    assert opened == {f"tcp:{EXT_A}:8080": "open", f"tcp:{EXT_A}:8081": opened[f"tcp:{EXT_A}:8081"]}
    assert opened[f"tcp:{EXT_A}:8081"] != "open"
    # changed while it runs: the open flow's next packet follows the new list
    sb.set_network({"deny": [f"{EXT_B}:*"]})
    again = probe(sb, f"tcp:{EXT_A}:8081", f"tcp:{EXT_B}:8080")
    assert again[f"tcp:{EXT_A}:8081"] == "open" and again[f"tcp:{EXT_B}:8080"] != "open"


def test_policy_changes_on_a_running_sandbox_both_ways(make: Callable[..., dsec.Sandbox]) -> None:
    sb = make()
    target = f"tcp:{EXT_B}:8081"
    assert probe(sb, target)[target] != "open"
    status = sb.set_network({"allow": [f"{EXT_B}:8081"]})
    assert status.address is not None
    assert probe(sb, target)[target] == "open"
    sb.set_network({"allow": [f"{EXT_B}:8080"]})
    assert probe(sb, target)[target] != "open"
    sb.set_network("full")
    assert probe(sb, target)[target] == "open"
    assert sb.info().network == "full"
    gone = sb.set_network(None)
    assert gone.address is None and gone.policy is None
    assert sb.exec("ls /sys/class/net").stdout.split() == ["lo"]
    assert probe(sb, target)[target] != "open"
    assert not Path(f"/sys/class/net/{nft.ifname(sb.id)}").exists()


def test_sandbox_cannot_take_another_address(make: Callable[..., dsec.Sandbox], netd: Daemon) -> None:
    sb = make(network="full")
    status = sb.network_status()
    spoof = sb.exec("/.dsec/busybox ip addr add 10.201.0.99/32 dev eth0", user="root")
    assert spoof.exit_code != 0 and "not permitted" in (spoof.stderr + spoof.stdout).lower()
    raw = sb.exec(["python3", "-c", "import socket; socket.socket(socket.AF_INET, socket.SOCK_RAW, 255)"], user="root")
    assert raw.exit_code != 0 and "PermissionError" in raw.stderr
    # and were it to send from another address, the kernel drops it: only its own pair is an owner
    out = subprocess.run(["nft", "-j", "list", "set", "inet", table(netd), "owners"], capture_output=True, text=True)
    owners = [e["concat"] for i in json.loads(out.stdout)["nftables"] if "set" in i for e in i["set"].get("elem", [])]
    assert [nft.ifname(sb.id), status.address] in owners
    assert all(addr == status.address for name, addr in owners if name == nft.ifname(sb.id))


def test_kill_removes_veth_rules_and_lease(make: Callable[..., dsec.Sandbox], netd: Daemon) -> None:
    sb = make(network={"allow": ["ext.test:80"]})
    name = nft.ifname(sb.id)
    index = None
    for link in addresses.LEASES.iterdir():
        if os.readlink(link) == name:
            index = link.name
    assert index is not None and Path(f"/sys/class/net/{name}").exists()
    sb.kill()
    assert not Path(f"/sys/class/net/{name}").exists()
    assert not (addresses.LEASES / index).exists()
    ruleset = subprocess.run(["nft", "list", "table", "inet", table(netd)], capture_output=True, text=True).stdout
    assert nft.key(sb.id) not in ruleset and name not in ruleset


def test_bad_policies_are_refused(make: Callable[..., dsec.Sandbox], netd: Daemon) -> None:
    client = netd.client()
    for bad in ({"allow": ["10.0.0.0/33:80"]}, {"allow": ["host:0"]}, {"allow": ["127.0.0.1:80"]}, "host", {"x": 1}):
        with pytest.raises(dsec.InvalidRequest):
            dsec.Sandbox.create(image="dsec/busybox", network=bad, client=client)  # type: ignore[arg-type]
    sb = make(image="dsec/busybox")
    with pytest.raises(dsec.InvalidRequest):
        sb.set_network({"allow": ["a..b:80"]})
    assert sb.network_status().policy is None


def test_daemon_restart_keeps_enforcing(remote: None) -> None:
    state = Path(tempfile.mkdtemp(prefix="dsec-net-restart-"))
    d = start_daemon(state, "--resolve", f"ext.test={EXT_A}")
    try:
        sb = dsec.Sandbox.create(image="dsec/debian:12", network={"allow": ["ext.test:8080"]}, client=d.client())
        assert probe(sb, "dns:ext.test", f"tcp:{EXT_A}:8080")[f"tcp:{EXT_A}:8080"] == "open"
        d.stop()
        d = start_daemon(state, "--resolve", f"ext.test={EXT_A}")
        sb = dsec.Sandbox.connect(sb.id, client=d.client())
        assert sb.info().state == dsec.State.running
        found = probe(sb, "dns:ext.test", "dns:other.test", f"tcp:{EXT_A}:8080", f"tcp:{EXT_A}:8081")
        assert found == {
            "dns:ext.test": EXT_A,
            "dns:other.test": "gaierror",
            f"tcp:{EXT_A}:8080": "open",
            f"tcp:{EXT_A}:8081": "timeout",
        }
        assert sb.network_status().policy == dsec.NetworkAllow(allow=["ext.test:8080"])
        sb.kill()
    finally:
        shut_down(d)
        release_node(state)
        shutil.rmtree(state, ignore_errors=True)
    # a daemon that stops with no sandbox on the network leaves nothing behind
    assert subprocess.run(["nft", "list", "table", "inet", nft.table_name(str(state.resolve()))]).returncode != 0


def test_create_latency(make: Callable[..., dsec.Sandbox]) -> None:
    """Not a benchmark: the extra cost of a network stays in milliseconds (printed with -s)."""
    times: dict[str, float] = {}
    for label, policy in (("none", None), ("allow", {"allow": [f"{EXT_A}:8080"]}), ("full", "full")):
        samples = []
        for _ in range(5):
            started = time.monotonic()
            sb = make(image="dsec/busybox", network=policy)
            samples.append(time.monotonic() - started)
            sb.kill()
        times[label] = sorted(samples)[len(samples) // 2]
    print(f"\n[network] median create seconds: {times}")
    assert times["allow"] - times["none"] < 0.5


def _vm(netd: Daemon, kind: str, image: str, **kwargs: object) -> dsec.Sandbox:
    require_kind(netd.client(), kind)
    return dsec.Sandbox.create(image=image, kind=kind, client=netd.client(), timeout=900, **kwargs)


def test_microvm_policies_on_its_tap(netd: Daemon, host_listener: int) -> None:
    """A VM's NIC is a tap on the host under the same ruleset: the same verdicts as a container's veth."""
    sb = _vm(netd, "microvm", "dsec/debian:12", network={"allow": ["ext.test:8080"]})
    try:
        tap = nft.ifname(sb.id)
        assert Path(f"/sys/class/net/{tap}").exists()
        status = sb.network_status()
        assert status.address is not None and ipaddress.IPv4Address(status.address) in addresses.POOL
        found = probe(
            sb,
            "dns:ext.test",
            "dns:other.test",
            f"tcp:{EXT_A}:8080",
            f"tcp:{EXT_A}:8081",
            f"tcp:{EXT_B}:8080",
            *unreachable_specs(status, host_listener, "10.201.0.1"),
        )
        assert found.pop("dns:ext.test") == EXT_A
        assert found.pop("dns:other.test") == "gaierror"
        assert found.pop(f"tcp:{EXT_A}:8080") == "open"
        assert not reached(found), found
        assert sb.network_status().denied_packets > 0 and sb.network_status().denied_dns >= 1
        # full, then none: the tap stays (QEMU holds it) but is down and empty, its lease and rules gone
        sb.set_network("full")
        found = probe(sb, f"tcp:{EXT_B}:8081", f"tcp:{EXT_P}:8080", f"tcp:192.0.2.2:{host_listener}")
        assert found == {
            f"tcp:{EXT_B}:8081": "open",
            f"tcp:{EXT_P}:8080": "timeout",
            f"tcp:192.0.2.2:{host_listener}": "timeout",
        }
        sb.set_network(None)
        assert not reached(probe(sb, f"tcp:{EXT_B}:8081")), "a lifted policy must cut the VM off"
        link = subprocess.run(["ip", "-j", "addr", "show", tap], capture_output=True, text=True, check=True)
        (info,) = json.loads(link.stdout)
        assert info["operstate"] == "DOWN" and not info.get("addr_info")
        assert all(os.readlink(p) != tap for p in addresses.LEASES.iterdir())
        assert (
            nft.key(sb.id)
            not in subprocess.run(["nft", "list", "table", "inet", table(netd)], capture_output=True, text=True).stdout
        )
    finally:
        sb.kill()
    assert not Path(f"/sys/class/net/{nft.ifname(sb.id)}").exists()  # gone with its QEMU


def test_vm_kind_full_network(netd: Daemon, host_listener: int) -> None:
    """kind=vm (the image's own init on q35, virtio-net on PCI): out to the remote, never to the host."""
    sb = _vm(netd, "vm", "dsec/busybox", network="full")
    try:
        out = sb.exec(
            f"for t in {EXT_A}:8080 192.0.2.2:{host_listener} 169.254.169.254:80 {EXT_P}:8080; do "
            'echo "$t=$(/.dsec/busybox nc -w 2 ${t%:*} ${t#*:} </dev/null 2>/dev/null)"; done',
            timeout=60,
        ).stdout.split()
        assert out == [
            f"{EXT_A}:8080={EXT_A}:8080",
            f"192.0.2.2:{host_listener}=",
            "169.254.169.254:80=",
            f"{EXT_P}:8080=",
        ]
    finally:
        sb.kill()
