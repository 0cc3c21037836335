"""GET /v1/sandboxes's filters and pages, as a node and the gateway both apply them."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from dsec.protocol.sandbox import Limits, SandboxInfo, State
from dsec.protocol.sandbox_query import MAX_PAGE, SandboxQuery, select


def info(i: int, **kw: object) -> SandboxInfo:
    at = datetime.fromtimestamp(1_800_000_000 + i, UTC)
    fields: dict[str, object] = {
        "id": f"sb-{i}",
        "kind": "container",
        "image": "dsec/debian:12",
        "state": State.running,
        "created_at": at,
        "expires_at": at,
        "limits": Limits(),
    }
    fields.update(kw)
    return SandboxInfo.model_validate(fields)


def same(i: SandboxInfo) -> SandboxInfo:
    return i


def test_no_query_is_the_list_as_it_was() -> None:
    infos = [info(i) for i in range(3)]
    answer = select(infos, SandboxQuery(), same)
    assert answer.sandboxes == infos and answer.total is None


def test_filters_then_a_page_newest_first_with_the_total() -> None:
    infos = [info(i, kind="vm" if i % 3 == 0 else "container", owner="alice" if i < 5 else "bob") for i in range(10)]
    assert [i.id for i in select(infos, SandboxQuery(kind="vm"), same).sandboxes] == ["sb-0", "sb-3", "sb-6", "sb-9"]
    page = select(infos, SandboxQuery(owner="alice", limit=2, offset=1), same)
    assert page.total == 5 and [i.id for i in page.sandboxes] == ["sb-3", "sb-2"]
    assert select(infos, SandboxQuery(limit=5, offset=50), same).sandboxes == []
    assert select(infos, SandboxQuery(state=State.paused, limit=5), same).total == 0


@pytest.mark.parametrize("bad", [{"limit": 0}, {"limit": MAX_PAGE + 1}, {"offset": -1}, {"kind": "pod"}])
def test_a_query_out_of_range_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        SandboxQuery.model_validate(bad)
