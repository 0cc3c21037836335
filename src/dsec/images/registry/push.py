"""Writing to a registry (Distribution API): a blob unless the repository has it already (HEAD), uploaded
in one PUT after the upload session's POST; then the manifest under the tag. Pushes go to the registry
itself, never a mirror, authorised for ``pull,push`` on the repository.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator, Callable

import httpx

from ...errors import DigestMismatch, DsecError, NotFound, RegistryError
from .hosts import Endpoint
from .reference import Reference
from .transport import Body, RegistryAnswer, Transport

log = logging.getLogger(__name__)

UPLOAD_SECONDS = 3600.0  # the deadline of one blob's PUT (its whole body goes in that request)


def _scope(ref: Reference) -> str:
    return f"repository:{ref.repository}:pull,push"


def _missing(what: str, endpoint: Endpoint) -> Callable[[RegistryAnswer], DsecError]:
    def make(answer: RegistryAnswer) -> DsecError:
        return NotFound(f"{what} is not at {endpoint.label()}")

    return make


def _refused(what: str, endpoint: Endpoint) -> Callable[[RegistryAnswer], DsecError]:
    def make(answer: RegistryAnswer) -> DsecError:
        said = f": {answer.text}" if answer.text else ""
        return RegistryError(f"{endpoint.label()} answered 404 to {what} (no such repository?){said}")

    return make


class Pusher:
    """Blobs and a manifest into one repository of one registry."""

    def __init__(self, http: Transport, ref: Reference) -> None:
        self.http = http
        self.ref = ref
        self.endpoint = http.hosts.endpoints(ref.registry)[-1]  # the registry itself: mirrors only serve pulls

    async def has_blob(self, digest: str) -> bool:
        what = f"blob {digest} of {self.ref.repository}"

        async def once() -> bool:
            try:
                async with self.http.attempt(
                    self.endpoint,
                    f"/v2/{self.ref.repository}/blobs/{digest}",
                    scope=_scope(self.ref),
                    headers={},
                    what=what,
                    not_found=_missing(what, self.endpoint),
                    method="HEAD",
                ):
                    return True
            except NotFound:
                return False

        return await self.http.retrying(once, f"checking {what}")

    async def _send(
        self, path: str, what: str, method: str, headers: dict[str, str], body: Body, seconds: float | None = None
    ) -> httpx.Headers:
        """One write, authorised; the answer's headers (a 404 means the repository cannot take it)."""
        async with self.http.attempt(
            self.endpoint,
            path,
            scope=_scope(self.ref),
            headers=headers,
            what=what,
            not_found=_refused(what, self.endpoint),
            method=method,
            body=body,
            seconds=seconds,
        ) as answer:
            return answer.headers

    async def upload_blob(self, digest: str, size: int, body: Callable[[], AsyncIterator[bytes] | bytes]) -> None:
        """Upload a blob (``body`` gives its bytes afresh for each try): a session, then one PUT."""
        what = f"upload of blob {digest} to {self.ref.repository}"

        async def once() -> None:
            started = await self._send(
                f"/v2/{self.ref.repository}/blobs/uploads/", what, "POST", {"Content-Length": "0"}, lambda: b""
            )
            location = started.get("location")
            if not location:
                raise RegistryError(f"{self.endpoint.label()} started the {what} without saying where (no Location)")
            url = httpx.URL(await self.http.base_url(self.endpoint)).join(location)
            self.http.check_url(url, f"{self.endpoint.label()} sent the upload to")
            url = url.copy_merge_params({"digest": digest})
            headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
            said = (await self._send(str(url), what, "PUT", headers, body, UPLOAD_SECONDS)).get("docker-content-digest")
            if said and said != digest:
                raise DigestMismatch(f"{self.endpoint.label()} stored the {what} as {said}")

        await self.http.retrying(once, what)

    async def put_manifest(self, tag: str, data: bytes, media_type: str) -> str:
        """Put the manifest under ``tag``; its digest."""
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        what = f"manifest {tag} of {self.ref.repository}"
        payload: Body = lambda: data  # noqa: E731 - sent afresh if a challenge is answered

        async def once() -> None:
            path = f"/v2/{self.ref.repository}/manifests/{tag}"
            said = (await self._send(path, what, "PUT", {"Content-Type": media_type}, payload)).get(
                "docker-content-digest"
            )
            if said and said != digest:
                raise DigestMismatch(f"{self.endpoint.label()} stored {what} as {said}, not {digest}")

        await self.http.retrying(once, what)
        log.info("pushed %s:%s (%s)", self.ref.repository, tag, digest)
        return digest
