"""The daemon's own setup: token file, TCP listening, clear errors for bad flags."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import dsec

from .conftest import IMAGES_DIR, Daemon, release_node


def test_token_file_is_private(daemon: Daemon) -> None:
    mode = stat.S_IMODE(os.stat(daemon.state_dir / "token").st_mode)
    assert mode == 0o600
    assert stat.S_IMODE(os.stat(daemon.state_dir).st_mode) == 0o711  # traversable, not listable
    for name in ("state.db", "state.db-wal"):
        if (daemon.state_dir / name).exists():
            assert stat.S_IMODE(os.stat(daemon.state_dir / name).st_mode) == 0o600, name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_tcp_listen_and_token_required() -> None:
    state = Path(tempfile.mkdtemp(prefix="dsec-tcp-"))
    port = _free_port()
    argv = [
        sys.executable,
        "-m",
        "dsec",
        "serve",
        "--state-dir",
        str(state),
        "--repository",
        str(IMAGES_DIR / "repository"),
    ]
    proc = subprocess.Popen([*argv, "--listen", f"http://127.0.0.1:{port}"], stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                token = (state / "token").read_text().strip()
                dsec.Client(url=url, token=token).health()
                break
            except (OSError, dsec.DaemonUnreachable):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.1)
        with dsec.Sandbox.create(image="dsec/busybox", client=dsec.Client(url=url, token=token)) as sb:
            assert sb.exec("echo over tcp").stdout == "over tcp\n"
        with pytest.raises(dsec.Unauthorized):
            dsec.Client(url=url, token="wrong").list()
    finally:
        proc.terminate()
        proc.wait(20)
        release_node(state)
    import shutil

    shutil.rmtree(state, ignore_errors=True)


@pytest.mark.parametrize("listen", ["ftp://x", "http://127.0.0.1", "unix://", "nonsense"])
def test_bad_listen_address_is_a_clear_error(listen: str, tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "dsec", "serve", "--state-dir", str(tmp_path), "--listen", listen],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 2
    assert "invalid_request" in res.stderr and "--listen" in res.stderr
    assert "Traceback" not in res.stderr
