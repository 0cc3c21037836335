"""A node daemon per Ray node: a Ray actor on each node starts ``dsec serve`` there and looks after it.

Placement is Ray's own: each actor is pinned to its node with ``NodeAffinitySchedulingStrategy``
(hard affinity), and on clusters whose nodes advertise the custom resource ``dsec_node`` (``ray start
--resources '{"dsec_node": 1}'``) only those nodes get one, each actor holding that resource, so no
node ever runs two. ``--label KEY=VALUE`` narrows the nodes further by Ray node labels. The actor asks
for no CPU: the daemon's sandboxes are accounted by the daemon's own admission, not by Ray.

The daemon is a child of the actor's process that dies with it (``PR_SET_PDEATHSIG``), so a Ray node
that goes away takes its daemon along, as a machine that goes away would; the daemon's state directory
is ``STATE_ROOT/NAME`` on that node, NAME the node's ``dsec-node-name`` label or its Ray id.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidRequest
from .options import RayOptions

try:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as e:  # the optional extra: `pip install 'dsec[cluster]'`
    raise InvalidRequest(
        f"`dsec cluster` needs Ray, which is not installed here ({e}): pip install 'dsec[cluster]'"
    ) from None

log = logging.getLogger("dsec.cluster")

RESOURCE = "dsec_node"
NAME_LABEL = "dsec-node-name"
START_TIMEOUT = 120.0  # a daemon's first start may build its kinds' helpers
STOP_TIMEOUT = 30.0
# Run in the daemon's place before exec: die with the actor (SIGKILL when the actor's thread exits),
# and give up if the actor is already gone. Not a preexec_fn: the actor's process has threads.
_LAUNCH = (
    "import ctypes,os,signal,sys;"
    "ctypes.CDLL(None,use_errno=True).prctl(1,signal.SIGKILL,0,0,0);"  # 1: PR_SET_PDEATHSIG
    "os.getppid()==int(sys.argv[1]) or os._exit(70);"
    "os.execv(sys.argv[2],sys.argv[2:])"
)


def ray_nodes() -> list[dict[str, Any]]:
    """Every node Ray knows, as ``ray_nodes()`` describes them (NodeID, Alive, Resources, Labels...)."""
    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return nodes


def _free_port(ip: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        port: int = s.getsockname()[1]
        return port


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        return path.read_bytes()[-limit:].decode(errors="replace")
    except OSError:
        return ""


class NodeDaemon:
    """The actor (made remote by ``Fleet``): one ``dsec serve`` on its node."""

    def __init__(self, name: str, state_root: str, token: str, args: list[str], e2b: bool = False) -> None:
        self.name = name
        self.state_dir = Path(state_root) / name
        self.token = token
        self.args = args
        self.e2b = e2b  # also serve the E2B API, on this node's address (the gateway finds it in the status)
        self.e2b_port = 0
        self.port = 0
        self.ip = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> dict[str, str]:
        self.ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o711)  # as `dsec serve` makes it: crun must traverse it
        token_file = self.state_dir / "token"
        with contextlib.suppress(FileNotFoundError):
            if token_file.read_text().strip() != self.token:
                token_file.unlink()  # the cluster's token is every node's
        if not token_file.exists():
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.token + "\n")
        self.port = self.port or _free_port(self.ip)
        if self.e2b:
            self.e2b_port = self.e2b_port or _free_port(self.ip)
        self._spawn()
        return {"name": self.name, "url": self.url(), "ray_node": ray.get_runtime_context().get_node_id()}

    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"

    def _spawn(self) -> None:
        log_path = self.state_dir / "daemon.log"
        argv = [sys.executable, "-m", "dsec", "serve", "--state-dir", str(self.state_dir)]
        argv += ["--listen", self.url(), "--node-name", self.name, *self.args]
        if self.e2b:
            argv += ["--e2b-listen", f"http://{self.ip}:{self.e2b_port}"]
        with open(log_path, "ab") as out:
            # a session of its own: a Ctrl-C at a terminal reaches the CLI, which stops daemons in order
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _LAUNCH, str(os.getpid()), *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"node daemon {self.name} exited ({self.proc.returncode}): {_tail(log_path)}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(f"{self.url()}/v1/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError(f"node daemon {self.name} did not answer within {START_TIMEOUT:.0f} s: {_tail(log_path)}")

    def poll(self) -> int | None:
        """The daemon's exit status, None while it runs."""
        return None if self.proc is None else self.proc.poll()

    def restart(self) -> str:
        """Start the daemon again on the same state directory and port (it re-adopts its sandboxes)."""
        self._spawn()
        return self.url()

    def stop(self, kill_sandboxes: bool = True) -> None:
        if self.proc is None:
            return
        if kill_sandboxes and self.proc.poll() is None:
            self._kill_sandboxes()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if kill_sandboxes:  # nothing runs on them now: the layer fetcher and mounts go too
            _release(self.state_dir)

    def _kill_sandboxes(self) -> None:
        import json

        headers = {"Authorization": f"Bearer {self.token}"}
        try:
            req = urllib.request.Request(f"{self.url()}/v1/sandboxes", headers=headers)
            with urllib.request.urlopen(req, timeout=30) as reply:
                ids = [s["id"] for s in json.loads(reply.read())["sandboxes"]]
        except (OSError, ValueError, KeyError) as e:
            log.warning("node %s: could not list its sandboxes to kill them: %s", self.name, e)
            return
        for sid in ids:
            with contextlib.suppress(OSError):
                kill = urllib.request.Request(f"{self.url()}/v1/sandboxes/{sid}", headers=headers, method="DELETE")
                urllib.request.urlopen(kill, timeout=30).close()


def _release(state_dir: Path) -> None:
    """What a daemon leaves running on purpose so its sandboxes survive a restart: the layer fetcher
    and the layer mounts (released once the node's sandboxes are gone)."""
    from ..isolation.mounts import unmount_under

    with contextlib.suppress(OSError, ValueError):
        pid = int((state_dir / "images" / "fetcher" / "fetcher.pid").read_text().strip())
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        unmount_under(state_dir)


@dataclass
class Daemon:
    name: str
    url: str
    ray_node: str
    actor: Any


class Fleet:
    """The node daemons of one Ray cluster, seen from the driver (``dsec cluster up``)."""

    def __init__(self, opts: RayOptions) -> None:
        self.opts = opts
        self.daemons: dict[str, Daemon] = {}  # by Ray node id
        self.cluster: Any = None  # ray.cluster_utils.Cluster of --local-nodes
        self.owns_ray = False  # connected here (not by whoever called us): disconnected here too
        self._remote: Any = ray.remote(NodeDaemon)

    def connect(self) -> None:
        """Join the Ray cluster (``--address``), start a local test cluster (``--local-nodes``) or a
        local single-node Ray. Call from the main thread: Ray sets signal handlers there."""
        if ray.is_initialized():
            return
        self.owns_ray = True
        if self.opts.local_nodes > 0:
            from ray.cluster_utils import Cluster

            head = {"num_cpus": 1, "resources": {RESOURCE: 1}}
            self.cluster = Cluster(initialize_head=True, head_node_args=head)
            for _ in range(self.opts.local_nodes - 1):
                self.cluster.add_node(num_cpus=1, resources={RESOURCE: 1})
            ray.init(address=self.cluster.address, log_to_driver=False)
        elif self.opts.address:
            ray.init(address=self.opts.address, log_to_driver=False)
        else:
            ray.init(log_to_driver=False)

    def eligible(self) -> list[dict[str, Any]]:
        """The alive Ray nodes that should run a daemon."""
        alive = [n for n in ray_nodes() if n.get("Alive")]
        if any(n.get("Resources", {}).get(RESOURCE, 0) >= 1 for n in alive):
            alive = [n for n in alive if n.get("Resources", {}).get(RESOURCE, 0) >= 1]
        if self.opts.label:
            key, _, value = self.opts.label.partition("=")
            alive = [n for n in alive if (n.get("Labels") or {}).get(key) == value]
        return alive

    def _args(self) -> list[str]:
        args = list(self.opts.node_args)
        if self.opts.repository:
            args += ["--repository", self.opts.repository]
        if self.opts.trajectory_db:
            args += ["--trajectory-db", self.opts.trajectory_db]
        return args

    def _launch(self, node: dict[str, Any]) -> Any:
        node_id: str = node["NodeID"]
        name = (node.get("Labels") or {}).get(NAME_LABEL) or f"node-{node_id[:12]}"
        options: dict[str, Any] = {
            "num_cpus": 0,
            "max_restarts": 0,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        }
        if node.get("Resources", {}).get(RESOURCE, 0) >= 1:
            options["resources"] = {RESOURCE: 1}
        e2b = self.opts.e2b_listen is not None
        actor = self._remote.options(**options).remote(
            name, str(self.opts.state_root), self.opts.token, self._args(), e2b
        )
        return actor, actor.start.remote()

    def start_all(self) -> list[Daemon]:
        """A daemon on every eligible node that has none; the ones that came up."""
        todo = [n for n in self.eligible() if n["NodeID"] not in self.daemons]
        launched = [(n, *self._launch(n)) for n in todo]
        started: list[Daemon] = []
        for node, actor, ref in launched:
            try:
                info = ray.get(ref, timeout=START_TIMEOUT + 30)
            except Exception as e:
                log.error("no node daemon on Ray node %s: %s", node["NodeID"], e)
                with contextlib.suppress(Exception):
                    ray.kill(actor)
                continue
            daemon = Daemon(info["name"], info["url"], info["ray_node"], actor)
            self.daemons[daemon.ray_node] = daemon
            started.append(daemon)
            log.info("node daemon %s on Ray node %s at %s", daemon.name, daemon.ray_node, daemon.url)
        return started

    def sync(self) -> tuple[list[Daemon], list[tuple[Daemon, str]]]:
        """(daemons started on nodes that joined, daemons lost with why). A daemon that exited on a
        live node is restarted in place (its sandboxes re-adopted)."""
        alive = {n["NodeID"] for n in ray_nodes() if n.get("Alive")}
        dead: list[tuple[Daemon, str]] = []
        for node_id, daemon in list(self.daemons.items()):
            if node_id not in alive:
                dead.append((daemon, f"Ray reports node {node_id} dead"))
                del self.daemons[node_id]
                continue
            try:
                status = ray.get(daemon.actor.poll.remote(), timeout=10)
                if status is not None:
                    log.warning("node daemon %s exited (%s); restarting it", daemon.name, status)
                    ray.get(daemon.actor.restart.remote(), timeout=START_TIMEOUT + 30)
            except Exception as e:  # the actor died, or the restart failed
                dead.append((daemon, f"its Ray actor failed: {type(e).__name__}: {e}"))
                del self.daemons[node_id]
                with contextlib.suppress(Exception):
                    ray.kill(daemon.actor)
        return self.start_all(), dead

    def stop_daemons(self) -> None:
        """Stop every daemon (killing its sandboxes unless asked to keep them) and its actor."""
        stops = [(d, d.actor.stop.remote(not self.opts.keep_sandboxes)) for d in self.daemons.values()]
        for daemon, ref in stops:
            try:
                ray.get(ref, timeout=STOP_TIMEOUT + 120)
            except Exception as e:
                log.warning("node daemon %s did not stop cleanly: %s", daemon.name, e)
            with contextlib.suppress(Exception):
                ray.kill(daemon.actor)
        self.daemons.clear()

    def leave(self) -> None:
        """Disconnect from Ray if it was joined here, and stop the local test cluster if it was made here."""
        if self.owns_ray:
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
