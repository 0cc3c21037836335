"""Exposed ports: which ports of a sandbox may be reached from outside it, and the connections to them.

Exposing a port makes a secret for it, kept in the sandbox's record (a restarted daemon keeps serving
the same URL) and dropped with the sandbox. The proxy (server/port_proxy.py) presents the sandbox id,
the port and the secret; ``connect`` checks them in constant time and asks the kind for a connection to
the port on the sandbox's loopback. Connections are bounded per sandbox, so one busy client cannot take
the daemon's file descriptors.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import time
from datetime import UTC, datetime

from ..errors import LimitExceeded, NotFound
from ..protocol.ports import MAX_CONNECTIONS, MAX_PORTS, ExposedPort, ExposeRequest, port_path
from ..store.records import SandboxRecord
from ..tenancy import OPERATOR, Caller
from .sandboxes import Sandboxes


def _info(rec: SandboxRecord, port: int) -> ExposedPort:
    secret, at = rec.ports[port]
    return ExposedPort(port=port, path=port_path(rec.id, port, secret), created_at=datetime.fromtimestamp(at, UTC))


class PortActions:
    def __init__(self, sandboxes: Sandboxes) -> None:
        self.sandboxes = sandboxes
        self._open: dict[str, int] = {}  # sandbox id -> proxied connections open

    def expose(self, sandbox_id: str, req: ExposeRequest, *, caller: Caller = OPERATOR) -> ExposedPort:
        """Expose a port (again: the same URL, so exposing is idempotent)."""
        rec, backend = self.sandboxes.running(sandbox_id, caller)
        backend.check_ports()
        if req.port not in rec.ports:
            if len(rec.ports) >= MAX_PORTS:
                raise LimitExceeded(f"a sandbox exposes at most {MAX_PORTS} ports; unexpose one first")
            rec.ports[req.port] = (secrets.token_urlsafe(24), time.time())
            self.sandboxes.save(rec)
        return _info(rec, req.port)

    def list(self, sandbox_id: str, *, caller: Caller = OPERATOR) -> list[ExposedPort]:
        rec = self.sandboxes.get(sandbox_id, caller)
        return [_info(rec, p) for p in sorted(rec.ports)]

    def unexpose(self, sandbox_id: str, port: int, *, caller: Caller = OPERATOR) -> None:
        """Forget a port's secret: its URL stops working (connections already open stay until closed)."""
        rec = self.sandboxes.get(sandbox_id, caller)
        if rec.ports.pop(port, None) is None:
            raise NotFound(f"port {port} of sandbox {sandbox_id} is not exposed")
        self.sandboxes.save(rec)

    async def connect(self, sandbox_id: str, port: int, secret: str) -> socket.socket:
        """A connection to an exposed port, for the proxy. Any mismatch is the same NotFound, so a URL
        cannot be probed for which of its parts is wrong. The caller calls ``closed`` when done with it."""
        rec = self.sandboxes.find_live(sandbox_id)
        grant = rec.ports.get(port) if rec is not None else None
        if rec is None or grant is None or not hmac.compare_digest(grant[0].encode(), secret.encode()):
            raise NotFound("no such exposed port (the sandbox ended, the port was unexposed, or the URL is wrong)")
        return await self.reach(sandbox_id, port)

    async def reach(self, sandbox_id: str, port: int) -> socket.socket:
        """A connection to any port of a running sandbox, for a caller that has checked a credential of
        its own (the E2B API's traffic token); counted against the sandbox's bound until ``closed``."""
        rec, backend = self.sandboxes.running(sandbox_id)
        if self._open.get(sandbox_id, 0) >= MAX_CONNECTIONS:
            raise LimitExceeded(f"sandbox {sandbox_id} has {MAX_CONNECTIONS} connections open through its ports")
        self._open[sandbox_id] = self._open.get(sandbox_id, 0) + 1
        try:
            return await backend.connect_port(rec, port)
        except BaseException:
            self.closed(sandbox_id)
            raise

    def closed(self, sandbox_id: str) -> None:
        left = self._open.get(sandbox_id, 0) - 1
        if left > 0:
            self._open[sandbox_id] = left
        else:
            self._open.pop(sandbox_id, None)
