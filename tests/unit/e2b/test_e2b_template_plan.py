"""E2B template steps as the Dockerfile dsec's builder runs: read back by dsec's own Dockerfile reader, each
step is what E2B's SDK asked for (user, workdir, build-time variables, copies), nothing in a step's
arguments can change the Dockerfile, and what cannot be expressed is refused (no daemon)."""

from __future__ import annotations

import io
import tarfile

import pytest

from dsec.core.dockerfile.context import Tree, place
from dsec.core.dockerfile.parse import parse
from dsec.core.dockerfile.stage import Copy, Run, StageReader
from dsec.e2b.template_builds import BuildLog, _as_envd, merged_context
from dsec.e2b.template_models import BuildStart
from dsec.e2b.template_plan import BASE_STEP, FINALIZE_STEP, FORCE_ARG, Plan, plan
from dsec.errors import InvalidRequest
from dsec.images.model import ImageConfig

HASH = "ab" * 32
BUILD = "0f7c3c1e-1111-4222-8333-944445555666"


def start(*steps: dict[str, object], **extra: object) -> BuildStart:
    return BuildStart.model_validate({"fromImage": "dsec/debian:12", "steps": list(steps), **extra})


def read(made: Plan, base: ImageConfig | None = None) -> list[tuple[int, Run | Copy]]:
    """Each step the builder would run on a base with ``base``'s settings, with its Dockerfile line."""
    df = parse(made.dockerfile)
    [stage] = df.stages
    reader = StageReader(df, stage, base or ImageConfig(), {}, {})
    out = []
    for inst in stage.instructions:
        step = reader.step(inst)
        if step is not None:
            out.append((inst.line, step))
    return out


def runs(made: Plan) -> list[Run]:
    return [s for _, s in read(made) if isinstance(s, Run)]


def test_a_template_starts_as_user_in_its_home_made_by_the_base_step() -> None:
    made = plan(start({"type": "RUN", "args": ["whoami"]}), "dsec/debian:12", BUILD)
    account, command = runs(made)
    assert account.user == "root" and account.argv[-1] == "user"  # the account is made as root
    assert command.user == "user" and command.workdir == "/home/user"
    assert command.argv[-1] == "whoami"
    lines = dict(read(made))
    assert {made.steps[line] for line in lines} == {BASE_STEP, "1"}


def test_a_step_user_is_that_step_only_and_set_user_makes_the_account() -> None:
    made = plan(
        start(
            {"type": "RUN", "args": ["id", "root"]},
            {"type": "RUN", "args": ["id"]},
            {"type": "USER", "args": ["guest"]},
            {"type": "RUN", "args": ["id"]},
        ),
        "dsec/debian:12",
        BUILD,
    )
    _, as_root, after, make_guest, as_guest = runs(made)
    assert (as_root.user, after.user, as_guest.user) == ("root", "user", "guest")
    assert make_guest.user == "root" and make_guest.argv[-1] == "guest"


def test_a_template_from_another_starts_as_that_templates_user() -> None:
    made = plan(
        start({"type": "RUN", "args": ["id", "root"]}, {"type": "RUN", "args": ["id"]}),
        "e2b/x:1",
        BUILD,
        base_user="guest",
    )
    as_root, after = [s for _, s in read(made, ImageConfig(user="guest", workdir="/home/guest")) if isinstance(s, Run)]
    assert (as_root.user, after.user, after.workdir) == ("root", "guest", "/home/guest")


@pytest.mark.parametrize("value", ['b a$r"q\\x', "$(rm -rf /)", "${HOME}", "a\\"])
def test_set_envs_reach_later_steps_exactly_and_not_the_image(value: str) -> None:
    made = plan(start({"type": "ENV", "args": ["FOO", value]}, {"type": "RUN", "args": ["env"]}), "b", BUILD)
    df = parse(made.dockerfile)
    reader = StageReader(df, df.stages[0], ImageConfig(), {}, {})
    found = [reader.step(i) for i in df.stages[0].instructions]
    run = [s for s in found if isinstance(s, Run)][-1]
    assert run.env["FOO"] == value
    assert "FOO" not in reader.settings.config().env  # E2B's envs are the build's


def test_a_command_is_one_argument_whatever_it_holds() -> None:
    nasty = 'echo "]" \\\nRUN rm -rf /\n["x"] $(id) `id`'
    [run] = runs(plan(start({"type": "RUN", "args": [nasty, "root"]}), "b", BUILD, base_user="root"))
    assert run.argv[-1] == nasty and run.argv[0] == "/bin/sh"


def test_workdir_is_relative_to_the_last_and_made_for_the_current_account() -> None:
    made = plan(
        start(
            {"type": "WORKDIR", "args": ["/app"]},
            {"type": "WORKDIR", "args": ["sub"]},
            {"type": "RUN", "args": ["pwd"]},
        ),
        "b",
        BUILD,
    )
    *_, make_app, make_sub, last = runs(made)
    assert make_app.user == make_sub.user == "root"  # made as root, given to the account
    assert make_app.argv[-2:] == ["/app", "user"] and make_app.workdir == "/home/user"
    assert make_sub.argv[-2:] == ["sub", "user"] and make_sub.workdir == "/app"
    assert last.workdir == "/app/sub" and last.user == "user"


def test_copy_takes_its_upload_by_hash_and_places_it_as_docker_does() -> None:
    made = plan(start({"type": "COPY", "args": ["folder/*", "folder", "", "0755"], "filesHash": HASH}), "b", BUILD)
    [(_, copy)] = [(line, s) for line, s in read(made) if isinstance(s, Copy)]
    assert copy.chown == "user" and copy.chmod == 0o755 and copy.dest == "/home/user/folder"
    assert made.hashes == [HASH]
    upload = io.BytesIO()
    with tarfile.open(fileobj=upload, mode="w:gz") as tar:
        for name, data in (("folder/test.txt", b"This is a test file."), ("folder/other.txt", b"x")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("folder/symlink.txt")
        link.type, link.linkname = tarfile.SYMTYPE, "test.txt"
        tar.addfile(link)
    tree = Tree.read(merged_context({HASH: upload.getvalue()}), "context")
    placed = place(copy, tree, "context")
    with tarfile.open(fileobj=io.BytesIO(placed.tar)) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert set(members) == {"home/user/folder/test.txt", "home/user/folder/other.txt", "home/user/folder/symlink.txt"}
    assert members["home/user/folder/symlink.txt"].linkname == "test.txt"


def test_two_uploads_never_see_each_others_files() -> None:
    def one(name: str, data: bytes) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    other = "cd" * 32
    tree = Tree.read(merged_context({HASH: one("a.txt", b"1"), other: one("../../a.txt", b"2")}), "context")
    assert tree.entries[f"{HASH}/a.txt"].data == b"1"
    assert tree.entries[f"{other}/a.txt"].data == b"2"  # '..' cannot leave its own upload


def test_a_device_in_an_upload_is_refused() -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        dev = tarfile.TarInfo("null")
        dev.type = tarfile.CHRTYPE
        tar.addfile(dev)
    with pytest.raises(InvalidRequest, match="device"):
        merged_context({HASH: buf.getvalue()})


@pytest.mark.parametrize(
    ("step", "why"),
    [
        ({"type": "ENV", "args": ["A", "two\nlines"]}, "line break"),
        ({"type": "ENV", "args": ["1A", "x"]}, "variable name"),
        ({"type": "ENV", "args": ["A"]}, "pairs"),
        ({"type": "USER", "args": ["Bad User"]}, "account name"),
        ({"type": "RUN", "args": ["id", "a b"]}, "RUN's user"),
        ({"type": "RUN", "args": [" "]}, "needs a command"),
        ({"type": "COPY", "args": ["a", "/b"]}, "filesHash"),
        ({"type": "COPY", "args": ["../etc", "/b"], "filesHash": HASH}, "inside the build's context"),
        ({"type": "COPY", "args": ["/etc", "/b"], "filesHash": HASH}, "inside the build's context"),
        ({"type": "COPY", "args": ["a", "/b", "", "999"], "filesHash": HASH}, "octal"),
        ({"type": "WORKDIR", "args": ["/a\nRUN x"]}, "line break"),
    ],
)
def test_what_cannot_be_a_step_is_refused_naming_the_step(step: dict[str, object], why: str) -> None:
    with pytest.raises(InvalidRequest, match=why) as info:
        plan(start({"type": "RUN", "args": ["true"]}, step), "b", BUILD)
    assert "step 2" in info.value.message


def test_forcing_a_step_gives_it_a_new_cache_key_input() -> None:
    plain = runs(plan(start({"type": "RUN", "args": ["true"]}), "b", BUILD))[-1]
    forced = runs(plan(start({"type": "RUN", "args": ["true"], "force": True}), "b", BUILD))[-1]
    assert FORCE_ARG not in plain.env and forced.env[FORCE_ARG] == BUILD
    whole = runs(plan(start({"type": "RUN", "args": ["true"]}, force=True), "b", BUILD))
    assert all(r.env[FORCE_ARG] == BUILD for r in whole)


def test_start_and_ready_commands_are_the_finalize_step_and_the_images_command() -> None:
    made = plan(start({"type": "RUN", "args": ["true"]}, startCmd="serve --port 1", readyCmd="test -e /r"), "b", BUILD)
    final = runs(made)[-1]
    assert final.argv[-2:] == ["serve --port 1", "test -e /r"]
    assert FINALIZE_STEP in made.steps.values()
    df = parse(made.dockerfile)
    reader = StageReader(df, df.stages[0], ImageConfig(), {}, {})
    for inst in df.stages[0].instructions:
        reader.step(inst)
    assert reader.settings.config().cmd == ["/bin/sh", "-c", "serve --port 1"]


def test_a_missing_account_fails_with_envds_words() -> None:
    message = _as_envd("user 'root123' is not in the image's /etc/passwd", ("whoami", "root123"))
    assert "failed to run command 'whoami': command failed: unauthenticated: invalid username: 'root123'" in message
    assert _as_envd("exited with status 3: oops", ("false", "user")) == "exited with status 3: oops"


def test_output_becomes_one_entry_per_line_of_the_step() -> None:
    log = BuildLog()
    log.step = "2"
    log.output("stdout", b"one\ntw")
    log.output("stdout", b"o\r\nthree")
    log.flush()
    assert [(e.message, e.step) for e in log.entries] == [("one", "2"), ("two", "2"), ("three", "2")]
