"""The SDK: the sync API mirrors the async one, and both speak the daemon's wire format."""

from __future__ import annotations

import inspect
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

import dsec
from dsec.core.manager import SandboxManager
from dsec.errors import (
    DsecError,
    InvalidRequest,
    SandboxGone,
    SandboxNotFound,
    Unauthorized,
)
from dsec.protocol.sandbox import State
from dsec.sdk import sync
from dsec.sdk.aio import AsyncClient, AsyncFiles, AsyncSandbox
from dsec.sdk.transport import raise_for_reply

from ...fakes.backend import FakeBackend
from ..conftest import IMAGE, TOKEN, ManagerSwitch, new_manager

PAIRS = [(AsyncSandbox, dsec.Sandbox), (AsyncFiles, sync.Files), (AsyncClient, dsec.Client)]


def public_async_members(cls: type) -> dict[str, Any]:
    """Its own and its mixins' (AsyncClient's images, volumes, tenants, ...), as sync.synchronize sees them."""
    members = {}
    own: dict[str, Any] = {}
    for base in reversed(cls.__mro__[:-1]):
        own.update(vars(base))
    for name, value in own.items():
        if name.startswith("_"):
            continue
        func = value.__func__ if isinstance(value, classmethod) else value
        if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
            members[name] = value
    return members


def test_the_async_classes_have_members_to_mirror() -> None:
    assert {"create", "connect", "list", "info", "exec", "exec_stream", "kill"} <= set(
        public_async_members(AsyncSandbox)
    )
    assert {"read", "write", "list", "remove", "mkdir", "upload_dir"} <= set(public_async_members(AsyncFiles))
    assert {"health", "images", "list", "create", "aclose"} <= set(public_async_members(AsyncClient))
    assert {"create_volume", "volumes", "volume", "remove_volume"} <= set(public_async_members(AsyncClient))


@pytest.mark.parametrize(("async_cls", "sync_cls"), PAIRS, ids=lambda c: c.__name__)
def test_sync_mirrors_async(async_cls: type, sync_cls: type) -> None:
    for name, value in public_async_members(async_cls).items():
        assert hasattr(sync_cls, name), f"{sync_cls.__name__} lacks {name}"
        mirrored = getattr(sync_cls, name)
        original = getattr(async_cls, name)
        want = inspect.signature(original).parameters
        got = inspect.signature(mirrored).parameters
        assert list(got) == list(want), name
        for p in want:
            assert got[p].kind == want[p].kind, (name, p)
            assert got[p].default == want[p].default, (name, p)
        if isinstance(value, classmethod):
            assert inspect.ismethod(mirrored) and mirrored.__self__ is sync_cls, f"{name} is not a classmethod"
        else:
            assert inspect.isfunction(mirrored), name
            assert not inspect.iscoroutinefunction(mirrored), f"{name} is still async"
            if inspect.isasyncgenfunction(original):
                assert not inspect.isasyncgenfunction(mirrored)
        assert mirrored.__doc__ == original.__doc__


def test_sync_properties_and_context_managers() -> None:
    assert isinstance(dsec.Sandbox.id, property)
    assert isinstance(dsec.Sandbox.kind, property)
    assert hasattr(dsec.Sandbox, "__enter__") and hasattr(dsec.Sandbox, "__exit__")
    assert hasattr(dsec.Client, "close")


# ---- wire errors -----------------------------------------------------------------------------------


def test_raise_for_reply_maps_codes() -> None:
    raise_for_reply(200, b"not even json")
    body = {"error": {"code": "sandbox_not_found", "message": "no sandbox 'x'", "detail": {"a": 1}}}
    with pytest.raises(SandboxNotFound, match="no sandbox 'x'") as info:
        raise_for_reply(404, json.dumps(body).encode())
    assert info.value.detail == {"a": 1}
    with pytest.raises(Unauthorized):
        raise_for_reply(401, b'{"error": {"code": "unauthorized", "message": "m"}}')


@pytest.mark.parametrize("body", [b"<html>bad gateway</html>", b"{}", b'{"error": "x"}', b"[]"])
def test_raise_for_reply_non_dsec_bodies(body: bytes) -> None:
    with pytest.raises(DsecError, match="HTTP 502") as info:
        raise_for_reply(502, body)
    assert type(info.value) is DsecError


# ---- local validation before any request ------------------------------------------------------------


async def test_create_validates_locally() -> None:
    client = AsyncClient(url="http://127.0.0.1:9", token="x")  # nothing listens: no request may be sent
    try:
        with pytest.raises(InvalidRequest, match="timeout"):
            await AsyncSandbox.create(IMAGE, timeout=-1, client=client)
        with pytest.raises(InvalidRequest, match="memory"):
            await AsyncSandbox.create(IMAGE, memory="1Mi", client=client)
        with pytest.raises(InvalidRequest):
            await AsyncSandbox.create(IMAGE, env={"A=B": "1"}, client=client)
    finally:
        await client.aclose()


# ---- the async SDK against the real app over ASGI ----------------------------------------------------


def asgi_client(app: Any, token: str = TOKEN) -> AsyncClient:
    client = AsyncClient(url="http://dsec.test", token=token)
    client._transport.http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://dsec.test",
        headers={"authorization": f"Bearer {token}"},
    )
    return client


@pytest.fixture
async def sdk(
    workdir: Path, shared_app: tuple[FastAPI, ManagerSwitch]
) -> AsyncIterator[tuple[AsyncClient, SandboxManager, FakeBackend]]:
    app, switch = shared_app
    mgr, backend = new_manager(workdir)
    switch.target = mgr
    await mgr.start()  # httpx's ASGI transport does not run the lifespan
    client = asgi_client(app)
    try:
        yield client, mgr, backend
    finally:
        await client.aclose()
        await mgr.close()
        switch.target = None


async def test_async_sdk_round_trip(sdk: tuple[AsyncClient, SandboxManager, FakeBackend]) -> None:
    client, _, backend = sdk
    assert (await client.health()).ok
    sb = await client.create(image=IMAGE, memory="256Mi", labels={"job": "7"}, env={"A": "1"})
    assert sb.id.startswith("sb-")
    assert sb.kind == "container"
    assert [i.id for i in await client.list(labels={"job": "7"})] == [sb.id]
    assert [i.id for i in await AsyncSandbox.list(labels={"job": "7"}, client=client)] == [sb.id]
    result = await sb.exec(["echo", "x"], env={"B": "2"})
    assert result.ok
    assert result.stdout == "echo x\n"
    assert backend.execs[-1].env == {"A": "1", "B": "2"}
    events = [e async for e in sb.exec_stream("echo y")]
    assert [e.type for e in events] == ["stdout", "result"]
    await sb.files.write("/t/a.txt", "héllo")
    assert await sb.files.read_text("/t/a.txt") == "héllo"
    assert [e.name for e in await sb.files.list("/t")] == ["a.txt"]
    again = await AsyncSandbox.connect(sb.id, client=client)
    assert (await again.info()).state == State.running
    async with sb:
        pass
    assert (await again.info()).state == State.stopped
    with pytest.raises(SandboxGone):
        await sb.exec("true")
    with pytest.raises(SandboxGone):
        _ = [e async for e in sb.exec_stream("true")]


async def test_async_sdk_errors(sdk: tuple[AsyncClient, SandboxManager, FakeBackend]) -> None:
    client, _, _ = sdk
    with pytest.raises(SandboxNotFound):
        await AsyncSandbox.connect("sb-missing", client=client)
    with pytest.raises(InvalidRequest, match="not enabled"):
        await client.create(image=IMAGE, kind="function")  # the fake daemon runs the container kind only
    sb = await client.create(image=IMAGE)
    with pytest.raises(dsec.FileNotFoundInSandbox):
        await sb.files.read("/nope")
    with pytest.raises(FileNotFoundError):
        await sb.files.read("/nope")
    wrong = asgi_client(client._transport.http._transport.app, token="wrong")  # type: ignore[attr-defined]
    try:
        with pytest.raises(Unauthorized):
            await wrong.list()
    finally:
        await wrong.aclose()


# ---- the sync SDK, on its loop thread, against the same app ---------------------------------------------


@pytest.fixture
def sync_sdk(workdir: Path, shared_app: tuple[FastAPI, ManagerSwitch]) -> Iterator[tuple[Any, FakeBackend]]:
    app, switch = shared_app
    mgr, backend = new_manager(workdir)
    switch.target = mgr
    sync._runner.run(mgr.start())
    client = dsec.Client(url="http://dsec.test", token=TOKEN)
    impl = client._impl
    old = impl._transport.http

    async def swap() -> None:
        await old.aclose()
        impl._transport.http = asgi_client(app)._transport.http

    sync._runner.run(swap())
    try:
        yield client, backend
    finally:
        client.close()
        sync._runner.run(mgr.close())
        switch.target = None


def test_sync_sdk_round_trip(sync_sdk: tuple[Any, FakeBackend]) -> None:
    client, backend = sync_sdk
    with dsec.Sandbox.create(IMAGE, client=client, labels={"s": "1"}) as sb:
        assert isinstance(sb, dsec.Sandbox)
        assert sb.id.startswith("sb-")
        assert isinstance(sb.files, sync.Files)
        res = sb.exec(["echo", "sync"])
        assert isinstance(res, dsec.ExecResult)
        assert res.stdout == "echo sync\n"
        events = list(sb.exec_stream("echo s"))
        assert events[-1].type == "result"
        sb.files.write("/f", b"\0\1")
        assert sb.files.read("/f") == b"\0\1"
        listed = dsec.Sandbox.list(labels={"s": "1"}, client=client)
        assert [i.id for i in listed] == [sb.id]
        again = dsec.Sandbox.connect(sb.id, client=client)
        assert isinstance(again, dsec.Sandbox)
    assert again.info().state == State.stopped
    assert backend.destroyed == [sb.id]
    with pytest.raises(SandboxGone):
        sb.exec("true")
