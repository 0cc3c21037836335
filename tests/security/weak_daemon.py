"""The negative control's daemon: ``python -m tests.security.weak_daemon serve ...``.

It imports dsec, deliberately weakens every container the daemon creates, then runs the normal
``serve``. Nothing in src/ offers these switches: the weakening lives only here, in the test tree.

Weakenings (each one a layer the red-team cases claim to test):
- no seccomp profile (neither the OCI section nor crun's precompiled filter);
- every capability (bounding, effective, permitted), and no ``no_new_privs``;
- no masked or read-only /proc and /sys paths;
- the host's network namespace (the container reaches everything the host reaches).

Kept on purpose so that running the control cannot harm the machine or the other tests on it: the
user namespace (container root stays an unprivileged host uid), the pid namespace (a /proc of the
host's pid namespace cannot be mounted from a user namespace) and the memory, pids and disk limits.
"""

from __future__ import annotations

from typing import Any

ALL_CAPS = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
]


def weaken() -> None:
    from dsec.kinds.container import spec

    original = spec.config

    def weak_config(*args: Any, **kwargs: Any) -> dict[str, Any]:
        cfg = original(*args, **kwargs)
        cfg["annotations"].pop("run.oci.seccomp_bpf_data", None)
        linux = cfg["linux"]
        linux.pop("seccomp", None)
        linux["maskedPaths"] = []
        linux["readonlyPaths"] = []
        linux["namespaces"] = [ns for ns in linux["namespaces"] if ns["type"] != "network"]
        process = cfg["process"]
        process["noNewPrivileges"] = False
        process["capabilities"] = {k: list(ALL_CAPS) for k in ("bounding", "effective", "permitted")}
        return cfg

    spec.config = weak_config


if __name__ == "__main__":
    weaken()
    from dsec.cli.main import main

    main()
