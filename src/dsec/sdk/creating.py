"""Creating sandboxes from the SDK: the request body, waiting out a full node, and batches.

A node that has no capacity answers 429 (``Overloaded``) with Retry-After once a creation has waited
its queue deadline. The SDK waits as told and asks again, up to ``wait_for_capacity`` seconds in all,
so trainers need no rate limiter of their own; nothing is left behind by the refused ones (the node
creates nothing it has not admitted), and every retry carries the same Idempotency-Key: a creation
whose answer was lost is answered again, not made twice.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ..errors import DsecError, InvalidRequest, Overloaded, error_from_wire, validation_message
from ..protocol.names import PullPolicy
from ..protocol.network import NetworkAllow, NetworkDeny, NetworkSpec
from ..protocol.node import BatchCreate, BatchEvent
from ..protocol.sandbox import CreateSandbox, Limits, OnTimeout, SandboxInfo
from .transport import Transport, new_key

log = logging.getLogger("dsec.sdk")

CREATE_TIMEOUT = 1800.0  # the first use of a built-in image builds it
DEFAULT_WAIT_FOR_CAPACITY = 600.0


def network_body(policy: NetworkSpec | dict[str, Any]) -> Any:
    """A policy as JSON, validated here for a clear error before the round trip."""
    if policy == "full":
        return "full"
    try:
        raw = policy.model_dump() if isinstance(policy, NetworkAllow | NetworkDeny) else policy
        if isinstance(raw, dict) and "deny" in raw:
            return NetworkDeny.model_validate(raw).model_dump()
        return NetworkAllow.model_validate(raw).model_dump()
    except ValueError as e:
        raise InvalidRequest(validation_message(e)) from None


def create_body(
    image: str,
    kind: str,
    limits: dict[str, Any],
    timeout: float,
    env: dict[str, str] | None,
    labels: dict[str, str] | None,
    network: NetworkSpec | dict[str, Any],
    trajectory: str | None,
    queue_timeout: float | None,
    volumes: Mapping[str, str | tuple[str, str]] | None = None,
    pull: PullPolicy = "if-not-present",
    on_timeout: OnTimeout = "stop",
) -> dict[str, Any]:
    """The JSON of a CreateSandbox, validated locally for a clear error before the round trip."""
    limits = {k: v for k, v in limits.items() if v is not None}
    body: dict[str, Any] = {"image": image, "kind": kind, "timeout": timeout, "env": env or {}, "labels": labels or {}}
    if network is not None:
        body["network"] = network_body(network)
    if trajectory is not None:
        body["trajectory"] = trajectory
    if queue_timeout is not None:
        body["queue_timeout"] = queue_timeout
    if pull != "if-not-present":  # the default is left out: a node from before pull policies accepts the body
        body["pull"] = pull
    if on_timeout != "stop":  # likewise
        body["on_timeout"] = on_timeout
    if limits:
        body["limits"] = limits
    if volumes:
        body["volumes"] = {path: ref if isinstance(ref, str) else list(ref) for path, ref in volumes.items()}
    try:
        CreateSandbox.model_validate({**body, "limits": Limits.model_validate(limits)})
    except ValueError as e:
        raise InvalidRequest(validation_message(e)) from None
    return body


async def post_create(transport: Transport, body: dict[str, Any], wait_for_capacity: float) -> SandboxInfo:
    """POST the creation; on 429, wait as the node says (with jitter) and retry until the budget is spent."""
    deadline = time.monotonic() + wait_for_capacity
    # giving up on the answer cancels the creation in the daemon: wait out the queue it may wait in too
    timeout = CREATE_TIMEOUT + float(body.get("queue_timeout") or 0)
    key = new_key()  # one creation, however many times it is asked for: never two sandboxes
    while True:
        try:
            reply = await transport.request("POST", "/v1/sandboxes", json=body, timeout=timeout, idempotency_key=key)
            return SandboxInfo.model_validate_json(reply.content)
        except Overloaded as e:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            # spread the retries of a burst refused at once, so they do not all come back together
            delay = min(left, e.retry_after * random.uniform(0.8, 1.5))
            log.info("node overloaded (%s); retrying the creation in %.1f s", e.message, delay)
            await asyncio.sleep(delay)


async def stream_batch(
    transport: Transport, body: dict[str, Any], count: int, trajectories: list[str] | None
) -> AsyncIterator[BatchEvent]:
    """The batch's events as the daemon sends them (one per sandbox, then the summary)."""
    request: dict[str, Any] = {"count": count, "sandbox": body}
    if trajectories is not None:
        request["trajectories"] = trajectories
    try:
        BatchCreate.model_validate(request)
    except ValueError as e:
        raise InvalidRequest(validation_message(e)) from None
    async with transport.stream("POST", "/v1/sandboxes/batch", json=request, timeout=CREATE_TIMEOUT) as reply:
        async for line in reply.aiter_lines():
            if line.strip():
                yield BatchEvent.model_validate_json(line)


def batch_error(event: BatchEvent) -> DsecError:
    """The error a failed sandbox of a batch would have raised on its own, with ``index`` set."""
    assert event.error is not None
    err = error_from_wire(event.error.code, event.error.message, event.error.detail)
    err.index = event.index
    return err
