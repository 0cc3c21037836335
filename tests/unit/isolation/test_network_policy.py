"""Network policy parsing, the nftables text it becomes, and the resolver's answers (no kernel needed)."""

from __future__ import annotations

import asyncio
import ipaddress
from pathlib import Path

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import pytest
from pydantic import ValidationError

from dsec.errors import InvalidRequest
from dsec.isolation.network import addresses, nft
from dsec.isolation.network.options import DEFAULT_FULL_DENY, NetworkOptions, parse_full_deny
from dsec.isolation.network.resolver import ALLOW_TIMEOUT, Client, Resolver, decide
from dsec.isolation.network.static import parse_resolve
from dsec.protocol.network import NetworkAllow, NetworkDeny, from_json, parse_entry, to_json
from dsec.protocol.sandbox import CreateSandbox, NetworkStatus

from ..conftest import AUTH, IMAGE, Api

# ---- policy ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "normal"),
    [
        ("10.1.2.0/24:443", "10.1.2.0/24:443"),
        ("1.2.3.4:53", "1.2.3.4:53"),
        ("1.2.3.4/32:*", "1.2.3.4:*"),
        ("PyPI.org.:443", "pypi.org:443"),
        ("a-b.example.com:65535", "a-b.example.com:65535"),
        ("0.1.2.3.example:1", "0.1.2.3.example:1"),
    ],
)
def test_good_entries_normalise(text: str, normal: str) -> None:
    assert str(parse_entry(text)) == normal


@pytest.mark.parametrize(
    "text",
    [
        "10.1.2.0/24",  # no port
        "10.1.2.0/33:80",
        "10.1.2.1/24:80",  # host bits set
        "1.2.3.4:0",
        "1.2.3.4:65536",
        "1.2.3.4:-1",
        "1.2.3.4:http",
        "1.2.3.4:080000",
        "[::1]:80",
        "fd00:ec2::254:80",
        "127.0.0.1:80",
        "169.254.169.254:80",
        "0.0.0.0/0:443",  # overlaps loopback and link-local: "full" is the way to say that
        "224.0.0.1:5353",
        "bad_name:80",
        "-lead.example:80",
        "a..b:80",
        ("x" * 64) + ".com:80",
        ".".join(["abcdefghi"] * 30) + ":80",
        ":80",
        "",
        "name:*:*",
        "1.2.3.4:8\x000",
    ],
)
def test_bad_entries_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_entry(text)


def test_wire_model_validates_strictly() -> None:
    assert CreateSandbox.model_validate({}).network is None
    assert CreateSandbox.model_validate({"network": "full"}).network == "full"
    allow = CreateSandbox.model_validate({"network": {"allow": ["Example.com:443", "example.com:443"]}}).network
    assert allow == NetworkAllow(allow=["example.com:443"])
    for bad in ("host", "none", {"allow": ["x:1"], "extra": 1}, {"allow": "1.2.3.4:80"}, {"allow": ["1.2.3.4:0"]}):
        with pytest.raises(ValidationError):
            CreateSandbox.model_validate({"network": bad})
    with pytest.raises(ValidationError, match="at most 256"):
        NetworkAllow(allow=[f"10.0.{i // 256}.{i % 256}:80" for i in range(257)])
    assert to_json(from_json({"allow": ["1.2.3.4:80"]})) == {"allow": ["1.2.3.4:80"]}
    assert from_json("full") == "full" and from_json(None) is None and from_json("garbage") is None
    assert NetworkStatus(policy=None).denied_packets == 0


def test_static_resolve_entries() -> None:
    assert parse_resolve(["ext.test=10.0.0.1", "EXT.test=10.0.0.2"]) == {"ext.test": ["10.0.0.1", "10.0.0.2"]}
    for bad in ("ext.test", "ext.test=::1", "ext.test=300.1.1.1", "bad name=1.2.3.4"):
        with pytest.raises(InvalidRequest):
            parse_resolve([bad])


# ---- ruleset text ---------------------------------------------------------------------------------


def test_base_ruleset_drops_what_must_stay_unreachable() -> None:
    text = nft.base("dsec_t", "10.201.0.2", guard_forwarding=True)
    assert "add table inet dsec_t" in text
    assert "ip daddr 10.201.0.2 meta l4proto { tcp, udp } th dport 53 accept" in text
    rules = [line for line in text.splitlines() if line.startswith("add rule")]
    # the input path: resolver DNS, then everything else to the host dropped and counted
    assert rules.index("add rule inet dsec_t to_host jump deny") > rules.index(
        "add rule inet dsec_t to_host ip daddr 10.201.0.2 meta l4proto { tcp, udp } th dport 53 accept"
    )
    egress = next(r for r in rules if r.startswith("add rule inet dsec_t egress ip daddr"))
    for net in ("127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "10.201.0.0/16", "255.255.255.255/32"):
        assert net in egress
    assert "add rule inet dsec_t prerouting iifname @ifs iifname . ip saddr != @owners jump deny" in rules
    assert "add rule inet dsec_t prerouting iifname @ifs meta nfproto ipv6 jump deny" in rules
    assert 'add rule inet dsec_t forward iifname != "dv*" oifname != "dv*" drop' in rules
    assert "masquerade" in text
    unguarded = nft.base("dsec_t", "10.201.0.2", guard_forwarding=False)
    assert '!= "dv*"' not in unguarded


def test_sandbox_rules_for_an_allowlist() -> None:
    entries = NetworkAllow(
        allow=["10.1.0.0/16:443", "10.1.2.0/24:443", "10.2.0.0/16:*", "10.2.3.4:*", "1.2.3.4:53", "pypi.org:443"]
    ).entries()
    text = nft.install("dsec_t", nft.SandboxRules("sb-0123456789ab", "10.201.0.5", "allow", 77, entries))
    # interval sets refuse overlaps: same-port networks are merged, any-port ones too
    assert "add element inet dsec_t allow_0123456789ab { 1.2.3.4/32 . 53, 10.1.0.0/16 . 443 }" in text
    assert "add element inet dsec_t allany_0123456789ab { 10.2.0.0/16 }" in text
    assert "ct state established,related ct mark 77 accept" in text
    assert "ip daddr . th dport @dyn_0123456789ab ct mark set 77 accept" in text
    assert 'add element inet dsec_t owners { "dv0123456789ab" . 10.201.0.5 }' in text
    assert 'add element inet dsec_t pol { "dv0123456789ab" : jump sb_0123456789ab }' in text
    assert "flush set inet dsec_t dyn_0123456789ab" in text
    kept = nft.install("dsec_t", nft.SandboxRules("sb-0123456789ab", "10.201.0.5", "allow", 77, entries), True)
    assert "flush set inet dsec_t dyn_0123456789ab" not in kept
    full = nft.install("dsec_t", nft.SandboxRules("sb-0123456789ab", "10.201.0.5", "full", 9, []))
    assert "add rule inet dsec_t sb_0123456789ab ct mark set 9 accept" in full
    assert "@allow_" not in full


def test_full_mode_denies_the_nodes_own_networks_first() -> None:
    deny = parse_full_deny(["10.0.0.0/8", "10.1.0.0/16", "192.168.0.0/16", "169.254.0.0/16"])
    assert deny == ("10.0.0.0/8", "192.168.0.0/16")  # merged; link-local is unreachable in every mode anyway
    text = nft.install("dsec_t", nft.SandboxRules("sb-0123456789ab", "10.201.0.5", "full", 9, [], deny)).splitlines()
    drop = "add rule inet dsec_t sb_0123456789ab ip daddr { 10.0.0.0/8, 192.168.0.0/16 } jump deny"
    assert text.index(drop) < text.index("add rule inet dsec_t sb_0123456789ab ct mark set 9 accept")
    # an allowlist may name a private network: the deny list is "full"'s only
    allow = nft.install("dsec_t", nft.SandboxRules("sb-0123456789ab", "10.201.0.5", "allow", 9, [], deny))
    assert "10.0.0.0/8" not in allow
    assert NetworkOptions().full_deny == DEFAULT_FULL_DENY and "10.0.0.0/8" in DEFAULT_FULL_DENY
    assert parse_full_deny(["none"]) == ()
    for bad in (["10.0.0.0/33"], ["nonsense"], ["none", "10.0.0.0/8"], ["fd00::/8"]):
        with pytest.raises(InvalidRequest, match="--full-deny"):
            parse_full_deny(bad)


def test_a_deny_list_is_full_but_its_networks_with_allowed_exceptions_first() -> None:
    policy = NetworkDeny(deny=["8.8.8.0/24:*", "203.0.113.7:443", "8.8.8.8:*"], allow=["8.8.8.8:*", "ext.test:80"])
    assert policy.deny == ["8.8.8.0/24:*", "203.0.113.7:443", "8.8.8.8:*"]
    assert from_json(to_json(policy)) == policy
    rules = nft.SandboxRules(
        "sb-0123456789ab", "10.201.0.5", "deny", 5, policy.entries(), ("10.0.0.0/8",), policy.denied()
    )
    text = nft.install("dsec_t", rules).splitlines()
    assert "add element inet dsec_t blkall_0123456789ab { 8.8.8.0/24 }" in text
    assert "add element inet dsec_t blk_0123456789ab { 203.0.113.7/32 . 443 }" in text
    rule = "add rule inet dsec_t sb_0123456789ab"
    allowed = f"{rule} meta l4proto {{ tcp, udp }} ip daddr @allany_0123456789ab ct mark set 5 accept"
    private = "add rule inet dsec_t sb_0123456789ab ip daddr { 10.0.0.0/8 } jump deny"
    denied = "add rule inet dsec_t sb_0123456789ab ip daddr @blkall_0123456789ab jump deny"
    last = "add rule inet dsec_t sb_0123456789ab ct mark set 5 accept"
    # the exceptions first, then the node's own networks and the denied ones, then everything else
    assert text.index(allowed) < text.index(private) < text.index(denied) < text.index(last) == len(text) - 5
    assert "delete set inet dsec_t blk_0123456789ab" in nft.remove("dsec_t", "sb-0123456789ab", None)
    for bad in ({"deny": []}, {"deny": ["example.com:*"]}, {"deny": ["127.0.0.1:*"]}, {"deny": ["8.8.8.8/16:*"]}):
        with pytest.raises(ValidationError):
            NetworkDeny.model_validate(bad)
    with pytest.raises(ValidationError):
        CreateSandbox.model_validate({"network": {"deny": ["8.8.8.8:*"], "extra": 1}})
    assert CreateSandbox.model_validate({"network": {"deny": ["8.8.8.8:*"]}}).network == NetworkDeny(deny=["8.8.8.8:*"])


def test_removal_and_resolved_entries_never_fail_on_missing_objects() -> None:
    text = nft.remove("dsec_t", "sb-0123456789ab", "10.201.0.5").splitlines()
    # every delete is preceded by an add of the same object
    for i, line in enumerate(text):
        if line.startswith("delete element"):
            assert text[i - 1].startswith("add element")
    assert text.index("delete chain inet dsec_t sb_0123456789ab") > text.index(
        'delete element inet dsec_t pol { "dv0123456789ab" }'
    )
    res = nft.resolved("dsec_t", "sb-0123456789ab", ["1.2.3.4"], [None, 443], 600)
    assert "add element inet dsec_t dynall_0123456789ab { 1.2.3.4 timeout 600s }" in res
    assert "delete element inet dsec_t dyn_0123456789ab { 1.2.3.4 . 443 }" in res
    assert len(nft.ifname("sb-0123456789ab")) <= 15


def test_table_names_differ_per_state_dir() -> None:
    assert nft.table_name("/a") != nft.table_name("/b")
    assert nft.table_name("/a") == nft.table_name("/a")


# ---- address leases -------------------------------------------------------------------------------


def test_leases_are_exclusive_and_reclaimed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = addresses.lease("dvaaaa", tmp_path)
    assert addresses.lease("dvaaaa", tmp_path) == a  # its own lease again
    b = addresses.lease("dvbbbb", tmp_path)
    assert a != b
    for pair in (a, b):
        host, sb = ipaddress.IPv4Address(pair.host), ipaddress.IPv4Address(pair.sandbox)
        assert host in addresses.POOL and int(sb) == int(host) + 1 and int(host) % 2 == 0
    # young leases of interfaces that do not exist (yet) are kept; old ones are reclaimed
    assert addresses.sweep(tmp_path) == 0
    monkeypatch.setattr(addresses, "LEASE_GRACE_S", -1.0)
    assert addresses.sweep(tmp_path) == 2
    addresses.release("dvaaaa", a.index, tmp_path)
    assert addresses.find("dvaaaa", a.index, tmp_path) is None


# ---- the resolver ---------------------------------------------------------------------------------


def test_decide() -> None:
    allow = Client("sb-1", "allow", {"ext.test": {80}})
    assert decide(allow, "ext.test") == "resolve"
    assert decide(allow, "EXT.TEST") == "resolve"
    assert decide(allow, "sub.ext.test") == "refuse"
    assert decide(allow, "other.test") == "refuse"
    assert decide(Client("sb-2", "full"), "anything.example") == "resolve"
    assert decide(Client("sb-2", "full"), "bad_name") == "refuse"
    assert decide(Client("sb-3", "deny"), "anything.example") == "resolve"
    assert decide(None, "ext.test") == "refuse"


def _ask(resolver: Resolver, name: str, source: str, rdtype: str = "A") -> dns.message.Message:
    query = dns.message.make_query(name, rdtype)
    wire = asyncio.run(resolver.answer(query.to_wire(), source))
    assert wire is not None
    return dns.message.from_wire(wire)


def test_resolver_answers_only_what_the_sandbox_may_resolve() -> None:
    granted: list[tuple[str, list[str], set[int | None]]] = []

    async def on_resolved(client: Client, found: list[str], ports: set[int | None]) -> None:
        granted.append((client.sandbox_id, found, ports))

    async def upstream(name: str) -> list[str]:
        return {"pypi.org": ["151.101.0.223"]}.get(name, [])

    r = Resolver("10.201.0.2", on_resolved, {"ext.test": ["10.202.0.2"]})
    r.upstream = upstream
    allow = r.clients["10.201.0.5"] = Client("sb-a", "allow", {"ext.test": {8080, None}, "pypi.org": {443}})
    full = r.clients["10.201.0.7"] = Client("sb-f", "full")

    ok = _ask(r, "ext.test", "10.201.0.5")
    assert ok.rcode() == dns.rcode.NOERROR
    assert [rd.address for rd in ok.answer[0]] == ["10.202.0.2"] and ok.answer[0].ttl <= ALLOW_TIMEOUT
    assert granted == [("sb-a", ["10.202.0.2"], {8080, None})]
    assert _ask(r, "pypi.org", "10.201.0.5").answer[0][0].address == "151.101.0.223"

    # names off the list, and every record type of them, are refused and counted: no channel out
    for name, rdtype in (("other.test", "A"), ("secret.attacker.example", "TXT"), ("x.ext.test", "A")):
        assert _ask(r, name, "10.201.0.5", rdtype).rcode() == dns.rcode.REFUSED
    assert allow.denied == 3
    assert len(granted) == 2
    assert _ask(r, "ext.test", "10.201.0.5", "AAAA").answer == []  # no IPv6, no records
    # full mode answers anything it can resolve, and grants nothing (it needs no grant)
    assert _ask(r, "pypi.org", "10.201.0.7").rcode() == dns.rcode.NOERROR
    assert _ask(r, "nowhere.example", "10.201.0.7").rcode() == dns.rcode.NXDOMAIN
    assert full.denied == 0 and len(granted) == 2
    # a deny list's sandbox resolves anything, and its allowed names open past the deny list
    r.clients["10.201.0.9"] = Client("sb-d", "deny", {"pypi.org": {None}})
    assert _ask(r, "nowhere.example", "10.201.0.9").rcode() == dns.rcode.NXDOMAIN
    assert _ask(r, "ext.test", "10.201.0.9").answer[0][0].address == "10.202.0.2"
    assert len(granted) == 2
    assert _ask(r, "pypi.org", "10.201.0.9").rcode() == dns.rcode.NOERROR
    assert granted[-1] == ("sb-d", ["151.101.0.223"], {None})
    # strangers (not a sandbox address) get nothing
    assert _ask(r, "ext.test", "192.0.2.9").rcode() == dns.rcode.REFUSED


def test_resolver_survives_garbage_and_bounds_work() -> None:
    async def never(name: str) -> list[str]:
        await asyncio.sleep(3600)
        return []

    async def nothing(client: Client, found: list[str], ports: set[int | None]) -> None:
        return None

    r = Resolver("10.201.0.2", nothing)
    r.upstream = never
    client = r.clients["10.201.0.5"] = Client("sb-a", "full")

    async def scenario() -> list[int]:
        assert await r.answer(b"", "10.201.0.5") is None
        assert await r.answer(b"\xff" * 40, "10.201.0.5") is None
        response = dns.message.make_response(dns.message.make_query("x.test", "A"))
        assert await r.answer(response.to_wire(), "10.201.0.5") is None  # answers are not questions
        queries = [dns.message.make_query(f"n{i}.test", "A").to_wire() for i in range(20)]
        tasks = [asyncio.ensure_future(r.answer(q, "10.201.0.5")) for q in queries]
        await asyncio.sleep(0.05)
        done = [t for t in tasks if t.done()]
        for t in tasks:
            t.cancel()
        codes = []
        for t in done:
            wire = t.result()
            assert wire is not None
            codes.append(dns.message.from_wire(wire).rcode())
        return codes

    codes = asyncio.run(scenario())
    # at most MAX_INFLIGHT_PER_SANDBOX queries wait upstream; the rest fail at once instead of queueing
    assert len(codes) == 12 and set(codes) == {dns.rcode.SERVFAIL}
    assert client.inflight == 0
    two = dns.message.make_query("a.test", "A")
    two.question.append(dns.message.make_query("b.test", "A").question[0])
    wire = asyncio.run(r.answer(two.to_wire(), "10.201.0.5"))
    assert wire is not None and dns.message.from_wire(wire).rcode() == dns.rcode.FORMERR
    assert not dns.message.from_wire(wire).flags & dns.flags.TC
    assert dns.rdatatype.A == 1


# ---- the routes (over the in-memory fake kind, which has no network) -------------------------------


def test_routes_parse_every_policy_form_and_refuse_what_the_kind_cannot_do(api: Api) -> None:
    sid = api.create()["id"]
    url = f"/v1/sandboxes/{sid}/network"
    got = api.client.get(url, headers=AUTH)
    assert got.status_code == 200 and got.json()["policy"] is None and got.json()["address"] is None
    assert api.client.put(url, content=b"null", headers={**AUTH, "content-type": "application/json"}).status_code == 200
    for body, needle in (("full", "not supported for kind"), ({"allow": ["1.2.3.4:80"]}, "not supported for kind")):
        reply = api.client.put(url, json=body, headers=AUTH)
        assert reply.status_code == 400 and needle in reply.json()["error"]["message"], reply.text
    for bad in ({"allow": ["1.2.3.4:0"]}, "host", {"allow": ["x:1"], "more": 1}, 7):
        reply = api.client.put(url, json=bad, headers=AUTH)
        assert reply.status_code == 400, reply.text
    created = api.client.post("/v1/sandboxes", json={"image": IMAGE, "network": "full"}, headers=AUTH)
    assert created.status_code == 400 and "not supported for kind" in created.text
    assert api.client.get("/v1/sandboxes/sb-nothere/network", headers=AUTH).status_code == 404


def test_pairs_round_trip() -> None:
    pair = addresses.Pair(1234)
    assert addresses.index_of(pair.host) == addresses.index_of(pair.sandbox) == 1234
