"""The async SDK. ``dsec.Sandbox`` (sync) is generated from these classes; nothing here is written twice."""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import Any, Literal, TypeVar

from ..errors import DsecError, InvalidRequest, error_from_wire, validation_message
from ..protocol.checkpoints import CheckpointInfo
from ..protocol.grade import GRADE_DIR, GradeRequest, GradeResult
from ..protocol.names import PullPolicy
from ..protocol.network import NetworkSpec
from ..protocol.ports import ExposedPort, ExposeRequest
from ..protocol.sandbox import (
    DEFAULT_OUTPUT_CAP,
    ExecEvent,
    ExecRequest,
    ExecResult,
    ForkRequest,
    ForkResult,
    Health,
    ImageInfo,
    NetworkStatus,
    OnTimeout,
    SandboxInfo,
    SandboxList,
    SnapshotRequest,
)
from ..protocol.trajectory import RecordedCall
from .checkpoints import CheckpointMixin, Forked
from .code import CodeMixin
from .creating import (
    CREATE_TIMEOUT,
    DEFAULT_WAIT_FOR_CAPACITY,
    batch_error,
    create_body,
    network_body,
    post_create,
    stream_batch,
)
from .files import AsyncFiles
from .images import ImageClient
from .node import NodeClient
from .oneshot import RunClient
from .pools import PoolClient
from .tenants import TenantClient
from .trajectory import Params, Trajectory, TrajectoryClient, canonical_params, exec_result, model_result, replay
from .transport import Transport
from .volumes import VolumeClient

T = TypeVar("T")


class AsyncClient(ImageClient, VolumeClient, RunClient, TrajectoryClient, TenantClient, NodeClient, PoolClient):
    """A connection to a dsec daemon (``DSEC_URL`` / ``DSEC_TOKEN``, or the local daemon's defaults)."""

    def __init__(self, url: str | None = None, token: str | None = None) -> None:
        self._transport = Transport(url, token)

    @property
    def url(self) -> str:
        return self._transport.url

    async def health(self) -> Health:
        reply = await self._transport.request("GET", "/v1/health", timeout=10)
        return Health.model_validate_json(reply.content)

    async def list(self, labels: dict[str, str] | None = None, include_finished: bool = False) -> list[SandboxInfo]:
        params: list[tuple[str, str]] = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        if include_finished:
            params.append(("all", "true"))
        reply = await self._transport.request("GET", "/v1/sandboxes", params=params)
        return SandboxList.model_validate_json(reply.content).sandboxes

    async def create(self, **kwargs: Any) -> AsyncSandbox:
        return await AsyncSandbox.create(client=self, **kwargs)

    async def aclose(self) -> None:
        await self._transport.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


_default_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncClient] = weakref.WeakKeyDictionary()


def default_client() -> AsyncClient:
    """One shared client per event loop (an httpx client belongs to the loop it was made on)."""
    loop = asyncio.get_running_loop()
    client = _default_clients.get(loop)
    if client is None:
        client = _default_clients[loop] = AsyncClient()
    return client


class AsyncSandbox(CheckpointMixin, CodeMixin):
    """One sandbox. Create with ``await AsyncSandbox.create(...)``; ``async with`` kills it on exit."""

    def __init__(self, info: SandboxInfo, client: AsyncClient) -> None:
        self._info = info
        self._client = client
        self.files = AsyncFiles(info.id, lambda: self._t, self._call)
        # A sandbox created with a trajectory numbers its calls and has them logged. One attached by id
        # (``connect``) is outside the trajectory: it may read and kill, not change the sandbox.
        self.trajectory: Trajectory | None = None
        self._batch_index: int | None = None
        if info.trajectory and info.trajectory_length is not None:
            self.trajectory = Trajectory(client._transport, info.trajectory, info.trajectory_length)

    async def _call(
        self,
        op: str,
        params: Params,
        payload: bytes | None,
        live: Callable[[dict[str, str]], Awaitable[T]],
        decode: Callable[[RecordedCall], T],
    ) -> T:
        """A call that a trajectory logs (and answers from its log when resuming)."""
        if self.trajectory is None:
            return await live({})
        return await self.trajectory.call(op, params, payload, live, decode)

    @property
    def _t(self) -> Transport:
        return self._client._transport

    @property
    def id(self) -> str:
        return self._info.id

    @property
    def kind(self) -> str:
        return self._info.kind

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self._info.kind} {self._info.image}>"

    @classmethod
    async def create(
        cls,
        image: str = "dsec/debian:12",
        kind: str = "container",
        *,
        cpu: float | None = None,
        cpu_limit: float | None = None,
        memory: int | str | None = None,
        memory_request: int | str | None = None,
        disk: int | str | None = None,
        pids: int | None = None,
        nofile: int | None = None,
        file_size: int | str | None = None,
        timeout: float = 600.0,
        env: dict[str, str] | None = None,
        labels: dict[str, str] | None = None,
        network: NetworkSpec | dict[str, Any] = None,
        trajectory: str | None = None,
        queue_timeout: float | None = None,
        pull: PullPolicy = "if-not-present",
        wait_for_capacity: float = DEFAULT_WAIT_FOR_CAPACITY,
        volumes: dict[str, str | tuple[str, str]] | None = None,
        on_timeout: OnTimeout = "stop",
        client: AsyncClient | None = None,
    ) -> AsyncSandbox:
        """Create a sandbox and wait until it runs. ``timeout`` is its time to live in seconds.

        ``cpu`` and ``memory_request`` are what the node admits against its (oversubscribed) capacity;
        ``cpu_limit`` and ``memory`` are hard ceilings. A node without capacity queues the creation up to
        ``queue_timeout`` seconds (default: the node's), then answers 429; the SDK then waits as told and
        retries for up to ``wait_for_capacity`` seconds in all before raising ``Overloaded``.

        ``trajectory`` (e.g. ``"job-17/rollout-3"``): bind the sandbox to it. Every call is then logged;
        creating again with the same id and arguments returns the same sandbox (rebuilt from the log if
        it is gone), and the calls the log holds are answered from it until the log ends (see
        ``sb.trajectory``). A call that differs from the recorded one raises ``TrajectoryDiverged``.

        ``network``: None (loopback only), ``"full"``, ``{"allow": ["10.1.2.0/24:443", "pypi.org:443"]}``,
        or ``{"deny": ["203.0.113.0/24:*"], "allow": [...]}`` ("full" but the denied networks); see
        ``set_network``.

        ``on_timeout``: what the end of its time to live does: ``"stop"`` ends it, ``"pause"`` pauses it
        (kinds that pause), kept paused for up to 7 days until ``resume``.

        ``volumes``: named volumes (``client.create_volume``) to mount, by path: ``{"/data": "name"}``
        read-write, ``{"/data": ("name", "ro")}`` read-only (container kind). One live sandbox at a time
        may mount a volume read-write, any number read-only.

        ``image``: a name the node has (``dsec/debian:12``, a build, a snapshot) or a registry image
        (``registry.example:5000/org/task:1``, ``python:3.11``), pulled onto the node as ``pull`` says:
        ``"if-not-present"`` uses the node's copy when it has one, ``"always"`` asks the registry.
        """
        client = client or default_client()
        limits = {
            "cpu": cpu,
            "cpu_limit": cpu_limit,
            "memory": memory,
            "memory_request": memory_request,
            "disk": disk,
            "pids": pids,
            "nofile": nofile,
            "file_size": file_size,
        }
        body = create_body(
            image, kind, limits, timeout, env, labels, network, trajectory, queue_timeout, volumes, pull, on_timeout
        )
        return cls(await post_create(client._transport, body, wait_for_capacity), client)

    @classmethod
    async def create_many(
        cls,
        n: int,
        image: str = "dsec/debian:12",
        kind: str = "container",
        *,
        cpu: float | None = None,
        cpu_limit: float | None = None,
        memory: int | str | None = None,
        memory_request: int | str | None = None,
        disk: int | str | None = None,
        pids: int | None = None,
        timeout: float = 600.0,
        env: dict[str, str] | None = None,
        labels: dict[str, str] | None = None,
        network: NetworkSpec | dict[str, Any] = None,
        trajectories: builtins.list[str] | None = None,
        queue_timeout: float | None = None,
        volumes: dict[str, str | tuple[str, str]] | None = None,
        pull: PullPolicy = "if-not-present",
        client: AsyncClient | None = None,
    ) -> AsyncIterator[AsyncSandbox | DsecError]:
        """Create ``n`` sandboxes alike in one request, yielding each as soon as it runs, in the order they
        become ready. A creation that failed is yielded as the error it would have raised alone (with
        ``.index``; ``Overloaded`` if the node had no capacity before ``queue_timeout``); the others are
        not affected. Each sandbox's ``batch_index`` says which of the ``n`` it is. ``trajectories``: one
        id per sandbox. Leaving the loop early kills the sandboxes not yet yielded. ``volumes``: as for
        ``create``; every sandbox mounts them, so read-only (a second writer is refused).

        ``async for sb in AsyncSandbox.create_many(100, "dsec/busybox"): ...``
        """
        client = client or default_client()
        limits = {"cpu": cpu, "cpu_limit": cpu_limit, "memory": memory, "memory_request": memory_request}
        limits |= {"disk": disk, "pids": pids}
        body = create_body(image, kind, limits, timeout, env, labels, network, None, queue_timeout, volumes, pull)
        async for event in stream_batch(client._transport, body, n, trajectories):
            if event.sandbox is not None:
                sb = cls(event.sandbox, client)
                sb._batch_index = event.index
                yield sb
            elif event.error is not None:
                yield batch_error(event)

    @property
    def batch_index(self) -> int | None:
        """Which sandbox of its ``create_many`` batch this is (None: created alone)."""
        return self._batch_index

    @classmethod
    async def connect(cls, sandbox_id: str, client: AsyncClient | None = None) -> AsyncSandbox:
        """Attach to an existing sandbox by id. A trajectory's sandbox attached this way can be read and
        killed (not logged; a resumed trajectory rebuilds it), not changed: resume with ``create``."""
        client = client or default_client()
        reply = await client._transport.request("GET", f"/v1/sandboxes/{sandbox_id}")
        return cls(SandboxInfo.model_validate_json(reply.content), client)

    @classmethod
    async def list(
        cls, labels: dict[str, str] | None = None, client: AsyncClient | None = None
    ) -> builtins.list[SandboxInfo]:
        """Live sandboxes, optionally only those carrying all the given labels."""
        return await (client or default_client()).list(labels)

    async def info(self) -> SandboxInfo:
        reply = await self._t.request("GET", f"/v1/sandboxes/{self.id}")
        self._info = SandboxInfo.model_validate_json(reply.content)
        return self._info

    def _exec_body(
        self,
        cmd: str | builtins.list[str],
        timeout: float,
        cwd: str | None,
        env: dict[str, str] | None,
        stdin: str | None,
        output_limit: int | None,
        user: str | None = None,
        idle_timeout: float | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"cmd": cmd, "timeout": timeout, "cwd": cwd, "env": env or {}, "stdin": stdin}
        if idle_timeout is not None:
            body["idle_timeout"] = idle_timeout
        if output_limit is not None:
            body["output_limit"] = output_limit
        if user is not None:
            body["user"] = user
        try:
            ExecRequest.model_validate(body)
        except ValueError as e:
            raise InvalidRequest(validation_message(e)) from None
        return body

    async def exec(
        self,
        cmd: str | builtins.list[str],
        *,
        timeout: float = 60.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: str | None = None,
        output_limit: int | None = None,
        user: str | None = None,
        idle_timeout: float | None = None,
    ) -> ExecResult:
        """Run ``cmd`` (a string runs under ``/bin/sh -c``; a list is the argv) and return its result.

        A command still running after ``timeout`` seconds, or silent on stdout and stderr for
        ``idle_timeout`` seconds, is killed with its whole process tree and the result has
        ``timed_out=True`` (and ``idle_timed_out=True`` for the latter). It runs as the image's runtime
        user unless ``user`` says otherwise (``"root"``, a name or uid of the image).
        """
        body = self._exec_body(cmd, timeout, cwd, env, stdin, output_limit, user, idle_timeout)

        async def live(headers: dict[str, str]) -> ExecResult:
            url = f"/v1/sandboxes/{self.id}/exec"
            reply = await self._t.request("POST", url, json=body, timeout=timeout + 60, headers=headers)
            return ExecResult.model_validate_json(reply.content)

        return await self._call("exec", lambda: canonical_params(ExecRequest, body), None, live, exec_result)

    async def exec_stream(
        self,
        cmd: str | builtins.list[str],
        *,
        timeout: float = 60.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: str | None = None,
        output_limit: int | None = None,
        user: str | None = None,
        idle_timeout: float | None = None,
    ) -> AsyncIterator[ExecEvent]:
        """Like ``exec``, yielding ``stdout``/``stderr`` events as output arrives, then one ``result`` event."""
        body = self._exec_body(cmd, timeout, cwd, env, stdin, output_limit, user, idle_timeout)
        url = f"/v1/sandboxes/{self.id}/exec/stream"
        async with contextlib.AsyncExitStack() as stack:
            headers: dict[str, str] = {}
            if self.trajectory is not None:
                step = await stack.enter_async_context(
                    self.trajectory.step("exec", lambda: canonical_params(ExecRequest, body))
                )
                if step.recorded is not None:  # from the log: its output, then its result
                    result = replay(step.recorded, exec_result)
                    for stream in ("stdout", "stderr"):
                        if text := getattr(result, stream):
                            yield ExecEvent(type=stream, data=text)
                    yield ExecEvent(type="result", result=result)
                    return
                headers = step.headers
            async with self._t.stream("POST", url, json=body, timeout=timeout + 60, headers=headers) as reply:
                async for line in reply.aiter_lines():
                    if not line:
                        continue
                    event = ExecEvent.model_validate_json(line)
                    if event.type == "error" and event.error is not None:
                        raise error_from_wire(event.error.code, event.error.message, event.error.detail)
                    yield event

    async def snapshot(
        self,
        name: str,
        *,
        scrub: builtins.list[str] | None = None,
        scrub_defaults: bool = True,
        description: str = "",
        canaries: builtins.list[str] | None = None,
    ) -> ImageInfo:
        """Pack this sandbox's changes into a new image ``name`` (repo:tag) on top of its image (pack_diff).

        The sandbox is frozen while its writable layer is packed and runs on afterwards. Residue (package
        caches, /tmp, shell history, credentials; plus ``scrub`` globs such as ``"work/answers/*"``) is
        left out. New sandboxes can start from ``name`` at once. ``canaries``: strings (8+ bytes) that no
        layer of the new image may hold, its parents' included; if one does, ``ResidueFound`` is raised
        (naming the layer and paths, never the canary) and nothing is published.
        """
        body = {
            "name": name,
            "scrub": scrub or [],
            "scrub_defaults": scrub_defaults,
            "description": description,
            "canaries": canaries or [],
        }

        async def live(headers: dict[str, str]) -> ImageInfo:
            url = f"/v1/sandboxes/{self.id}/snapshot"
            reply = await self._t.request("POST", url, json=body, timeout=CREATE_TIMEOUT, headers=headers)
            return ImageInfo.model_validate_json(reply.content)

        return await self._call(
            "snapshot", lambda: canonical_params(SnapshotRequest, body), None, live, model_result(ImageInfo)
        )

    async def grade(
        self,
        cmd: str | builtins.list[str],
        *,
        paths: builtins.list[str],
        tests: dict[str, str | bytes] | None = None,
        timeout: float = 600.0,
        output_limit: int = DEFAULT_OUTPUT_CAP,
        cwd: str = GRADE_DIR,
        image: str | None = None,
    ) -> GradeResult:
        """Grade this sandbox without trusting anything in it: ``cmd`` runs in a fresh sibling sandbox of
        the exact image version this one started from, against a read-only copy of ``paths`` (this
        sandbox's work, e.g. ``["/workspace"]``), with ``tests`` (path under /grade -> text or bytes)
        placed pristine and read-only under /grade, as uid 65534 with a fixed environment (the platform's
        PATH, no PYTHONPATH, LD_PRELOAD, ...; run Python as ``python3 -I``). The sibling has no network
        and is destroyed afterwards; this sandbox is left as it was. ``.result`` is the command's result.
        """
        files: dict[str, Any] = {}
        for name, content in (tests or {}).items():
            if isinstance(content, bytes):
                files[name] = {"content": base64.b64encode(content).decode(), "encoding": "base64"}
            else:
                files[name] = content
        body: dict[str, Any] = {
            "cmd": cmd,
            "paths": paths,
            "tests": files,
            "timeout": timeout,
            "output_limit": output_limit,
            "cwd": cwd,
            "image": image,
        }
        try:
            GradeRequest.model_validate(body)
        except ValueError as e:
            raise InvalidRequest(validation_message(e)) from None

        async def live(headers: dict[str, str]) -> GradeResult:
            url = f"/v1/sandboxes/{self.id}/grade"
            reply = await self._t.request("POST", url, json=body, timeout=CREATE_TIMEOUT + timeout, headers=headers)
            return GradeResult.model_validate_json(reply.content)

        return await self._call(
            "grade", lambda: canonical_params(GradeRequest, body), None, live, model_result(GradeResult)
        )

    async def pause(self) -> None:
        """Stop every process of the sandbox where it stands (VM kinds: the whole machine) until ``resume()``.

        Refused while a command runs. Its time to live keeps counting.
        """
        reply = await self._t.request("POST", f"/v1/sandboxes/{self.id}/pause")
        self._info = SandboxInfo.model_validate_json(reply.content)

    async def resume(self) -> None:
        """Let a paused sandbox run on (a VM's clock and random state are refreshed)."""
        reply = await self._t.request("POST", f"/v1/sandboxes/{self.id}/resume")
        self._info = SandboxInfo.model_validate_json(reply.content)

    async def fork(
        self,
        n: int = 1,
        *,
        timeout: float | None = None,
        labels: dict[str, str] | None = None,
        checkpoint: str | CheckpointInfo | None = None,
        processes: bool | None = None,
    ) -> Forked[AsyncSandbox]:
        """``n`` new sandboxes, copies of this one; this sandbox is left running (or paused) as it was.

        VM kinds restore each copy from one memory snapshot: same processes, same files, clocks and random
        state refreshed; all or none. Containers: copies of its files (now, or at ``checkpoint``) on shared
        read-only layers with a writable layer each, processes started afresh (``processes=True`` is an
        error there); each copy is made or fails on its own, and the result's ``failed`` lists those that
        failed with their errors. ``timeout``: each copy's time to live (default: this sandbox's);
        ``labels``: theirs (default: its).
        """
        ref = checkpoint.id if isinstance(checkpoint, CheckpointInfo) else checkpoint
        body: dict[str, Any] = {"n": n, "timeout": timeout, "labels": labels, "checkpoint": ref, "processes": processes}
        try:
            ForkRequest.model_validate(body)
        except ValueError as e:
            raise InvalidRequest(validation_message(e)) from None
        reply = await self._t.request("POST", f"/v1/sandboxes/{self.id}/fork", json=body, timeout=CREATE_TIMEOUT)
        result = ForkResult.model_validate_json(reply.content)
        failed = [(f.index, error_from_wire(f.error.code, f.error.message, f.error.detail)) for f in result.failed]
        return Forked([AsyncSandbox(info, self._client) for info in result.sandboxes], failed)

    async def set_network(self, policy: NetworkSpec | dict[str, Any]) -> NetworkStatus:
        """Change the network policy of this running sandbox; new and open connections follow it at once.

        None: loopback only. ``"full"``: anything but the host, the daemon, metadata (169.254.0.0/16) and
        other sandboxes. ``{"allow": [...]}``: only ``CIDR:PORT``, ``IP:PORT`` or ``NAME:PORT`` (PORT a
        number or ``*``), tcp and udp; names resolve through the platform's resolver, which refuses others.
        """
        body = None if policy is None else network_body(policy)

        async def live(headers: dict[str, str]) -> NetworkStatus:
            reply = await self._t.request("PUT", f"/v1/sandboxes/{self.id}/network", json=body, headers=headers)
            return NetworkStatus.model_validate_json(reply.content)

        return await self._call("set_network", {"policy": body}, None, live, model_result(NetworkStatus))

    async def network_status(self) -> NetworkStatus:
        """The policy in force, the sandbox's address, denied packets and DNS queries, what it may reach now."""
        reply = await self._t.request("GET", f"/v1/sandboxes/{self.id}/network")
        return NetworkStatus.model_validate_json(reply.content)

    async def expose(self, port: int, protocol: Literal["http"] = "http") -> str:
        """The URL at which a server on ``port`` of the sandbox's loopback is reached (HTTP), through the
        daemon, with a secret of the port's own in it (never this client's token): hand it to anything.
        The same URL again for a port already exposed; it stops working when the sandbox ends."""
        body = ExposeRequest(port=port, protocol=protocol).model_dump()
        reply = await self._t.request("POST", f"/v1/sandboxes/{self.id}/ports", json=body)
        return self._t.public_url(ExposedPort.model_validate_json(reply.content).path)

    async def unexpose(self, port: int) -> None:
        """The port's URL stops working (connections open through it stay until they close)."""
        await self._t.request("DELETE", f"/v1/sandboxes/{self.id}/ports/{port}")

    async def kill(self) -> None:
        """Stop the sandbox and free everything it holds. Killing a stopped sandbox is not an error."""

        async def live(headers: dict[str, str]) -> SandboxInfo:
            reply = await self._t.request("DELETE", f"/v1/sandboxes/{self.id}", headers=headers)
            return SandboxInfo.model_validate_json(reply.content)

        self._info = await self._call("kill", {}, None, live, model_result(SandboxInfo))

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.kill()
