"""What a Harbor task's settings become in dsec: the name a task's Dockerfile is built under, the sandbox's
limits, its network policy, and a command's result as Harbor reads it.

Plain functions of plain values, with no import of Harbor: they hold the decisions, and the unit tests
(which run where Harbor, needing Python 3.12, is not installed) check them there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import dsec

# the daemon's longest exec: a command Harbor gives no timeout runs at most this long
MAX_EXEC = 24 * 3600.0
# coreutils' `timeout` status, which several of Harbor's own environments return for a command past its time
TIMED_OUT = 124

_NOT_NAME = re.compile(r"[^a-z0-9._-]+")
_EDGES = re.compile(r"^[._-]+|[._-]+$")
_SLUG_MAX = 100


def image_name(environment_name: str, content_hash: str) -> str:
    """The dsec image a task's ``environment/Dockerfile`` is built as: ``harbor/<task>:<content hash>``.

    The tag is the hash of the environment directory's files (Harbor's ``environment_id``), so an
    unchanged task finds its image on the node and a changed one is built anew under a tag of its own.
    """
    slug = _EDGES.sub("", _NOT_NAME.sub("-", environment_name.lower()))[:_SLUG_MAX]
    slug = _EDGES.sub("", slug) or "task"
    tag = re.sub(r"[^A-Za-z0-9_.-]", "", content_hash)[:32] or "latest"
    return f"harbor/{slug}:{tag}"


def network_spec(mode: str, allowed_hosts: list[str]) -> Literal["full"] | dict[str, list[str]] | None:
    """A Harbor network mode as a dsec policy: ``no-network`` is loopback only (None), ``public`` is
    ``"full"`` (anything but the host, the daemon, cloud metadata and other sandboxes), ``allowlist``
    allows each host on every port (Harbor's entries name hosts, not ports)."""
    if mode == "no-network":
        return None
    if mode == "public":
        return "full"
    if mode == "allowlist":
        return {"allow": [f"{host}:*" for host in allowed_hosts]}
    raise ValueError(f"unknown Harbor network mode {mode!r}")


def limits(
    *,
    cpu_request: float | None,
    cpu_limit: float | None,
    memory_request_mb: int | None,
    memory_limit_mb: int | None,
    storage_mb: int | None,
) -> dict[str, Any]:
    """``Sandbox.create``'s resource arguments from the task's resources as Harbor's enforcement policy
    resolved them (a request, a limit, or both). A memory request without a limit gets the request as its
    limit too: a dsec sandbox always has a memory ceiling, and the node's default may be below the request."""
    out: dict[str, Any] = {}
    if cpu_request is not None:
        out["cpu"] = float(cpu_request)
    if cpu_limit is not None:
        out["cpu_limit"] = float(cpu_limit)
    memory = memory_limit_mb if memory_limit_mb is not None else memory_request_mb
    if memory is not None:
        out["memory"] = f"{memory}Mi"
    if memory_request_mb is not None:
        out["memory_request"] = f"{memory_request_mb}Mi"
    if storage_mb is not None:
        out["disk"] = f"{storage_mb}Mi"
    return out


def home_of(user: str, passwd: str) -> str | None:
    """The home directory ``/etc/passwd`` (its text) gives the account ``user`` names (NAME, UID,
    NAME:GROUP or UID:GID); None when it has no such account. ``docker exec -u`` sets HOME to it."""
    name = user.partition(":")[0]
    for line in passwd.splitlines():
        fields = line.split(":")
        if len(fields) >= 6 and not line.startswith("#") and name in (fields[0], fields[2]):
            return fields[5] or "/"
    return "/root" if name in ("root", "0") else None


@dataclass(frozen=True)
class CommandResult:
    """A command's outcome in Harbor's terms (its ``ExecResult`` fields)."""

    stdout: str
    stderr: str
    return_code: int


def command_result(result: dsec.ExecResult, timeout: float | None) -> CommandResult:
    """A finished dsec exec as Harbor reads it: a command killed by a signal has 128 + the signal's number
    (as a shell reports it); one past its timeout returns 124 with a line saying so after its stderr."""
    stderr = result.stderr
    if result.timed_out:
        seconds = f"{timeout:g}" if timeout is not None else f"{MAX_EXEC:g}"
        note = f"Command timed out after {seconds} seconds"
        return CommandResult(result.stdout, f"{stderr}\n{note}" if stderr else note, TIMED_OUT)
    if result.exit_code is not None:
        code = result.exit_code
    else:
        code = 128 + (result.signal or 0)
    return CommandResult(result.stdout, stderr, code)
