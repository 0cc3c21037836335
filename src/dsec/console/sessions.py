"""Console sessions: a random cookie value names a session held here, in the serving process. The token
stays on the server (the cookie carries nothing a stolen copy of the page could reuse elsewhere), and is
checked again on every call, so a revoked tenant token ends its sessions at once."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

COOKIE = "dsec_session"
IDLE_S = 12 * 3600.0  # a session unused this long is forgotten
MAX_SESSIONS = 10_000  # past this the least recently used go first: logins cannot grow memory without bound


@dataclass
class Session:
    token: str
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    last_used: float = field(default_factory=time.monotonic)


class Sessions:
    def __init__(self, idle_s: float = IDLE_S, max_sessions: int = MAX_SESSIONS) -> None:
        self.idle_s = idle_s
        self.max_sessions = max_sessions
        self._by_id: dict[str, Session] = {}  # insertion order is use order (get moves a session last)

    def __len__(self) -> int:
        return len(self._by_id)

    def open(self, token: str) -> tuple[str, Session]:
        self._expire()
        while len(self._by_id) >= self.max_sessions:
            del self._by_id[next(iter(self._by_id))]
        sid = secrets.token_urlsafe(32)
        session = self._by_id[sid] = Session(token)
        return sid, session

    def get(self, sid: str) -> Session | None:
        session = self._by_id.pop(sid, None)
        if session is None:
            return None
        now = time.monotonic()
        if now - session.last_used > self.idle_s:
            return None
        session.last_used = now
        self._by_id[sid] = session
        return session

    def close(self, sid: str) -> None:
        self._by_id.pop(sid, None)

    def _expire(self) -> None:
        now = time.monotonic()
        for sid in [sid for sid, s in self._by_id.items() if now - s.last_used > self.idle_s]:
            del self._by_id[sid]


def cookie_value(headers: list[tuple[bytes, bytes]], name: str = COOKIE) -> str | None:
    """The named cookie of a request's Cookie headers (RFC 6265: ``a=b; c=d``), or None."""
    for key, value in headers:
        if key != b"cookie":
            continue
        for part in value.decode("latin-1").split(";"):
            k, sep, v = part.strip().partition("=")
            if sep and k == name:
                return v.strip('"')
    return None


def set_cookie(sid: str, *, secure: bool) -> str:
    # Strict: a request from another site never carries the session, which is the first CSRF defence
    flags = "; Secure" if secure else ""
    return f"{COOKIE}={sid}; Path=/; HttpOnly; SameSite=Strict{flags}"


def clear_cookie(*, secure: bool) -> str:
    flags = "; Secure" if secure else ""
    return f"{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0{flags}"
