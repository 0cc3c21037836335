"""A client for OCI registries (the Distribution / Docker Registry HTTP API v2).

- ``reference``: image references read as Docker reads them.
- ``manifest``: manifests, indexes and image configs; choosing a platform from an index.
- ``hosts``: where requests go (mirrors first), TLS or plain HTTP, CA bundles per host.
- ``auth``: credentials (explicit, or a Docker config.json), challenges, the bearer-token flow.
- ``transport``: one authorised, redirected, retried request with a deadline.
- ``blobs``: blobs streamed and verified, resumed after a dropped connection, downloaded atomically.
- ``client``: ``RegistryClient``, which puts them together.
- ``options``: ``RegistryOptions``, a node's registry configuration, which makes its clients.
"""

from .auth import Credentials, CredentialStore
from .blobs import BlobDownload, BlobProgress
from .client import FetchedManifest, RegistryClient, ResolvedImage
from .hosts import RegistryHosts
from .manifest import LINUX_AMD64, Descriptor, ImageConfigFile, ImageIndex, ImageManifest, Platform
from .options import RegistryOptions
from .reference import Reference, parse_reference
from .transport import RetryPolicy, Timeouts

__all__ = [
    "LINUX_AMD64",
    "BlobDownload",
    "BlobProgress",
    "CredentialStore",
    "Credentials",
    "Descriptor",
    "FetchedManifest",
    "ImageConfigFile",
    "ImageIndex",
    "ImageManifest",
    "Platform",
    "Reference",
    "RegistryClient",
    "RegistryHosts",
    "RegistryOptions",
    "ResolvedImage",
    "RetryPolicy",
    "Timeouts",
    "parse_reference",
]
