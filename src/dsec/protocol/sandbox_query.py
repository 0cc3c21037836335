"""Which sandboxes a list answers (GET /v1/sandboxes's filters and pages), as one function over the wire
models, so a node and the gateway (which merges its nodes' lists) select alike."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from pydantic import BaseModel, Field

from .sandbox import Kind, SandboxInfo, SandboxList, State

MAX_PAGE = 500
T = TypeVar("T", bound="Listed")


class SandboxQuery(BaseModel):
    state: State | None = Field(None, description="Only sandboxes in this state.")
    kind: Kind | None = Field(None, description="Only sandboxes of this kind.")
    image: str | None = Field(None, max_length=512, description="Only sandboxes of this image (as created).")
    owner: str | None = Field(None, max_length=64, description="Only this tenant's sandboxes (the operator's call).")
    limit: int | None = Field(
        None, ge=1, le=MAX_PAGE, description="A page of at most this many, newest first, with the total."
    )
    offset: int = Field(0, ge=0, le=10_000_000, description="Sandboxes skipped before the page (with limit).")

    @property
    def filters(self) -> bool:
        return any(v is not None for v in (self.state, self.kind, self.image, self.owner, self.limit))


class Listed(Protocol):
    """What a list filters on: a sandbox's record on a node, or its info at the gateway."""

    @property
    def state(self) -> State: ...
    @property
    def kind(self) -> str: ...
    @property
    def image(self) -> str: ...
    @property
    def owner(self) -> str | None: ...


def matches(item: Listed, q: SandboxQuery) -> bool:
    return (
        (q.state is None or item.state == q.state)
        and (q.kind is None or item.kind == q.kind)
        and (q.image is None or item.image == q.image)
        and (q.owner is None or item.owner == q.owner)
    )


def select(items: Sequence[T], q: SandboxQuery, info: Callable[[T], SandboxInfo]) -> SandboxList:
    """``items`` oldest first, as a node lists them; the answer as the query asks. Only the page is turned
    into infos: at thousands of sandboxes that is most of a list's cost."""
    if not q.filters:
        return SandboxList(sandboxes=[info(i) for i in items])
    chosen = [i for i in items if matches(i, q)]
    if q.limit is None:
        return SandboxList(sandboxes=[info(i) for i in chosen])
    page = chosen[::-1][q.offset : q.offset + q.limit]
    return SandboxList(sandboxes=[info(i) for i in page], total=len(chosen))
