"""The grade request model and the cleaning of a candidate's archive (no daemon)."""

from __future__ import annotations

import base64
import io
import tarfile

import pytest
from pydantic import ValidationError

from dsec.core.grading import GRADE_ENV, clean_archive
from dsec.protocol.grade import MAX_GRADE_FILE, MAX_GRADE_TOTAL, GradeRequest


def test_request_defaults_and_test_files() -> None:
    req = GradeRequest(
        cmd="python3 -I -m pytest -q /grade/tests",
        paths=["/workspace/", "/workspace", "/srv//x/."],
        tests={"tests/test_a.py": "assert True\n", "/grade/data.bin": {"content": "AP8=", "encoding": "base64"}},
    )
    assert req.paths == ["/workspace", "/srv/x"]
    assert req.cwd == "/grade" and req.image is None and req.timeout == 600
    assert req.test_files() == {"/grade/tests/test_a.py": b"assert True\n", "/grade/data.bin": b"\x00\xff"}


@pytest.mark.parametrize(
    "change",
    [
        {"paths": []},
        {"paths": ["workspace"]},
        {"paths": ["/"]},
        {"paths": ["/usr/lib/python3/dist-packages"]},
        {"paths": ["/etc"]},
        {"paths": ["/grade/tests"]},
        {"paths": ["/.dsec"]},
        {"paths": ["/w/../usr"]},
        {"paths": [f"/p{i}" for i in range(65)]},
        {"tests": {"../x.py": "x"}},
        {"tests": {"/etc/x.py": "x"}},
        {"tests": {"a//b.py": "x"}},
        {"tests": {"": "x"}},
        {"tests": {"a.bin": {"content": "not base64!", "encoding": "base64"}}},
        {"tests": {"big.txt": "x" * (MAX_GRADE_FILE + 1)}},
        {"tests": {f"t{i}": "x" * (MAX_GRADE_FILE // 2) for i in range(2 * MAX_GRADE_TOTAL // MAX_GRADE_FILE + 1)}},
        {"tests": {"b.bin": {"content": base64.b64encode(b"x" * (MAX_GRADE_FILE + 1)).decode(), "encoding": "base64"}}},
        {"tests": {f"f{i}": "" for i in range(1001)}},
        {"cmd": ""},
        {"cmd": []},
        {"cmd": ["a\0b"]},
        {"cwd": "grade"},
        {"timeout": 0},
        {"output_limit": 10},
        {"env": {"PYTHONPATH": "/workspace"}},  # no way to hand the grader an environment
    ],
)
def test_bad_requests_are_refused(change: dict[str, object]) -> None:
    body: dict[str, object] = {"cmd": "true", "paths": ["/workspace"], **change}
    with pytest.raises(ValidationError):
        GradeRequest.model_validate(body)


def test_grade_environment_redirects_nothing() -> None:
    assert set(GRADE_ENV) == {"PATH", "LANG", "PYTHONNOUSERSITE", "PYTHONDONTWRITEBYTECODE", "PYTHONSAFEPATH"}
    assert "/workspace" not in GRADE_ENV["PATH"] and "." not in GRADE_ENV["PATH"].split(":")


def _tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, mode: int = 0o644, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname, info.uid, info.gid = kind, mode, link, 1234, 1234
    return info


def test_clean_archive_defuses_hostile_entries() -> None:
    data = _tar(
        (_member("./", tarfile.DIRTYPE, 0o777), None),
        (_member("./ok.py", mode=0o4777), b"print(1)\n"),
        (_member("./lib", tarfile.SYMTYPE, link="/usr/lib/python3.11"), None),
        (_member("./lib/os.py"), b"evil"),  # written through the symlink: dropped
        (_member("./lib", mode=0o644), b"replaces the link: dropped too"),
        (_member("./hard", tarfile.LNKTYPE, link="./ok.py"), None),
        (_member("../escape"), b"x"),
        (_member("./a/../../escape2"), b"x"),
        (_member("./dev", tarfile.CHRTYPE), None),
        (_member("./fifo", tarfile.FIFOTYPE), None),
    )
    out = tarfile.open(fileobj=io.BytesIO(clean_archive(data)))
    members = {m.name: m for m in out.getmembers()}
    assert sorted(members) == ["hard", "lib", "ok.py"]
    assert members["ok.py"].mode == 0o777 and members["ok.py"].uid == 0
    assert members["lib"].issym()
    hard = members["hard"]
    assert hard.isfile() and out.extractfile(hard).read() == b"print(1)\n"  # type: ignore[union-attr]


def test_clean_archive_refuses_garbage() -> None:
    from dsec.errors import BackendError

    with pytest.raises(BackendError):
        clean_archive(b"this is not a tar archive" * 100)
