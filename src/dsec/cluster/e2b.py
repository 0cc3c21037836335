"""The E2B-compatible API of a cluster (``dsec cluster up|gateway --e2b-listen``).

Each node daemon serves the E2B API itself (``dsec serve --e2b-listen``) and says where in its status
(``e2b_url``). The gateway only places and routes:

- a creation goes where the gateway's placement puts a dsec creation (its requests from the
  ``dsec.cpu`` and ``dsec.memory`` metadata), to that node's E2B listener;
- lists are merged from every node and paged here;
- every call that names a sandbox (in its path, or in envd's ``E2b-Sandbox-Id`` header) is passed,
  streaming both ways, to the E2B listener of the node that holds it;
- volumes (``/volumes``, ``/volumecontent``) are refused, as the node API's are: they are one node's;
  so are E2B's template builds, tags and aliases (a snapshot's deletion, ``DELETE /templates/ID``, is not);
- a sandbox's ports (E2B's ``get_host``: ``PORT-ID.DOMAIN``) are relayed by ports.py, and the answers
  that give a sandbox's domain give the gateway's (``--e2b-domain``), not the node's.

The access token a node gave a sandbox opens it only on that node, which is where its calls are sent.
The control API takes the cluster's operator token as its API key (tenants are per node and are not
managed through the gateway).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import secrets
from datetime import datetime
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode

from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from ..errors import DaemonUnreachable, InvalidRequest, MethodNotAllowed, SandboxGone, SandboxNotFound, Unauthorized
from ..protocol.sandbox import Limits
from .gateway import Gateway
from .nodes import Node
from .placement import Demand
from .proxy import Failure, answer, body_of, control_headers, forward, query, read_body, target
from .wire import Broken, NodeClient

log = logging.getLogger("dsec.cluster.e2b")

ENVD_PREFIXES = ("/process.Process/", "/filesystem.Filesystem/")
ENVD_PATHS = ("/files", "/health")
PAGE = 100  # E2B's largest page
NAMING = (["connect"], ["resume"], ["fork"])  # POSTs whose answers give the sandbox's domain
JSON_TYPE = [(b"content-type", b"application/json")]


def _header(scope: Scope, name: bytes) -> bytes:
    return next((v for k, v in scope["headers"] if k == name), b"")


async def _error(send: Send, status: int, message: str, retry_after: object = None) -> None:
    """An answer in the E2B API's own error shape (``{code, message}``)."""
    headers = list(JSON_TYPE)
    if isinstance(retry_after, int | float):
        headers.append((b"retry-after", str(max(1, round(retry_after))).encode()))
    await answer(send, status, json.dumps({"code": status, "message": message}).encode(), headers)


def _demand(body: bytes) -> Demand:
    try:
        raw = json.loads(body or b"{}")
        metadata = (raw.get("metadata") or {}) if isinstance(raw, dict) else {}
        fields = {k: metadata[m] for k, m in (("cpu", "dsec.cpu"), ("memory", "dsec.memory")) if m in metadata}
        return Demand.of(Limits.model_validate(fields))
    except (ValueError, AttributeError, ValidationError):
        return Demand.of(Limits())  # the node answers the bad request with its own clear error


class E2BGateway:
    def __init__(self, gateway: Gateway, domain: str | None = None) -> None:
        self.gw = gateway
        self.domain = domain  # the gateway's sandbox domain, in place of the nodes' in their answers
        self._clients: dict[str, NodeClient] = {}

    def client(self, node: Node) -> NodeClient | None:
        """The connections to the node's E2B listener, None if it serves none."""
        url = node.status.e2b_url if node.status is not None else None
        if not url:
            return None
        found = self._clients.get(url)
        if found is None:
            found = self._clients[url] = NodeClient(url, self.gw.token.decode())
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        try:
            await self._dispatch(scope, receive, send)
        except Failure as f:
            await _error(send, f.status, f.message, f.detail.get("retry_after"))
        except Exception as e:  # an E2B client always gets the API's JSON error
            log.exception("E2B gateway error on %s %s", scope["method"], scope["path"])
            await _error(send, 500, f"gateway error: {type(e).__name__}: {e}")

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        if path.startswith(ENVD_PREFIXES) or path in ENVD_PATHS:
            await self._envd(scope, receive, send)
            return
        if path.strip("/").split("/")[0] in ("volumes", "volumecontent"):
            raise Failure(
                InvalidRequest,
                "named volumes are kept on one node's disk and cannot be used through the cluster gateway: "
                "use a node's own E2B listener (docs/volumes.md)",
            )
        if _template_build(scope["method"], path):
            raise Failure(
                InvalidRequest,
                "E2B templates are built and kept on one node (their builds, tags and uploads): build and use "
                "them through a node's own E2B listener (docs/e2b.md)",
            )
        key = _header(scope, b"x-api-key").strip()
        if not key:
            scheme, _, bearer = _header(scope, b"authorization").partition(b" ")
            key = bearer.strip() if scheme.lower() == b"bearer" else b""
        if not secrets.compare_digest(key, self.gw.token):
            raise Failure(Unauthorized, "missing or wrong API key: use the cluster's operator token")
        method = scope["method"]
        parts = path.strip("/").split("/")
        if parts and parts[0] == "v2":
            parts = parts[1:]
        if parts[:1] == ["sandboxes"] and len(parts) == 1:
            if method == "POST":
                await self._create(scope, receive, send)
            elif method == "GET":
                await self._list(scope, send, v1=not path.startswith("/v2/"))
            else:
                raise Failure(MethodNotAllowed, f"{method} {path}")
            return
        if parts[:1] == ["sandboxes"]:
            if (method == "GET" and len(parts) == 2) or (method == "POST" and parts[2:] in NAMING):
                await self._rebranded(scope, receive, send, parts[1])
            else:
                await self._to_holder(scope, receive, send, parts[1])
            return
        await self.gw.nodes.first_answers()
        primary = self.gw.nodes.primary()  # templates (snapshots), and what no node offers: any node answers
        http = self.client(primary) if primary is not None else None
        if http is None:
            raise Failure(DaemonUnreachable, "no node of the cluster serves the E2B API now")
        await forward(http, scope, send, await body_of(receive), lambda sent: self._broken(primary, sent))

    def _broken(self, node: Node | None, sent: bool) -> Failure:
        name = node.name if node is not None else "?"
        if node is not None:
            self.gw.nudge(node)
        maybe = "; the call may or may not have taken effect" if sent else ""
        return Failure(DaemonUnreachable, f"node {name} does not answer{maybe}", status=502)

    async def holder(self, sandbox_id: str) -> tuple[Node, NodeClient] | None:
        node = await self.gw.directory.locate(sandbox_id)
        if node is None or node.lost:
            return None
        http = self.client(node)
        return None if http is None else (node, http)

    async def _to_holder(self, scope: Scope, receive: Receive, send: Send, sandbox_id: str) -> None:
        found = await self.holder(sandbox_id)
        if found is None:
            raise Failure(SandboxNotFound, f"Sandbox {sandbox_id} not found on any reachable node")
        node, http = found
        await forward(http, scope, send, await body_of(receive), lambda sent: self._broken(node, sent))

    async def _rebranded(self, scope: Scope, receive: Receive, send: Send, sandbox_id: str) -> None:
        """An answer that names the sandbox's domain (get, connect, resume, fork), with the gateway's in it:
        E2B's get_host must name the gateway, which the client reaches, not the node."""
        found = await self.holder(sandbox_id)
        if found is None:
            raise Failure(SandboxNotFound, f"Sandbox {sandbox_id} not found on any reachable node")
        node, http = found
        try:
            reply = await http.request(
                scope["method"], target(scope), body=await read_body(receive), headers=control_headers(scope)
            )
        except Broken as e:
            raise self._broken(node, e.sent) from e
        await answer(send, reply.status, self._with_domain(reply.content), reply.response_headers())

    def _with_domain(self, content: bytes) -> bytes:
        if self.domain is None:
            return content
        try:
            parsed = json.loads(content)
        except ValueError:
            return content
        return json.dumps(_set_domain(parsed, self.domain)).encode()

    async def _envd(self, scope: Scope, receive: Receive, send: Send) -> None:
        sandbox_id = _header(scope, b"e2b-sandbox-id").decode(errors="replace").strip()
        if not sandbox_id:
            if scope["path"] == "/health":
                await answer(send, 204, b"", [])
                return
            raise Failure(InvalidRequest, "no E2b-Sandbox-Id header: point E2B_SANDBOX_URL at this gateway")
        found = await self.holder(sandbox_id)
        if found is None:  # as E2B's proxy answers a sandbox that is gone, and as a node does
            raise Failure(SandboxGone, f"The sandbox {sandbox_id[:64]} was not found", status=502)
        node, http = found

        def broken(sent: bool) -> Failure:
            self.gw.nudge(node)
            message = f"The sandbox {sandbox_id[:64]} was not found: node {node.name} does not answer"
            return Failure(SandboxGone, message, status=502)

        await forward(http, scope, send, await body_of(receive), broken)

    async def _create(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        placed = await self.gw.place_for(receive, send, scope, target(scope), body, _demand(body), via=self.client)
        if placed is None:
            return
        reply, node = placed
        if reply.status < 300:
            # the directory learns where it is from the node's own API (the E2B answer is no SandboxInfo)
            try:
                sandbox_id = str(json.loads(reply.content)["sandboxID"])
                info = await node.http.request("GET", f"/v1/sandboxes/{quote(sandbox_id, safe='')}", timeout=10)
                if info.status == 200:
                    self.gw.directory.record_json(node, info.content)
            except (ValueError, KeyError, TypeError, Broken) as e:
                log.warning("could not record the new E2B sandbox on %s: %s", node.name, e)
        await answer(send, reply.status, self._with_domain(reply.content), reply.response_headers())

    async def _list(self, scope: Scope, send: Send, *, v1: bool) -> None:
        """Every node's list, merged in the order asked, paged here with a token of the gateway's."""
        params = dict(parse_qsl(query(scope)))
        after, limit = params.pop("nextToken", None), params.pop("limit", None)
        desc = params.get("order") != "asc"  # E2B's default order is newest first
        items: list[dict[str, Any]] = []
        for node in self.gw.nodes.routable():
            http = self.client(node)
            if http is not None:
                items += await self._node_items(node, http, params, v1)
        items.sort(key=_key, reverse=desc)
        if after:
            key = _after(after)
            items = [i for i in items if ((_key(i) < key) if desc else (_key(i) > key))]
        size = PAGE if v1 or limit is None else max(1, min(PAGE, int(limit) if limit.isdigit() else PAGE))
        page = items if v1 else items[:size]
        headers = list(JSON_TYPE)
        if not v1 and len(items) > size:
            token = base64.urlsafe_b64encode(json.dumps(list(_key(page[-1]))).encode())
            headers.append((b"x-next-token", token))
        await answer(send, 200, json.dumps(page).encode(), headers)

    async def _node_items(self, node: Node, http: NodeClient, params: dict[str, str], v1: bool) -> list[Any]:
        out: list[Any] = []
        token: str | None = None
        path = "/sandboxes" if v1 else "/v2/sandboxes"
        while True:
            qs = dict(params) | ({} if v1 else {"limit": str(PAGE)}) | ({"nextToken": token} if token else {})
            try:
                reply = await http.request("GET", f"{path}?{urlencode(qs)}" if qs else path, timeout=30)
            except Broken as e:
                log.warning("E2B list: node %s does not answer: %s", node.name, e)
                return out
            if reply.status != 200:
                message = json.loads(reply.content or b"{}").get("message", "") if reply.content else ""
                raise Failure.relay(reply.status, "invalid_request", str(message) or f"HTTP {reply.status}")
            out += json.loads(reply.content)
            next_token = reply.header(b"x-next-token")
            if v1 or not next_token:
                return out
            token = next_token.decode()

    async def aclose(self) -> None:
        for http in self._clients.values():
            await http.aclose()


def _set_domain(value: Any, domain: str) -> Any:
    """``value`` with every sandbox's ``domain`` (an object with a ``sandboxID``) set to ``domain``."""
    if isinstance(value, list):
        return [_set_domain(v, domain) for v in value]
    if isinstance(value, dict):
        out = {k: _set_domain(v, domain) for k, v in value.items()}
        if "sandboxID" in out:
            out["domain"] = domain
        return out
    return value


def _key(item: dict[str, Any]) -> tuple[float, str]:
    """Creation time, then id: the order of E2B's lists."""
    try:
        started = datetime.fromisoformat(str(item.get("startedAt", "")).replace("Z", "+00:00")).timestamp()
    except ValueError:
        started = 0.0
    return started, str(item.get("sandboxID", ""))


def _after(token: str) -> tuple[float, str]:
    try:
        started, sandbox_id = json.loads(base64.urlsafe_b64decode(token.encode()))
        return float(started), str(sandbox_id)
    except (ValueError, TypeError, binascii.Error):
        raise Failure(InvalidRequest, f"invalid nextToken {token[:40]!r}") from None


def _template_build(method: str, path: str) -> bool:
    """E2B's template API (the node's e2b/templates.py): every route under /templates but a template's
    deletion (snapshots are templates to E2B, and their names may hold a '/'), and the versioned ones."""
    parts = path.strip("/").split("/")
    if parts[0] in ("v2", "v3") and parts[1:2] == ["templates"]:
        return True
    if parts[0] != "templates" or len(parts) < 2:
        return False
    return method != "DELETE" or parts[1] == "tags"
