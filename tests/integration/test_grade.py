"""sb.grade: a rigged candidate cannot make its grade pass; the grade runs on pristine ground.

The candidate below does everything a reward hacker would: hooks Python start-up in the image's own
site-packages (sitecustomize, usercustomize, a .pth), plants conftest.py / pytest.py / unittest.py in its
workspace, edits its copy of the tests, sets PYTHONPATH and LD_PRELOAD, and finally replaces
/usr/bin/python3 and /bin/sh with scripts that print PASS and exit 0. Its solution is wrong, so the grade
must fail; a correct solution (the positive control) must pass under the same grader.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

import dsec
from dsec.protocol.grade import MAX_GRADE_TOTAL

from .conftest import Daemon, require_kind

IMAGE = "dsec/debian:12"
TEST = """import sys
sys.path.append("/workspace")  # appended: the candidate's files never shadow the standard library
import unittest
import solution

class T(unittest.TestCase):
    def test_add(self):
        self.assertEqual(solution.add(2, 3), 5)

unittest.main()
"""
CMD = ["python3", "-I", "/grade/tests/test_solution.py"]
HOOK = "import os; print('PASS'); os._exit(0)\n"
RIG = r"""set -e
dirs=$(python3 -c 'import site; print(" ".join(site.getsitepackages() + [site.getusersitepackages()]))')
for d in $dirs /etc/python3.11; do
  mkdir -p "$d"
  echo "$HOOK" > "$d/sitecustomize.py"
  echo "$HOOK" > "$d/usercustomize.py"
  echo "$HOOK" > "$d/zzz_evil.py"
  echo "import zzz_evil" > "$d/zzz_evil.pth"
done
mkdir -p /workspace /grade/tests
for f in conftest pytest unittest sitecustomize; do echo "$HOOK" > /workspace/$f.py; done
echo "def test_add(): pass" > /grade/tests/test_solution.py
"""
FAKE = "#!/.dsec/busybox sh\necho PASS\nexit 0\n"


def _rigged(make_sandbox: Callable[..., dsec.Sandbox], solution: str) -> dsec.Sandbox:
    sb = make_sandbox(image=IMAGE, env={"PYTHONPATH": "/workspace", "LD_PRELOAD": "/workspace/evil.so"})
    res = sb.exec(RIG, user="root", env={"HOOK": HOOK}, timeout=60)
    assert res.exit_code == 0, res.stderr
    sb.files.write("/workspace/solution.py", solution)
    for target in ("/usr/bin/python3.11", "/bin/sh", "/bin/dash"):
        sb.files.write(target, FAKE, mode=0o755)
    # the candidate's own world is rigged: its python passes anything
    own = sb.exec(["/usr/bin/python3", "-c", "raise SystemExit(1)"], timeout=30)
    assert own.exit_code == 0 and "PASS" in own.stdout
    return sb


async def _post(path: str, body: dict[str, object]) -> None:
    client = dsec.AsyncClient()
    try:
        await client._transport.request("POST", path, json=body)
    finally:
        await client.aclose()


WRONG = "def add(a, b):\n    return a - b\n"
RIGHT = "def add(a, b):\n    return a + b\n"


@pytest.mark.parametrize("solution, passes", [(WRONG, False), (RIGHT, True)])
def test_rigged_candidate_gets_its_true_grade(
    make_sandbox: Callable[..., dsec.Sandbox], solution: str, passes: bool
) -> None:
    sb = _rigged(make_sandbox, solution)
    graded = sb.grade(CMD, paths=["/workspace"], tests={"tests/test_solution.py": TEST}, timeout=120)
    res = graded.result
    assert (res.exit_code == 0) is passes, (res.stdout, res.stderr)
    assert "PASS" not in res.stdout
    assert ("OK" if passes else "FAILED") in res.stderr
    assert graded.image_digest and graded.sandbox_id != sb.id
    # the sibling is gone, the candidate runs on untouched
    assert graded.sandbox_id not in {i.id for i in dsec.Sandbox.list()}
    assert sb.info().state == "running"
    assert sb.files.read("/workspace/solution.py").decode() == solution
    assert sb.files.read("/grade/tests/test_solution.py") == b"def test_add(): pass\n"


PROBE = r"""
import errno, os, sys
out = []
for path in ("/workspace/solution.py", "/workspace/new.py", "/grade/tests/test_solution.py", "/grade/new.py"):
    try:
        with open(path, "a") as f:
            f.write("x")
        out.append(f"WROTE {path}")
    except OSError as e:
        out.append(f"{errno.errorcode[e.errno]} {path}")
for path in ("/workspace/solution.py", "/grade/tests/test_solution.py"):
    try:
        os.chmod(path, 0o777)
        out.append(f"CHMOD {path}")
    except OSError as e:
        out.append(f"{errno.errorcode[e.errno]} chmod {path}")
out.append("uid %d gid %d" % (os.getuid(), os.getgid()))
out.append("net " + ",".join(sorted(os.listdir("/sys/class/net"))))
out.append("env " + ",".join(sorted(os.environ)))
out.append("home " + os.environ["HOME"] + " " + str(os.listdir(os.environ["HOME"])))
out.append("sh " + open("/bin/sh", "rb").read(2).hex())
print("\n".join(out))
"""


def test_grading_sandbox_is_read_only_offline_and_clean(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = _rigged(make_sandbox, WRONG)
    graded = sb.grade(
        ["python3", "-I", "/grade/probe.py"],
        paths=["/workspace"],
        tests={"probe.py": PROBE, "tests/test_solution.py": TEST},
    )
    out = graded.result.stdout
    assert graded.result.exit_code == 0, graded.result.stderr
    assert "WROTE" not in out and "CHMOD" not in out, out
    for path in ("/workspace/solution.py", "/workspace/new.py", "/grade/tests/test_solution.py", "/grade/new.py"):
        assert f"EACCES {path}" in out or f"EROFS {path}" in out, out
    assert "uid 65534 gid 65534" in out
    assert "net lo\n" in out  # loopback only
    env = next(line for line in out.splitlines() if line.startswith("env "))[4:].split(",")
    assert not {"PYTHONPATH", "LD_PRELOAD", "PYTHONSTARTUP", "BASH_ENV", "ENV"} & set(env), env
    assert {"PATH", "HOME", "PYTHONSAFEPATH", "PYTHONNOUSERSITE"} <= set(env)
    assert "home /tmp/grade-home-" in out and "[]" in out
    assert "sh 7f45" in out  # the pristine /bin/sh is an ELF binary, not the candidate's script


def test_binary_tests_and_files_as_paths(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox(image=IMAGE)
    sb.files.write("/srv/answer.txt", "42\n")
    graded = sb.grade(
        "cat /srv/answer.txt; od -An -tx1 /grade/blob.bin",
        paths=["/srv/answer.txt"],
        tests={"blob.bin": bytes([0, 255, 1])},
    )
    assert graded.result.exit_code == 0, graded.result.stderr
    assert graded.result.stdout.split() == ["42", "00", "ff", "01"]


def test_bad_requests_are_refused_clearly(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox(image="dsec/busybox")
    with pytest.raises(dsec.InvalidRequest, match="absolute"):
        sb.grade("true", paths=["workspace"])
    with pytest.raises(dsec.InvalidRequest, match="may not be copied"):
        sb.grade("true", paths=["/usr/lib"])
    with pytest.raises(dsec.InvalidRequest, match=r"\.\."):
        sb.grade("true", paths=["/tmp"], tests={"../escape.py": "x"})
    with pytest.raises(dsec.InvalidRequest, match="limit"):
        sb.grade(
            "true",
            paths=["/tmp"],
            tests={f"t{i}.txt": "x" * (4 << 20) for i in range(MAX_GRADE_TOTAL // (4 << 20) + 1)},
        )
    with pytest.raises(dsec.FileNotFoundInSandbox, match="/nope"):
        sb.grade("true", paths=["/nope"])
    # the same checks on the wire, past the SDK's own validation
    for body, error in (
        ({"cmd": "true", "paths": ["relative"]}, dsec.InvalidRequest),
        ({"cmd": "true", "paths": ["/"]}, dsec.InvalidRequest),
        (
            {"cmd": "true", "paths": ["/tmp"], "tests": {"a": {"content": "!!", "encoding": "base64"}}},
            dsec.InvalidRequest,
        ),
        ({"cmd": "true", "paths": ["/tmp"], "tests": {"big": "x" * (40 << 20)}}, dsec.LimitExceeded),
    ):
        with pytest.raises(error):
            asyncio.run(_post(f"/v1/sandboxes/{sb.id}/grade", body))
    sb.pause()
    try:
        with pytest.raises(dsec.InvalidState, match="paused"):
            sb.grade("true", paths=["/tmp"])
    finally:
        sb.resume()
    assert not [i for i in dsec.Sandbox.list() if i.labels.get("dsec.grade") == sb.id]


def test_grade_on_a_microvm(daemon: Daemon) -> None:
    """The core is kind-generic: the same path on a VM kind (busybox image, shell grader)."""
    client = daemon.client()
    require_kind(client, "microvm")
    sb = dsec.Sandbox.create(image="dsec/busybox", kind="microvm", client=client, memory="256Mi")
    try:
        sb.exec("mkdir -p /workspace && echo 41 > /workspace/answer", user="root")
        sb.files.write("/bin/cat", "#!/bin/sh\necho 42\n", mode=0o755)  # rigged in the candidate only
        graded = sb.grade(
            '[ "$(cat /workspace/answer)" = "$(cat /grade/expected)" ] && echo right || { echo wrong; exit 1; }',
            paths=["/workspace"],
            tests={"expected": "42\n"},
            timeout=60,
        )
        assert graded.result.exit_code == 1 and graded.result.stdout == "wrong\n", graded.result
        assert sb.info().state == "running"
    finally:
        sb.kill()
