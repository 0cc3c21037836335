"""One-shot runs from the SDK: ``AsyncClient.run``, ``run_many`` and ``pools`` (a mixin of AsyncClient,
so the blocking ``Client`` gets them too)."""

from __future__ import annotations

import builtins
from typing import Any, Literal

from ..errors import DsecError, InvalidRequest, error_from_wire, validation_message
from ..protocol.network import NetworkSpec
from ..protocol.run import RUN_DIR, PoolInfo, PoolList, RunBatch, RunBatchResult, RunRequest, RunResult
from ..protocol.sandbox import DEFAULT_OUTPUT_CAP
from .transport import Transport

RUN_MARGIN = 120.0  # on top of the command's timeout: taking a worker, writing files, the reply


class RunClient:
    _transport: Transport

    async def run(
        self,
        image: str = "dsec/debian:12",
        command: str | list[str] | None = None,
        *,
        code: str | None = None,
        language: Literal["python", "bash", "sh"] = "python",
        stdin: str | None = None,
        files: dict[str, str | bytes] | None = None,
        cwd: str = RUN_DIR,
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
        idle_timeout: float | None = None,
        output_limit: int = DEFAULT_OUTPUT_CAP,
        user: str | None = None,
        kind: str = "function",
        limits: dict[str, Any] | None = None,
        network: NetworkSpec | dict[str, Any] = None,
    ) -> RunResult:
        """Run ``command`` (a string for /bin/sh -c, or an argv) or ``code`` (in ``language``) once, in a
        sandbox that exists only for this call: by default a warm worker of the function kind, reset
        and verified before anyone else gets it. ``files`` are written first (relative paths under
        ``cwd``, which is /tmp: emptied between uses). Returns the command's result; a command that
        fails is a result with its exit code, not an exception."""
        req = _request(
            image=image,
            command=command,
            code=code,
            language=language,
            stdin=stdin,
            files=files,
            cwd=cwd,
            env=env,
            timeout=timeout,
            idle_timeout=idle_timeout,
            output_limit=output_limit,
            user=user,
            kind=kind,
            limits=limits,
            network=network,
        )
        reply = await self._transport.request(
            "POST", "/v1/run", json=req.model_dump(mode="json"), timeout=timeout + RUN_MARGIN
        )
        return RunResult.model_validate_json(reply.content)

    async def run_many(
        self, runs: builtins.list[RunRequest | dict[str, Any]], concurrency: int = 64
    ) -> builtins.list[RunResult | DsecError]:
        """Many one-shot runs in one request, ``concurrency`` in flight on the daemon. Each element of
        ``runs`` takes the keyword arguments of ``run`` (``files`` as text). Returns, in order, each
        run's result or the error that kept it from running (not raised: the others still count)."""
        try:
            reqs = [r if isinstance(r, RunRequest) else _request(**r) for r in runs]
            batch = RunBatch(runs=reqs, concurrency=concurrency)
        except (TypeError, ValueError) as e:
            raise InvalidRequest(validation_message(e) if isinstance(e, ValueError) else str(e)) from None
        longest = max(r.timeout for r in reqs)
        waves = -(-len(reqs) // concurrency)
        reply = await self._transport.request(
            "POST", "/v1/run/batch", json=batch.model_dump(mode="json"), timeout=waves * (longest + RUN_MARGIN)
        )
        out: builtins.list[RunResult | DsecError] = []
        for o in RunBatchResult.model_validate_json(reply.content).outcomes:
            if o.result is not None:
                out.append(o.result)
            else:
                assert o.error is not None
                out.append(error_from_wire(o.error.code, o.error.message, o.error.detail))
        return out

    async def pools(self) -> builtins.list[PoolInfo]:
        """The warm pools of function workers: sizes, hits and misses, resets and rejections."""
        reply = await self._transport.request("GET", "/v1/pools")
        return PoolList.model_validate_json(reply.content).pools


def _request(files: dict[str, str | bytes] | None = None, **kwargs: Any) -> RunRequest:
    body: dict[str, Any] = {k: v for k, v in kwargs.items() if v is not None}
    if files:
        body["files"] = {
            p: {"content": _b64(c), "encoding": "base64"} if isinstance(c, bytes) else c for p, c in files.items()
        }
    try:
        return RunRequest.model_validate(body)
    except ValueError as e:
        raise InvalidRequest(validation_message(e)) from None


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()
