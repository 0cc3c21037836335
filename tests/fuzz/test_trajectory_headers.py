"""Fuzzing what the daemon parses of a trajectory call (server/routes.py, core/trajectory/): the
Dsec-Seq header, the trajectory id of the log's routes, and the call's parameters that the log digests
and stores (canonical JSON, which must hold any string JSON can carry, lone surrogates included).
Through the real app, manager, recorder and SQLite log, on the in-memory FakeBackend: every answer is
a success or a 4xx with the error body, never a 500; the log stays readable."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from dsec.core.manager import SandboxManager
from dsec.protocol.trajectory import SEQ_HEADER
from dsec.server.app import create_app

from ..unit.conftest import IMAGE, TOKEN, new_manager
from .budget import fuzz, outcome
from .fsguard import fuzz_root

TRAJECTORY = "fuzz/rollout-1"
# "@next": the log's length (a live call), "@last": the last position (a replay, or a divergence)
SEQ_VALUES = st.one_of(
    st.just("@next"),
    st.just("@next"),
    st.just("@next"),
    st.just("@last"),
    st.integers(-3, 12).map(str),  # mostly positions past the log's end, or replays of what is there
    st.sampled_from(["", " 1", "1 ", "+1", "1_0", "0x1", "1.0", "1e2", "٣", "9" * 30, "9" * 5000, "-0", "\x00"]),
    st.binary(max_size=8).map(lambda b: b.decode("latin-1")),
)
# JSON text as a client may send it: escapes Python's json reads into lone surrogates, NULs, huge numbers
STRINGS = st.one_of(
    st.sampled_from(['"/a"', '"/tmp/x"', '"/é"', '"/"', '"\\/\\/"', '"\\ud800"', '"/a\\udfffb"', '"/\\u0000"', '""']),
    st.text(max_size=8).map(lambda t: json.dumps("/" + t)),
    st.text(max_size=8).map(json.dumps),
)
# no kill: the first that succeeded would leave every later example a closed trajectory to refuse
OPS = st.sampled_from(["exec", "exec", "exec", "read", "write", "list", "mkdir", "remove", "info", "calls"])


@dataclass
class Node:
    loop: asyncio.AbstractEventLoop
    mgr: SandboxManager
    http: httpx.AsyncClient
    sandbox: str

    def run(self, method: str, path: str, seq: str | None, **kwargs: object) -> httpx.Response:
        headers = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
        if seq is not None:
            headers[SEQ_HEADER] = seq
        request = self.http.request(method, path, headers=headers, **kwargs)  # type: ignore[arg-type]
        return self.loop.run_until_complete(request)


@pytest.fixture
def node() -> Iterator[Node]:
    with fuzz_root() as (top, _):
        loop = asyncio.new_event_loop()
        mgr, _backend = new_manager(Path(top))
        app = create_app(mgr, token=TOKEN)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dsec.test")
        loop.run_until_complete(mgr.start())
        mgr.tenants.set_operator_token(TOKEN)
        try:
            node = Node(loop, mgr, http, "")
            reply = node.run("POST", "/v1/sandboxes", None, json={"image": IMAGE, "trajectory": TRAJECTORY})
            assert reply.status_code == 201, reply.text
            node.sandbox = reply.json()["id"]
            yield node
        finally:
            loop.run_until_complete(http.aclose())
            loop.run_until_complete(mgr.close())
            loop.close()


def _request(op: str, sandbox: str, text: str, number: str) -> tuple[str, str, dict[str, str], str | None]:
    """(method, path, query, raw JSON body) of one call."""
    base = f"/v1/sandboxes/{sandbox}"
    plain = json.loads(text)  # what a query parameter can carry of it
    if op == "exec":
        body = f'{{"cmd": ["echo", {text}], "env": {{"K": {text}}}, "cwd": {text}, "timeout": {number}}}'
        return "POST", f"{base}/exec", {}, body
    if op == "write":
        return "PUT", f"{base}/files", {"path": plain, "mode": number}, text
    if op in ("read", "remove"):
        return "GET" if op == "read" else "DELETE", f"{base}/files", {"path": plain}, None
    if op in ("list", "mkdir"):
        return "GET" if op == "list" else "POST", f"{base}/files/{op}", {"path": plain}, None
    tid = TRAJECTORY if number == "1" else plain  # the log's own id half the time, then anything
    if op == "info":
        return "GET", "/v1/trajectories/info", {"id": tid}, None
    return "GET", "/v1/trajectories/calls", {"id": tid, "start": number}, None


@fuzz(600, fixtures=True)
@given(
    op=OPS,
    seq=st.one_of(st.none(), SEQ_VALUES),
    text=STRINGS,
    number=st.sampled_from(["1", "1", "2", "0", "-1", "1e400"]),
)
# a lone surrogate in a parameter would break the log's canonical JSON (UTF-8): it must be refused first
@example(op="exec", seq="1", text='"\\ud800"', number="1")
def test_a_trajectory_call_is_answered_or_refused_never_a_500(
    node: Node, op: str, seq: str | None, text: str, number: str
) -> None:
    method, path, query, body = _request(op, node.sandbox, text, number)
    if seq in ("@next", "@last"):
        length = node.run("GET", "/v1/trajectories/info", None, params={"id": TRAJECTORY}).json()["length"]
        seq = str(length if seq == "@next" else length - 1)
    content = body.encode("utf-8", "surrogatepass") if body else None
    try:
        reply = node.run(method, path, seq, params=query, content=content)
    except (UnicodeError, httpx.InvalidURL, httpx.LocalProtocolError):
        outcome("not sendable by an HTTP client")  # a header or URL no client can put on the wire
        return
    outcome(f"{op}: {reply.status_code}")
    assert reply.status_code < 500, reply.text
    data = reply.json() if reply.content else None
    if reply.status_code >= 400:
        assert isinstance(data, dict) and set(data["error"]) >= {"code", "message"}
    # the log is still readable whatever went into it
    calls = node.run("GET", f"/v1/trajectories/calls?id={TRAJECTORY}", None)
    assert calls.status_code == 200, calls.text
