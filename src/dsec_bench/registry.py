"""A registry of the bench's own: Debian's ``docker-registry`` (Distribution 2.8) on a free loopback port,
plain HTTP, storing in a directory the bench removes; images pushed to it from an OCI layout by ``skopeo``.

Its access log (Gorilla's combined format, one line per request on its stdout) is what the pull bench counts
registry traffic by: the bytes of every answer's body, whoever asked. Both sides of the comparison go to the
registry one after the other, so the lines between two offsets of the log are one round's.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import re
import signal
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REGISTRY_BIN = Path("/usr/bin/docker-registry")
START_TIMEOUT = 30.0
PUSH_TIMEOUT = 600.0
# host [ident] [user] [time] "request" status size "referer" "user agent"
_LINE = re.compile(
    r'^\S+ \S+ \S+ \[[^\]]*\] "(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[0-9.]+" (?P<status>\d{3}) (?P<size>\d+|-)'
    r'(?: "[^"]*" "(?P<agent>[^"]*)")?'
)
_BLOB = re.compile(r"/blobs/(sha256:[0-9a-f]{64})$")


@dataclass(frozen=True)
class Request:
    """One line of the access log."""

    method: str
    path: str
    status: int
    size: int  # bytes of the answer's body
    agent: str = ""

    @property
    def blob(self) -> str | None:
        """The digest of the blob asked for, if it is a blob request."""
        m = _BLOB.search(self.path.split("?", 1)[0])
        return m[1] if m else None

    @property
    def manifest(self) -> bool:
        return "/manifests/" in self.path


def parse_access_log(text: str) -> list[Request]:
    """The requests of a log's text, in order; other lines (the registry's own messages) are skipped."""
    found = []
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m is None:
            continue
        size = 0 if m["size"] == "-" else int(m["size"])
        found.append(Request(m["method"], m["path"], int(m["status"]), size, m["agent"] or ""))
    return found


def traffic(requests: Iterable[Request]) -> dict[str, Any]:
    """What a round cost the registry: requests, bytes served, and how often each blob was fetched (a blob
    fetched twice is a shared layer that was not shared)."""
    requests = list(requests)
    gets = [r for r in requests if r.method == "GET"]
    blob_gets = Counter(r.blob for r in gets if r.blob is not None and r.status in (200, 206))
    return {
        "requests": len(requests),
        "bytes": sum(r.size for r in requests),
        "blob_gets": sum(blob_gets.values()),
        "blob_bytes": sum(r.size for r in gets if r.blob is not None),
        "distinct_blobs": len(blob_gets),
        "blobs_fetched_more_than_once": sum(1 for n in blob_gets.values() if n > 1),
        "manifest_gets": sum(1 for r in gets if r.manifest),
        "heads": sum(1 for r in requests if r.method == "HEAD"),
        "errors": sum(1 for r in requests if r.status >= 400 and r.status != 401),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(directory: Path, host: str) -> dict[str, Any]:
    """The registry's configuration: filesystem storage under ``directory``, an access log, no auth."""
    return {
        "version": "0.1",
        "log": {"level": "warn", "accesslog": {"disabled": False}},
        "storage": {
            "filesystem": {"rootdirectory": str(directory / "storage")},
            "delete": {"enabled": True},
            # the bench's pushes are never left half-done for long: no purge sweeps during a run
            "maintenance": {"uploadpurging": {"enabled": False}},
        },
        "http": {"addr": host, "secret": "dsec-bench-pull"},
        "health": {"storagedriver": {"enabled": False}},
    }


def _die_with_parent() -> None:
    # a bench killed outright (SIGKILL) must not leave its registry listening
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class LocalRegistry:
    """The registry process; a context manager that stops it on the way out, Ctrl-C included. Start it
    from the main thread: the parent-death signal follows the thread that started it."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.directory / "registry.log"

    def __enter__(self) -> LocalRegistry:
        if not REGISTRY_BIN.exists():
            raise RuntimeError(f"{REGISTRY_BIN} is not installed (apt-get install docker-registry)")
        self.directory.mkdir(parents=True, exist_ok=True)
        # YAML is a superset of JSON: no YAML writer needed
        (self.directory / "config.yml").write_text(json.dumps(config(self.directory, self.host), indent=1))
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [str(REGISTRY_BIN), "serve", str(self.directory / "config.yml")],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env={"PATH": "/usr/bin:/bin", "HOME": str(self.directory)},  # no REGISTRY_* from outside
                preexec_fn=_die_with_parent,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://{self.host}/v2/", timeout=2).status_code == 200:
                    return
            if self.proc is None or self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"docker-registry did not start: {self.log.read_text(errors='replace')[-800:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def offset(self) -> int:
        """Where the log ends now: a round's requests are those after it."""
        return self.log.stat().st_size

    def requests_since(self, offset: int) -> list[Request]:
        with self.log.open("rb") as f:
            f.seek(offset)
            return parse_access_log(f.read().decode(errors="replace"))


def skopeo_argv(skopeo: str, layout: Path, name: str, host: str, repository: str) -> list[str]:
    """``skopeo copy`` of the layout's image ``name`` to ``host/repository``, its blobs as they are (no
    recompression, so the registry's digests are the layout's), over plain HTTP."""
    argv = [skopeo, "--insecure-policy", "copy", "--quiet", "--retry-times", "0", "--preserve-digests"]
    return [*argv, "--dest-tls-verify=false", f"oci:{layout}:{name}", f"docker://{host}/{repository}"]


def push(skopeo: str, layout: Path, name: str, host: str, repository: str, work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    # its own HOME, TMPDIR and auth file: nothing of the host's container configuration applies
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "REGISTRY_AUTH_FILE": str(work / "a.json")}
    done = subprocess.run(
        skopeo_argv(skopeo, layout, name, host, repository),
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=PUSH_TIMEOUT,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"skopeo copy of {name} failed ({done.returncode}): {done.stderr.decode()[-800:]}")
