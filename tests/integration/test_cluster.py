"""`dsec cluster` on a real 3-node Ray cluster started on this machine: a node daemon per Ray node (its
own state directory), real containers, the gateway in front, the SDK unchanged.

A burst of creations spreads over the three nodes; one node is removed from Ray mid-burst. Every
creation must end with a sandbox or a clear error (none hangs), the removed node's sandboxes must read
``lost`` with the reason, later creations must land on the two others, and a trajectory begun on the
removed node must resume on another through the shared trajectory log (PostgreSQL when it is installed,
else one SQLite file on this machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dsec
from dsec.cluster.options import RayOptions
from dsec.cluster.runner import run_ray

from ..pg import PgServer, pg_unavailable, start_postgres
from .conftest import IMAGES_DIR, free_port, shut_down, start_daemon

ray = pytest.importorskip("ray", reason="`dsec cluster` needs Ray (the dsec[cluster] extra)")
from ray.cluster_utils import Cluster  # noqa: E402

IMAGE = "dsec/busybox"
NODES = 3
BURST = 60
KILL_AFTER = 18  # creations done before the node is removed
AT_ONCE = 12
AFTER = 8
# each node counts 2 cores x 8 for sandboxes: 64 of 0.25 cores each, so two nodes hold everything the
# test makes (3 nodes' worth of burst included); a test that ran out would wait for capacity
NODE_ARGS = ("--cpu-capacity", "2", "--cpu-ratio", "8", "--log-level", "info")
WAIT_FOR_CAPACITY = 60.0  # the SDK's retries on 429: bounded, so that running out fails instead of waiting
STEPS = ("echo one >> /tmp/log; wc -l < /tmp/log", "echo two >> /tmp/log; wc -l < /tmp/log")


@pytest.fixture(scope="module")
def trajectory_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if pg_unavailable() is None:
        server: PgServer = start_postgres()
        try:
            yield server.create_database("cluster")
        finally:
            server.stop()
    else:  # every node is a process on this machine: one SQLite file serves them all
        yield f"sqlite:///{tmp_path_factory.mktemp('cluster-log') / 'trajectories.db'}"


class Running:
    """The cluster's gateway and node daemons, run by ``run_ray`` in a thread of their own."""

    def __init__(self, opts: RayOptions) -> None:
        self.url: str | None = None
        self.ready = threading.Event()
        self.error: BaseException | None = None
        opts.ready = self._ready
        self.opts = opts
        self.loop = asyncio.new_event_loop()
        self.stop = asyncio.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _ready(self, url: str) -> None:
        self.url = url
        self.ready.set()

    def _run(self) -> None:
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as e:
            self.error = e
            self.ready.set()

    async def _main(self) -> None:
        await run_ray(self.opts, self.stop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(300)


async def create(client: dsec.AsyncClient, **kw: Any) -> dsec.AsyncSandbox:
    return await dsec.AsyncSandbox.create(IMAGE, timeout=900, client=client, wait_for_capacity=WAIT_FOR_CAPACITY, **kw)


async def wait_lost(client: dsec.AsyncClient, name: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = await client._transport.request("GET", "/v1/cluster")
        nodes = {n["name"]: n for n in reply.json()["nodes"]}
        if nodes[name]["health"] == "lost":
            return nodes
        await asyncio.sleep(0.2)
    raise AssertionError(f"node {name} was not declared lost within {timeout} s")


def test_a_burst_across_three_ray_nodes_survives_losing_one(trajectory_db: str) -> None:
    root = Path(tempfile.mkdtemp(prefix="dsec-cluster-"))
    os.chmod(root, 0o711)  # crun, in a sandbox's user namespace, traverses the state directories under it
    token = secrets.token_urlsafe(24)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"dsec_node": 1}})
    running: Running | None = None
    lost: list[str] = []  # the node removed, once it is
    passed = False
    session = Path(cluster.head_node.get_session_dir_path())  # Ray's logs
    try:
        for _ in range(NODES - 1):
            cluster.add_node(num_cpus=1, resources={"dsec_node": 1})
        ray.init(address=cluster.address, log_to_driver=False)
        opts = RayOptions(
            listen=f"http://127.0.0.1:{free_port()}",
            state_root=root,
            token=token,
            repository=str(IMAGES_DIR / "repository"),
            trajectory_db=trajectory_db,
            node_args=NODE_ARGS,
            interval=0.5,
            misses=3,
            e2b_listen=f"http://127.0.0.1:{free_port()}",
        )
        running = Running(opts)
        assert running.ready.wait(180), "the cluster did not come up in 3 minutes"
        assert running.error is None and running.url is not None, running.error
        e2b_through_ray(opts)
        asyncio.run(scenario(running.url, token, cluster, lost))
        passed = True
    finally:
        if running is not None:
            running.close()  # stops the surviving daemons, their sandboxes killed
        with contextlib.suppress(Exception):
            ray.shutdown()
        cluster.shutdown()
        for name in lost:
            release_lost_node(root / name)
        if passed:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(session, ignore_errors=True)
        else:
            print(f"\n[dsec] kept for a look: node daemons' state and logs in {root}, Ray's logs in {session}")


def e2b_through_ray(opts: RayOptions) -> None:
    """`cluster up --e2b-listen`: every Ray node's daemon serves the E2B API and the gateway routes to it."""
    e2b = pytest.importorskip("e2b")
    assert opts.e2b_listen is not None
    where = {"api_key": opts.token, "api_url": opts.e2b_listen, "sandbox_url": opts.e2b_listen}
    box = e2b.Sandbox.create("dsec/debian:12", timeout=120, **where)  # E2B runs commands with bash
    try:
        assert box.commands.run("echo on a ray node").stdout == "on a ray node\n"
        box.files.write("/tmp/r.txt", "ray")
        assert box.files.read("/tmp/r.txt") == "ray"
    finally:
        assert box.kill() is True


def release_lost_node(state: Path) -> None:
    """A removed node's daemon died with its actor, but its containers run on (this machine stays up):
    a daemon started on its state directory re-adopts them, and is stopped after killing them."""
    try:
        shut_down(start_daemon(state))
    except Exception as e:
        print(f"[dsec] could not release {state}: {e}")


async def scenario(url: str, token: str, cluster: Any, lost: list[str]) -> None:
    client = dsec.AsyncClient(url=url, token=token)
    try:
        await _scenario(client, url, token, cluster, lost)
    finally:
        await client.aclose()


async def _scenario(client: dsec.AsyncClient, url: str, token: str, cluster: Any, lost: list[str]) -> None:
    status = (await client._transport.request("GET", "/v1/cluster")).json()
    assert [n["health"] for n in status["nodes"]] == ["healthy"] * NODES
    ray_ids = {n["name"]: n["meta"]["ray_node"] for n in status["nodes"]}

    # a trajectory on every node (placement spreads them), each a few recorded calls in
    trajectories: dict[str, dsec.AsyncSandbox] = {}
    for i in range(NODES):
        sb = await create(client, trajectory=f"cluster/rollout-{i}")
        assert (await sb.exec(STEPS[0])).stdout.strip() == "1"
        await sb.files.write("/tmp/data", b"\x00payload\xff")
        assert (await sb.exec(STEPS[1])).stdout.strip() == "2"
        trajectories[f"cluster/rollout-{i}"] = sb
    head = cluster.head_node.node_id
    victim = next(sb._info.node for sb in trajectories.values() if ray_ids[sb._info.node or ""] != head)
    assert victim is not None
    victim_ray = next(n for n in cluster.list_all_nodes() if n.node_id == ray_ids[victim])

    # the burst, the node removed from Ray while it runs
    gate = asyncio.Semaphore(AT_ONCE)
    done = 0
    killed = asyncio.Event()

    async def one(i: int) -> dsec.AsyncSandbox | dsec.DsecError:
        nonlocal done
        async with gate:
            try:
                return await create(client, labels={"burst": "1"})
            except dsec.DsecError as e:
                return e
            finally:
                done += 1
                if done == KILL_AFTER:
                    killed.set()

    async def kill() -> float:
        await killed.wait()
        lost.append(victim)
        started = time.monotonic()
        await asyncio.to_thread(cluster.remove_node, victim_ray)
        return started

    started = time.monotonic()
    burst, (killed_at,) = await asyncio.wait_for(
        asyncio.gather(asyncio.gather(*(one(i) for i in range(BURST))), asyncio.gather(kill())), timeout=240
    )
    outcomes: list[dsec.AsyncSandbox | dsec.DsecError] = list(burst)
    made = [o for o in outcomes if isinstance(o, dsec.AsyncSandbox)]
    errors = [o for o in outcomes if isinstance(o, dsec.DsecError)]
    print(
        f"\n[dsec] burst of {BURST}: {len(made)} made, {len(errors)} errors in {time.monotonic() - started:.1f} s "
        f"(node {victim} removed {killed_at - started:.1f} s in); per node {Counter(s._info.node for s in made)}; "
        f"errors {Counter(type(e).__name__ for e in errors)}"
    )
    assert len(outcomes) == BURST  # every creation ended: a sandbox or a clear error
    assert {s._info.node for s in made} == set(ray_ids)  # the burst reached all three nodes
    assert len(made) >= BURST - AT_ONCE, errors[:3]  # at most those in flight on the lost node may fail
    for e in errors:
        assert e.code in ("daemon_unreachable", "overloaded"), e

    # the removed node is lost; its sandboxes say so, with the reason
    nodes = await wait_lost(client, victim)
    print(f"[dsec] node {victim} lost: {nodes[victim]['reason']}")
    for name, n in nodes.items():
        print(f"[dsec] {name}: placed {n['placed']}, refused {n['refused']}, unreachable {n['unreachable']}")
    on_victim = [s for s in made if s._info.node == victim] + [
        sb for sb in trajectories.values() if sb._info.node == victim
    ]
    assert on_victim
    for sb in on_victim:
        info = await sb.info()
        assert info.state == dsec.State.lost and (info.reason or "").startswith(f"node {victim} was lost"), info
    with pytest.raises(dsec.SandboxGone, match=f"node {victim} was lost"):
        await on_victim[0].exec("true")
    for sb in [s for s in made if s._info.node != victim][:6]:  # the others answer as before
        assert (await sb.exec("echo alive")).stdout == "alive\n"

    # new creations go to the two nodes left, single ones and a batch (split, its streams merged)
    after = await asyncio.gather(*(create(client, labels={"after": "1"}) for _ in range(AFTER)))
    assert {s._info.node for s in after} == set(ray_ids) - {victim}
    batch = [b async for b in dsec.AsyncSandbox.create_many(AFTER, IMAGE, timeout=900, client=client)]
    assert all(isinstance(b, dsec.AsyncSandbox) for b in batch), batch
    assert sorted(b.batch_index for b in batch if isinstance(b, dsec.AsyncSandbox)) == list(range(AFTER))
    assert {b._info.node for b in batch if isinstance(b, dsec.AsyncSandbox)} == set(ray_ids) - {victim}
    events = [e async for e in after[0].exec_stream("echo a; sleep 0.2; echo b")]
    assert [(e.type, e.data) for e in events[:2]] == [("stdout", "a\n"), ("stdout", "b\n")]
    assert events[-1].type == "result"

    # the trajectory begun on the lost node resumes on another, rebuilt from the shared log
    tid, old = next((t, sb) for t, sb in trajectories.items() if sb._info.node == victim)
    async with dsec.AsyncClient(url=url, token=token) as trainer:  # a restarted trainer: a new client
        resumed = await create(trainer, trajectory=tid)
        assert resumed._info.node not in (None, victim) and resumed.id != old.id
        assert (await resumed.exec(STEPS[0])).replayed
        await resumed.files.write("/tmp/data", b"\x00payload\xff")
        again = await resumed.exec(STEPS[1])
        assert again.replayed and again.stdout.strip() == "2"
        live = await resumed.exec("echo three >> /tmp/log; wc -l < /tmp/log")
        assert not live.replayed and live.stdout.strip() == "3"  # the rebuilt state, each call applied once
        assert await resumed.files.read("/tmp/data") == b"\x00payload\xff"
        info = await trainer.trajectory(tid)
        assert info.rebuilds == 1 and info.sandbox_id == resumed.id
        # a trajectory whose node is alive resumes where it runs, not rebuilt
        tid2, live_sb = next((t, sb) for t, sb in trajectories.items() if sb._info.node != victim)
        same = await create(trainer, trajectory=tid2)
        assert same.id == live_sb.id and (await same.exec(STEPS[0])).replayed
