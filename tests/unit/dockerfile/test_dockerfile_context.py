"""What COPY and ADD place where, by Docker's rules, and .dockerignore (no daemon)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from dsec.core.dockerfile.context import Tree, place
from dsec.core.dockerfile.parse import parse
from dsec.core.dockerfile.stage import Copy, StageReader
from dsec.errors import InvalidRequest
from dsec.images.model import ImageConfig
from dsec.protocol import dockerignore
from dsec.sdk.images import context_tar


def tar_of(files: dict[str, bytes | None], links: dict[str, str] | None = None, mode: str = "w") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:  # type: ignore[call-overload]
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), 0o755 if name.endswith(".sh") else 0o644
                tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.LNKTYPE, target
            tar.addfile(info)
    return buf.getvalue()


CONTEXT = tar_of(
    {
        "app": None,
        "app/main.py": b"print(1)\n",
        "app/lib/util.py": b"x = 1\n",
        "run.sh": b"#!/bin/sh\n",
        "a.txt": b"a",
        "b.txt": b"b",
        "data.tar.gz": tar_of({"inner/x": b"unpacked"}, mode="w:gz"),
    }
)


def copy_of(line: str, workdir: str = "/") -> Copy:
    df = parse(f"FROM x\n{line}\n")
    step = StageReader(df, df.stages[0], ImageConfig(workdir=workdir), {}, {}).step(df.stages[0].instructions[0])
    assert isinstance(step, Copy)
    return step


def placed(line: str, workdir: str = "/", tree: bytes = CONTEXT) -> dict[str, tuple[int, int, bytes]]:
    result = place(copy_of(line, workdir), Tree.read(tree, "ctx"), "the build context")
    out = {}
    with tarfile.open(fileobj=io.BytesIO(result.tar)) as tar:
        for info in tar:
            data = tar.extractfile(info).read() if info.isreg() else b""  # type: ignore[union-attr]
            out[info.name] = (info.type[0] if info.type else 0, info.mode, data)
    return {k: (v[1], len(v[2]), v[2]) for k, v in out.items()}


def test_a_directory_copies_its_contents_and_a_file_goes_to_the_destination() -> None:
    assert set(placed("COPY app /srv")) == {"srv/main.py", "srv/lib", "srv/lib/util.py"}
    assert set(placed("COPY run.sh /usr/bin/go")) == {"usr/bin/go"}
    assert set(placed("COPY run.sh /usr/bin/")) == {"usr/bin/run.sh"}
    assert placed("COPY run.sh /usr/bin/")["usr/bin/run.sh"][0] == 0o755  # the mode is kept
    assert set(placed("COPY *.txt /t")) == {"t/a.txt", "t/b.txt"}  # a wildcard: into a directory
    assert set(placed("COPY a.txt b.txt dir/", workdir="/w")) == {"w/dir/a.txt", "w/dir/b.txt"}
    assert set(placed("COPY . /all")) >= {"all/run.sh", "all/app/main.py", "all/data.tar.gz"}


def test_chmod_and_what_a_copy_is_keyed_by() -> None:
    assert placed("COPY --chmod=700 a.txt /a")["a"][0] == 0o700
    one = place(copy_of("COPY a.txt /a"), Tree.read(CONTEXT, "ctx"), "c")
    again = place(copy_of("COPY a.txt /a"), Tree.read(CONTEXT, "ctx"), "c")
    other = place(copy_of("COPY b.txt /a"), Tree.read(CONTEXT, "ctx"), "c")
    assert one.key == again.key != other.key and one.tops == ["/a"]


def test_add_unpacks_a_local_archive_and_copy_does_not() -> None:
    assert placed("ADD data.tar.gz /opt/")["opt/inner/x"][2] == b"unpacked"
    assert set(placed("COPY data.tar.gz /opt/")) == {"opt/data.tar.gz"}


def test_hard_links_inside_a_copied_directory_stay_links() -> None:
    tree = tar_of({"d/f": b"bytes"}, {"d/g": "d/f"})
    result = place(copy_of("COPY d /x"), Tree.read(tree, "ctx"), "ctx")
    with tarfile.open(fileobj=io.BytesIO(result.tar)) as tar:
        g = tar.getmember("x/g")
        assert g.islnk() and g.linkname == "x/f"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("COPY missing /x", "'missing' not found in the build context"),
        ("COPY *.nope /x/", "not found"),
        ("COPY ../etc/passwd /x", "outside the build context"),
    ],
)
def test_a_source_that_is_not_there_is_an_error(line: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        place(copy_of(line), Tree.read(CONTEXT, "ctx"), "the build context")


def test_a_device_in_a_context_is_refused() -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("dev/sda")
        info.type = tarfile.BLKTYPE
        tar.addfile(info)
    with pytest.raises(InvalidRequest, match="device"):
        Tree.read(buf.getvalue(), "ctx")
    with pytest.raises(InvalidRequest, match="not a readable tar"):
        Tree.read(b"not a tar at all" * 100, "ctx")


@pytest.mark.parametrize(
    ("path", "is_ignored"),
    [
        ("node_modules", True),
        ("node_modules/x/y.js", True),
        ("src/a.pyc", True),
        ("a.pyc", True),
        ("docs/readme.md", True),
        ("docs/keep.md", False),
        ("README.md", False),
        ("notes.md", True),
        ("src/main.py", False),
        (".git/config", True),
        ("build", False),
        ("build/out", True),
    ],
)
def test_dockerignore_rules(path: str, is_ignored: bool) -> None:
    rules = dockerignore.rules(
        "# comment\nnode_modules\n**/*.pyc\n/docs\n!docs/keep.md\n*.md\n!README.md\n.git\nbuild/*\n"
    )
    assert dockerignore.ignored(path, rules) is is_ignored


def test_the_sdk_leaves_ignored_files_out_of_the_context(tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text("FROM x\n")
    (tmp_path / ".dockerignore").write_text("secret.key\ncache\n")
    (tmp_path / "secret.key").write_text("no")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "big").write_text("no")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "app.py").write_text("yes")
    with tarfile.open(fileobj=io.BytesIO(context_tar(tmp_path))) as tar:
        assert sorted(tar.getnames()) == [".dockerignore", "Dockerfile", "src", "src/app.py"]
    # the daemon applies the context's own .dockerignore again (a context uploaded another way)
    raw = tar_of({".dockerignore": b"secret.key\n", "secret.key": b"no", "app.py": b"yes"})
    assert set(Tree.read(raw, "ctx", ignore=True).entries) == {".dockerignore", "app.py"}
