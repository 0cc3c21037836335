"""dsec.integrations.openenv without a daemon: the server command derived from openenv.yaml, the
launcher and probe scripts run by this host's /bin/sh as a sandbox's shell runs them, and what
``DsecProvider`` refuses before it creates anything."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

import dsec

pytest.importorskip("openenv")
from openenv.core.containers.runtime.providers import ContainerProvider

from dsec.integrations.openenv import (
    LAUNCH,
    PROBE,
    DsecProvider,
    EnvServerError,
    check_port,
    discovered_command,
    launch_argv,
    server_argv,
)

# the openenv.yaml of OpenEnv's template (cli/templates/openenv_env/openenv.yaml), as DISCOVER prints it
TEMPLATE = "/app/env/openenv.yaml\nspec_version: 1\nname: echo\ntype: space\nruntime: fastapi\napp: server.app:app\n"


def test_the_command_comes_from_the_app_field_and_runs_in_the_files_directory() -> None:
    assert discovered_command(TEMPLATE, 8000) == (
        'cd /app/env && exec "$(command -v python || command -v python3)" -m uvicorn server.app:app '
        "--host 127.0.0.1 --port 8000"
    )
    odd = discovered_command("/app/my env/openenv.yaml\napp: 'pkg.app:make()'\n", 9001)
    assert odd.startswith("cd '/app/my env' && ") and odd.endswith(
        "-m uvicorn 'pkg.app:make()' --host 127.0.0.1 --port 9001"
    )


@pytest.mark.parametrize(
    ("listing", "message"),
    [
        ("/app/env/openenv.yaml\nname: echo\n", "has no app: field"),
        ("/app/env/openenv.yaml\napp: ''\n", "has no app: field"),
        ("/app/env/openenv.yaml\n- a list\n", "has no app: field"),
        ("/app/env/openenv.yaml\napp: [unclosed\n", "is not valid YAML"),
    ],
)
def test_an_openenv_yaml_without_an_app_is_an_error_that_says_what_to_do(listing: str, message: str) -> None:
    with pytest.raises(EnvServerError, match=message):
        discovered_command(listing, 8000)


def test_commands_are_shell_strings_or_argv_lists() -> None:
    assert server_argv("uvicorn app:app --port $PORT") == ["/bin/sh", "-c", "uvicorn app:app --port $PORT"]
    assert server_argv(("python3", "-m", "server")) == ["python3", "-m", "server"]
    with pytest.raises(ValueError, match="non-empty list"):
        server_argv([])
    assert launch_argv(["x"])[:3] == ["/bin/sh", "-c", LAUNCH] and launch_argv(["x"])[-1] == "x"


@pytest.mark.parametrize("port", [0, 65536, -1, True, "8000"])
def test_ports_outside_the_range_are_refused(port: object) -> None:
    with pytest.raises(ValueError, match="port must be"):
        check_port(port)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="port must be"):
        DsecProvider(port=port)  # type: ignore[arg-type]


def test_the_launcher_returns_at_once_and_the_probe_sees_the_exit_status(tmp_path: Path) -> None:
    log, status = tmp_path / "server.log", tmp_path / "server.status"
    server = ["/bin/sh", "-c", 'echo "up on $0"; sleep 1; echo bye >&2; exit 3', "here"]
    t0 = time.monotonic()
    started = subprocess.run(
        ["/bin/sh", "-c", LAUNCH, "launch", str(log), str(status), *server], capture_output=True, text=True, timeout=10
    )
    assert time.monotonic() - t0 < 0.9, "the launcher waited for the server"
    assert started.returncode == 0 and started.stdout.strip().isdigit()

    def probe() -> str:
        return subprocess.run(["/bin/sh", "-c", PROBE, "probe", str(status)], capture_output=True, text=True).stdout

    assert probe() == "running\n"
    deadline = time.monotonic() + 10
    while probe() == "running\n" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert probe() == "exited 3\n"
    assert log.read_text() == "up on here\nbye\n"


def test_what_the_provider_refuses_before_it_creates_anything() -> None:
    p = DsecProvider(url="unix:///nonexistent/dsec.sock", token="t")
    assert isinstance(p, ContainerProvider)
    with pytest.raises(ValueError, match="takes no replicas"):
        p.start_container("dsec/debian:12", replicas=2)
    # a daemon on a unix socket hands out no URL another program can use: refused without a call to it
    # (a call would fail with DaemonUnreachable: there is no such socket)
    with pytest.raises(dsec.InvalidRequest, match="needs the daemon on TCP"):
        p.start_container("dsec/debian:12")
    assert p.sandbox is None and p.base_url is None
    with pytest.raises(RuntimeError, match="call start_container"):
        p.wait_for_ready("http://127.0.0.1:1")
    p.stop_container()  # nothing started: nothing to do
