"""Warm pools over the in-memory FakeBackend: matching, refills, draining, capacity, restart, the API.

The backend is a fake here because what is checked is the core's bookkeeping; the same behaviour over
real sandboxes of each kind is tests/integration/test_warm_pools.py's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dsec.core.admission import AdmissionOptions
from dsec.core.manager import SandboxManager
from dsec.core.node import node_status
from dsec.core.warm_match import servable, shape_of
from dsec.errors import InvalidRequest, NotFound, Overloaded, SandboxNotFound
from dsec.images.store import ImageStore
from dsec.protocol.network import NetworkAllow
from dsec.protocol.node import TenantQuota
from dsec.protocol.pools import WarmPoolSpec, default_name, parse_warm
from dsec.protocol.sandbox import CreateSandbox, ExecRequest, Limits, State
from dsec.tenancy import OPERATOR, Caller

from ...fakes.backend import FakeBackend, make_image
from ..conftest import AUTH, IMAGE, ROOMY, Api, new_manager

Core = tuple[SandboxManager, FakeBackend]


def req(**kw: object) -> CreateSandbox:
    return CreateSandbox.model_validate({"image": IMAGE, **kw})


def spec(size: int = 2, **kw: object) -> WarmPoolSpec:
    return WarmPoolSpec.model_validate({"image": IMAGE, "size": size, **kw})


async def until(check: Callable[[], bool], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def idle(mgr: SandboxManager, name: str = "p") -> int:
    return mgr.warm.pools[name].info().idle


# ---- the spec on a line ----------------------------------------------------------------------------------


def test_warm_spec_forms() -> None:
    s = parse_warm("dsec/debian:12=3")
    assert (s.image, s.kind, s.size, s.limits) == ("dsec/debian:12", "container", 3, Limits())
    s = parse_warm("dsec/debian:12@microvm:cpu=1,memory=512Mi=2")
    assert (s.image, s.kind, s.size, s.limits.cpu, s.limits.memory) == ("dsec/debian:12", "microvm", 2, 1.0, 512 << 20)
    s = parse_warm("127.0.0.1:5000/org/task:1:memory=1Gi=1")  # a registry port and a tag are not limits
    assert (s.image, s.limits.memory) == ("127.0.0.1:5000/org/task:1", 1 << 30)
    digest = "sha256:" + "a" * 64
    s = parse_warm(f"python@{digest}@function=4")  # a digest's @ is not a kind's
    assert (s.image, s.kind) == (f"python@{digest}", "function")


@pytest.mark.parametrize(
    "text",
    [
        "dsec/debian:12",  # no size
        "dsec/debian:12=x",
        "dsec/debian:12=-1",
        "dsec/debian:12=5000",  # over the bound
        "dsec/debian:12:cpu=1",  # the size is missing: cpu=1 is not one
        "dsec/debian:12:cpu=lots=1",
        "dsec/debian:12:disk=0=1",  # below the floor
        "dsec/debian:12:speed=9=1",  # not a limit
        "dsec/debian:12:cpu=1,cpu=2=1",
        "Dsec/Debian=1",
        "dsec/debian:12@nonsense=1",  # not a kind, so part of the image name, which it cannot be
    ],
)
def test_bad_warm_specs_say_the_form(text: str) -> None:
    with pytest.raises(InvalidRequest, match="warm pool"):
        parse_warm(text)


def test_default_names_are_unique_names() -> None:
    s = parse_warm("registry.example:5000/org/Task_1:v2@microvm=1".replace("T", "t"))
    first = default_name(s, set())
    assert first == "registry.example-5000-org-task_1-v2-microvm"
    assert default_name(s, {first}) == first + "-2"


def test_the_shape_is_what_the_sandbox_is() -> None:
    base = shape_of("admin", "container", Limits(), None)
    assert base == shape_of("admin", "container", Limits(memory="512Mi"), None)  # one size, two spellings
    allow = NetworkAllow(allow=["10.0.0.0/8:443", "1.2.3.4:53"])
    assert shape_of("admin", "container", Limits(), allow) == shape_of(
        "admin", "container", Limits(), NetworkAllow(allow=["10.0.0.0/8:443", "1.2.3.4:53"])
    )
    for other in (
        shape_of("alice", "container", Limits(), None),
        shape_of("admin", "microvm", Limits(), None),
        shape_of("admin", "container", Limits(disk="2Gi"), None),
        shape_of("admin", "container", Limits(), "full"),
        shape_of("admin", "container", Limits(), allow),
    ):
        assert other != base
    assert servable(CreateSandbox(image=IMAGE)) and not servable(CreateSandbox(image=IMAGE, trajectory="t/1"))
    assert not servable(CreateSandbox(image=IMAGE, volumes={"/data": "v"}))


# ---- filling, matching, handing over ---------------------------------------------------------------------


async def test_a_pool_fills_and_its_members_are_nobodys(core: Core) -> None:
    mgr, backend = core
    mgr.tenants.add("alice")
    mgr.set_warm_pool("p", spec(2))
    await until(lambda: idle(mgr) == 2)
    members = list(mgr.warm.pools["p"].idle)
    assert sorted(members) == sorted(backend.created)
    assert mgr.list() == [] and mgr.live_count("admin") == 0
    for sid in members:
        with pytest.raises(SandboxNotFound):
            mgr.info(sid, caller=Caller("alice"))
        assert mgr.info(sid).state == State.running  # the operator reaches it by id
    assert mgr.admission.admitted == 2  # counted against capacity like any sandbox
    assert b'dsec_warm_pool_idle{kind="container",pool="p",tenant="admin"} 2.0' in mgr.metrics.render()
    assert [p.idle for p in node_status(mgr, OPERATOR).warm_pools] == [2]
    assert node_status(mgr, Caller("alice")).warm_pools == []


async def test_a_matching_creation_is_handed_a_member_as_its_own(core: Core) -> None:
    mgr, backend = core
    mgr.set_warm_pool("p", spec(1))
    await until(lambda: idle(mgr) == 1)
    member = mgr.warm.pools["p"].idle[0]
    made = len(backend.created)
    before = time.time()
    await asyncio.sleep(0.05)
    info = await mgr.create(req(labels={"job": "7"}, env={"A": "1"}, timeout=30))
    assert info.id == member and len(backend.created) == made  # nothing new was made for it
    assert info.labels == {"job": "7"} and info.env == {"A": "1"} and info.owner == "admin"
    assert info.created_at.timestamp() >= before + 0.05
    assert 29 < info.expires_at.timestamp() - info.created_at.timestamp() <= 30.001
    assert "claim" in info.timings
    assert [s.id for s in mgr.list()] == [member]
    stored = mgr.store.get(member)
    assert stored is not None and stored.pool is None and stored.labels == {"job": "7"}
    result = await mgr.exec(member, ExecRequest(cmd="env"))
    assert result.exit_code == 0 and backend.execs[-1].env["A"] == "1"  # the claimant's environment
    await until(lambda: idle(mgr) == 1)  # refilled in the background
    assert mgr.warm.pools["p"].idle[0] != member
    pool = mgr.warm.pools["p"].info()
    assert (pool.claims, pool.refills, pool.misses) == (1, 2, 0)
    await mgr.kill(member)
    assert member not in mgr.warm.pools["p"].idle  # a member serves one claimant, never back to the pool


@pytest.mark.parametrize(
    "differs",
    [
        {"limits": {"memory": "256Mi"}},
        {"limits": {"cpu": 1}},
        {"trajectory": "job/1"},
    ],
)
async def test_a_creation_that_differs_is_never_served(core: Core, differs: dict[str, object]) -> None:
    mgr, _ = core
    mgr.set_warm_pool("p", spec(1))
    await until(lambda: idle(mgr) == 1)
    member = mgr.warm.pools["p"].idle[0]
    info = await mgr.create(req(**differs))
    assert info.id != member
    assert list(mgr.warm.pools["p"].idle) == [member]
    assert mgr.warm.pools["p"].info().misses == 0


async def test_another_tenants_creation_is_made_for_itself(core: Core) -> None:
    mgr, _ = core
    mgr.tenants.add("alice")
    mgr.set_warm_pool("p", spec(1))
    await until(lambda: idle(mgr) == 1)
    member = mgr.warm.pools["p"].idle[0]
    theirs = await mgr.create(req(), caller=Caller("alice"))
    assert theirs.id != member and theirs.owner == "alice"
    assert list(mgr.warm.pools["p"].idle) == [member]


async def test_a_tenants_pool_serves_that_tenant_only(core: Core) -> None:
    mgr, _ = core
    mgr.tenants.add("alice")
    mgr.set_warm_pool("p", spec(1, tenant="alice"))
    await until(lambda: idle(mgr) == 1)
    member = mgr.warm.pools["p"].idle[0]
    assert (await mgr.create(req())).id != member
    info = await mgr.create(req(), caller=Caller("alice"))
    assert info.id == member and info.owner == "alice"
    assert mgr.info(member, caller=Caller("alice")).labels == {}


async def test_a_removed_tenants_pool_is_emptied_and_not_refilled(core: Core) -> None:
    mgr, _ = core
    mgr.tenants.add("alice")
    mgr.set_warm_pool("p", spec(2, tenant="alice"))
    await until(lambda: idle(mgr) == 2)
    await mgr.remove_tenant("alice")
    await until(lambda: idle(mgr) == 0)
    await asyncio.sleep(1.5)  # a pass or two
    pool = mgr.warm.pools["p"].info()
    assert pool.idle == 0 and pool.filling == 0 and "removed" in (pool.waiting or "")
    assert not [r for r in mgr.sandboxes.live() if r.pool]


def test_dsec_top_shows_the_pools() -> None:
    from rich.console import Console

    from dsec.cli.top import render
    from dsec.protocol.node import NodeStatus, Ratios, Resources
    from dsec.protocol.pools import WarmPoolInfo

    zero = Resources(cpu=0, memory=0)
    info = WarmPoolInfo(
        name="web", spec=spec(3), idle=2, filling=1, claims=7, misses=1, refills=9, drained=0, reclaimed=0, failures=0
    )
    status = NodeStatus(
        node="n", version="v", kinds=["container"], capacity=zero, ratios=Ratios(cpu=8, memory=1.2),
        allocatable=zero, requested=zero, free=zero, used=zero, sandboxes={}, queued=0, starting={},
        start_slots={}, memory_pressure=0.0, evictions=0, warm_pools=[info],
    )  # fmt: skip
    console = Console(record=True, width=200)
    console.print(render(status))
    text = console.export_text()
    assert "warm pools" in text and "web" in text and "2/3" in text


async def test_an_empty_pool_counts_a_miss_and_the_creation_is_made(core: Core) -> None:
    mgr, _ = core
    mgr.set_warm_pool("p", spec(1))
    await until(lambda: idle(mgr) == 1)
    first = await mgr.create(req())
    second = await mgr.create(req())  # before the refill is done (or after: either way one was made)
    assert first.id != second.id
    await until(lambda: idle(mgr) == 1)
    pool = mgr.warm.pools["p"].info()
    assert pool.claims + pool.misses == 2 and pool.claims >= 1


# ---- versions ---------------------------------------------------------------------------------------


async def test_a_pool_drains_when_its_image_names_another_version(core: Core, workdir: Path) -> None:
    mgr, _ = core
    mgr.set_warm_pool("p", spec(2))
    await until(lambda: idle(mgr) == 2)
    old = set(mgr.warm.pools["p"].idle)
    old_digest = mgr.warm.pools["p"].info().version
    await mgr.remove_image(IMAGE)  # idle members alone do not hold a name
    await until(lambda: idle(mgr) == 0)
    make_image(workdir / "images", IMAGE, files={"etc/version": b"2\n"})
    await until(lambda: idle(mgr) == 2, within=10)
    pool = mgr.warm.pools["p"].info()
    assert pool.version != old_digest and pool.drained == 2
    assert not old & set(mgr.warm.pools["p"].idle)
    for sid in old:
        assert mgr.store.get(sid).state == State.stopped  # type: ignore[union-attr]
    info = await mgr.create(req())
    assert mgr.record(info.id).image_digest == pool.version and pool.version is not None


# ---- capacity ---------------------------------------------------------------------------------------


async def test_a_pool_fills_only_what_is_free_and_gives_it_back_to_real_creations(workdir: Path) -> None:
    # room for four sandboxes of the default request (0.25 cpu)
    mgr, _ = new_manager(workdir, AdmissionOptions(cpu_capacity=1.0, cpu_ratio=1.0, memory_capacity=1 << 40))
    await mgr.start()
    try:
        with pytest.raises(InvalidRequest, match="cpu"):
            mgr.set_warm_pool("big", spec(1, limits={"cpu": 2}))  # larger than the node admits
        mgr.set_warm_pool("p", spec(8))
        await until(lambda: idle(mgr) == 4)
        await asyncio.sleep(0.2)
        pool = mgr.warm.pools["p"].info()
        assert pool.idle == 4 and pool.waiting is not None and "capacity" in pool.waiting
        other = Limits(memory=256 << 20)  # matches no pool: needs capacity the members hold
        made = [await mgr.create(req(limits=other.model_dump(), queue_timeout=0)) for _ in range(3)]
        assert len(made) == 3 and mgr.admission.queued == 0
        assert mgr.warm.pools["p"].info().reclaimed == 3
        await asyncio.sleep(0.2)
        assert idle(mgr) == 1  # nothing free to refill into
        with pytest.raises(Overloaded):
            for _ in range(2):
                await mgr.create(req(limits=other.model_dump(), queue_timeout=0))
        for info in made:
            await mgr.kill(info.id)
        await until(lambda: idle(mgr) == 3)  # refilled once capacity came back
    finally:
        await mgr.close()


async def test_a_full_quota_takes_only_its_own_tenants_idle_sandboxes(core: Core) -> None:
    mgr, _ = core
    for name in ("alice", "bob"):
        mgr.tenants.add(name)
        mgr.tenants.set_quota(name, TenantQuota(sandboxes=2))
    mgr.set_warm_pool("ops", spec(2))  # the operator's
    mgr.set_warm_pool("alice", spec(2, tenant="alice", limits={"memory": "256Mi"}))
    await until(lambda: idle(mgr, "ops") == 2 and idle(mgr, "alice") == 2)
    bob = Caller("bob")
    for _ in range(2):
        await mgr.create(req(), caller=bob)
    with pytest.raises(Overloaded):  # bob's quota is full: nobody else's idle sandboxes would help
        await mgr.create(req(queue_timeout=0), caller=bob)
    assert (idle(mgr, "ops"), idle(mgr, "alice")) == (2, 2)
    # alice's quota is held by her pool's idle sandboxes: a creation of hers that matches no pool takes one
    info = await mgr.create(req(queue_timeout=0), caller=Caller("alice"))
    assert info.owner == "alice" and mgr.warm.pools["alice"].info().reclaimed == 1
    assert idle(mgr, "ops") == 2


# ---- configuration ----------------------------------------------------------------------------------


async def test_resizing_keeps_members_and_changing_replaces_them(core: Core) -> None:
    mgr, _ = core
    mgr.set_warm_pool("p", spec(3))
    await until(lambda: idle(mgr) == 3)
    kept = set(mgr.warm.pools["p"].idle)
    mgr.set_warm_pool("p", spec(1))
    assert idle(mgr) == 1 and set(mgr.warm.pools["p"].idle) <= kept
    mgr.set_warm_pool("p", spec(1, limits={"memory": "256Mi"}))
    assert idle(mgr) == 0
    await until(lambda: idle(mgr) == 1)
    assert not set(mgr.warm.pools["p"].idle) & kept
    mgr.remove_warm_pool("p")
    assert mgr.warm_pools() == []
    with pytest.raises(NotFound):
        mgr.remove_warm_pool("p")
    await until(lambda: not [r for r in mgr.sandboxes.live() if r.pool])


async def test_pools_that_could_never_fill_are_refused(core: Core) -> None:
    mgr, _ = core
    with pytest.raises(InvalidRequest, match="kind 'microvm'"):
        mgr.set_warm_pool("p", spec(1, kind="microvm"))
    with pytest.raises(NotFound, match="tenant"):
        mgr.set_warm_pool("p", spec(1, tenant="nobody"))
    assert mgr.warm_pools() == []


async def test_failing_refills_are_counted_and_backed_off(core: Core) -> None:
    mgr, backend = core
    backend.create_error = RuntimeError("no more")
    mgr.set_warm_pool("p", spec(2))
    await until(lambda: mgr.warm.pools["p"].info().failures >= 1)
    await asyncio.sleep(0.5)
    pool = mgr.warm.pools["p"].info()
    assert pool.failures <= 3 and pool.waiting is not None and "no more" in pool.waiting  # backed off
    backend.create_error = None
    await until(lambda: idle(mgr) == 2, within=10)
    assert mgr.warm.pools["p"].info().waiting is None


# ---- restart ----------------------------------------------------------------------------------------


async def test_members_end_with_the_daemon_and_crash_leftovers_are_not_readopted(workdir: Path) -> None:
    mgr, backend = new_manager(workdir)
    await mgr.start()
    mgr.set_warm_pool("p", spec(2))
    await until(lambda: idle(mgr) == 2)
    members = list(mgr.warm.pools["p"].idle)
    claimed = await mgr.create(req())
    await mgr.close()
    again = SandboxManager(
        state_dir=workdir / "state",
        images=ImageStore(workdir / "images", lazy=False, mount=False),
        kinds=["container"],
        admission=ROOMY,
    )
    backend2 = FakeBackend(again.ctx)
    again.backends["container"] = backend2
    for sid in members:
        if sid != claimed.id:  # killed as the daemon stopped
            rec = again.store.get(sid)
            assert rec is not None and rec.state == State.stopped and sid in backend.destroyed
    # a crash: a record of an idle member still says running
    stale = again.store.get(claimed.id)
    assert stale is not None
    stale.id, stale.pool = "sb-00000000beef", "p"
    again.store.put(stale)
    await again.start()
    try:
        assert claimed.id in [s.id for s in again.list()]  # a claimed one is an ordinary sandbox
        left = again.store.get("sb-00000000beef")
        assert left is not None and left.state == State.stopped and "warm-pool" in (left.reason or "")
        assert "sb-00000000beef" in backend2.destroyed
        assert again.warm_pools() == []  # pools set at run time last for the daemon's life
    finally:
        await again.close()


# ---- the HTTP API -----------------------------------------------------------------------------------


def test_pools_over_http_are_the_operators(api: Api) -> None:
    body = {"image": IMAGE, "size": 1, "limits": {"memory": "256Mi"}}
    reply = api.client.put("/v1/warm-pools/web", json=body, headers=AUTH)
    assert reply.status_code == 200, reply.text
    assert reply.json()["spec"]["limits"]["memory"] == 256 << 20
    tenant = api.client.post("/v1/tenants", json={"name": "alice"}, headers=AUTH).json()["token"]
    theirs = {"authorization": f"Bearer {tenant}"}
    for method, path in (("GET", "/v1/warm-pools"), ("PUT", "/v1/warm-pools/x"), ("DELETE", "/v1/warm-pools/web")):
        assert api.client.request(method, path, json=body, headers=theirs).status_code == 403
    for bad in ({**body, "size": -1}, {**body, "size": 5000}, {**body, "kind": "vmm"}, {**body, "extra": 1}):
        assert api.client.put("/v1/warm-pools/web", json=bad, headers=AUTH).status_code == 400, bad
    assert api.client.put("/v1/warm-pools/Bad_Name", json=body, headers=AUTH).status_code == 400
    listed = api.client.get("/v1/warm-pools", headers=AUTH).json()["pools"]
    assert [p["name"] for p in listed] == ["web"]
    assert api.client.delete("/v1/warm-pools/web", headers=AUTH).status_code == 204
    assert api.client.delete("/v1/warm-pools/web", headers=AUTH).status_code == 404
