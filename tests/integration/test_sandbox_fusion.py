"""The SandboxFusion API (``dsec serve --sandbox-fusion-listen``) driven by the unmodified ``sandbox-fusion``
client 0.3.7, as verl's SandboxFusion tool and code reward drive it: every language dsec documents, a
compile error, a time limit, standard input, files in and out, verl's own request (``memory_limit_MB``,
posted to the full URL) with the limit really applied, an unknown language, and bad requests answered
in SandboxFusion's shapes, never a 500."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args

import pytest
import requests
import sandbox_fusion as sf

from .conftest import Daemon, free_port, scratch_dir, shut_down, start_daemon

IMAGE = "dsec/code:1"
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def fusion() -> Iterator[tuple[Daemon, str]]:
    """A daemon serving the SandboxFusion API, its image built (found once the shared test repository
    has it), and the API's URL."""
    with scratch_dir("dsec-fusion-") as work:
        url = f"http://127.0.0.1:{free_port()}"
        d = start_daemon(work / "state", "--sandbox-fusion-listen", url)
        try:
            # the built-in image, built by its Dockerfile on first use: once per layer repository
            assert d.client().build_image(IMAGE).ready
            yield d, url
        finally:
            shut_down(d)


def run(url: str, **kw: Any) -> sf.RunCodeResponse:
    # one attempt: the client's retries (with back-off) would only hide an answer worth seeing
    return sf.run_code(sf.RunCodeRequest(**kw), endpoint=url, max_attempts=1, client_timeout=120)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


HELLO = {
    "python": "import sys\nprint('python', sys.stdin.read().strip())",
    "bash": "read x; echo bash $x",
    "sh": "read x; echo sh $x",
    "c": '#include <stdio.h>\nint main(void) { char s[64]; scanf("%63s", s); printf("c %s\\n", s); }',
    "cpp": "#include <iostream>\n#include <string>\n"
    'int main() { std::string s; std::cin >> s; std::cout << "cpp " << s << "\\n"; }',
    "go": 'package main\nimport "fmt"\nfunc main() { var s string; fmt.Scan(&s); fmt.Println("go", s) }',
    "java": "import java.util.Scanner;\npublic class Main { public static void main(String[] a) {\n"
    '  System.out.println("java " + new Scanner(System.in).next()); } }',
    "nodejs": "const s = require('fs').readFileSync(0, 'utf8').trim(); console.log('nodejs', s);",
}


@pytest.mark.parametrize("language", list(HELLO))
def test_each_language_reads_stdin_and_prints(fusion: tuple[Daemon, str], language: str) -> None:
    _, url = fusion
    kw: dict[str, Any] = {"code": HELLO[language], "language": language, "stdin": "42\n", "compile_timeout": 60}
    if language in get_args(sf.models.Language):
        res = run(url, **kw)
    else:  # c and sh are dsec's, not in the client's vocabulary: posted as they are, read by the client's model
        answer = requests.post(f"{url}/run_code", json=kw, timeout=120)
        assert answer.status_code == 200, answer.text
        res = sf.RunCodeResponse(**answer.json())
    assert res.status == sf.RunStatus.Success, res
    assert res.run_result is not None and res.run_result.stdout == f"{language} 42\n"
    assert res.run_result.return_code == 0 and res.run_result.status == sf.CommandRunStatus.Finished
    compiled = language in ("c", "cpp", "go", "java")
    assert (res.compile_result is not None) == compiled
    if res.compile_result is not None:
        assert res.compile_result.return_code == 0 and res.compile_result.execution_time > 0
    assert res.executor_pod_name  # the sandbox that ran it
    assert sf.summary_run_code_result(res, sf.SummaryMapping()) == "Success"


def test_a_compile_error_is_failed_with_the_compilers_message(fusion: tuple[Daemon, str]) -> None:
    _, url = fusion
    res = run(url, code="int main() { return undeclared; }", language="cpp")
    assert res.status == sf.RunStatus.Failed and res.run_result is None
    assert res.compile_result is not None and res.compile_result.status == sf.CommandRunStatus.Finished
    assert res.compile_result.return_code != 0 and "undeclared" in (res.compile_result.stderr or "")
    mapping = sf.SummaryMapping(CompileFailed="compile_failed")
    assert sf.summary_run_code_result(res, mapping) == "compile_failed"


def test_a_run_past_its_time_limit_is_time_limit_exceeded(fusion: tuple[Daemon, str]) -> None:
    _, url = fusion
    started = time.monotonic()
    res = run(url, code="import time\nprint('started', flush=True)\ntime.sleep(60)", language="python", run_timeout=1)
    assert time.monotonic() - started < 20
    assert res.status == sf.RunStatus.Failed
    assert res.run_result is not None and res.run_result.status == sf.CommandRunStatus.TimeLimitExceeded
    assert res.run_result.return_code is None and res.run_result.stdout == "started\n"
    assert 1.0 <= (res.run_result.execution_time or 0) < 10
    assert sf.summary_run_code_result(res, sf.SummaryMapping(RunTimeout="timeout")) == "timeout"


def test_failures_and_signals_have_their_return_codes(fusion: tuple[Daemon, str]) -> None:
    _, url = fusion
    res = run(url, code="raise SystemExit('boom')", language="python")
    assert res.status == sf.RunStatus.Failed and res.run_result is not None
    assert res.run_result.return_code == 1 and "boom" in (res.run_result.stderr or "")
    res = run(url, code="kill -9 $$", language="bash")
    assert res.status == sf.RunStatus.Failed and res.run_result is not None
    assert res.run_result.status == sf.CommandRunStatus.Finished and res.run_result.return_code == -9


def test_files_in_and_fetched_out(fusion: tuple[Daemon, str]) -> None:
    _, url = fusion
    data = bytes(range(256)) * 10
    code = (
        "import pathlib\n"
        "blob = pathlib.Path('data/in.bin').read_bytes()\n"
        "pathlib.Path('out/copy.bin').parent.mkdir()\n"
        "pathlib.Path('out/copy.bin').write_bytes(blob[::-1])\n"
        "pathlib.Path('/tmp/abs.txt').write_text(open('/tmp/note.txt').read().upper())\n"
        "print(len(blob))"
    )
    res = run(
        url,
        code=code,
        language="python",
        files={"data/in.bin": b64(data), "/tmp/note.txt": b64(b"absolute"), "skipped.txt": None},
        fetch_files=["out/copy.bin", "/tmp/abs.txt", "missing.txt", "out"],
    )
    assert res.status == sf.RunStatus.Success, res
    assert res.run_result is not None and res.run_result.stdout == f"{len(data)}\n"
    # as SandboxFusion: keyed as asked; what is missing or not a file is left out
    assert sorted(res.files) == ["/tmp/abs.txt", "out/copy.bin"]
    assert base64.b64decode(res.files["out/copy.bin"]) == data[::-1]
    assert base64.b64decode(res.files["/tmp/abs.txt"]) == b"ABSOLUTE"


def test_verls_request_with_its_memory_limit(fusion: tuple[Daemon, str]) -> None:
    """What verl posts (the full URL, memory_limit_MB, compile_timeout and run_timeout as ints) and
    reads; the limit is the sandbox's: 64 MiB does not hold 256 MiB, the default 512 MiB does."""
    _, url = fusion
    grab = "b = bytearray(256 << 20)\nb[::4096] = b'x' * len(b[::4096])\nprint('held')"

    def verl(memory_mb: int) -> dict[str, Any]:
        payload = {"compile_timeout": 10, "run_timeout": 10, "code": grab, "stdin": None, "language": "python"}
        payload |= {"memory_limit_MB": memory_mb, "files": {}, "fetch_files": []}
        answer = requests.post(f"{url}/run_code", json=payload, timeout=60)
        assert answer.status_code == 200, answer.text
        body: dict[str, Any] = answer.json()
        return body

    small = verl(64)
    assert small["status"] == "Failed", small
    assert small["run_result"]["status"] == "Finished" and small["run_result"]["return_code"] == -9
    big = verl(1024)
    assert big["status"] == "Success" and big["run_result"]["stdout"] == "held\n", big
    assert verl(-1)["status"] == "Success"  # SandboxFusion's "no limit": the server's default


def test_the_async_client_too(fusion: tuple[Daemon, str]) -> None:
    import asyncio

    _, url = fusion
    request = sf.RunCodeRequest(code="console.log(6 * 7)", language="nodejs")
    res = asyncio.run(sf.run_code_async(request, endpoint=url, max_attempts=1))
    assert res.status == sf.RunStatus.Success and res.run_result is not None and res.run_result.stdout == "42\n"


def test_an_unknown_language_is_a_sandbox_error_that_says_so(fusion: tuple[Daemon, str]) -> None:
    _, url = fusion
    # in the client's vocabulary, not run by dsec: the client raises with the server's message
    with pytest.raises(Exception, match=r"language 'rust' is not supported.*cpp.*go.*java.*nodejs.*python"):
        run(url, code="fn main() {}", language="rust")
    answer = requests.post(f"{url}/run_code", json={"code": "x", "language": "klingon"}, timeout=30)
    assert answer.status_code == 200 and answer.json()["status"] == "SandboxError"
    assert "klingon" in answer.json()["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"code": "print(1)"},  # no language
        {"code": "print(1)", "language": "python", "run_timeout": -1},
        {"code": "print(1)", "language": "python", "files": {"a.txt": "not base64!"}},
        {"code": "print(1)", "language": "python", "files": {"../a.txt": "eA=="}},
        {"code": "print(1)", "language": "python", "fetch_files": ["a/../../etc/passwd"]},
        {"code": "print(1)", "language": "python", "memory_limit_MB": 4},
        {"code": ["not", "a", "string"], "language": "python"},
    ],
    ids=["no-language", "negative-timeout", "bad-base64", "dotdot-file", "dotdot-fetch", "tiny-memory", "code-list"],
)
def test_bad_requests_are_422_with_a_reason(fusion: tuple[Daemon, str], body: dict[str, Any]) -> None:
    _, url = fusion
    answer = requests.post(f"{url}/run_code", json=body, timeout=30)
    assert answer.status_code == 422, answer.text
    assert isinstance(answer.json()["detail"], str) and answer.json()["detail"]


def test_the_rest_of_the_listener(fusion: tuple[Daemon, str]) -> None:
    d, url = fusion
    assert requests.get(f"{url}/v1/ping", timeout=10).json() == "pong"
    assert requests.post(f"{url}/run_code", data=b"{not json", timeout=10).status_code == 422
    missing = requests.post(f"{url}/get_prompts", json={}, timeout=10)
    assert missing.status_code == 404 and missing.json() == {"detail": "Not Found"}
    # the node's own API stays on its listener, and no call left a sandbox behind
    assert [s.id for s in d.client().list(labels={"dsec.fusion": "1"})] == []


def test_the_example_scores_solutions_as_verl_does(fusion: tuple[Daemon, str]) -> None:
    _, url = fusion
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "sandbox_fusion_dsec.py")],
        env=os.environ | {"SANDBOX_FUSION_ENDPOINT": url},
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for language in ("python", "cpp", "java", "go"):
        assert f"{language:7} ['pass', 'pass', 'pass']  reward 1.00" in lines, done.stdout
    assert "typo    compile error" in lines and "loop    timeout" in lines, done.stdout
    assert any(line.startswith("client  Success [1, 2, 3] in sb-") for line in lines), done.stdout


def test_three_listeners_each_answer_their_own_api() -> None:
    """The node API, the E2B API and the SandboxFusion API on one daemon: each port serves its API only."""
    with scratch_dir("dsec-fusion-three-") as work:
        node, fusion = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
        d = start_daemon(work / "state", "--sandbox-fusion-listen", fusion, e2b=True, listen=node)
        try:
            assert d.e2b_url is not None
            assert requests.get(f"{fusion}/v1/ping", timeout=10).json() == "pong"
            assert requests.get(f"{d.e2b_url}/health", timeout=10).status_code in (200, 204)
            assert d.client().health().version
            for other in (node, d.e2b_url):  # not theirs: refused (401, 404, E2B's 501), never run
                answer = requests.post(f"{other}/run_code", json={"code": "", "language": "python"}, timeout=10)
                assert answer.status_code >= 400 and "run_result" not in answer.text
            assert requests.get(f"{fusion}/v1/health", timeout=10).status_code == 404
        finally:
            shut_down(d)


def jupyter(url: str, **kw: Any) -> sf.RunJupyterResponse:
    return sf.run_jupyter(sf.RunJupyterRequest(**kw), endpoint=url, max_attempts=1, client_timeout=300)


def test_run_jupyter_runs_cells_in_one_kernel(fusion: tuple[Daemon, str]) -> None:
    _, url = fusion
    cells = [
        "import pandas as pd\ndf = pd.DataFrame({'a': [1, 2, 3]})\nprint('rows', len(df))",
        "df.a.sum()",
        "import matplotlib.pyplot as plt\nplt.plot(df.a)\nplt.show()",
        "df.b",
        "open('out.txt', 'w').write(open('in.txt').read().upper())",
    ]
    r = jupyter(url, cells=cells, files={"in.txt": b64(b"shout")}, fetch_files=["out.txt"])
    assert r.status == "Success" and r.driver is not None and r.driver.status == "Finished"
    assert len(r.cells) == len(cells)
    assert r.cells[0].stdout == "rows 3\n" and r.cells[0].display == []
    assert r.cells[1].display == [{"text/plain": "np.int64(6)"}]  # the state of cell 0 carried over
    assert base64.b64decode(r.cells[2].display[0]["image/png"])[:4] == b"\x89PNG"
    assert r.cells[3].error[0]["ename"] == "AttributeError" and "b" in r.cells[3].error[0]["evalue"]
    assert base64.b64decode(r.files["out.txt"]) == b"SHOUT"


def test_run_jupyter_time_limits_end_the_run(fusion: tuple[Daemon, str]) -> None:
    _, url = fusion
    r = jupyter(url, cells=["x = 1", "import time\ntime.sleep(30)", "x"], cell_timeout=2, total_timeout=20)
    assert r.status == "Failed" and r.driver is not None and r.driver.status == "TimeLimitExceeded"
    assert len(r.cells) == 2 and r.cells[1].error[0]["ename"] == "TimeoutError"
    assert r.driver.execution_time is not None and r.driver.execution_time < 15
    total = jupyter(url, cells=["import time\ntime.sleep(30)"], total_timeout=3)
    assert total.status == "Failed" and total.cells[0].error[0]["ename"] == "TimeoutError"


def test_run_jupyter_refuses_what_it_cannot_run(fusion: tuple[Daemon, str]) -> None:
    _, url = fusion
    other = requests.post(f"{url}/run_jupyter", json={"cells": ["1"], "kernel": "ir"}, timeout=60)
    assert (
        other.status_code == 200 and other.json()["status"] == "SandboxError" and "python3" in other.json()["message"]
    )
    empty = requests.post(f"{url}/run_jupyter", json={"cells": []}, timeout=60)
    assert empty.status_code == 422 and "cells" in empty.json()["detail"]
