"""E2B's template build API driven by the real ``e2b`` SDK (pinned) against a real daemon: templates built
from a local image and from a registry image on loopback, with copies, commands, users, workdirs and
build-time variables; streamed logs; a failing step's error and step; background builds and their status;
tags, aliases and deletion; other tenants kept out; then sandboxes created from what was built."""

from __future__ import annotations

import secrets
import traceback
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import dsec

from .conftest import Daemon, scratch_dir
from .registry import Registry
from .test_dockerfile_build import busybox_registry

e2b = pytest.importorskip("e2b")
from e2b import Sandbox, Template, wait_for_file  # noqa: E402
from e2b.exceptions import BuildException, SandboxException, TemplateException  # noqa: E402
from e2b.template.logger import LogEntry  # noqa: E402

pytestmark = pytest.mark.timeout(300)


MADE: list[str] = []  # the templates built here, removed at the end (newest first: a child before its base)


def _name(what: str) -> str:
    name = f"t-{what}-{secrets.token_hex(4)}"
    MADE.append(name)
    return name


@pytest.fixture(scope="module", autouse=True)
def _remove_templates(e2b_env: dict[str, str]) -> Iterator[None]:
    """The templates' images are in the suite's shared layer repository: not left there."""
    yield
    url, key = e2b_env["E2B_API_URL"], e2b_env["E2B_API_KEY"]
    for name in reversed(MADE):
        httpx.delete(f"{url}/templates/{name}", headers={"X-API-KEY": key}, timeout=60)


@pytest.fixture(scope="module")
def context() -> Iterator[Path]:
    with scratch_dir("dsec-e2b-tpl-") as path:
        (path / "app").mkdir()
        (path / "app" / "main.py").write_text("print('hi')\n")
        (path / "app" / "data.txt").write_text("payload\n")
        (path / "tool.sh").write_text("echo tool ran as $(whoami)\n")
        yield path


@pytest.fixture(scope="module")
def registry() -> Iterator[Registry]:
    with scratch_dir("dsec-e2b-tpl-reg-") as path, busybox_registry(path) as found:
        yield found


def build(template: object, name: str, **kwargs: object) -> tuple[object, list[LogEntry]]:
    logs: list[LogEntry] = []
    info = Template.build(template, name, on_build_logs=logs.append, **kwargs)  # type: ignore[arg-type]
    return info, logs


def messages(logs: list[LogEntry]) -> list[str]:
    return [entry.message for entry in logs]


def test_a_template_from_a_local_image_is_built_as_asked_and_sandboxes_run_it(
    daemon: Daemon, e2b_env: dict[str, str], context: Path
) -> None:
    name = _name("local")
    template = (
        Template(file_context_path=context)
        .skip_cache()  # the node's build cache would answer for an earlier run's steps, without output
        .from_image("dsec/debian:12")
        .copy("app", "app/")
        .copy("tool.sh", "/opt/tool.sh", mode=0o755)
        .run_cmd('echo "built by $(whoami) in $(pwd)"')
        .run_cmd("/opt/tool.sh", user="root")
        .set_envs({"GREETING": "hi $there"})
        .run_cmd('echo "greeting=[$GREETING]" > greeting.txt')
        .make_symlink("app/main.py", "main.py")
        .set_user("guest")
        .set_workdir("/srv/work")
        .run_cmd("touch made-by-guest")
    )
    info, logs = build(template, name)
    said = messages(logs)
    assert "built by user in /home/user" in said  # a RUN's output, streamed as it was written
    assert "tool ran as root" in said
    assert any(m.startswith("[3] RUN") for m in said), said  # each step announced by its number
    with Sandbox.create(name, timeout=120) as box:
        assert box.commands.run("whoami").stdout == "guest\n"  # the last user is the sandbox's
        assert box.files.read("/home/user/app/data.txt") == "payload\n"  # a directory's contents
        assert box.files.read("/home/user/greeting.txt") == "greeting=[hi $there]\n"
        assert box.commands.run("readlink /home/user/main.py").stdout == "app/main.py\n"
        assert box.commands.run("stat -c '%U %a' /opt/tool.sh /home/user/app/main.py").stdout == "user 755\nuser 644\n"
        assert box.commands.run("stat -c %U /srv/work/made-by-guest").stdout == "guest\n"
        assert box.commands.run('echo "[$GREETING]"').stdout == "[]\n"  # set_envs are the build's only
    # the same template by its id and by name:tag
    with Sandbox.create(info.template_id, timeout=60) as box:  # type: ignore[attr-defined]
        assert box.files.exists("/srv/work/made-by-guest")
    with Sandbox.create(f"{name}:default", timeout=60) as box:
        assert box.files.exists("/srv/work/made-by-guest")


def test_a_template_from_a_registry_image_and_one_built_on_it(
    daemon: Daemon, e2b_env: dict[str, str], registry: Registry
) -> None:
    parent, child = _name("registry"), _name("child")
    base = Template().skip_cache().from_image(f"{registry.host}/base/busybox:1").run_cmd("id -un > who; id -un")
    _, logs = build(base, parent)
    assert "user" in messages(logs)  # BusyBox's adduser made E2B's account
    _, logs = build(Template().from_template(parent).skip_cache().run_cmd("cat who && echo child > from-child"), child)
    assert "user" in messages(logs)
    with Sandbox.create(child, timeout=60) as box:  # BusyBox has no bash: files only
        assert box.files.read("/home/user/from-child") == "child\n"
        assert "user:x:" in box.files.read("/etc/passwd")


def test_a_failing_step_fails_the_build_naming_it_with_its_output(daemon: Daemon, e2b_env: dict[str, str]) -> None:
    template = (
        Template()
        .from_image("dsec/debian:12")
        .run_cmd("echo fine")
        .run_cmd("echo broken >&2; exit 3")
        .run_cmd("echo never")
    )
    with pytest.raises(BuildException) as failed:
        Template.build(template, _name("fails"))
    message = str(failed.value)
    assert "step 2 (RUN echo broken >&2; exit 3)" in message and "exited with status 3" in message
    assert "broken" in message
    # the SDK points the error at the call that made the failing step (the failing step's number)
    lines = [frame.line for frame in traceback.extract_tb(failed.value.__traceback__) if frame.filename == __file__]
    assert lines[-1] == '.run_cmd("echo broken >&2; exit 3")', lines
    missing_user = Template().from_image("dsec/debian:12").run_cmd("whoami", user="nobody-here")
    with pytest.raises(BuildException, match="invalid username: 'nobody-here'"):
        Template.build(missing_user, _name("nouser"))
    with pytest.raises(BuildException, match="no template"):
        Template.build(Template().from_template("no-such-template-anywhere"), _name("nobase"))
    creds = Template().from_image("registry.example/x:1", username="u", password="p")
    with pytest.raises(BuildException, match="registry credentials"):
        Template.build(creds, _name("creds"))


def test_a_background_build_is_followed_by_its_status_and_logs(daemon: Daemon, e2b_env: dict[str, str]) -> None:
    template = (
        Template()
        .from_image("dsec/debian:12")
        .skip_cache()
        .run_cmd("sleep 2; echo slow step done")
        .set_start_cmd("touch /tmp/started; sleep 600", wait_for_file("/tmp/started"))
    )
    info = Template.build_in_background(template, _name("background"))
    first = Template.get_build_status(info)
    assert first.status.value == "building"
    seen = list(first.log_entries)
    status = first
    while status.status.value == "building":
        status = Template.get_build_status(info, logs_offset=len(seen))
        seen += status.log_entries
    assert status.status.value == "ready", status.reason
    said = [e.message for e in seen]
    assert "slow step done" in said and "[finalize] start and ready commands" in said
    assert len(said) == len(set(zip(said, [e.timestamp for e in seen], strict=True)))  # no entry twice
    failing = Template().from_image("dsec/debian:12").set_start_cmd("exit 7", "false")
    bad = Template.build_in_background(failing, _name("badstart"))
    while (status := Template.get_build_status(bad)).status.value == "building":
        pass
    assert status.status.value == "error" and status.reason is not None
    assert status.reason.step == "finalize" and "exited with status 7" in status.reason.message


def test_tags_aliases_and_deletion(daemon: Daemon, e2b_env: dict[str, str], context: Path) -> None:
    name = _name("tags")
    template = Template(file_context_path=context).from_image("dsec/debian:12").copy("tool.sh", "/opt/")
    _, logs = build(template, f"{name}:v1", tags=["stable"])
    assert Template.exists(name) and Template.exists("base")
    assert not Template.exists(_name("nothing"))
    assert {t.tag for t in Template.get_tags(name)} == {"v1", "stable"}
    assigned = Template.assign_tags(f"{name}:v1", ["prod", f"{name}:latest"])
    assert set(assigned.tags) == {"prod", "latest"}
    for bad in (":nothing", f"{name}:", "other-name:x"):
        with pytest.raises(TemplateException):
            Template.assign_tags(f"{name}:v1", bad)
    with Sandbox.create(f"{name}:prod", timeout=60) as box:
        assert box.files.exists("/opt/tool.sh")
    Template.remove_tags(name, "prod")
    with pytest.raises(SandboxException):
        Sandbox.create(f"{name}:prod", timeout=60)
    with pytest.raises(TemplateException):
        Template.remove_tags(name, "prod")
    # the same files again: the SDK is told they are here and uploads nothing
    _, logs = build(template, f"{name}:v2")
    assert any("already cached" in m for m in messages(logs))
    url, key = e2b_env["E2B_API_URL"], e2b_env["E2B_API_KEY"]
    with Sandbox.create(f"{name}:v2", timeout=60):
        in_use = httpx.delete(f"{url}/templates/{name}", headers={"X-API-KEY": key})
        assert in_use.status_code == 409
    assert httpx.delete(f"{url}/templates/{name}", headers={"X-API-KEY": key}).status_code == 204
    assert not Template.exists(name)


def test_a_tenants_templates_are_its_own(daemon: Daemon, e2b_env: dict[str, str], tmp_path: Path) -> None:
    op = daemon.client()
    suffix = secrets.token_hex(3)
    alice, bob = (op.create_tenant(f"tpl-{who}-{suffix}").token for who in ("alice", "bob"))
    name = _name("alice")
    Template.build(Template().from_image("dsec/debian:12").run_cmd("echo mine > mine"), name, api_key=alice)
    assert Template.exists(name, api_key=alice) and Template.exists(name)  # the operator sees it
    assert not Template.exists(name, api_key=bob)
    with pytest.raises(SandboxException):
        Sandbox.create(name, api_key=bob, timeout=60)
    with pytest.raises(BuildException, match="taken"):
        Template.build(Template().from_image("dsec/debian:12"), name, api_key=bob)
    with pytest.raises(BuildException, match="no template"):
        Template.build(Template().from_template(name), _name("bob"), api_key=bob)
    with pytest.raises(TemplateException):
        Template.assign_tags(f"{name}:default", "bobs", api_key=bob)
    with Sandbox.create(name, api_key=alice, timeout=60) as box:
        assert box.files.read("/home/user/mine") == "mine\n"
    # bob's own image that shares the name's first part: alice's template does not change what it means
    (tmp_path / "Dockerfile").write_text("FROM dsec/debian:12\nRUN echo bob > /bob\n")
    dsec.Client(url=daemon.url, token=bob).build_dockerfile(f"{name}:bobs", tmp_path)
    with Sandbox.create(f"{name}:bobs", api_key=bob, timeout=60) as box:
        assert box.files.read("/bob") == "bob\n"
    dsec.Client(url=daemon.url, token=bob).remove_image(f"{name}:bobs")
