"""Per-user pipe buffer accounting (fs.pipe-user-pages-soft) is per sandbox: each container sandbox has its
own host uid range, so one sandbox exhausting its pipe pages does not stop a neighbour from sizing pipes.
(VM kinds have their own kernels, so the question does not arise there.)"""

from __future__ import annotations

import threading
from collections.abc import Callable

import dsec

HOG = r"""
import fcntl, os, time
pipes = []
while True:
    r, w = os.pipe()
    try:
        fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ to pipe-max-size
    except PermissionError:
        print("exhausted", len(pipes), flush=True)
        break
    pipes.append((r, w))
    if len(pipes) > 4096:
        print("unlimited", flush=True)
        break
time.sleep(60)
"""

PROBE = r"""
import fcntl, os
r, w = os.pipe()
try:
    print("sized", fcntl.fcntl(w, 1031, 1 << 20))
except PermissionError as e:
    print("refused", e)
"""


def test_one_sandbox_exhausting_pipes_leaves_a_neighbours_alone(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    hog = make_sandbox(image="dsec/debian:12")
    neighbour = make_sandbox(image="dsec/debian:12")
    exhausted = threading.Event()
    lines: list[str] = []

    def run_hog() -> None:
        try:
            for event in hog.exec_stream(["python3", "-c", HOG], timeout=90, idle_timeout=80):
                if event.type == "stdout" and event.data:
                    lines.append(event.data)
                    exhausted.set()
        except dsec.DsecError:  # the sandbox is killed under it at the end
            pass

    t = threading.Thread(target=run_hog, daemon=True)
    t.start()
    try:
        assert exhausted.wait(60), "the hog never reported"
        # the hog really hit the per-user limit (this would fail if the platform ran sandboxes as host root)
        assert lines[0].startswith("exhausted"), lines
        # while the hog holds its pipes: a second try in the hog's own sandbox is refused...
        assert hog.exec(["python3", "-c", PROBE]).stdout.startswith("refused")
        # ...and the neighbour sizes a pipe as if nothing happened
        res = neighbour.exec(["python3", "-c", PROBE])
        assert res.stdout.split() == ["sized", str(1 << 20)], res
    finally:
        hog.kill()
        t.join(30)
