"""The console's images and audit pages in a real browser: a snapshot made from a sandbox appears in the
lineage graph as a child of the test image, with its layers and lazy-fetch statistics, next to the warm
pools; the calls just made appear in the audit log, and its filters narrow them as the API does."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime

import httpx
import pytest
from playwright.sync_api import expect

import dsec

from ..conftest import Daemon
from .conftest import IMAGE, Console


@pytest.mark.timeout(180)
def test_a_snapshot_is_drawn_as_a_child_of_its_image(
    console: Console, daemon: Daemon, make_sandbox: Callable[..., dsec.Sandbox]
) -> None:
    client = daemon.client()
    base = client.image(IMAGE)
    sb = make_sandbox()
    sb.exec("mkdir -p /srv && echo v1 > /srv/app.txt")
    name = f"console-test/snap:{uuid.uuid4().hex[:8]}"
    snap = sb.snapshot(name, description="<b>not bold</b> made by the console test")
    assert snap.parent == base.digest
    pool = f"ui-pool-{uuid.uuid4().hex[:6]}"
    client.set_warm_pool(pool, IMAGE, 0)  # size 0: listed, no sandbox made for it
    try:
        console.goto("#/images")
        graph = console.testid("image-graph")
        # the newest child of its image is drawn without asking: an edge from the image to it
        node = graph.locator(f'[data-testid="image-node"][data-name="{name}"]')
        expect(node).to_have_attribute("data-kind", "snapshot")
        expect(node).to_have_attribute("data-parent", base.digest)
        expect(graph.locator(f'[data-testid="image-node"][data-name="{base.name}"]')).to_have_attribute(
            "data-kind", "base"
        )
        expect(graph.locator(f'[data-testid="image-edge"][data-from="{base.name}"][data-to="{name}"]')).to_have_count(1)

        node.click()
        expect(console.testid("image-detail")).to_contain_text(sb.id)  # the sandbox it was taken of
        expect(console.testid("image-info")).to_contain_text("<b>not bold</b>")  # text, not markup
        layers = console.testid("image-layers").get_by_test_id("image-layer")
        expect(layers).to_have_count(len(snap.layers))
        expect(layers.last).to_have_attribute("data-role", "diff")
        stats = client.image_stats(name)
        expect(console.testid("image-stats")).to_be_visible()
        expect(console.testid("image-exposed")).to_have_text(
            f"{stats.exposed_fraction * 100:.{1 if stats.exposed_fraction < 0.1 else 0}f}%"
        )

        # the filter narrows the graph to the name and its ancestors
        console.testid("image-filter").fill(name)
        console.testid("image-filter").press("Enter")
        expect(graph.get_by_test_id("image-node")).to_have_count(2)

        row = console.testid("warm-pools").locator(f'[data-testid="warm-pool"][data-name="{pool}"]')
        expect(row).to_contain_text(IMAGE)
        expect(row).to_contain_text("0 / 0")
        assert console.watch.dialogs == [] and console.watch.page_errors == []
    finally:
        client.remove_warm_pool(pool)
        client.remove_image(name)  # the test repository is shared: leave no name behind


@pytest.mark.timeout(180)
def test_the_audit_log_shows_the_calls_and_filters_them(
    console: Console,
    open_console: Callable[[str | None], Console],
    daemon: Daemon,
    make_sandbox: Callable[..., dsec.Sandbox],
) -> None:
    client = daemon.client()
    for _ in range(60):  # enough records for a second page
        client.list()
    marker = f"audit-marker-{uuid.uuid4().hex[:8]}"
    sb = make_sandbox()
    sb.exec(f"echo {marker}")
    sb.files.write("/tmp/f.txt", "x")
    other = make_sandbox()
    other.exec("true")
    tenant = client.create_tenant(f"ui-audit-{uuid.uuid4().hex[:6]}")
    dsec.Client(url=daemon.url, token=tenant.token).list()

    console.goto("#/audit")
    rows = console.testid("audit-row")
    expect(rows.filter(has_text=marker)).to_have_count(1)
    expect(rows).to_have_count(50)  # a page
    first = rows.first.text_content() or ""
    oldest = rows.last.get_attribute("data-time") or ""
    console.testid("page-next").click()
    expect(rows.first).not_to_have_text(first)
    # the next page is the API's answer for what precedes the oldest call shown (`until`), newest first
    older = httpx.get(
        f"{daemon.url}/v1/audit",
        params={"until": oldest, "limit": 50},
        headers={"authorization": f"Bearer {daemon.token}"},
        timeout=30,
    ).json()["records"][::-1]
    assert older and all(datetime.fromisoformat(r["time"]) < datetime.fromisoformat(oldest) for r in older)
    expect(rows).to_have_count(len(older))
    assert [r.get_attribute("data-time") for r in rows.all()] == [r["time"] for r in older]
    console.testid("page-prev").click()
    expect(rows.first).to_have_text(first)  # the page seen, not the calls made since

    # by sandbox (the API's filter): exactly that sandbox's calls
    console.testid("audit-filter-sandbox").fill(sb.id)
    console.testid("audit-filter-apply").click()
    want = client.audit(sandbox=sb.id, limit=1000)
    expect(rows).to_have_count(len(want))
    assert len(want) >= 3  # create, exec, write
    for i in range(len(want)):
        expect(rows.nth(i)).to_have_attribute("data-sandbox", sb.id)
    # and by route, here: the exec only
    console.testid("audit-filter-route").fill("/exec")
    console.testid("audit-filter-method").select_option("POST")
    console.testid("audit-filter-apply").click()
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text(marker)
    expect(rows.first).to_have_attribute("data-route", "/v1/sandboxes/{sandbox_id}/exec")

    # by tenant (operator only): the tenant's one call
    console.testid("audit-filter-clear").click()
    console.testid("audit-filter-tenant").fill(tenant.name)
    console.testid("audit-filter-apply").click()
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text(tenant.name)
    expect(rows.first).to_have_attribute("data-route", "/v1/sandboxes")

    # a tenant sees its own records only, and has no tenant filter
    mine = dsec.Client(url=daemon.url, token=tenant.token).audit(limit=1000)
    t = open_console(tenant.token)
    t.goto("#/audit")
    expect(t.testid("audit-filter-tenant")).to_have_count(0)
    expect(t.testid("audit-row").filter(has_text=marker)).to_have_count(0)
    expect(t.testid("audit-row").first).to_be_visible()
    assert len(mine) >= 1
    for row in t.testid("audit-row").all():
        assert tenant.name in row.inner_text()
    assert console.watch.dialogs == [] and console.watch.page_errors == []
