"""Real OCI registries for tests: Debian's ``docker-registry`` (Distribution 2.8) on a free loopback port,
with its own config and storage in a temporary directory, plain or with TLS (a CA made here with openssl),
with htpasswd or token authentication (a token service run here, signing JWTs with a key whose certificate
the registry trusts); and images written here as OCI layouts and pushed with ``skopeo``.

A facility that is not installed makes the test skip with the package to install, which under CI
(``CI=true``, tests/conftest.py) is a failure. The registry gets a parent-death signal, so a killed test
run does not leave it running; it must therefore be started from the main thread (pytest's), which lives
as long as the run.
"""

from __future__ import annotations

import base64
import ctypes
import gzip
import hashlib
import io
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import tarfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
import pytest

from .conftest import free_port

REGISTRY_BIN = "/usr/bin/docker-registry"
_PACKAGES = {
    REGISTRY_BIN: "docker-registry",
    "skopeo": "skopeo",
    "htpasswd": "apache2-utils",
    "openssl": "openssl",
    "podman": "podman",
}


def need(tool: str) -> str:
    """The path of ``tool``; a skip naming its Debian package when it is not installed."""
    path = tool if Path(tool).is_absolute() and os.access(tool, os.X_OK) else shutil.which(tool)
    if not path:
        pytest.skip(f"{tool} is not installed (apt-get install {_PACKAGES.get(tool, tool)})")
    return path


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _run(
    argv: list[str], *, input: bytes | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    done = subprocess.run(argv, input=input, env=env, capture_output=True, timeout=120, check=False)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(argv[:3])} failed ({done.returncode}): {done.stderr.decode(errors='replace')[-2000:]}")
    return done


# ---- TLS and htpasswd -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tls:
    ca: Path  # the CA certificate clients are given
    cert: Path  # the registry's certificate, for 127.0.0.1 and localhost, signed by the CA
    key: Path


def make_tls(directory: Path) -> Tls:
    openssl = need("openssl")
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / "ca.crt", directory / "ca.key"
    cert, key, csr = directory / "server.crt", directory / "server.key", directory / "server.csr"
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _run([openssl, "req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
          "-subj", "/CN=dsec test CA", "-addext", "basicConstraints=critical,CA:TRUE",
          "-addext", "keyUsage=critical,keyCertSign,cRLSign"])  # fmt: skip
    _run([openssl, "req", *ec, "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1"])
    ext = directory / "server.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _run([openssl, "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
          "-out", str(cert), "-days", "2", "-extfile", str(ext)])  # fmt: skip
    return Tls(ca, cert, key)


def htpasswd(directory: Path, users: dict[str, str]) -> Path:
    tool = need("htpasswd")
    path = directory / "htpasswd"
    lines = [_run([tool, "-Bbn", user, password]).stdout.decode().strip() for user, password in users.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- a token service --------------------------------------------------------------------------------------


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def libtrust_key_id(der_public_key: bytes) -> str:
    """The key id Distribution looks a token's signing key up by: base32 of the first 240 bits of the
    sha256 of the DER public key, in groups of four."""
    encoded = base64.b32encode(hashlib.sha256(der_public_key).digest()[:30]).decode().rstrip("=")
    return ":".join(encoded[i : i + 4] for i in range(0, len(encoded), 4))


@dataclass
class TokenService:
    """Docker's token flow, server side: Basic credentials (or none) in, a signed JWT out.

    A known user gets what it asks for on every repository; anonymous callers get pull on repositories under
    ``public/`` and nothing else (the registry then refuses them). Every request is recorded."""

    directory: Path
    users: dict[str, str]
    issuer: str = "dsec-test-issuer"
    service: str = "dsec-test-registry"
    requests: list[tuple[str, list[str]]] = field(default_factory=list)  # (user or "", scopes)

    def __post_init__(self) -> None:
        openssl = need("openssl")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.key, self.cert = self.directory / "token.key", self.directory / "token.crt"
        _run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(self.key), "-out",
              str(self.cert), "-days", "2", "-subj", "/CN=dsec test token issuer"])  # fmt: skip
        der = _run([openssl, "pkey", "-in", str(self.key), "-pubout", "-outform", "DER"]).stdout
        self.kid = libtrust_key_id(der)
        self._openssl = openssl
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/token"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def sign(self, claims: dict[str, object]) -> str:
        header = {"typ": "JWT", "alg": "RS256", "kid": self.kid}
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        signature = _run([self._openssl, "dgst", "-sha256", "-sign", str(self.key)], input=signing_input.encode())
        return f"{signing_input}.{_b64url(signature.stdout)}"

    def _grant(self, user: str, scope: str) -> dict[str, object] | None:
        kind, _, rest = scope.partition(":")
        name, _, actions = rest.rpartition(":")
        if kind != "repository" or not name:
            return None
        asked = set(actions.split(","))
        allowed = asked if user else (asked & {"pull"} if name.startswith("public/") else set())
        return {"type": "repository", "name": name, "actions": sorted(allowed)}

    def _answer(self, authorization: str | None, query: dict[str, list[str]]) -> tuple[int, dict[str, object]]:
        user = ""
        if authorization:
            try:
                user, _, password = base64.b64decode(authorization.removeprefix("Basic ")).decode().partition(":")
            except ValueError:
                return 401, {"details": "malformed credentials"}
            if self.users.get(user) != password:
                return 401, {"details": "wrong user or password"}
        scopes = query.get("scope", [])
        self.requests.append((user, scopes))
        now = int(time.time())
        access = [g for g in (self._grant(user, s) for s in scopes) if g is not None]
        claims = {"iss": self.issuer, "sub": user, "aud": self.service, "exp": now + 300, "nbf": now - 10,
                  "iat": now, "jti": os.urandom(8).hex(), "access": access}  # fmt: skip
        return 200, {"token": self.sign(claims), "expires_in": 300}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urlparse(self.path)
                if url.path != "/token":
                    self.send_error(404)
                    return
                status, body = service._answer(self.headers.get("Authorization"), parse_qs(url.query))
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler


# ---- the registry -----------------------------------------------------------------------------------------


_ACCESS = re.compile(r'"(GET|HEAD|PUT|POST|PATCH|DELETE) (\S+) HTTP/[0-9.]+"')


@dataclass
class Registry:
    directory: Path
    port: int
    tls: Tls | None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}"

    @property
    def log(self) -> Path:
        return self.directory / "registry.log"

    def requests(self) -> list[str]:
        """``METHOD /path`` of every request logged so far (with ``access_log``), in order."""
        found = []
        for line in self.log.read_text(errors="replace").splitlines():
            m = _ACCESS.search(line)
            if m is not None:
                found.append(f"{m[1]} {m[2]}")
        return found

    def blob_file(self, digest: str) -> Path:
        """Where the registry stores a blob (to damage it on purpose)."""
        hex_ = digest.removeprefix("sha256:")
        return self.directory / "storage/docker/registry/v2/blobs/sha256" / hex_[:2] / hex_ / "data"

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [REGISTRY_BIN, "serve", str(self.directory / "config.yml")],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env={"PATH": "/usr/bin:/bin", "HOME": str(self.directory)},  # no REGISTRY_* from outside
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + 30
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(self.tls.ca)) if self.tls else True
        while True:
            try:
                if httpx.get(f"{self.url}/v2/", verify=verify, timeout=2).status_code in (200, 401):
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"docker-registry did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a crash: whatever it was sending breaks off."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def start_registry(
    directory: Path, *, tls: Tls | None = None, auth: Mapping[str, object] | None = None, access_log: bool = False
) -> Registry:
    """A registry on a free loopback port, storing under ``directory``; ``auth`` is the config's auth section.
    ``access_log``: one line per request in ``registry.log`` (``Registry.requests`` reads them)."""
    need(REGISTRY_BIN)
    directory.mkdir(parents=True, exist_ok=True)
    registry = Registry(directory, free_port(), tls)
    http: dict[str, object] = {"addr": registry.host, "secret": "dsec-test-secret"}
    if tls is not None:
        http["tls"] = {"certificate": str(tls.cert), "key": str(tls.key)}
    config: dict[str, object] = {
        "version": "0.1",
        "log": {"level": "warn", "accesslog": {"disabled": not access_log}},
        "storage": {
            "filesystem": {"rootdirectory": str(directory / "storage")},
            "delete": {"enabled": True},
            "maintenance": {"uploadpurging": {"enabled": False}},
        },
        "http": http,
        "health": {"storagedriver": {"enabled": False}},
    }
    if auth is not None:
        config["auth"] = dict(auth)
    # YAML is a superset of JSON: no YAML writer needed
    (directory / "config.yml").write_text(json.dumps(config, indent=1))
    registry.start()
    return registry


# ---- images: OCI layouts written here, pushed with skopeo -------------------------------------------------

LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Layer:
    blob: bytes  # as stored: a tar, or a gzip of it
    tar: bytes
    media_type: str

    @property
    def digest(self) -> str:
        return sha256(self.blob)

    @property
    def diff_id(self) -> str:
        return sha256(self.tar)


def layer(files: dict[str, bytes], *, gzipped: bool, level: int = 6) -> Layer:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 1_700_000_000
            tar.addfile(info, io.BytesIO(data))
    tar_bytes = buf.getvalue()
    if not gzipped:
        return Layer(tar_bytes, tar_bytes, LAYER_TAR)
    return Layer(gzip.compress(tar_bytes, compresslevel=level, mtime=0), tar_bytes, LAYER_GZIP)


class OciLayout:
    """An OCI image layout directory: blobs, and index.json naming what it holds."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        (directory / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
        (directory / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        self.entries: list[dict[str, object]] = []

    def blob(self, data: bytes, media_type: str) -> dict[str, object]:
        digest = sha256(data)
        (self.directory / "blobs" / "sha256" / digest.removeprefix("sha256:")).write_bytes(data)
        return {"mediaType": media_type, "digest": digest, "size": len(data)}

    def image(self, layers: list[Layer], *, architecture: str = "amd64") -> dict[str, object]:
        """A manifest (and its config) over ``layers``: its descriptor, with its platform."""
        for item in layers:
            self.blob(item.blob, item.media_type)
        config = {
            "architecture": architecture,
            "os": "linux",
            "config": {"Env": ["PATH=/usr/bin:/bin"], "Cmd": ["/bin/sh"], "WorkingDir": "/work"},
            "rootfs": {"type": "layers", "diff_ids": [item.diff_id for item in layers]},
        }
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": self.blob(json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json"),
            "layers": [{"mediaType": x.media_type, "digest": x.digest, "size": len(x.blob)} for x in layers],
        }
        desc = self.blob(json.dumps(manifest).encode(), OCI_MANIFEST)
        return {**desc, "platform": {"architecture": architecture, "os": "linux"}}

    def index(self, manifests: list[dict[str, object]]) -> dict[str, object]:
        return self.blob(
            json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests}).encode(), OCI_INDEX
        )

    def name(self, desc: dict[str, object], ref: str) -> None:
        entry = {k: v for k, v in desc.items() if k != "platform"}
        self.entries.append({**entry, "annotations": {"org.opencontainers.image.ref.name": ref}})
        index = {"schemaVersion": 2, "manifests": self.entries}
        (self.directory / "index.json").write_text(json.dumps(index))


def push(
    layout: OciLayout,
    ref: str,
    registry: Registry,
    repository: str,
    *,
    creds: str | None = None,
    multi: bool = False,
    docker_format: bool = False,
) -> None:
    """``skopeo copy`` of the layout's image ``ref`` to ``repository`` (with its tag) on ``registry``,
    keeping the blobs as written (no recompression), so their digests are the layout's."""
    skopeo = need("skopeo")
    work = registry.directory / "skopeo"
    work.mkdir(exist_ok=True)
    argv = [skopeo, "--insecure-policy", "copy", "--quiet", "--retry-times", "0"]
    argv += ["--all"] if multi else []
    argv += ["--format", "v2s2"] if docker_format else ["--preserve-digests"]
    if registry.tls is not None:
        certs = work / "certs"
        certs.mkdir(exist_ok=True)
        shutil.copy(registry.tls.ca, certs / "ca.crt")
        argv += ["--dest-cert-dir", str(certs)]
    else:
        argv += ["--dest-tls-verify=false"]
    argv += ["--dest-creds", creds] if creds else []
    argv += [f"oci:{layout.directory}:{ref}", f"docker://{registry.host}/{repository}"]
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(work),
        "TMPDIR": str(work),
        "REGISTRY_AUTH_FILE": str(work / "auth.json"),
    }
    _run(argv, env=env)
