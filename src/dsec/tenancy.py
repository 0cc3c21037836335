"""Who is calling: the tenant behind a request's token, and what it may see.

Every tenant sees only what it owns plus what nobody owns (built-in images, images the operator
made); the operator (tenant ``admin``, the daemon's ``STATE_DIR/token``) sees and acts on everything.
The daemon's own work (builder sandboxes, the reaper, re-adoption) runs as the operator.
"""

from __future__ import annotations

from dataclasses import dataclass

ADMIN = "admin"


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
