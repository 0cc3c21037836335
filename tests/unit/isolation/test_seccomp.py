from __future__ import annotations

from typing import Any

import pytest

from dsec.isolation.seccomp import ALLOWED, EPERM, REFUSED, oci_profile, refused_syscalls

ENOSYS = 38
MUST_REFUSE = [
    "mount",
    "bpf",
    "userfaultfd",
    "perf_event_open",
    "keyctl",
    "kexec_load",
    "init_module",
    "finit_module",
    "open_by_handle_at",
    "unshare",
    "setns",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "ptrace",
]
NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
    "CLONE_NEWTIME": 0x00000080,
}


@pytest.fixture(scope="module")
def profile() -> dict[str, Any]:
    return oci_profile()


def _rules(profile: dict[str, Any], action: str) -> list[dict[str, Any]]:
    return [r for r in profile["syscalls"] if r["action"] == action]


def _unconditional_allows(profile: dict[str, Any]) -> set[str]:
    return {n for r in _rules(profile, "SCMP_ACT_ALLOW") if not r.get("args") for n in r["names"]}


def _eperm_rule(profile: dict[str, Any]) -> dict[str, Any]:
    rules = [r for r in _rules(profile, "SCMP_ACT_ERRNO") if r.get("errnoRet") == EPERM]
    assert len(rules) == 1
    return rules[0]


def test_default_is_enosys(profile: dict[str, Any]) -> None:
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    assert profile["defaultErrnoRet"] == ENOSYS
    assert "SCMP_ARCH_X86_64" in profile["architectures"]


@pytest.mark.parametrize("name", MUST_REFUSE)
def test_refused_syscall_gets_eperm_and_no_allow(profile: dict[str, Any], name: str) -> None:
    assert name in _eperm_rule(profile)["names"]
    for rule in _rules(profile, "SCMP_ACT_ALLOW"):
        assert name not in rule["names"]
    assert name not in ALLOWED


def test_no_syscall_is_both_refused_and_allowed(profile: dict[str, Any]) -> None:
    refused = set(_eperm_rule(profile)["names"])
    allowed = {n for r in _rules(profile, "SCMP_ACT_ALLOW") for n in r["names"]}
    assert refused.isdisjoint(allowed)
    assert refused == set(refused_syscalls())
    assert refused == {n for names in REFUSED.values() for n in names}


def test_clone3_is_not_allowed(profile: dict[str, Any]) -> None:
    for rule in profile["syscalls"]:
        if rule["action"] == "SCMP_ACT_ALLOW":
            assert "clone3" not in rule["names"]
    # not refused either: ENOSYS by default makes libc fall back to clone
    assert "clone3" not in _eperm_rule(profile)["names"]


def test_clone_only_with_the_masked_eq_rule(profile: dict[str, Any]) -> None:
    assert "clone" not in _unconditional_allows(profile)
    rules = [r for r in profile["syscalls"] if "clone" in r["names"]]
    assert len(rules) == 1
    rule = rules[0]
    assert rule["names"] == ["clone"]
    assert rule["action"] == "SCMP_ACT_ALLOW"
    (arg,) = rule["args"]
    assert arg["index"] == 0
    assert arg["op"] == "SCMP_CMP_MASKED_EQ"
    assert arg["valueTwo"] == 0
    mask = arg["value"]
    for flag, bit in NAMESPACE_FLAGS.items():
        assert mask & bit, f"{flag} is not in the clone mask"


def _clone_allowed(mask: int, flags: int) -> bool:
    """How the kernel evaluates SCMP_CMP_MASKED_EQ(mask, 0) on clone's first argument."""
    return (flags & mask) == 0


@pytest.mark.parametrize("flag", sorted(NAMESPACE_FLAGS))
def test_clone_with_a_namespace_flag_is_refused(profile: dict[str, Any], flag: str) -> None:
    (rule,) = [r for r in profile["syscalls"] if "clone" in r["names"]]
    mask = rule["args"][0]["value"]
    thread_flags = 0x00000100 | 0x00000200 | 0x00000400 | 0x00000800 | 0x00010000  # VM|FS|FILES|SIGHAND|THREAD
    assert _clone_allowed(mask, thread_flags)
    assert _clone_allowed(mask, 17)  # SIGCHLD: plain fork
    assert not _clone_allowed(mask, thread_flags | NAMESPACE_FLAGS[flag])


def test_everyday_syscalls_are_allowed(profile: dict[str, Any]) -> None:
    allowed = _unconditional_allows(profile)
    for name in ("read", "write", "openat", "execve", "mmap", "futex", "socketpair", "exit_group", "wait4"):
        assert name in allowed


def test_socket_only_for_unix_inet_and_netlink(profile: dict[str, Any]) -> None:
    assert "socket" not in _unconditional_allows(profile)
    rules = [r for r in _rules(profile, "SCMP_ACT_ALLOW") if r["names"] == ["socket"]]
    families = set()
    for rule in rules:
        (arg,) = rule["args"]
        assert arg["index"] == 0 and arg["op"] == "SCMP_CMP_EQ"
        families.add(arg["value"])
    assert families == {1, 2, 10, 16}  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK; not AF_PACKET (17), AF_ALG (38)


@pytest.mark.parametrize("name", ["fanotify_init", "mbind", "set_mempolicy", "listmount", "process_madvise"])
def test_calls_docker_allows_but_agents_never_need_are_refused(profile: dict[str, Any], name: str) -> None:
    assert name not in _unconditional_allows(profile)
    assert name in _eperm_rule(profile)["names"]


def test_allow_list_has_no_duplicates_after_dedup(profile: dict[str, Any]) -> None:
    (rule,) = [r for r in _rules(profile, "SCMP_ACT_ALLOW") if not r.get("args")]
    assert rule["names"] == sorted(set(rule["names"]))
