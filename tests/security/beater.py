"""The neighbour's heartbeat, sampled by a process of its own (``python -m tests.security.beater``).

A thread in the test process shared the GIL and the sync SDK's one event loop with the attack's own
requests, so parsing an attack's answer delayed the neighbour's samples: that measured the test
harness, not the platform. This process has its own interpreter, client and loop.

Protocol, a line each way: ``sample N`` -> N samples now; ``run`` -> sample continuously until
``stop N`` (at least N samples in all); ``quit``. Each answer is a JSON line:
``{"samples": [seconds, ...], "failures": [str, ...]}``.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import dsec


def main() -> None:
    url, token, sandbox_id, period = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    sb = dsec.Sandbox.connect(sandbox_id, client=dsec.Client(url=url, token=token))
    samples: list[float] = []
    failures: list[str] = []

    def beat() -> None:
        t = time.monotonic()
        try:
            res = sb.exec(["true"], timeout=30)
            if res.exit_code != 0:
                failures.append(f"`true` answered {res}")
        except Exception as e:
            failures.append(repr(e))
            return
        samples.append(time.monotonic() - t)
        time.sleep(period)

    beat()  # the first exec of a client pays for its connection
    samples.clear()
    print("ready", flush=True)
    running = threading.Event()
    thread: threading.Thread | None = None

    def loop() -> None:
        while running.is_set() and not failures:
            beat()

    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "quit":
            return
        if cmd == "sample":
            samples.clear()
            failures.clear()
            while len(samples) < int(arg) and not failures:
                beat()
        elif cmd == "run":
            samples.clear()
            failures.clear()
            running.set()
            thread = threading.Thread(target=loop, daemon=True)
            thread.start()
            continue
        elif cmd == "stop":
            while len(samples) < int(arg) and not failures:
                time.sleep(period)
            running.clear()
            if thread is not None:
                thread.join(60)
        print(json.dumps({"samples": list(samples), "failures": list(failures)}), flush=True)


if __name__ == "__main__":
    main()
