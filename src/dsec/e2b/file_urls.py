"""Signed file URLs (E2B's ``download_url``/``upload_url`` of a secured sandbox).

The SDK signs ``path:operation:user:token[:expiration]`` with sha256, where ``token`` is the sandbox's
envd access token: without the token nobody can make a signature, and one signature opens one path, for
one operation (``read`` is GET, ``write`` is POST), as one user, until its expiration (or, with none,
while the sandbox lives: its token names it and dies with it).

The URL names no sandbox when the SDK talks to one endpoint for every sandbox (``E2B_SANDBOX_URL``, as
with dsec): then the sandbox is the live one whose token made the signature. That costs one hash per
live sandbox, bounded by ``MAX_CANDIDATES``, and is tried only for requests that carry a signature.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Callable, Iterable
from enum import Enum

PREFIX = "v1_"
MAX_CANDIDATES = 50_000  # live sandboxes one unnamed signature is tried against


class Signed(Enum):
    VALID = "valid"
    INVALID = "invalid"
    EXPIRED = "expired"


def sign(token: str, path: str, operation: str, user: str, expiration: int | None = None) -> str:
    parts = [path, operation, user, token]
    if expiration is not None:
        parts.append(str(expiration))
    digest = hashlib.sha256(":".join(parts).encode()).digest()
    return PREFIX + base64.b64encode(digest).rstrip(b"=").decode()


def check(
    token: str, path: str, operation: str, user: str, signature: str, expiration: str | None, now: float | None = None
) -> Signed:
    """Whether ``signature`` was made with ``token`` for this path, operation and user, and is still good.
    EXPIRED only for a signature that is otherwise valid: a forged one learns nothing from the answer."""
    if not signature.startswith(PREFIX):
        return Signed.INVALID
    stamp: int | None = None
    if expiration:
        if not (expiration.isascii() and expiration.isdigit()) or len(expiration) > 20:
            return Signed.INVALID
        stamp = int(expiration)
    want = sign(token, path, operation, user, stamp)
    if not hmac.compare_digest(want.encode(), signature.encode()):
        return Signed.INVALID
    if stamp is not None and stamp < (time.time() if now is None else now):
        return Signed.EXPIRED
    return Signed.VALID


def signer(
    candidates: Iterable[str],
    token_of: Callable[[str], str],
    path: str,
    operation: str,
    user: str,
    signature: str,
    expiration: str | None,
) -> tuple[str | None, Signed]:
    """The sandbox (of ``candidates``) whose token made ``signature``, and the check's result; (None,
    INVALID) when none did."""
    if not signature.startswith(PREFIX):
        return None, Signed.INVALID
    for n, sandbox_id in enumerate(candidates):
        if n >= MAX_CANDIDATES:
            break
        result = check(token_of(sandbox_id), path, operation, user, signature, expiration)
        if result is not Signed.INVALID:
            return sandbox_id, result
    return None, Signed.INVALID
