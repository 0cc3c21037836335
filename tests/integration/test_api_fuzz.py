"""API fuzzing (schemathesis, apifuzz.py) of a live daemon with real crun: its node API from its own
/openapi.json, its E2B control API from the document of our control routes, and a cluster gateway in
front of it with the node API's document. Every response must be a documented status with a documented
body (ErrorResponse for errors), never a 5xx; and a refused request must leave nothing behind: no
sandbox (nor a failed record of one), image, trajectory or tenant that no accepted request made.

The daemon is private to this module: its own repository (the built-in images hard-linked from the
shared test repository, so a fuzzed gc or image removal never reaches what other tests use), a small
capacity and a short queue (a fuzzed creation is refused soon rather than waited for).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from schemathesis import Case, Response

from dsec.e2b.control import openapi_document
from dsec_bench.seed import seed_repository

from . import apifuzz
from .conftest import IMAGES_DIR, Daemon, free_port, shut_down, start_daemon

BUILTINS = ("dsec/busybox:latest", "dsec/debian:12")
TARGET_IMAGE = "dsec/busybox:latest"
# a longer run (docs/reliability.md) takes what it takes
pytestmark = pytest.mark.timeout(900 if apifuzz.EXAMPLES <= 20 and not apifuzz.COVERAGE else 6 * 3600)


@dataclass
class FuzzNode:
    daemon: Daemon
    gateway: subprocess.Popen[bytes]
    gateway_url: str
    root: Path

    @property
    def url(self) -> str:
        return self.daemon.url

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.daemon.token}"}

    def get(self, path: str, **params: Any) -> Any:
        reply = requests.get(f"{self.url}{path}", headers=self.headers, params=params, timeout=60)
        reply.raise_for_status()
        return reply.json()

    def state(self) -> dict[str, set[str]]:
        """What the node holds that a request can make."""
        return {
            "sandboxes": {s["id"] for s in self.get("/v1/sandboxes", all="true")["sandboxes"]},
            "images": {i["name"] for i in self.get("/v1/images")["images"]},
            "trajectories": {t["id"] for t in self.get("/v1/trajectories")["trajectories"]},
            "tenants": {t["name"] for t in self.get("/v1/tenants")["tenants"]},
        }

    def kill(self, sandbox_id: str) -> None:
        requests.delete(f"{self.url}/v1/sandboxes/{sandbox_id}", headers=self.headers, timeout=60)


def _wait(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer: {log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def node(daemon: Daemon) -> Iterator[FuzzNode]:
    client = daemon.client()
    for name in BUILTINS:  # built in the shared repository if they are not yet (other tests use them too)
        client.build_image(name)
    root = Path(tempfile.mkdtemp(prefix="dsec-fuzz-api-"))
    root.chmod(0o711)
    seed_repository(IMAGES_DIR / "repository", root / "repository", BUILTINS)
    capacity = ("--memory-capacity", "4G", "--cpu-capacity", "2", "--queue-timeout", "1", "--max-queue", "8")
    fuzzed = start_daemon(
        root / "state",
        "--node-name",
        "fuzz",
        *capacity,
        # fuzzed image names that name a registry are refused at once (403), not looked up on the network
        "--registry-allow",
        "none",
        e2b=True,
        repository=root / "repository",
        listen=f"http://127.0.0.1:{free_port()}",
    )
    gateway_url = f"http://127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "dsec", "cluster", "gateway", "--token-file", str(root / "state" / "token")]
    argv += ["--listen", gateway_url, "--node", fuzzed.url, "--interval", "0.5"]
    log = root / "gateway.log"
    with log.open("ab") as out:
        gateway = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    try:
        _wait(f"{gateway_url}/v1/health", gateway, log)
        yield FuzzNode(fuzzed, gateway, gateway_url, root)
    finally:
        if gateway.poll() is None:
            gateway.terminate()
            gateway.wait(20)
        shut_down(fuzzed)
        shutil.rmtree(root, ignore_errors=True)


class Run:
    """One fuzzing run against ``node``: the live target sandbox, what the cases made (killed as they go),
    and the leak check at the end."""

    def __init__(self, node: FuzzNode) -> None:
        self.node = node
        self.target_id = ""
        self.before = node.state()
        self.made: set[str] = set()

    def target(self) -> str:
        """The live target, resumed if a case paused it, made again if a case killed it."""
        node = self.node
        if self.target_id:
            state = node.get(f"/v1/sandboxes/{self.target_id}")["state"]
            if state == "running":
                return self.target_id
            if state == "paused":
                requests.post(f"{node.url}/v1/sandboxes/{self.target_id}/resume", headers=node.headers, timeout=60)
                return self.target_id
        body: dict[str, Any] = {"image": TARGET_IMAGE, "labels": {"fuzz": "target"}, "timeout": 3600}
        reply = requests.post(f"{node.url}/v1/sandboxes", headers=node.headers, json=body, timeout=120)
        reply.raise_for_status()
        self.target_id = reply.json()["id"]
        self.made.add(self.target_id)
        return self.target_id

    def after(self, case: Case[Any], response: Response, made: set[str]) -> None:
        """Kill what an accepted case made (a sandbox holds memory and a slot), the target excepted."""
        for sandbox_id in filter(apifuzz.SANDBOX_ID.fullmatch, made):
            if sandbox_id != self.target_id and sandbox_id not in self.before["sandboxes"]:
                self.node.kill(sandbox_id)

    def leaks(self, tally: apifuzz.Tally) -> dict[str, set[str]]:
        after = self.node.state()
        accepted = tally.accepted | self.made
        return {kind: found for kind, names in after.items() if (found := names - self.before[kind] - accepted)}


def _fuzz_and_check(
    node: FuzzNode,
    api: str,
    document: dict[str, Any],
    base_url: str,
    headers: dict[str, str],
    coverage: tuple[apifuzz.GenerationMode, ...] = (),
) -> None:
    """Fuzz every operation of ``document``, then: each was exercised, nothing failed a strict check,
    and nothing is left that no accepted request made."""
    run = Run(node)
    tally = apifuzz.fuzz(
        api, apifuzz.load(document), base_url, headers, target=run.target, after=run.after, coverage=coverage
    )
    print("\n" + tally.summary())
    operations = [f"{method.upper()} {path}" for path, ops in document["paths"].items() for method in ops]
    assert sorted(tally.operations) == sorted(operations)
    missed = [op for op in operations if not tally.per_operation[op]]
    assert not missed, f"operations never exercised: {missed}"
    assert not tally.strict_failures(), tally.summary()
    leaks = run.leaks(tally)
    assert not leaks, f"left behind by refused requests: {leaks}"


def test_node_api(node: FuzzNode) -> None:
    """With the coverage phase's positive cases: the boundaries (a longest image name, a largest size),
    where the 500s of issue 19 were, which generated cases seldom reach."""
    document = requests.get(f"{node.url}/openapi.json", timeout=30).json()
    _fuzz_and_check(node, "node API", document, node.url, node.headers, coverage=(apifuzz.POSITIVE,))


def test_e2b_control_api(node: FuzzNode) -> None:
    assert node.daemon.e2b_url is not None
    headers = {"X-API-KEY": node.daemon.token}
    _fuzz_and_check(node, "E2B control API", openapi_document(), node.daemon.e2b_url, headers)


def test_gateway(node: FuzzNode) -> None:
    """The node API's document against the gateway, which answers it for the cluster."""
    document = requests.get(f"{node.url}/openapi.json", timeout=30).json()
    _fuzz_and_check(node, "gateway", document, node.gateway_url, node.headers)


def test_the_leak_check_sees_what_no_accepted_request_made(node: FuzzNode) -> None:
    """The check the fuzzing runs end with can fail: a sandbox made behind its back is a leak, and one an
    accepted request's answer named is not."""
    run = Run(node)
    reply = requests.post(
        f"{node.url}/v1/sandboxes", headers=node.headers, json={"image": TARGET_IMAGE, "timeout": 60}, timeout=120
    )
    sandbox_id = reply.json()["id"]
    try:
        assert run.leaks(apifuzz.Tally("none")) == {"sandboxes": {sandbox_id}}
        assert run.leaks(apifuzz.Tally("one", accepted={sandbox_id})) == {}
    finally:
        node.kill(sandbox_id)
