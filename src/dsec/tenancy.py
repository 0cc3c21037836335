"""Who is calling: the tenant behind a request's token, and what it may see.

Every tenant sees only what it owns plus what nobody owns (built-in images, images the operator
made); the operator (tenant ``admin``, the daemon's ``STATE_DIR/token``) sees and acts on everything.
The daemon's own work (builder sandboxes, the reaper, re-adoption) runs as the operator.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated

from pydantic import AfterValidator, WithJsonSchema

from .errors import InvalidRequest

ADMIN = "admin"
TENANT_NAME = r"^[a-z0-9][a-z0-9-]{0,62}$"
_NAME_RE = re.compile(TENANT_NAME)


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str
    operator: bool = False

    def owns(self, owner: str | None) -> bool:
        """May act on a sandbox or image owned by ``owner`` (None: nobody, i.e. the operator's)."""
        return self.operator or (owner is not None and owner == self.tenant)

    def sees(self, owner: str | None) -> bool:
        """May see or use (read-only) an image owned by ``owner``: its own, or an unowned one."""
        return owner is None or self.owns(owner)

    @property
    def owner(self) -> str | None:
        """What the caller's new images record as their owner: none for the operator's (public)."""
        return None if self.operator else self.tenant


OPERATOR = Caller(ADMIN, operator=True)


def check_tenant_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidRequest(
            f"invalid tenant name {str(name)[:80]!r}: 1-63 characters of a-z, 0-9 and '-', starting with a letter "
            "or digit"
        )
    return name


TenantName = Annotated[
    str,
    AfterValidator(check_tenant_name),
    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": 63, "pattern": TENANT_NAME}),
]
