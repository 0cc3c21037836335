"""E2B templates' names, tags, owners and builds as the node keeps them, and the upload links (no daemon)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from dsec.e2b.service import E2BService
from dsec.e2b.template_builds import TemplateBuilds, _evict
from dsec.e2b.template_store import MAX_BUILDS, TemplateStore, TemplateTaken
from dsec.errors import Forbidden, InvalidRequest, NotFound
from dsec.tenancy import OPERATOR, Caller

ALICE = Caller("alice")
BOB = Caller("bob")


def test_a_name_is_its_owners_and_another_tenant_neither_sees_nor_takes_it(tmp_path: Path) -> None:
    store = TemplateStore(tmp_path / "t.json")
    template, build = store.new_build("app", ["default"], ALICE)
    with pytest.raises(TemplateTaken):
        store.new_build("app", ["default"], BOB)
    for ref in ("app", "app:default", template.id):
        with pytest.raises(NotFound):
            store.visible(ref, BOB)
        assert store.visible(ref, ALICE)[0] is template
    assert store.visible("app", OPERATOR)[0] is template
    again, second = store.new_build("app", ["v2"], ALICE)
    assert again is template and second.id != build.id


def test_the_operators_templates_are_everyones_to_use_not_to_change(tmp_path: Path) -> None:
    store = TemplateStore(tmp_path / "t.json")
    store.new_build("shared", ["default"], OPERATOR)
    assert store.visible("shared", ALICE)
    with pytest.raises(Forbidden):
        store.own("shared", ALICE)
    with pytest.raises(TemplateTaken):
        store.new_build("shared", ["mine"], ALICE)


def test_a_tag_names_a_build_once_it_is_ready(tmp_path: Path) -> None:
    store = TemplateStore(tmp_path / "t.json")
    template, build = store.new_build("app", ["v1", "stable"], ALICE)
    assert store.image_for("nothing-here") is None
    with pytest.raises(NotFound):
        store.image_for("app:v1")  # not tagged before it is ready
    store.finish(template, build, "ready", None, None)
    image = template.image(build.id)
    assert store.image_for("app:v1") == store.image_for("app:stable") == image
    with pytest.raises(NotFound):
        store.image_for("app")  # no 'default' tag was asked for
    store.assign(template, build, ["default"])
    assert store.image_for("app") == store.image_for(template.id) == image
    _, failed = store.new_build("app", ["v2"], ALICE)
    store.finish(template, failed, "error", "step 1 failed", "1")
    with pytest.raises(NotFound):
        store.image_for("app:v2")
    store.remove_tags(template, ["stable"])
    with pytest.raises(NotFound):
        store.remove_tags(template, ["stable"])


def test_a_tag_that_names_an_unfinished_build_says_so(tmp_path: Path) -> None:
    store = TemplateStore(tmp_path / "t.json")
    template, first = store.new_build("app", ["default"], ALICE)
    store.finish(template, first, "ready", None, None)
    _, second = store.new_build("app", ["x"], ALICE)
    store.assign(template, second, ["next"])
    with pytest.raises(InvalidRequest, match="waiting"):
        store.image_for("app:next")


def test_the_store_outlives_the_daemon_and_a_build_it_did_not_see_end_is_an_error(tmp_path: Path) -> None:
    store = TemplateStore(tmp_path / "t.json")
    template, done = store.new_build("app", ["default"], ALICE)
    store.finish(template, done, "ready", None, None)
    _, running = store.new_build("app", ["next"], ALICE)
    running.status = "building"
    store.save()
    again = TemplateStore(tmp_path / "t.json")
    kept = again.visible("app", ALICE)[0]
    assert kept.builds[done.id].status == "ready" and again.image_for("app") == template.image(done.id)
    assert kept.builds[running.id].status == "error" and "daemon stopped" in (kept.builds[running.id].reason or "")


def test_old_untagged_builds_are_forgotten_and_their_images_given_back(tmp_path: Path) -> None:
    store = TemplateStore(tmp_path / "t.json")
    template, first = store.new_build("app", ["default"], ALICE)
    store.finish(template, first, "ready", None, None)
    builds = []
    for _ in range(MAX_BUILDS + 3):
        _, b = store.new_build("app", [], ALICE)
        store.finish(template, b, "ready", None, None)
        builds.append(b)
    images = store.prune(template)
    assert images == [template.image(b.id) for b in builds[:4]]
    assert first.id in template.builds and len(template.builds) == MAX_BUILDS


def test_an_upload_link_opens_one_upload_of_one_template_for_a_while(tmp_path: Path) -> None:
    store = TemplateStore(tmp_path / "t.json")
    template, _ = store.new_build("app", ["default"], ALICE)
    svc = cast(E2BService, SimpleNamespace(mgr=None))
    builds = TemplateBuilds(svc, store, tmp_path, b"k" * 32)
    files_hash = "ab" * 32
    url = builds.upload_link("http://127.0.0.1:9/", template.id, files_hash)
    tid, fh, expires, sig = url.split("/")[-5:-1]
    assert (tid, fh) == (template.id, files_hash)
    assert builds.check_link(tid, fh, int(expires), sig) is template
    for args in (
        (tid, "cd" * 32, int(expires), sig),  # another upload
        (tid, fh, int(expires) + 1, sig),  # a later expiry
        (tid, fh, int(expires), "0" * 64),
    ):
        with pytest.raises(NotFound):
            builds.check_link(*args)
    past = int(time.time()) - 1
    with pytest.raises(NotFound):
        builds.check_link(tid, fh, past, builds._sign(tid, fh, past))
    other = TemplateBuilds(svc, store, tmp_path, b"q" * 32)  # another daemon's key
    with pytest.raises(NotFound):
        other.check_link(tid, fh, int(expires), sig)


def test_uploads_past_the_owners_bound_go_least_recently_used_first(tmp_path: Path) -> None:
    for i, name in enumerate(("old", "mid", "new")):
        (tmp_path / f"{name}.tar").write_bytes(b"x" * 100)
        t = time.time() - 100 + i

        os.utime(tmp_path / f"{name}.tar", (t, t))
    _evict(tmp_path, 150, tmp_path / "new.tar")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.tar"]


async def test_the_cluster_gateway_refuses_template_builds() -> None:
    """Templates are one node's: the gateway's E2B API refuses their routes before any key or node, and
    still passes a snapshot's deletion on."""
    from dsec.cluster.e2b import E2BGateway, _template_build
    from dsec.cluster.gateway import Gateway

    gateway = E2BGateway(cast(Gateway, None))
    for method, path in (
        ("POST", "/v3/templates"),
        ("GET", "/templates/abc/files/" + "a" * 64),
        ("POST", "/v2/templates/abc/builds/b"),
        ("GET", "/templates/abc/builds/b/status"),
        ("GET", "/templates/aliases/app"),
        ("POST", "/templates/tags"),
        ("GET", "/templates/app/tags"),
        ("DELETE", "/templates/tags"),
    ):
        sent: list[dict[str, object]] = []

        async def send(message: dict[str, object], sent: list[dict[str, object]] = sent) -> None:
            sent.append(message)

        async def receive() -> dict[str, object]:
            return {"type": "http.request", "body": b"", "more_body": False}

        await gateway({"type": "http", "method": method, "path": path, "headers": []}, receive, send)
        assert sent[0]["status"] == 400 and b"one node" in cast(bytes, sent[1]["body"]), path
    assert not _template_build("DELETE", "/templates/e2b-snapshots/sb-1:123")
    assert not _template_build("DELETE", "/templates/snap") and _template_build("DELETE", "/templates/tags")
    assert not _template_build("POST", "/sandboxes") and not _template_build("GET", "/v2/sandboxes")


async def test_a_build_whose_steps_cannot_be_built_is_refused_when_it_is_started(tmp_path: Path) -> None:
    from dsec.e2b.template_models import BuildStart

    store = TemplateStore(tmp_path / "t.json")
    template, build = store.new_build("app", ["default"], ALICE)
    builds = TemplateBuilds(cast(E2BService, SimpleNamespace(mgr=None)), store, tmp_path, b"k" * 32)
    bad = BuildStart.model_validate({"fromImage": "b", "steps": [{"type": "ENV", "args": ["A", "x\ny"]}]})
    with pytest.raises(InvalidRequest, match="step 1"):
        builds.start(template, build, bad, ALICE)
    assert build.status == "waiting" and not builds.tasks
    creds = BuildStart.model_validate({"fromImage": "r.example/x", "fromImageRegistry": {"type": "registry"}})
    with pytest.raises(InvalidRequest, match="registry credentials"):
        builds.start(template, build, creds, ALICE)
