"""How a node reaches registries: credentials, mirrors, hosts allowed plain HTTP, CA bundles.

One ``RegistryOptions`` per node, given to the ImageStore (``dsec serve`` fills it from its flags). The
explicit parts are checked when the options are made, so a malformed mirror or a missing CA bundle stops the
daemon at start; the Docker config is read at the first pull, so a config.json that dsec cannot use only
matters to pulls that need it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ...errors import InvalidRequest
from .auth import Credentials, CredentialStore
from .client import RegistryClient
from .hosts import RegistryHosts
from .transport import RetryPolicy, Timeouts

__all__ = ["RegistryOptions"]

MAX_PARALLEL_LAYERS = 16


@dataclass(frozen=True)
class RegistryOptions:
    """``credentials``: ``{host: "user:password"}`` (or a pair), winning host by host over the Docker config.
    ``docker_config``: a config.json to read; None reads ``$DOCKER_CONFIG/config.json`` or
    ``~/.docker/config.json`` when there is one, and ``use_docker_config=False`` reads none. ``mirrors``:
    ``registry=url``, tried in order before the registry. ``insecure``: hosts (``host``, ``host:port``, a CIDR
    range) that may be spoken to in plain HTTP besides loopback ones. ``ca_files``: a CA bundle per host.
    ``parallel_layers``: layers fetched and converted at once on the node. ``max_sparse_bytes``: the sizes a
    pulled layer's sparse files may claim in all (packing reads their holes: ~7 s per GiB here)."""

    credentials: Mapping[str, str | tuple[str, str]] = field(default_factory=dict)
    docker_config: Path | None = None
    use_docker_config: bool = True
    mirrors: tuple[str, ...] = ()
    insecure: tuple[str, ...] = ()
    # the registries this node may pull from (host or host:port; docker.io for Docker Hub); None: any
    allowed: tuple[str, ...] | None = None
    ca_files: Mapping[str, Path] = field(default_factory=dict)
    parallel_layers: int = 3
    max_sparse_bytes: int = 1 << 30  # what a pulled layer's sparse files may claim, holes included
    retry: RetryPolicy | None = None
    timeouts: Timeouts | None = None
    # the network itself, replaced in-process (unit tests answer requests with an httpx.MockTransport)
    transport: httpx.AsyncBaseTransport | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 1 <= self.parallel_layers <= MAX_PARALLEL_LAYERS:
            raise InvalidRequest(f"parallel layers must be 1 to {MAX_PARALLEL_LAYERS}, not {self.parallel_layers}")
        self.hosts()
        self.explicit_credentials()

    def allows(self, registry: str) -> bool:
        return self.allowed is None or registry in self.allowed or registry.split(":")[0] in self.allowed

    def hosts(self) -> RegistryHosts:
        return RegistryHosts.from_options(mirrors=self.mirrors, insecure=self.insecure, ca_files=self.ca_files)

    def explicit_credentials(self) -> CredentialStore:
        entries: dict[str, str | tuple[str, str] | Credentials] = dict(self.credentials)
        return CredentialStore.from_mapping(entries)

    def credential_store(self) -> CredentialStore:
        """The Docker config's credentials (if it is to be read) under the explicit ones."""
        explicit = self.explicit_credentials()
        if not self.use_docker_config:
            return explicit
        return CredentialStore.from_docker_config(self.docker_config).merged(explicit)

    def client(self) -> RegistryClient:
        return RegistryClient(
            hosts=self.hosts(),
            credentials=self.credential_store(),
            timeouts=self.timeouts,
            retry=self.retry,
            transport=self.transport,
        )
