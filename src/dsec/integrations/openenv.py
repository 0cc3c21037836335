"""OpenEnv (openenv-core 0.3.0) environment servers in dsec sandboxes: ``DsecProvider``.

OpenEnv's clients start their environment server through a ``ContainerProvider`` and then talk to it
over a WebSocket::

    env = await MyEnv.from_docker_image("my-env:1", provider=DsecProvider(memory="2Gi"))
    result = await env.reset()
    result = await env.step(MyAction(...))
    await env.close()              # stops the provider: the sandbox is killed

``start_container`` creates one sandbox of the image, starts the server in it and returns the URL of
the server's port exposed through the daemon (``sb.expose``). ``port`` is the port the server listens
on *inside* the sandbox (8000 by default, OpenEnv's convention): there is no host port to map, since
the daemon's port proxy is the only way in and the URL carries the port's own secret.

dsec does not run an image's ``CMD``/``ENTRYPOINT`` (a sandbox runs only the commands sent to it), and
its SDK does not show an image's ``CMD``. So the server's command is, in order: ``cmd`` given to
``start_container``, ``cmd`` given to the provider, else the one OpenEnv's own Daytona provider derives
from the environment's ``openenv.yaml`` (``/app/env/openenv.yaml``, the layout of OpenEnv's Dockerfile
template, or the first one found under ``/app``): ``python -m uvicorn APP --host 127.0.0.1 --port PORT``
in that file's directory, ``APP`` being its ``app:`` field. The command runs detached under
``/bin/sh -c`` (or as the argv given as a list), in the image's working directory unless ``cwd`` says
otherwise, with ``PORT`` and ``env_vars`` in its environment and its output in ``LOG_PATH``.

The URL returned has a path (``http://NODE:PORT/ports/<sandbox>/<port>/<secret>``, without the trailing
slash): OpenEnv appends ``/health`` and ``/ws`` to it as strings (``convert_to_ws_url`` keeps the path),
and the daemon strips the prefix, so the server sees ``/health`` and ``/ws``.

Failures never leave a sandbox behind: a start that fails kills its sandbox; so does ``wait_for_ready``
when the server exits (``EnvServerError`` with its exit status and the end of its log) or does not
answer ``/health`` in time (``dsec.SandboxTimeout``, a ``TimeoutError``), since ``from_docker_image``
gives the caller no client to close in either case. The sandbox's time to live (``sandbox_timeout``)
bounds it whatever happens to this process, and it is killed when the provider is collected or the
interpreter exits.
"""

from __future__ import annotations

import logging
import shlex
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import httpx
import yaml  # type: ignore[import-untyped]  # PyYAML (an openenv-core dependency) has no stubs here
from openenv.core.containers.runtime.providers import ContainerProvider

import dsec

DEFAULT_PORT = 8000
LOG_PATH = "/tmp/dsec-openenv-server.log"
STATUS_PATH = "/tmp/dsec-openenv-server.status"
# OpenEnv's Dockerfile template copies the environment to /app/env; its Daytona provider looks there,
# then under /app
DISCOVER = (
    'f=/app/env/openenv.yaml; [ -f "$f" ] || f=$(find /app -maxdepth 4 -name openenv.yaml -print 2>/dev/null '
    '| head -n 1); [ -n "$f" ] && [ -f "$f" ] || exit 3; printf "%s\\n" "$f"; cat "$f"'
)
# $1: the log, $2: where the exit status goes; the rest is the server's argv. Neither the server nor the
# subshell that waits for it to write its status keeps the exec's streams, so the exec that starts it ends
# at once and leaves it running (dsec kills a finished exec's background processes only when the exec
# timed out or was cancelled); the subshell's pid is printed.
LAUNCH = (
    'log=$1 status=$2; shift 2; rm -f "$status"; '
    '{ "$@" </dev/null >"$log" 2>&1; echo $? >"$status"; } </dev/null >/dev/null 2>&1 & echo $!'
)
PROBE = 'if [ -f "$1" ]; then echo "exited $(cat "$1")"; else echo running; fi'
HEALTH_TIMEOUT = 5.0
POLL_INTERVAL = 0.25
LOG_TAIL = 4000

log = logging.getLogger(__name__)


class EnvServerError(RuntimeError):
    """The environment server could not be started, or exited before it answered (OpenEnv's providers
    raise ``RuntimeError`` when a container fails to start)."""


def discovered_command(listing: str, port: int) -> str:
    """The server command for the ``openenv.yaml`` that ``DISCOVER`` printed (its path, then its text)."""
    path, _, text = listing.partition("\n")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise EnvServerError(f"{path} is not valid YAML: {e}") from None
    app = data.get("app") if isinstance(data, dict) else None
    if not isinstance(app, str) or not app.strip():
        raise EnvServerError(f"{path} has no app: field naming the server (module:attribute); pass cmd=")
    root = path.rsplit("/", 1)[0] or "/"
    python = '"$(command -v python || command -v python3)"'
    return (
        f"cd {shlex.quote(root)} && exec {python} -m uvicorn {shlex.quote(app.strip())} --host 127.0.0.1 --port {port}"
    )


def server_argv(cmd: str | Sequence[str]) -> list[str]:
    """A string runs under ``/bin/sh -c`` (as a Dockerfile's shell-form CMD); a sequence is the argv."""
    if isinstance(cmd, str):
        return ["/bin/sh", "-c", cmd]
    argv = list(cmd)
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"cmd must be a string or a non-empty list of strings, not {cmd!r}")
    return argv


def launch_argv(argv: Sequence[str]) -> list[str]:
    return ["/bin/sh", "-c", LAUNCH, "dsec-openenv", LOG_PATH, STATUS_PATH, *argv]


def check_port(port: int) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"port must be an integer from 1 to 65535, not {port!r}")
    return port


class DsecProvider(ContainerProvider):
    """An OpenEnv ``ContainerProvider`` whose container is a dsec sandbox (one at a time)."""

    def __init__(
        self,
        *,
        cmd: str | Sequence[str] | None = None,
        port: int = DEFAULT_PORT,
        cwd: str | None = None,
        user: str | None = None,
        env: Mapping[str, str] | None = None,
        kind: str = "container",
        cpu: float | None = None,
        cpu_limit: float | None = None,
        memory: int | str | None = None,
        memory_request: int | str | None = None,
        disk: int | str | None = None,
        pids: int | None = None,
        network: Literal["full"] | dict[str, list[str]] | None = None,
        labels: Mapping[str, str] | None = None,
        pull: Literal["if-not-present", "always"] = "if-not-present",
        sandbox_timeout: float = 3600.0,
        ready_timeout: float = 120.0,
        wait_for_capacity: float = 600.0,
        url: str | None = None,
        token: str | None = None,
        client: dsec.Client | None = None,
    ) -> None:
        """``cmd``: the server's command (default: from the image's ``openenv.yaml``); ``port``: where it
        listens inside the sandbox when ``start_container`` names none; ``cwd``, ``user``: where and as whom
        it runs (default: the image's); ``env``: variables of the sandbox (``env_vars`` win on a clash).
        The sandbox's options are ``dsec.Sandbox.create``'s (``sandbox_timeout`` is its time to live).
        ``ready_timeout``: seconds ``wait_for_ready`` waits when OpenEnv names none (``from_docker_image``
        never does). ``client``, else ``url``/``token``, else ``DSEC_URL``/``DSEC_TOKEN``: the daemon, which
        must listen on TCP for the URL to be of use to anyone (``dsec serve --listen http://HOST:PORT``)."""
        if cmd is not None:
            server_argv(cmd)  # a malformed command fails here, not in the middle of a start
        self.cmd = cmd
        self.port = check_port(port)
        self.cwd = cwd
        self.user = user
        self.env = dict(env or {})
        self.kind = kind
        self.limits: dict[str, Any] = {
            "cpu": cpu,
            "cpu_limit": cpu_limit,
            "memory": memory,
            "memory_request": memory_request,
            "disk": disk,
            "pids": pids,
        }
        self.network = network
        self.labels = dict(labels or {})
        self.pull = pull
        self.sandbox_timeout = sandbox_timeout
        self.ready_timeout = ready_timeout
        self.wait_for_capacity = wait_for_capacity
        self._url = url
        self._token = token
        self._given_client = client
        self._client: dsec.Client | None = None  # one this provider made, and closes
        self._sandbox: dsec.Sandbox | None = None
        self._finalizer: weakref.finalize[[dsec.Sandbox, dsec.Client | None], DsecProvider] | None = None
        self._port = port
        self.base_url: str | None = None

    @property
    def sandbox(self) -> dsec.Sandbox | None:
        """The running sandbox (to set a task up in it, read the server's files), or None."""
        return self._sandbox

    def start_container(
        self, image: str, port: int | None = None, env_vars: dict[str, str] | None = None, **kwargs: Any
    ) -> str:
        """Create a sandbox of ``image``, start the environment server in it on ``port`` and return its
        exposed URL. ``kwargs``: ``cmd`` only (as OpenEnv's Daytona provider takes it)."""
        unknown = set(kwargs) - {"cmd"}
        if unknown:
            raise ValueError(f"DsecProvider.start_container takes no {', '.join(sorted(unknown))} (only cmd=)")
        if self._sandbox is not None:
            raise RuntimeError(f"this provider already runs sandbox {self._sandbox.id}: stop_container() first")
        port = check_port(port if port is not None else self.port)
        cmd = kwargs["cmd"] if kwargs.get("cmd") is not None else self.cmd
        argv = server_argv(cmd) if cmd is not None else None
        client = self._connect()
        try:
            sb = dsec.Sandbox.create(
                image,
                self.kind,
                **self.limits,
                timeout=self.sandbox_timeout,
                env={**self.env, **(env_vars or {})},
                labels={"harness": "openenv", **self.labels},
                network=self.network,
                pull=self.pull,
                wait_for_capacity=self.wait_for_capacity,
                client=client,
            )
        except BaseException:
            self._release_client()
            raise
        self._sandbox, self._port = sb, port
        # not only stop_container: at interpreter exit objects may never be collected, while the SDK's loop
        # thread still runs during atexit; weakref.finalize kills the sandbox there
        self._finalizer = weakref.finalize(self, _kill, sb, self._client)
        try:
            self._launch(sb, argv or server_argv(self._discover(sb, port)), port)
            self.base_url = sb.expose(port).rstrip("/")
        except BaseException:
            self.stop_container()
            raise
        log.info("OpenEnv server of %s in dsec sandbox %s at %s", image, sb.id, self.base_url)
        return self.base_url

    def _connect(self) -> dsec.Client:
        """The client, checked before any sandbox exists: only a daemon on TCP can hand out usable URLs."""
        client = self._given_client
        if client is None:
            client = self._client = dsec.Client(url=self._url, token=self._token)
        if not str(client.url).startswith(("http://", "https://")):
            self._release_client()
            raise dsec.InvalidRequest(
                f"the daemon is reached at {client.url}, which no other program can use: an OpenEnv server's URL "
                "needs the daemon on TCP (dsec serve --listen http://HOST:PORT, and DSEC_URL or url= pointing there)"
            )
        return client

    def _discover(self, sb: dsec.Sandbox, port: int) -> str:
        found = sb.exec(DISCOVER, timeout=60)
        if found.exit_code != 0:
            raise EnvServerError(
                f"no server command for this image: dsec does not run an image's CMD, and no openenv.yaml was "
                f"found at /app/env or under /app to derive one from; pass cmd= to DsecProvider or to "
                f"from_docker_image ({(found.stderr or found.stdout).strip()[-500:]})"
            )
        return discovered_command(found.stdout, port)

    def _launch(self, sb: dsec.Sandbox, argv: list[str], port: int) -> None:
        started = sb.exec(launch_argv(argv), timeout=60, cwd=self.cwd, user=self.user, env={"PORT": str(port)})
        if started.exit_code != 0 or not started.stdout.strip().isdigit():
            raise EnvServerError(
                f"could not start the environment server ({shlex.join(argv)}): exit status {started.exit_code}: "
                f"{(started.stdout + started.stderr).strip()[-LOG_TAIL:]}"
            )

    def wait_for_ready(self, base_url: str, timeout_s: float | None = None) -> None:
        """Poll ``/health`` until it answers 200. On failure the sandbox is killed: the server exited
        (``EnvServerError``), or ``timeout_s`` (default: ``ready_timeout``) passed (``dsec.SandboxTimeout``)."""
        sb = self._sandbox
        if sb is None:
            raise RuntimeError("no sandbox is running: call start_container() first")
        seconds = self.ready_timeout if timeout_s is None else timeout_s
        try:
            self._poll(sb, f"{base_url.rstrip('/')}/health", seconds)
        except BaseException:
            self.stop_container()
            raise

    def _poll(self, sb: dsec.Sandbox, health: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        with httpx.Client(timeout=HEALTH_TIMEOUT) as http:
            while (last := _health(http, health)) != 200:
                # a server that exited will never answer: say so now, with its output, not at the deadline
                probe = sb.exec(["/bin/sh", "-c", PROBE, "probe", STATUS_PATH], timeout=30).stdout.strip()
                if probe.startswith("exited"):
                    raise EnvServerError(
                        f"the environment server in sandbox {sb.id} {probe} before it answered /health; "
                        f"its output ({LOG_PATH}):\n{self.server_log()}"
                    )
                if time.monotonic() >= deadline:
                    raise dsec.SandboxTimeout(
                        f"the environment server in sandbox {sb.id} did not answer /health within {seconds:g} s "
                        f"(last answer: {last}; does it listen on port {self._port} of the sandbox's loopback?); "
                        f"its output ({LOG_PATH}):\n{self.server_log()}"
                    )
                time.sleep(POLL_INTERVAL)

    def server_log(self, limit: int = LOG_TAIL) -> str:
        """The end of the server's output (stdout and stderr), read from the sandbox."""
        if self._sandbox is None:
            return ""
        try:
            read = self._sandbox.exec(["tail", "-c", str(limit), LOG_PATH], timeout=30)
        except dsec.DsecError as e:
            return f"(could not read it: {e})"
        return read.stdout if read.exit_code == 0 else f"(could not read it: {read.stderr.strip()})"

    def stop_container(self) -> None:
        """Kill the sandbox (the server with it). Stopping again, or before a start, does nothing."""
        sb, finalizer = self._sandbox, self._finalizer
        self._sandbox, self._finalizer, self.base_url = None, None, None
        if finalizer is not None:
            finalizer.detach()
        try:
            if sb is not None:
                try:
                    sb.kill()
                except dsec.SandboxNotFound:
                    pass
        finally:
            self._release_client()

    def _release_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()


def _health(http: httpx.Client, url: str) -> int | str:
    """The status of one ``/health`` request, or why there was none."""
    try:
        return http.get(url).status_code
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"


def _kill(sb: dsec.Sandbox, client: dsec.Client | None) -> None:
    """What the finalizer does when nobody stopped the provider; a failure is only logged there."""
    try:
        sb.kill()
    except dsec.SandboxNotFound:
        pass
    except Exception as e:  # e.g. the daemon is down: the sandbox's time to live ends it
        log.warning("could not kill dsec sandbox %s: %s", sb.id, e)
    finally:
        if client is not None:
            try:
                client.close()
            except Exception as e:
                log.debug("closing the dsec client: %s", e)
