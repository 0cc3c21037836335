"""The main job end to end on the real default image: a small burst of graded rollouts."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import dsec

from .conftest import IMAGES_DIR, release_node
from .test_daemon_shutdown import mounts_under, processes_of


def test_demo_rewards_exactly_the_right_candidates(daemon: object) -> None:
    url, token = daemon.url, daemon.token  # type: ignore[attr-defined]
    env = {**os.environ, "DSEC_URL": url, "DSEC_TOKEN": token, "COLUMNS": "120"}
    # dsec/debian:12 is built on first use (about a minute on a fresh machine)
    res = subprocess.run(
        [sys.executable, "-m", "dsec", "demo", "--n", "8", "--url", url, "--token", token],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert re.search(r"correct patches\s*│\s*4 / 4", out), out
    assert re.search(r"wrong patches\s*│\s*0 / 2", out), out
    assert re.search(r"stale patches\s*│\s*0 / 2", out), out
    assert re.search(r"sandboxes left behind\s*│\s*0 ", out), out
    assert "Traceback" not in res.stderr
    assert dsec.Client(url=url, token=token).list(labels={"rollout": "0"}) == []


def test_python_in_the_default_image(make_sandbox: object) -> None:
    sb = make_sandbox(image="dsec/debian:12")  # type: ignore[operator]
    res = sb.exec(["python3", "-c", "import sys, json; print(json.dumps(sys.version_info[:2]))"])
    assert res.exit_code == 0 and res.stdout.strip() == "[3, 11]"
    assert sb.exec("bash -c 'echo $BASH_VERSION' && git --version").exit_code == 0


def test_the_demo_on_a_daemon_of_its_own_leaves_no_process_and_no_mount() -> None:
    """What `make demo` does on a machine with no daemon: starts one, runs, stops it; nothing of dsec may
    stay running after it (the layer fetcher used to). The state dir shares the suite's layer repository,
    so dsec/debian:12 is not built again."""
    state = Path(tempfile.mkdtemp(prefix="dsec-demo-"))  # under /tmp: sandboxes' users traverse its parents
    (state / "images").mkdir()
    (state / "images" / "repository").symlink_to(IMAGES_DIR / "repository")
    env = {k: v for k, v in os.environ.items() if k not in ("DSEC_URL", "DSEC_TOKEN")}
    env["COLUMNS"] = "120"
    try:
        res = subprocess.run(
            [sys.executable, "-m", "dsec", "demo", "--n", "2", "--concurrency", "2", "--state-dir", str(state)],
            capture_output=True,
            text=True,
            timeout=900,
            env=env,
        )
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert re.search(r"sandboxes left behind\s*│\s*0 ", res.stdout), res.stdout
        # the daemon it started serves the web console; its address and token are printed for the user
        assert re.search(r"console: http://127\.0\.0\.1:\d+/ui/\s+token: \S{16,}", res.stdout), res.stdout
        assert processes_of(state) == []
        assert mounts_under(state) == []
    finally:
        release_node(state)
        shutil.rmtree(state, ignore_errors=True)
