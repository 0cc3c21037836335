"""Warm pools: sandboxes made ahead and handed out to creations that match them (docs/pools.md).

A pool is named and says what its sandboxes are (image, kind, limits, network policy, the tenant whose
creations it serves) and how many idle ones it keeps. ``dsec serve --warm`` and ``dsec pool set`` write
one on a line: ``IMAGE[@KIND][:LIMITS]=N``, LIMITS a comma-separated list of ``Limits`` fields
(``cpu=1,memory=512Mi``), parsed here once for both.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import InvalidRequest
from .names import ImageName, TenantName
from .network import NetworkSpec
from .sandbox import KINDS, Kind, Limits

MAX_POOL_SIZE = 1024
POOL_NAME = r"^[a-z0-9][a-z0-9._-]{0,62}$"
PoolName = Annotated[
    str, Field(pattern=POOL_NAME, description="Lower-case letters, digits and . _ -, at most 63, first alnum.")
]
SPEC_FORM = "IMAGE[@KIND][:LIMITS]=N, e.g. dsec/debian:12@container:cpu=1,memory=512Mi=4"


class WarmPoolSpec(BaseModel):
    """What a pool's sandboxes are and how many idle ones it keeps (PUT /v1/pools/{name})."""

    model_config = ConfigDict(extra="forbid")

    image: ImageName = Field(description="Served to creations whose image resolves to the version this names now.")
    kind: Kind = Field("container", description="Sandbox kind.")
    limits: Limits = Field(default_factory=lambda: Limits(), description="A creation must ask for exactly these.")
    network: NetworkSpec = Field(None, description="A creation must ask for exactly this network policy.")
    tenant: TenantName | None = Field(
        None,
        description="The tenant whose creations it serves, and whose quota its sandboxes count against "
        "(default: the operator's).",
    )
    size: int = Field(..., ge=0, le=MAX_POOL_SIZE, description="Idle sandboxes kept ready.")


class WarmPoolInfo(BaseModel):
    name: str
    spec: WarmPoolSpec
    version: str | None = Field(
        None, description="The image version (digest) the pool's sandboxes run; none until it is resolved."
    )
    idle: int = Field(description="Sandboxes ready to be handed out.")
    filling: int = Field(description="Sandboxes being made for it now.")
    claims: int = Field(description="Creations served by one of its sandboxes.")
    misses: int = Field(description="Creations that matched it but found no idle sandbox of the current version.")
    refills: int = Field(description="Sandboxes made for it.")
    drained: int = Field(description="Idle sandboxes killed because the image moved to a new version.")
    reclaimed: int = Field(description="Idle sandboxes killed to give their capacity to a real creation.")
    failures: int = Field(description="Refills that failed.")
    waiting: str | None = Field(None, description="Why it is not full now (no capacity, a failure), if it is not.")


class WarmPoolList(BaseModel):
    pools: list[WarmPoolInfo]


def parse_warm(text: str) -> WarmPoolSpec:
    """``IMAGE[@KIND][:LIMITS]=N`` as a spec; InvalidRequest naming the form otherwise.

    Image names hold ``:`` (tags, registry ports) and ``@`` (digests) but never ``=``: the size is after the
    last ``=``, LIMITS is the part after the last ``:`` when it holds an ``=``, and KIND the part after the
    last ``@`` when it is a kind's name."""
    head, eq, count = text.rpartition("=")
    if not eq or not count.isdigit() or not 0 <= int(count) <= MAX_POOL_SIZE:
        raise InvalidRequest(f"warm pool {text!r}: expected {SPEC_FORM} (N from 0 to {MAX_POOL_SIZE})")
    limits: dict[str, str] = {}
    rest, colon, tail = head.rpartition(":")
    if colon and "=" in tail:
        head = rest
        for item in tail.split(","):
            key, sep, value = item.partition("=")
            if not sep or not key or not value or key in limits:
                raise InvalidRequest(f"warm pool {text!r}: limits must be KEY=VALUE,... ({item!r})")
            limits[key] = value
    elif "=" in head:
        raise InvalidRequest(f"warm pool {text!r}: expected {SPEC_FORM}")
    kind = "container"
    image, at, name = head.rpartition("@")
    if at and name in KINDS:
        head, kind = image, name
    try:
        return WarmPoolSpec.model_validate({"image": head, "kind": kind, "limits": limits, "size": int(count)})
    except ValidationError as e:
        why = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
        raise InvalidRequest(f"warm pool {text!r}: {why}") from None


def default_name(spec: WarmPoolSpec, taken: set[str]) -> str:
    """A pool name for a spec given on the command line: its image and kind, made a name, unique in ``taken``."""
    base = "".join(c if c.isalnum() or c in "._-" else "-" for c in f"{spec.image}-{spec.kind}".lower())
    base = base.strip("-._")[:56] or "pool"
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}-{n}"
    return name
