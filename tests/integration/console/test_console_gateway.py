"""The console served by the cluster gateway, in a real browser: two real node daemons behind ``dsec
cluster gateway``; the fleet page has a row per node, the list merges both nodes' sandboxes, an exec's
output streams through the gateway into the page, and a kill from the page ends the sandbox on its node."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, expect

import dsec

from ..static_cluster import Cluster, static_cluster
from .conftest import IMAGE, KIND, Console, Watch, log_in


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with static_cluster("dsec-console-cluster-") as running:
        yield running


@pytest.mark.timeout(300)
def test_the_gateways_console_shows_every_node_and_acts_through_it(cluster: Cluster, browser: Browser) -> None:
    client = dsec.Client(url=cluster.url, token=cluster.token)
    made = [dsec.Sandbox.create(image=IMAGE, kind=KIND, client=client, timeout=300) for _ in range(4)]
    try:
        assert len({sb.info().node for sb in made}) == 2  # placement spread them: the list must merge nodes
        context = browser.new_context(viewport={"width": 1400, "height": 1000})
        context.set_default_timeout(15_000)
        page = context.new_page()
        watch = Watch()
        watch.attach(page)
        console = Console(page, context, watch, cluster.url.rstrip("/"))
        log_in(console, cluster.token)

        nodes = console.testid("fleet-nodes")
        expect(nodes).to_contain_text("n1")
        expect(nodes).to_contain_text("n2")

        console.goto("#/sandboxes")
        for sb in made:
            expect(page.locator(f'[data-testid="sandbox-row"][data-id="{sb.id}"]')).to_be_visible()

        target = made[-1]
        console.goto(f"#/sandboxes/{target.id}")
        expect(console.testid("exec-stream-status")).to_have_text("live")
        worker = threading.Thread(target=lambda: target.exec("echo through-the-gateway; sleep 2", timeout=60))
        worker.start()
        try:
            expect(console.testid("exec-output")).to_contain_text("through-the-gateway", timeout=10_000)
        finally:
            worker.join(60)

        console.testid("action-kill").click()
        console.testid("confirm-yes").click()
        expect(console.testid("sandbox-state")).to_have_text("stopped", timeout=20_000)
        with pytest.raises(dsec.DsecError):
            target.exec("true")
        assert watch.dialogs == [] and watch.page_errors == [] and watch.csp_violations() == []
        # no failed call but the session check before the login (401); a gateway has /v1/cluster, so no 404
        assert watch.unexpected_errors(allowed=("status of 401",)) == [], watch.console_errors
        context.close()
    finally:
        for sb in made:
            try:
                sb.kill()
            except dsec.DsecError:
                pass
