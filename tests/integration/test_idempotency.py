"""No command runs twice: a connection cut after the request was written and before the reply came makes
the SDK send the request again, with the same Idempotency-Key, and the daemon answers it from memory.

A proxy between the SDK (over TCP) and the daemon's socket cuts the first matching request's connection:
either once the daemon has started to answer (the request ran to its end), or at once after passing the
request on (the repeat then arrives while the first still runs)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import Iterator

import pytest

import dsec

from .conftest import Daemon


class CuttingProxy:
    """TCP on loopback -> the daemon's unix socket. The first request whose head contains ``cut`` has its
    connection closed before any byte of the answer reaches the client."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.cut = b""
        self.early = False  # close at once after passing the request on, not after the answer began
        self.cuts = 0
        self.seen: list[bytes] = []  # request heads matching ``cut`` (the cut one and its repeats)
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    def arm(self, cut: bytes, *, early: bool = False) -> None:
        self.cut, self.early, self.cuts, self.seen = cut, early, 0, []

    def disarm(self) -> None:
        self.cut = b""

    async def _start(self) -> None:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_unix_connection(self.socket_path)
        to_daemon = asyncio.create_task(self._requests(reader, up_w, writer, up_r))
        try:
            await to_daemon
        finally:
            for w in (writer, up_w):
                w.close()

    async def _requests(
        self,
        reader: asyncio.StreamReader,
        up_w: asyncio.StreamWriter,
        writer: asyncio.StreamWriter,
        up_r: asyncio.StreamReader,
    ) -> None:
        """One request at a time (the SDK does not pipeline): pass it on, then its answer back."""
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                ),
                0,
            )
            body = await reader.readexactly(length)
            up_w.write(head + body)
            await up_w.drain()
            if self.cut and self.cut in head:
                self.seen.append(head)
                if self.cuts == 0:
                    self.cuts += 1
                    if not self.early:
                        await up_r.read(1)  # the daemon answers: the request ran to its end
                    return  # both connections close: the client reads nothing
            answer = await _one_response(up_r)
            writer.write(answer)
            await writer.drain()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    async def _stop(self) -> None:
        self.server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _content_length(head: bytes) -> int | None:
    lines = head.split(b"\r\n")
    return next((int(x.split(b":")[1]) for x in lines if x.lower().startswith(b"content-length")), None)


async def _one_response(r: asyncio.StreamReader) -> bytes:
    head = await r.readuntil(b"\r\n\r\n")
    length = _content_length(head)
    if length is not None:
        return head + await r.readexactly(length)
    if b"transfer-encoding" not in head.lower():
        return head  # no body (204)
    body = b""  # chunked
    while True:
        size_line = await r.readuntil(b"\r\n")
        size = int(size_line.strip(), 16)
        chunk = await r.readexactly(size + 2)
        body += size_line + chunk
        if size == 0:
            return head + body


@pytest.fixture(scope="module")
def proxy(daemon: Daemon) -> Iterator[CuttingProxy]:
    p = CuttingProxy(daemon.url.removeprefix("unix://"))
    yield p
    p.close()


@pytest.fixture(scope="module")
def client(proxy: CuttingProxy, daemon: Daemon) -> dsec.Client:
    return dsec.Client(url=f"http://127.0.0.1:{proxy.port}", token=daemon.token)


@pytest.fixture(scope="module")
def box(client: dsec.Client) -> Iterator[dsec.Sandbox]:
    sb = dsec.Sandbox.create(image="dsec/busybox", client=client, timeout=600)
    yield sb
    with contextlib.suppress(dsec.DsecError):
        sb.kill()


@pytest.mark.parametrize("early", [False, True], ids=["answer-lost", "cut-while-running"])
def test_an_exec_whose_answer_was_lost_runs_once(box: dsec.Sandbox, proxy: CuttingProxy, early: bool) -> None:
    log = f"/tmp/runs-{uuid.uuid4().hex}"
    proxy.arm(b"/exec ", early=early)
    res = box.exec(f"sleep {1 if early else 0}; echo run >> {log}; wc -l < {log}")
    assert proxy.cuts == 1 and len(proxy.seen) == 2, "the SDK sent the cut request again"
    assert res.exit_code == 0 and res.stdout.strip() == "1"  # the first run's answer, replayed
    proxy.disarm()
    assert box.exec(f"wc -l < {log}").stdout.strip() == "1"  # it ran once


@pytest.mark.parametrize("early", [False, True], ids=["answer-lost", "cut-while-creating"])
def test_a_creation_whose_answer_was_lost_makes_one_sandbox(
    client: dsec.Client, proxy: CuttingProxy, daemon: Daemon, early: bool
) -> None:
    tag = uuid.uuid4().hex
    proxy.arm(b"POST /v1/sandboxes ", early=early)
    sb = dsec.Sandbox.create(image="dsec/busybox", client=client, labels={"idem": tag}, timeout=120)
    proxy.disarm()
    try:
        assert proxy.cuts == 1 and len(proxy.seen) == 2
        mine = [i for i in daemon.client().list() if i.labels.get("idem") == tag]
        assert [i.id for i in mine] == [sb.id]
    finally:
        sb.kill()


def test_an_append_whose_answer_was_lost_is_not_appended_twice(box: dsec.Sandbox, proxy: CuttingProxy) -> None:
    path = f"/tmp/append-{uuid.uuid4().hex}"
    box.files.write(path, b"")
    proxy.arm(b"POST /v1/sandboxes/" + box.id.encode() + b"/exec")
    box.exec(f"echo once >> {path}")
    proxy.disarm()
    assert proxy.cuts == 1 and len(proxy.seen) == 2
    assert box.files.read(path) == b"once\n"


def test_a_repeat_is_marked_as_a_replay_and_a_reused_key_is_refused(daemon: Daemon) -> None:
    """The wire as any HTTP client sees it: the same key and request give the first answer again, marked
    as a replay; the same key on another request is refused."""
    import httpx

    key = uuid.uuid4().hex
    with httpx.Client(transport=httpx.HTTPTransport(uds=daemon.url.removeprefix("unix://"))) as http:
        headers = {"authorization": f"Bearer {daemon.token}", "idempotency-key": key}
        body = {"image": "dsec/busybox", "labels": {"idem": key}, "timeout": 60}
        first = http.post("http://dsec/v1/sandboxes", json=body, headers=headers, timeout=120)
        again = http.post("http://dsec/v1/sandboxes", json=body, headers=headers, timeout=120)
        other = http.post("http://dsec/v1/sandboxes", json={**body, "timeout": 61}, headers=headers, timeout=120)
    assert first.status_code == again.status_code == 201 and first.json()["id"] == again.json()["id"]
    assert again.headers["idempotent-replayed"] == "true"
    assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_conflict"
    dsec.Sandbox.connect(first.json()["id"], client=daemon.client()).kill()
