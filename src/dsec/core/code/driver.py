"""dsec's code runner, run inside a sandbox by ``sb.run_code`` (see core/code/runner.py).

Not imported by dsec: its source is handed to the sandbox's ``python3`` as an argument, so it must run on
any Python >= 3.8 with the standard library alone, and uses ``jupyter_client`` where the image has it.

``call CONTEXT``: one request (JSON on stdin) to the context's server, the answer (JSON) on stdout. The
server is started by the first call and outlives it (a session of its own), so a context's state lives
in the sandbox and survives the daemon restarting. ``serve CONTEXT``: that server. It runs the code in a
Jupyter kernel when ``ipykernel`` and ``jupyter_client`` import, else in its own persistent namespace.
``interrupt CONTEXT``: interrupt the cell the server is running (its caller went away), by a signal,
since the server answers one connection at a time. A request with ``live`` gets the cell's output as it is
written, a JSON line ``{"stream": NAME, "text": TEXT}`` each, before the answer's own line.
"""

from __future__ import annotations

import ast
import base64
import fcntl
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

STREAM_CAP = 1 << 20  # bytes kept of stdout and of stderr per call
RICH_CAP = 16 << 20  # bytes kept of results and display outputs per call
START_TIMEOUT = 180.0  # a kernel's first start, under emulation, takes tens of seconds
INTERRUPT_GRACE = 10.0  # after an interrupt, how long the kernel has to come back before it is restarted
BOOT = "import sys; exec(sys.argv[1])"  # how this source is run: python3 -c BOOT SOURCE OP CONTEXT [MOST]
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
NO_SERVER = 3  # exit status: the context's server could not start
TOO_MANY = 4  # exit status: the sandbox holds its most contexts already
INTERRUPT = signal.SIGUSR1  # to a context's server: interrupt the running cell


def home() -> str:
    path = f"/tmp/.dsec-code-{os.getuid()}"
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


class Collector:
    """One call's output, bounded."""

    def __init__(self, live: Callable[[str, str], None] | None = None) -> None:
        self.live = live  # the caller's, for output as it is written: whole lines, as Jupyter sends them
        self.pending = {"stdout": "", "stderr": ""}
        self.streams = {"stdout": io.StringIO(), "stderr": io.StringIO()}
        self.result: dict[str, str] | None = None
        self.outputs: list[dict[str, str]] = []
        self.error: dict[str, Any] | None = None
        self.truncated = False
        self.rich = 0

    def stream(self, name: str, text: str) -> None:
        buf = self.streams["stderr" if name == "stderr" else "stdout"]
        room = STREAM_CAP - buf.tell()
        if len(text) > room:
            self.truncated = True
            text = text[: max(room, 0)]
        buf.write(text)
        if self.live is not None and text:
            stream = "stderr" if name == "stderr" else "stdout"
            done, newline, rest = (self.pending[stream] + text).rpartition("\n")
            self.pending[stream] = rest
            if newline:
                self.live(stream, done + newline)

    def flush(self) -> None:
        """What is left of a line without its end, when the cell is done."""
        for stream, text in self.pending.items():
            if self.live is not None and text:
                self.live(stream, text)
            self.pending[stream] = ""

    def bundle(self, data: dict[str, Any]) -> dict[str, str] | None:
        out = {}
        for mime, value in data.items():
            text = value if isinstance(value, str) else json.dumps(value)
            if self.rich + len(text) > RICH_CAP:
                self.truncated = True
                continue
            self.rich += len(text)
            out[mime] = text
        return out or None

    def answer(self, engine: str, count: int) -> dict[str, Any]:
        self.flush()
        return {
            "stdout": self.streams["stdout"].getvalue(),
            "stderr": self.streams["stderr"].getvalue(),
            "result": self.result,
            "outputs": self.outputs,
            "error": self.error,
            "execution_count": count,
            "engine": engine,
            "truncated": self.truncated,
        }


def timeout_error(timeout: float, kept: bool) -> dict[str, Any]:
    state = "its variables are kept" if kept else "the context was restarted: its variables are gone"
    return {
        "name": "TimeoutError",
        "value": f"the code ran past its {timeout:g}s timeout and was interrupted; {state}",
        "traceback": [],
    }


def interrupted_error() -> dict[str, Any]:
    return {
        "name": "KeyboardInterrupt",
        "value": "the code was interrupted: its caller went away; its variables are kept",
        "traceback": [],
    }


def env_code(env: dict[str, str]) -> tuple[str, str]:
    """Code that sets ``env`` in os.environ for one cell, and code that puts back what was there."""
    keys = sorted(env)
    apply = (
        "import os as _dsec_os\n"
        f"_dsec_env = {{k: _dsec_os.environ.get(k) for k in {keys!r}}}\n"
        f"_dsec_os.environ.update({env!r})\n"
        "del _dsec_os\n"
    )
    restore = (
        "import os as _dsec_os\n"
        "for _dsec_k, _dsec_v in _dsec_env.items():\n"
        "    if _dsec_v is None:\n"
        "        _dsec_os.environ.pop(_dsec_k, None)\n"
        "    else:\n"
        "        _dsec_os.environ[_dsec_k] = _dsec_v\n"
        "del _dsec_os, _dsec_env, _dsec_k, _dsec_v\n"
    )
    return apply, restore


class KernelEngine:
    """A Jupyter kernel (the image's ``python3`` kernel spec), driven over its own protocol."""

    name = "jupyter"

    def __init__(self) -> None:
        from jupyter_client.manager import start_new_kernel  # type: ignore[import-not-found]

        runtime = os.path.join(home(), "runtime")
        os.environ.setdefault("JUPYTER_RUNTIME_DIR", runtime)
        os.environ.setdefault("IPYTHONDIR", os.path.join(home(), "ipython"))
        self.km, self.kc = start_new_kernel(kernel_name="python3", startup_timeout=START_TIMEOUT)
        self.count = 0
        self.cut = False  # set by INTERRUPT
        self.live: Callable[[str, str], None] | None = None

    def interrupt(self, signum: int, frame: object) -> None:
        self.cut = True

    def restart(self) -> None:
        self.km.restart_kernel(now=True)
        self.kc.wait_for_ready(timeout=START_TIMEOUT)

    def run(self, code: str, timeout: float, env: dict[str, str] | None = None, quiet: bool = False) -> dict[str, Any]:
        """One cell; ``env``: environment variables for this cell only; ``quiet``: a cell of the caller's own
        (a context's setup), which does not count as one of the context's cells."""
        self.cut = False
        if env:
            apply, restore = env_code(env)
            self.cell(apply, timeout, quiet=True)
        answer = self.cell(code, timeout, quiet)
        if env:
            self.cell(restore, timeout, quiet=True)
        return answer

    def cell(self, code: str, timeout: float, quiet: bool) -> dict[str, Any]:
        count = self.count
        out = Collector(None if quiet else self.live)
        msg_id = self.kc.execute(code, store_history=not quiet, allow_stdin=False, stop_on_error=False)
        deadline = time.monotonic() + timeout
        interrupted = cut = False
        while True:
            if self.cut and not interrupted:  # the caller went away: as when the time is up, but at once
                self.km.interrupt_kernel()
                interrupted = cut = True
                deadline = time.monotonic() + INTERRUPT_GRACE
            left = deadline - time.monotonic()
            if left <= 0:
                if interrupted:  # the kernel did not come back from the interrupt
                    self.restart()
                    out.error = timeout_error(timeout, kept=False)
                    break
                self.km.interrupt_kernel()
                interrupted = True
                deadline = time.monotonic() + INTERRUPT_GRACE
                continue
            if not self.km.is_alive():
                self.restart()
                out.error = {
                    "name": "KernelDied",
                    "value": "the kernel died; the context restarted empty",
                    "traceback": [],
                }
                break
            try:
                msg = self.kc.get_iopub_msg(timeout=min(left, 1.0))
            except Exception:  # queue.Empty; the kernel is polled for life above
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if self.take(msg, out):
                break
        self.drain(msg_id)
        if interrupted and (out.error is None or out.error["name"] == "KeyboardInterrupt"):
            out.error = interrupted_error() if cut else timeout_error(timeout, kept=True)
        if quiet:  # the kernel numbers only cells kept in its history; what it said of this one is not ours
            self.count = count
        return out.answer(self.name, self.count)

    def take(self, msg: dict[str, Any], out: Collector) -> bool:
        """Fold one iopub message into ``out``; True when the kernel went idle (the cell is done)."""
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out.stream(content.get("name", "stdout"), content.get("text", ""))
        elif kind == "execute_result":
            out.result = out.bundle(content.get("data", {}))
            self.count = content.get("execution_count") or self.count
        elif kind == "display_data":
            bundle = out.bundle(content.get("data", {}))
            if bundle:
                out.outputs.append(bundle)
        elif kind == "error":
            lines = [ANSI.sub("", line) for line in content.get("traceback", [])]
            out.error = {"name": content.get("ename", ""), "value": content.get("evalue", ""), "traceback": lines}
        elif kind == "execute_input":
            self.count = content.get("execution_count") or self.count
        elif kind == "status":
            return bool(content.get("execution_state") == "idle")
        return False

    def drain(self, msg_id: str) -> None:
        """Take the cell's execute_reply off the shell channel, so replies do not pile up."""
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            try:
                reply = self.kc.get_shell_msg(timeout=0.5)
            except Exception:
                return
            if reply.get("parent_header", {}).get("msg_id") == msg_id:
                self.count = reply.get("content", {}).get("execution_count") or self.count
                return


class Interrupted(BaseException):
    """Raised into running code by the timer; a BaseException so that ``except Exception`` lets it go."""


class PlainEngine:
    """The image has no Jupyter kernel: run cells in one persistent namespace of this process."""

    name = "python"

    def __init__(self) -> None:
        self.ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
        self.count = 0
        self.running = False
        self.live: Callable[[str, str], None] | None = None

    def interrupt(self, signum: int, frame: object) -> None:
        if self.running:
            raise Interrupted("caller")

    def run(self, code: str, timeout: float, env: dict[str, str] | None = None, quiet: bool = False) -> dict[str, Any]:
        if not quiet:
            self.count += 1
        out = Collector(None if quiet else self.live)
        label = f"<cell {self.count}>"
        saved = sys.stdout, sys.stderr
        sink = Sink(out)
        sys.stdout, sys.stderr = sink.stdout, sink.stderr
        before = {k: os.environ.get(k) for k in env or {}}
        os.environ.update(env or {})

        def expire(signum: int, frame: object) -> None:
            raise Interrupted()

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            self.running = True
            value = self.execute(code, label)
            if value is not None:
                self.ns["_"] = value
                out.result = out.bundle(represent(value))
            self.figures(out)
        except Interrupted as e:
            out.error = interrupted_error() if e.args else timeout_error(timeout, kept=True)
        except BaseException as e:  # the code's own error, SystemExit included: the context lives on
            out.error = describe(e, label)
        finally:
            self.running = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            sys.stdout, sys.stderr = saved
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return out.answer(self.name, self.count)

    def execute(self, code: str, label: str) -> object:
        tree = ast.parse(code, label, "exec")
        last = tree.body[-1] if tree.body else None
        if isinstance(last, ast.Expr):
            tree.body.pop()
        exec(compile(tree, label, "exec"), self.ns)
        if not isinstance(last, ast.Expr):
            return None
        return eval(compile(ast.Expression(last.value), label, "eval"), self.ns)

    def figures(self, out: Collector) -> None:
        """matplotlib's open figures as PNG outputs, as Jupyter's inline backend shows them."""
        plt = sys.modules.get("matplotlib.pyplot")
        if plt is None:
            return
        for num in plt.get_fignums():
            buf = io.BytesIO()
            plt.figure(num).savefig(buf, format="png")
            bundle = out.bundle({"image/png": base64.b64encode(buf.getvalue()).decode(), "text/plain": "<Figure>"})
            if bundle:
                out.outputs.append(bundle)
        plt.close("all")


class Sink:
    """sys.stdout and sys.stderr for a plain cell, written into its Collector."""

    def __init__(self, out: Collector) -> None:
        self.stdout = Stream(out, "stdout")
        self.stderr = Stream(out, "stderr")


class Stream(io.TextIOBase):
    def __init__(self, out: Collector, name: str) -> None:
        self.out, self.name_ = out, name

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.out.stream(self.name_, text)
        return len(text)


def represent(value: object) -> dict[str, str]:
    data = {"text/plain": repr(value)}
    for mime, method in (("text/html", "_repr_html_"), ("image/png", "_repr_png_")):
        fn = getattr(value, method, None)
        if callable(fn):
            try:
                got = fn()
            except Exception:
                continue
            if isinstance(got, bytes):
                got = base64.b64encode(got).decode()
            if isinstance(got, str):
                data[mime] = got
    return data


def describe(e: BaseException, label: str) -> dict[str, Any]:
    """The error as Jupyter reports one: name, value, and the traceback from the cell down."""
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != label:
        tb = tb.tb_next
    lines = traceback.format_exception(type(e), e, tb if tb is not None else None)
    return {"name": type(e).__name__, "value": str(e), "traceback": [line.rstrip("\n") for line in lines]}


def engine() -> KernelEngine | PlainEngine:
    try:
        import importlib.util

        if importlib.util.find_spec("ipykernel") and importlib.util.find_spec("jupyter_client"):
            return KernelEngine()
    except ImportError:
        pass
    return PlainEngine()


def serve(context: str) -> int:
    base = os.path.join(home(), context)
    lock = open(base + ".lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return 0  # another call started this context's server first
    runner = engine()  # before listening: a call that connects finds the kernel ready
    signal.signal(INTERRUPT, runner.interrupt)
    with open(base + ".pid", "w") as f:
        f.write(str(os.getpid()))
    path = base + ".sock"
    if os.path.exists(path):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    while True:
        conn, _ = server.accept()
        with conn:
            try:
                request = json.loads(receive(conn))
            except (OSError, ValueError):  # a probe (``live``) or a caller gone: nothing to answer
                continue
            if request.get("op") == "stop":
                conn.sendall(json.dumps({"stopped": True}).encode())
                os.unlink(path)
                if isinstance(runner, KernelEngine):
                    runner.km.shutdown_kernel(now=True)
                return 0
            runner.live = Frames(conn).send if request.get("live") else None
            answer = runner.run(
                request["code"], float(request["timeout"]), request.get("env"), bool(request.get("quiet"))
            )
            runner.live = None
            try:
                conn.sendall(json.dumps(answer).encode() + b"\n")
            except OSError:  # the caller is gone (its exec was killed): the context lives on
                pass


class Frames:
    """A cell's output to its caller as it is written (a live request); a caller gone is not the cell's
    concern: the rest is dropped."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn: socket.socket | None = conn

    def send(self, name: str, text: str) -> None:
        if self.conn is None:
            return
        try:
            self.conn.sendall(json.dumps({"stream": name, "text": text}).encode() + b"\n")
        except OSError:
            self.conn = None


def receive(conn: socket.socket) -> bytes:
    parts: list[bytes] = []
    while True:
        chunk = conn.recv(1 << 16)
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)


def live() -> list[str]:
    """The contexts whose servers answer."""
    names = []
    for entry in sorted(os.listdir(home())):
        if entry.endswith(".sock"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(os.path.join(home(), entry))
                names.append(entry[: -len(".sock")])
            except OSError:
                pass
            finally:
                sock.close()
    return names


def connect(context: str, source: str, start: bool, most: int) -> socket.socket | None:
    """The context's server, started first if ``start`` and it is not running."""
    base = os.path.join(home(), context)
    path = base + ".sock"
    proc = None
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except OSError:
            sock.close()
        if not start:
            return None
        if proc is None:
            if len(live()) >= most:
                sys.stderr.write(f"the sandbox has {most} code contexts already, the most it may hold\n")
                sys.exit(TOO_MANY)
            log = open(base + ".log", "ab")
            argv = [sys.executable, "-c", BOOT, source, "serve", context]
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        elif proc.poll() not in (None, 0):
            with open(base + ".log", "rb") as f:
                tail = f.read()[-4000:].decode(errors="replace")
            sys.stderr.write("the code context's server failed to start:\n" + tail)
            sys.exit(NO_SERVER)
        if time.monotonic() > deadline:
            sys.stderr.write(f"the code context's server did not start in {START_TIMEOUT:g}s\n")
            sys.exit(NO_SERVER)
        time.sleep(0.05)


def call(context: str, source: str, most: int) -> int:
    request = sys.stdin.buffer.read()
    stop = json.loads(request).get("op") == "stop"
    sock = connect(context, source, not stop, most)
    if sock is None:
        sys.stdout.write(json.dumps({"stopped": False}))
        return 0
    out = sys.stdout.buffer
    with sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        while True:  # passed on as it comes: a live request's output lines reach the daemon at once
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            out.write(chunk)
            out.flush()
    return 0


def interrupt(context: str) -> int:
    """Signal the context's server to interrupt its cell; a pid file left by a server that is gone names
    another process, so the process must be that server (its command line ends ``serve CONTEXT``)."""
    base = os.path.join(home(), context)
    try:
        with open(base + ".pid") as f:
            pid = int(f.read())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            tail = f.read().rstrip(b"\0").split(b"\0")[-2:]
    except (OSError, ValueError):
        tail = []
    sent = tail == [b"serve", context.encode()]
    if sent:
        os.kill(pid, INTERRUPT)
    sys.stdout.write(json.dumps({"interrupted": sent}))
    return 0


def main(argv: list[str]) -> int:
    source, op, context = argv[0], argv[1], argv[2]
    if op == "serve":
        return serve(context)
    if op == "interrupt":
        return interrupt(context)
    if op == "list":
        sys.stdout.write(json.dumps(live()))
        return 0
    return call(context, source, int(argv[3]))


if __name__ == "__main__":
    # run as ``python3 -c BOOT SOURCE OP CONTEXT [MOST]``: argv[1] is this source
    sys.exit(main(sys.argv[1:]))
