"""Screenshots of every page of the web console, for docs/console.md (``make console-screenshots``).

Starts a daemon of its own from this checkout (loopback HTTP, a scratch state directory), gives it
something to show through the SDK (sandboxes with labels and output, two graded rollouts of one task
recorded as trajectories, a snapshot and a snapshot of it, a warm pool), then drives Debian's Chromium
with Playwright through each page and writes docs/console/<page>.png. Everything it made is killed and
the daemon stopped on the way out.

    PYTHONPATH=src python tools/console_screenshots.py [--out docs/console] [--serve]

Run as root with the console built (``make console``). The daemon has a layer repository of its own
(it builds dsec/busybox from the host's busybox-static at the first creation), so nothing it makes stays
behind. ``--serve`` keeps the daemon and its sandboxes up after the screenshots and prints the console's
address and token, until Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

import dsec
import dsec.console
from dsec.isolation.mounts import unmount_under
from dsec.protocol.build import ImageSpec

IMAGE = "dsec/busybox"
TASK = "console-demo/task-7"
# The task: leave the answer in /workspace/answer.txt; the grader, run in a pristine sibling, checks it.
GRADER = [
    "sh",
    "-c",
    'a=$(cat /workspace/answer.txt); if [ "$a" = 42 ]; then echo PASS; else echo "FAIL: got $a"; exit 1; fi',
]
WIDTH = 1400
MAX_HEIGHT = 1400  # a long page (the audit log, a trajectory opened up) is cut here
PAGES = ("fleet", "sandboxes", "sandbox", "trajectories", "trajectory", "compare", "images", "audit")


@dataclass
class Scene:
    """What the daemon was given to show: ids the pages are opened on."""

    sandboxes: list[dsec.Sandbox] = field(default_factory=list)
    trajectories: list[str] = field(default_factory=list)
    snapshot: str = ""
    featured: dsec.Sandbox | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def daemon(work: Path) -> Iterator[tuple[str, str]]:
    """``dsec serve`` on a free loopback port with a layer repository of its own (the images it makes
    stay out of every other); yields (url, operator token); stopped and released after."""
    state = work / "state"
    state.mkdir(parents=True)
    url = f"http://127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "dsec", "serve", "--state-dir", str(state), "--listen", url, "--log-level", "warning"]
    log = work / "daemon.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the daemon exited: {log.read_text()[-2000:]}")
            token = (state / "token").read_text().strip() if (state / "token").exists() else ""
            if token:
                with contextlib.suppress(dsec.DaemonUnreachable):
                    dsec.Client(url=url, token=token).health()
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"the daemon did not answer within 60 s; see {log}")
            time.sleep(0.1)
        yield url, token
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with contextlib.suppress(OSError, ValueError):
            pid = int((state / "images" / "fetcher" / "fetcher.pid").read_text().strip())
            os.kill(pid, signal.SIGKILL)
        unmount_under(state)


def rollout(client: dsec.Client, trajectory: str, answer: str) -> None:
    """One attempt at the task, recorded: a few commands, a file, an error, a long output, the grade."""
    sb = dsec.Sandbox.create(IMAGE, trajectory=trajectory, labels={"task": TASK.rsplit("/", 1)[1]}, client=client)
    sb.exec("mkdir -p /workspace && cd /workspace && ls -la /")
    sb.exec(["sh", "-c", "echo thinking about the task >&2; echo 'the answer is probably' " + answer])
    sb.files.write("/workspace/answer.txt", answer + "\n")
    with contextlib.suppress(dsec.DsecError):
        sb.files.read("/workspace/notes.txt")  # an error the log keeps too
    sb.exec("seq 1 5000", output_limit=4096)  # more output than kept: marked truncated
    sb.exec(["cat", "/workspace/answer.txt"])
    sb.grade(GRADER, paths=["/workspace"], timeout=60)
    sb.kill()


def populate(client: dsec.Client) -> Scene:
    scene = Scene()
    client.set_warm_pool("busybox-warm", IMAGE, 1)
    for i, team in enumerate(("search", "search", "math", "code")):
        sb = dsec.Sandbox.create(IMAGE, labels={"team": team, "run": f"r{i}"}, timeout=1800, client=client)
        sb.exec(f"echo sandbox {i} of team {team}; uname -a")
        scene.sandboxes.append(sb)
    scene.featured = scene.sandboxes[0]
    scene.featured.files.write("/tmp/report.txt", "all good\n")
    # the lineage: busybox (base) -> a build on it -> a snapshot of a sandbox of that -> a snapshot of that
    tool = ImageSpec(IMAGE).run("mkdir -p /opt/tool && echo 1.0 > /opt/tool/VERSION")
    client.build(tool.spec("console-demo/tool:1", "a tool installed on busybox"))
    made = dsec.Sandbox.create("console-demo/tool:1", labels={"team": "code", "run": "build"}, client=client)
    made.exec("mkdir -p /srv && echo v1 > /srv/app.txt")
    scene.snapshot = "console-demo/app:1"
    made.snapshot(scene.snapshot, description="the app, first version")
    child = dsec.Sandbox.create(scene.snapshot, labels={"team": "code", "run": "from-snapshot"}, client=client)
    child.exec("echo v2 > /srv/app.txt")
    child.snapshot("console-demo/app:2", description="the app, second version")
    scene.sandboxes += [made, child]
    scene.sandboxes[1].snapshot("console-demo/scratch:1", description="a snapshot straight off busybox")
    for n, answer in enumerate(("42", "41")):
        trajectory = f"{TASK}/rollout-{n}"
        rollout(client, trajectory, answer)
        scene.trajectories.append(trajectory)
    return scene


def shoot(url: str, token: str, scene: Scene, out: Path, chromium: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    shots: list[Path] = []
    featured = scene.featured
    assert featured is not None
    a, b = scene.trajectories[0], scene.trajectories[1]
    routes = {
        "fleet": ("#/fleet", "fleet-capacity"),
        "sandboxes": ("#/sandboxes", "sandbox-row"),
        "sandbox": (f"#/sandboxes/{featured.id}", "sandbox-info"),
        "trajectories": (f"#/trajectories?prefix={TASK}/", "trajectory-row"),
        "trajectory": (f"#/trajectories/view?id={a}", "call-row"),
        "compare": (f"#/trajectories/compare?a={a}&b={b}", "compare-row"),
        "images": (f"#/images?name={scene.snapshot}", "image-stats"),
        "audit": ("#/audit", "audit-row"),
    }
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(chromium), headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": WIDTH, "height": 900}, device_scale_factor=1)
        page.set_default_timeout(20_000)
        page.goto(f"{url}/ui/#/login")
        page.get_by_test_id("login-token").wait_for()
        shots.append(_snap(page, out / "login.png"))
        page.get_by_test_id("login-token").fill(token)
        page.get_by_test_id("login-submit").click()
        page.get_by_test_id("whoami").wait_for()
        for name in PAGES:
            route, ready = routes[name]
            page.evaluate("h => { window.location.hash = h; }", route)
            page.get_by_test_id(ready).first.wait_for()
            if name == "sandbox":
                _live_exec(page, featured)
            elif name == "trajectory":
                # open the calls that tell the story: both streams, a kept error, an output cut short
                for seq in (2, 4, 5):
                    row = page.locator(f'[data-testid="call-row"][data-seq="{seq}"]')
                    row.get_by_test_id("call-toggle").click()
            page.wait_for_timeout(800)  # charts animate in
            shots.append(_snap(page, out / f"{name}.png"))
        browser.close()
    return shots


def _live_exec(page: Page, sb: dsec.Sandbox) -> None:
    """An exec started once the sandbox page listens, so that its stream shows."""
    page.wait_for_timeout(1000)
    t = threading.Thread(target=lambda: sb.exec("for i in 1 2 3; do echo step $i; sleep 0.2; done; echo done >&2"))
    t.start()
    t.join(30)
    page.get_by_test_id("exec-block").first.wait_for()


def _snap(page: Page, path: Path) -> Path:
    page.evaluate("() => window.scrollTo(0, 0)")
    height = min(MAX_HEIGHT, int(page.evaluate("() => document.documentElement.scrollHeight")))
    page.screenshot(path=str(path), full_page=True, clip={"x": 0, "y": 0, "width": WIDTH, "height": height})
    print(f"wrote {path}")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/console"), help="Directory for the PNG files.")
    parser.add_argument("--chromium", type=Path, default=Path("/usr/bin/chromium"), help="The browser to drive.")
    parser.add_argument("--serve", action="store_true", help="Keep the daemon up afterwards, until Ctrl-C.")
    args = parser.parse_args()
    assets = Path(dsec.console.__file__).parent / "assets" / "app.js"
    if not assets.exists():
        raise SystemExit(f"{assets} is missing: build the console first (make console)")
    if not args.chromium.exists():
        raise SystemExit(f"{args.chromium} is missing (apt-get install chromium)")
    with tempfile.TemporaryDirectory(prefix="dsec-shots-") as tmp:
        work = Path(tmp)
        work.chmod(0o755)  # a sandbox's mapped root must get through to the state directory below it
        with daemon(work) as (url, token):
            client = dsec.Client(url=url, token=token)
            try:
                scene = populate(client)
                shoot(url, token, scene, args.out, args.chromium)
                if args.serve:
                    print(f"console: {url}/ui/  token: {token}  (Ctrl-C to stop)", flush=True)
                    with contextlib.suppress(KeyboardInterrupt):
                        while True:
                            time.sleep(3600)
            finally:
                with contextlib.suppress(dsec.DsecError):
                    client.remove_warm_pool("busybox-warm")
                    for info in client.list():
                        with contextlib.suppress(dsec.DsecError):
                            dsec.Sandbox.connect(info.id, client=client).kill()


if __name__ == "__main__":
    main()
