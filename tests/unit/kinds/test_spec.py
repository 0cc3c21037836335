from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from dsec.images.store import ImageRef
from dsec.isolation.seccomp import oci_profile
from dsec.kinds.container import spec
from dsec.protocol.sandbox import Limits, State
from dsec.store.records import SandboxRecord


def record(**limits: Any) -> SandboxRecord:
    now = time.time()
    return SandboxRecord(
        id="sb-0123456789ab",
        kind="container",
        image="test/img:1",
        state=State.creating,
        created_at=now,
        expires_at=now + 600,
        limits=Limits(**limits),
        env={"FROM_SANDBOX": "s", "SHARED": "sandbox", "HOME": "/home/agent"},
        labels={"run": "1"},
    )


IMAGE = ImageRef(
    name="test/img:1",
    layers=(Path("/images/test_img@1/rootfs"),),
    env={"PATH": "/opt/bin:/usr/bin", "FROM_IMAGE": "i", "SHARED": "image"},
    workdir="/work",
)


def build(
    rec: SandboxRecord | None = None,
    image: ImageRef = IMAGE,
    seccomp_bpf: str | None = None,
    uid_base: int | None = None,
) -> dict[str, Any]:
    return spec.config(
        rec or record(memory="512Mi", cpu=2, cpu_limit=1.5, pids=256),
        image,
        rootfs="/run/dsec/sb/rootfs",
        helper_dir="/var/lib/dsec/helper",
        cgroups_path="/dsec/sb-0123456789ab",
        init=["/.dsec/agent"],
        seccomp_bpf=seccomp_bpf,
        uid_base=uid_base,
    )


@pytest.fixture(scope="module")
def cfg() -> dict[str, Any]:
    return build()


def test_namespaces(cfg: dict[str, Any]) -> None:
    kinds = [ns["type"] for ns in cfg["linux"]["namespaces"]]
    assert set(kinds) >= {"pid", "network", "ipc", "uts", "mount", "cgroup"}
    assert "user" not in kinds
    assert len(kinds) == len(set(kinds))


@pytest.mark.parametrize("cap", ["CAP_SYS_ADMIN", "CAP_NET_RAW", "CAP_SYS_PTRACE", "CAP_MKNOD", "CAP_SYS_MODULE"])
def test_dangerous_capabilities_are_dropped(cfg: dict[str, Any], cap: str) -> None:
    caps = cfg["process"]["capabilities"]
    for which in ("bounding", "effective", "permitted"):
        assert cap not in caps[which]
    assert "ambient" not in caps or cap not in caps["ambient"]


def test_capability_sets_agree(cfg: dict[str, Any]) -> None:
    caps = cfg["process"]["capabilities"]
    assert caps["bounding"] == caps["effective"] == caps["permitted"]
    assert "CAP_CHOWN" in caps["bounding"]


def test_no_new_privileges(cfg: dict[str, Any]) -> None:
    assert cfg["process"]["noNewPrivileges"] is True


def test_resources_from_the_request(cfg: dict[str, Any]) -> None:
    res = cfg["linux"]["resources"]
    # the request (default a quarter of the limit) is the reservation: v1 soft limit, v2 memory.low
    assert res["memory"] == {"limit": 512 << 20, "swap": 512 << 20, "reservation": 128 << 20}
    assert "unified" not in res  # memory.high exists on cgroup v2 only
    assert res["pids"] == {"limit": 256}
    assert res["cpu"]["shares"] == 2048
    assert res["cpu"]["quota"] == 150_000
    assert res["cpu"]["period"] == 100_000


def test_memory_high_throttles_below_the_limit_on_cgroup_v2() -> None:
    rec = record(memory="512Mi", memory_request="64Mi")
    cfg = spec.config(rec, IMAGE, "/rootfs", "/helpers", "/dsec/sb-1", ["/init"], cgroup_v2=True)
    res = cfg["linux"]["resources"]
    assert res["memory"]["reservation"] == 64 << 20
    high = int(res["unified"]["memory.high"])
    assert high == spec.memory_high(512 << 20) and high % 4096 == 0
    assert (512 << 20) - high >= 4 << 20 and high >= (512 << 20) * 0.85
    assert spec.memory_high(8 << 20) == 4 << 20  # the smallest limit still leaves room to throttle


def test_no_cpu_limit_means_no_quota() -> None:
    cpu = build(record(cpu=0.5))["linux"]["resources"]["cpu"]
    assert cpu == {"shares": 512}


@pytest.mark.parametrize(("cores", "shares"), [(0.0001, 2), (1, 1024), (256, 262144)])
def test_cpu_shares_are_clamped(cores: float, shares: int) -> None:
    assert build(record(cpu=cores))["linux"]["resources"]["cpu"]["shares"] == shares


def test_masked_and_readonly_paths(cfg: dict[str, Any]) -> None:
    masked = cfg["linux"]["maskedPaths"]
    assert "/proc/kcore" in masked
    assert "/proc/kallsyms" in masked
    assert "/proc/sysrq-trigger" in masked
    assert "/proc/sys" in cfg["linux"]["readonlyPaths"]


def test_helper_mount_is_read_only(cfg: dict[str, Any]) -> None:
    (helper,) = [m for m in cfg["mounts"] if m["destination"] == spec.HELPER_MOUNT]
    assert helper["source"] == "/var/lib/dsec/helper"
    assert "ro" in helper["options"]
    assert "rw" not in helper["options"]
    assert "nosuid" in helper["options"]
    assert cfg["process"]["args"][0].startswith(spec.HELPER_MOUNT + "/")


def test_sys_and_cgroup_mounts_are_read_only(cfg: dict[str, Any]) -> None:
    by_dest = {m["destination"]: m for m in cfg["mounts"]}
    assert "ro" in by_dest["/sys"]["options"]
    assert "ro" in by_dest["/sys/fs/cgroup"]["options"]


def test_env_merges_defaults_image_and_sandbox(cfg: dict[str, Any]) -> None:
    env_list = cfg["process"]["env"]
    names = [e.split("=", 1)[0] for e in env_list]
    assert len(names) == len(set(names)), "an env name appears twice"
    env = dict(e.split("=", 1) for e in env_list)
    assert env["PATH"] == "/opt/bin:/usr/bin"  # the image's PATH wins over the default
    assert env["FROM_IMAGE"] == "i"
    assert env["FROM_SANDBOX"] == "s"
    assert env["SHARED"] == "sandbox"  # the sandbox wins over the image
    assert env["HOME"] == "/home/agent"
    assert env["TERM"] == "xterm"


def test_paths_and_ids(cfg: dict[str, Any]) -> None:
    assert cfg["root"]["path"] == "/run/dsec/sb/rootfs"
    assert cfg["linux"]["cgroupsPath"] == "/dsec/sb-0123456789ab"
    assert cfg["process"]["cwd"] == "/work"
    assert cfg["process"]["user"] == {"uid": 0, "gid": 0}


def test_seccomp_profile_is_attached(cfg: dict[str, Any]) -> None:
    assert cfg["linux"]["seccomp"] == oci_profile()


def test_devices_denied_by_default(cfg: dict[str, Any]) -> None:
    assert cfg["linux"]["resources"]["devices"][0] == {"allow": False, "access": "rwm"}


def test_core_dumps_disabled(cfg: dict[str, Any]) -> None:
    rlimits = {r["type"]: r for r in cfg["process"]["rlimits"]}
    assert rlimits["RLIMIT_CORE"]["hard"] == 0


def test_init_is_the_agent(cfg: dict[str, Any]) -> None:
    assert cfg["process"]["args"] == ["/.dsec/agent"]


def test_precompiled_seccomp_goes_in_the_crun_annotation() -> None:
    assert "run.oci.seccomp_bpf_data" not in build()["annotations"]
    cfg = build(seccomp_bpf="QUJD")
    assert cfg["annotations"]["run.oci.seccomp_bpf_data"] == "QUJD"
    assert cfg["linux"]["seccomp"]["defaultAction"] == "SCMP_ACT_ERRNO"  # kept for runtimes without it


def test_user_namespace_maps_root_to_the_sandbox_range() -> None:
    cfg = build(uid_base=1 << 20)
    assert {"type": "user"} in cfg["linux"]["namespaces"]
    expected = [{"containerID": 0, "hostID": 1 << 20, "size": 65536}]
    assert cfg["linux"]["uidMappings"] == expected and cfg["linux"]["gidMappings"] == expected
    plain = build()
    assert {"type": "user"} not in plain["linux"]["namespaces"] and "uidMappings" not in plain["linux"]


def test_a_hybrid_hosts_hierarchies_are_bound_from_the_sandboxs_own_groups() -> None:
    cfg = spec.config(
        record(memory="512Mi"),
        IMAGE,
        rootfs="/run/dsec/sb/rootfs",
        helper_dir="/var/lib/dsec/helper",
        cgroups_path="/dsec/sb-0123456789ab",
        init=["/.dsec/agent"],
        cgroup_hierarchies=["cpu", "memory", "unified"],
    )
    under = [m for m in cfg["mounts"] if m["destination"].startswith("/sys/fs/cgroup")]
    assert [m["type"] for m in under] == ["tmpfs", "bind", "bind", "bind"]
    assert [m["source"] for m in under[1:]] == [
        f"/sys/fs/cgroup/{h}/dsec/sb-0123456789ab" for h in ("cpu", "memory", "unified")
    ]
    assert all("ro" in m["options"] for m in under[1:])
    # no hierarchies given (a cgroup v2 host): the runtime mounts cgroup2 itself
    plain = [m for m in build()["mounts"] if m["destination"] == "/sys/fs/cgroup"]
    assert [m["type"] for m in plain] == ["cgroup"]
