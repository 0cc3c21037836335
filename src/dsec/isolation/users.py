"""Accounts inside a sandbox: an image's user spec ("agent", "1000", "agent:staff", "1000:1000") resolved
against the image's own /etc/passwd and /etc/group, as a runtime would resolve an OCI image's User."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import InvalidRequest
from ..protocol.types import USER_SPEC

_SPEC = re.compile(USER_SPEC)
MAX_ID = 65535  # a sandbox maps 65,536 ids


@dataclass(frozen=True)
class Account:
    uid: int
    gid: int
    home: str

    @property
    def is_root(self) -> bool:
        return self.uid == 0 and self.gid == 0


ROOT = Account(0, 0, "/root")


def _table(text: str) -> list[list[str]]:
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]


def _id(value: str, what: str) -> int:
    number = int(value)
    if not 0 <= number <= MAX_ID:
        raise InvalidRequest(f"{what} {number} is outside the sandbox's ids (0-{MAX_ID})")
    return number


def resolve(spec: str, passwd: str, group: str) -> Account:
    """The account ``spec`` names, from the image's passwd and group files (texts, possibly empty)."""
    if spec in ("", "root", "0", "0:0", "root:root"):
        return ROOT
    if not _SPEC.match(spec):
        raise InvalidRequest(f"invalid user {spec!r}: expected NAME, UID, NAME:GROUP or UID:GID")
    name, _, grp = spec.partition(":")
    users = _table(passwd)
    entry = next((u for u in users if len(u) >= 6 and (u[0] == name or (name.isdigit() and u[2] == name))), None)
    if entry is not None:
        uid, gid, home = _id(entry[2], "uid"), _id(entry[3], "gid"), entry[5] or "/"
    elif name.isdigit():
        uid, gid, home = _id(name, "uid"), _id(name, "gid"), "/"
    else:
        raise InvalidRequest(f"user {name!r} is not in the image's /etc/passwd")
    if grp:
        groups = _table(group)
        match = next((g for g in groups if len(g) >= 3 and (g[0] == grp or (grp.isdigit() and g[2] == grp))), None)
        if match is not None:
            gid = _id(match[2], "gid")
        elif grp.isdigit():
            gid = _id(grp, "gid")
        else:
            raise InvalidRequest(f"group {grp!r} is not in the image's /etc/group")
    return Account(uid, gid, home)
