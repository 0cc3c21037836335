"""What the E2B routes share: the core, the options, and the little state the E2B protocols need on
top of it (trajectory positions, idempotent creates, directory watchers, accounts). Everything a
sandbox is and does stays in the core; this only translates."""

from __future__ import annotations

import asyncio
import posixpath
import secrets
import time
import urllib.parse
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..core.manager import SandboxManager
from ..core.watch import DirWatch
from ..errors import FileNotFoundInSandbox, InvalidRequest, LimitExceeded, NotFound
from ..isolation import users
from ..kinds.base import OutputCallback
from ..kinds.execio import ExecIO
from ..protocol.network import NetworkSpec
from ..protocol.sandbox import KINDS
from ..store.records import SandboxRecord
from ..tenancy import Caller
from .auth import EnvdTokens, VolumeTokens
from .hosts import check_domain

# metadata keys that choose what E2B has no word for (the rest of the metadata is the sandbox's labels)
META_KIND = "dsec.kind"
META_CPU = "dsec.cpu"
META_MEMORY = "dsec.memory"
META_DISK = "dsec.disk"
META_TRAJECTORY = "dsec.trajectory"
META_TEMPLATE = "dsec.e2b.template"  # the template id the sandbox was created from, as E2B reports it
DEFAULT_TEMPLATE = "base"
IDEMPOTENCY_TTL = 3600.0
MAX_IDEMPOTENCY_KEYS = 100_000
MAX_WATCHERS = 32  # per sandbox
WATCHER_IDLE = 600.0  # seconds a polled watcher lives without being polled
ACCOUNT_CACHE_S = 2.0
SWEEP_EVERY = 256  # creations


@dataclass(frozen=True)
class E2BOptions:
    listen: str  # http://HOST:PORT
    default_image: str = "dsec/debian:12"
    default_kind: str = "container"
    # template id -> (image, kind or None); "base" (E2B's default template) is the default image
    templates: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    # E2B sandboxes reach the internet unless told otherwise; dsec's "full" still keeps the host, the
    # daemon, metadata, private ranges and other sandboxes out of reach
    network: NetworkSpec = "full"
    # where a sandbox's ports are, E2B's sandbox domain: ``PORT-ID.DOMAIN`` must reach this listener
    # (wildcard DNS, or a Host header); None: E2B_DOMAIN of the SDK's environment decides
    domain: str | None = None

    @classmethod
    def of(
        cls, listen: str, image: str, kind: str, templates: list[str], network: str, domain: str | None = None
    ) -> E2BOptions:
        """From ``dsec serve``'s flags; a bad one raises InvalidRequest naming it."""
        url = urllib.parse.urlparse(listen)
        if url.scheme != "http" or not url.hostname or url.port is None:
            raise InvalidRequest(f"--e2b-listen {listen!r}: expected http://HOST:PORT")
        if kind not in KINDS:
            raise InvalidRequest(f"--e2b-kind {kind!r}: one of {', '.join(KINDS)}")
        aliases: dict[str, tuple[str, str | None]] = {}
        for item in templates:
            name, sep, target = item.partition("=")
            image_name, at, alias_kind = target.rpartition("@")
            if not at:
                image_name, alias_kind = target, ""
            if not sep or not name or not image_name or (alias_kind and alias_kind not in KINDS):
                raise InvalidRequest(f"--e2b-template {item!r}: expected NAME=IMAGE or NAME=IMAGE@KIND")
            aliases[name] = (image_name, alias_kind or None)
        if network not in ("full", "none"):
            raise InvalidRequest(f"--e2b-network {network!r}: full or none")
        return cls(listen, image, kind, aliases, "full" if network == "full" else None, check_domain(domain))


@dataclass
class Account:
    spec: str | None  # what ExecRequest.user takes; None: the image's runtime account
    home: str


@dataclass
class Watcher:
    watch: DirWatch
    include_entry: bool
    used: float


class E2BService:
    def __init__(
        self,
        mgr: SandboxManager,
        options: E2BOptions,
        tokens: EnvdTokens,
        operator_token: str,
        volume_tokens: VolumeTokens | None = None,
    ) -> None:
        self.mgr = mgr
        self.options = options
        self.tokens = tokens
        # None: a key of this service's own (a test's); the daemon's are made with its envd key
        self.volume_tokens = volume_tokens or VolumeTokens(secrets.token_bytes(32))
        self.operator_token = operator_token
        self._cursors: dict[str, int] = {}  # sandbox id -> next trajectory position of its E2B calls
        self._idempotent: dict[tuple[str, str], tuple[str, float]] = {}
        self._idem_locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._watchers: dict[str, dict[str, Watcher]] = {}
        self._accounts: dict[tuple[str, str], tuple[float, Account]] = {}  # (sandbox id, user) -> (when, account)
        self._creates = 0
        # the image of an E2B template built on this node (templates.py), by its name, name:tag or id
        self.built: Callable[[str], str | None] = lambda _: None

    # ---- templates -------------------------------------------------------------------------------

    def template(self, template_id: str, metadata: dict[str, str]) -> tuple[str, str]:
        """(image, kind) for an E2B template id: an alias (``--e2b-template``), ``base``, or an image name
        with an optional ``@KIND`` suffix; the ``dsec.kind`` metadata key wins over both."""
        image, kind = self.options.templates.get(template_id, (None, None))
        if image is None:
            if template_id == DEFAULT_TEMPLATE:
                image = self.options.default_image
            else:
                image, at, suffix = template_id.rpartition("@")
                if not at:
                    image = template_id
                elif suffix in KINDS:
                    kind = suffix
                else:
                    raise InvalidRequest(
                        f"template {template_id!r}: {suffix!r} after '@' is not a sandbox kind ({', '.join(KINDS)})"
                    )
                image = self.built(image) or image
        chosen = metadata.get(META_KIND) or kind or self.options.default_kind
        if chosen not in KINDS:
            raise InvalidRequest(f"metadata {META_KIND}={chosen!r} is not a sandbox kind ({', '.join(KINDS)})")
        return image, chosen

    # ---- trajectory positions --------------------------------------------------------------------

    def begin(self, sandbox_id: str) -> None:
        """A create bound to a trajectory: the calls that follow are the trajectory's from position 1, so a
        resumed trainer's repeated calls are answered from the log."""
        self._cursors[sandbox_id] = 1

    async def position(self, rec: SandboxRecord) -> int | None:
        """The next position for a call on ``rec``, or None if it is not bound to a trajectory. Without a
        create in this daemon's life (a restart, a connect from elsewhere), calls go on at the log's end."""
        tid = rec.trajectory
        if not isinstance(tid, str):
            return None
        seq = self._cursors.get(rec.id)
        if seq is None:
            seq = await self.mgr.trajectories.length(rec.owner, tid)
        self._cursors[rec.id] = seq + 1
        return seq

    async def call(
        self,
        rec: SandboxRecord,
        op: str,
        req: Any,
        payload: bytes | None = None,
        *,
        caller: Caller,
        on_output: OutputCallback | None = None,
        io: ExecIO | None = None,
    ) -> Any:
        """One core call through the trajectory log (logged when the sandbox is bound to one)."""
        seq = await self.position(rec)
        value, _ = await self.mgr.actions.call(
            rec.id, op, req, payload, seq=seq, caller=caller, on_output=on_output, io=io
        )
        return value

    # ---- idempotent creates ----------------------------------------------------------------------

    def idempotency_lock(self, tenant: str, key: str) -> asyncio.Lock:
        return self._idem_locks.setdefault((tenant, key), asyncio.Lock())

    def idempotent(self, tenant: str, key: str) -> str | None:
        """The sandbox an earlier create with this key made, if it is recent."""
        hit = self._idempotent.get((tenant, key))
        if hit is None or time.time() - hit[1] > IDEMPOTENCY_TTL:
            return None
        return hit[0]

    def remember(self, tenant: str, key: str, sandbox_id: str) -> None:
        now = time.time()
        if len(self._idempotent) >= MAX_IDEMPOTENCY_KEYS:
            for k in [k for k, (_, t) in self._idempotent.items() if now - t > IDEMPOTENCY_TTL]:
                del self._idempotent[k]
                self._idem_locks.pop(k, None)
            while len(self._idempotent) >= MAX_IDEMPOTENCY_KEYS:
                self._idempotent.pop(next(iter(self._idempotent)))
        self._idempotent[(tenant, key)] = (sandbox_id, now)

    # ---- accounts and paths ----------------------------------------------------------------------

    async def account(self, rec: SandboxRecord, user: str | None, caller: Caller) -> Account:
        """The account an E2B call names (``None``: the default), with the home that relative paths and
        commands start from. E2B's templates run as ``user``; an image without that account runs the call
        as its own runtime account, which is what ``user`` means there. A home that does not exist (a
        system account's /nonexistent) is "/"."""
        key = (rec.id, user or "")
        cached = self._accounts.get(key)
        if cached is not None and time.monotonic() - cached[0] < ACCOUNT_CACHE_S:
            return cached[1]
        acct = await self._account(rec, user, caller)
        try:
            home = await self.mgr.stat(rec.id, acct.home, caller=caller)
            if home.type != "dir":
                acct.home = "/"
        except (FileNotFoundInSandbox, InvalidRequest):
            acct.home = "/"
        self._accounts[key] = (time.monotonic(), acct)
        return acct

    async def _account(self, rec: SandboxRecord, user: str | None, caller: Caller) -> Account:
        if user in ("root", "0"):
            return Account("root", "/root")
        passwd = await self._passwd(rec, caller)
        if user is None or (user == "user" and not _has_user(passwd, "user")):
            default = self.mgr.default_user(rec)
            uid = default[0] if default is not None else 0
            entry = next((e for e in _entries(passwd) if e[2] == str(uid)), None)
            home = entry[5] if entry is not None and entry[5] else ("/root" if uid == 0 else "/")
            return Account(None, rec.env.get("HOME") or home)
        try:
            acct = users.resolve(user, passwd, "")
        except InvalidRequest:
            raise InvalidRequest(f"user {user!r} is not in the sandbox's /etc/passwd") from None
        return Account(user, acct.home)

    async def _passwd(self, rec: SandboxRecord, caller: Caller) -> str:
        try:
            return (await self.mgr.read_file(rec.id, "/etc/passwd", caller=caller)).decode(errors="replace")
        except NotFound:
            return ""

    @staticmethod
    def absolute(path: str, home: str) -> str:
        """E2B paths may be relative: to the account's home, as envd resolves them."""
        if not path:
            raise InvalidRequest("path is empty")
        if "\0" in path:
            raise InvalidRequest("path contains a NUL byte")
        return posixpath.normpath(path if path.startswith("/") else posixpath.join(home, path))

    # ---- directory watchers (CreateWatcher / GetWatcherEvents) -----------------------------------

    def add_watcher(self, sandbox_id: str, watch: DirWatch, include_entry: bool) -> str:
        mine = self._watchers.setdefault(sandbox_id, {})
        now = time.monotonic()
        for wid in [w for w, v in mine.items() if now - v.used > WATCHER_IDLE]:
            mine.pop(wid).watch.close()
        if len(mine) >= MAX_WATCHERS:
            raise LimitExceeded(f"sandbox {sandbox_id} already has {MAX_WATCHERS} watchers; remove one first")
        wid = uuid.uuid4().hex
        mine[wid] = Watcher(watch, include_entry, now)
        return wid

    def watcher(self, sandbox_id: str, watcher_id: str) -> Watcher:
        found = self._watchers.get(sandbox_id, {}).get(watcher_id)
        if found is None:
            raise NotFound(f"no watcher {watcher_id!r} in sandbox {sandbox_id}")
        found.used = time.monotonic()
        return found

    def remove_watcher(self, sandbox_id: str, watcher_id: str) -> None:
        found = self._watchers.get(sandbox_id, {}).pop(watcher_id, None)
        if found is None:
            raise NotFound(f"no watcher {watcher_id!r} in sandbox {sandbox_id}")
        found.watch.close()

    def sweep(self) -> None:
        """Drop what this layer kept for sandboxes that ended some other way (their TTL, a native kill);
        called now and then by creations, so the maps stay as large as the live sandboxes."""
        self._creates += 1
        if self._creates % SWEEP_EVERY:
            return
        known = {*self._cursors, *self._watchers, *(k[0] for k in self._accounts)}
        for sid in [s for s in known if not self.mgr.is_live(s)]:
            self.forget(sid)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox ended: drop what this layer kept for it."""
        self._cursors.pop(sandbox_id, None)
        for watcher in self._watchers.pop(sandbox_id, {}).values():
            watcher.watch.close()
        for key in [k for k in self._accounts if k[0] == sandbox_id]:
            del self._accounts[key]


def _entries(passwd: str) -> list[list[str]]:
    rows = (line.split(":") for line in passwd.splitlines() if line and not line.startswith("#"))
    return [row for row in rows if len(row) >= 6]


def _has_user(passwd: str, name: str) -> bool:
    return any(e[0] == name for e in _entries(passwd))
