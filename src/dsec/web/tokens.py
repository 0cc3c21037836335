"""The operator's token file, shared by the node daemon and the cluster's gateway, and how long an idle
client connection is kept."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from ..errors import InvalidRequest

# idle keep-alive of every dsec server: longer than the SDK keeps its pooled connections (30 s), so the
# client always closes first and never sends on a connection the server is closing
KEEP_ALIVE_S = 120


def read_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise InvalidRequest(f"cannot read the token from {path}: {e}") from None
    if not token:
        raise InvalidRequest(f"the token file {path} is empty")
    return token


def ensure_token(path: Path) -> str:
    """The token in ``path``, or a new one made there (mode 0600, never overwriting) at first use."""
    if path.exists():
        return read_token(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token
