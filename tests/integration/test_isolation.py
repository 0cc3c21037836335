from __future__ import annotations

from collections.abc import Callable

import dsec


def test_sandboxes_do_not_see_each_other(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    a = make_sandbox()
    b = make_sandbox()
    a.exec("echo secret > /root/answer; echo x > /bin/sh-was-here; sleep 300 &")
    assert b.exec("cat /root/answer").exit_code != 0
    assert b.exec("test -e /bin/sh-was-here").exit_code == 1
    assert "sleep 300" not in b.exec("ps -o args").stdout
    # a new sandbox from the same image starts clean: the image was not changed
    c = make_sandbox()
    assert c.exec("test -e /root/answer || test -e /bin/sh-was-here").exit_code == 1


def test_overwriting_bin_sh_does_not_break_the_platform(sb: dsec.Sandbox) -> None:
    sb.exec("rm -f /bin/sh; printf '#!/bin/busybox ash\\necho pwned; exit 0\\n' > /bin/sh; chmod +x /bin/sh")
    res = sb.exec("exit 5")  # runs the planted /bin/sh: its exit code is the workload's word
    assert "pwned" in res.stdout
    # argv execs and files do not depend on the sandbox's shell
    assert sb.exec(["/bin/busybox", "false"]).exit_code == 1
    assert sb.files.read("/bin/sh").startswith(b"#!/bin/busybox")


def test_pid_namespace_and_only_loopback(sb: dsec.Sandbox) -> None:
    ps = sb.exec("ps -o pid,args").stdout.strip().splitlines()[1:]
    assert ps[0].split()[0] == "1" and "/.dsec/agent" in ps[0]
    links = sb.exec("cat /proc/net/dev").stdout
    assert "lo:" in links
    assert [line.split(":")[0].strip() for line in links.splitlines()[2:]] == ["lo"]
    # no route anywhere: nothing can leave the sandbox's network namespace
    assert sb.exec("ip route; ip -6 route | grep -v '^::1\\|^fe80'").stdout.strip() == ""


def test_dangerous_syscalls_refused(sb: dsec.Sandbox) -> None:
    for cmd in (
        "unshare -U true",
        "unshare -n true",
        "mount -t tmpfs none /mnt",
        "mknod /tmp/mem c 1 1",
        "nsenter -t 1 -m true",
    ):
        assert sb.exec(cmd).exit_code != 0, cmd


def test_capabilities_dropped_and_no_new_privs(sb: dsec.Sandbox) -> None:
    status = sb.exec("cat /proc/self/status").stdout
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    eff = int(fields["CapEff"].strip(), 16)
    cap_sys_admin, cap_net_raw, cap_sys_ptrace, cap_mknod = 21, 13, 19, 27
    for bit in (cap_sys_admin, cap_net_raw, cap_sys_ptrace, cap_mknod):
        assert not eff & (1 << bit), bit
    assert fields["NoNewPrivs"].strip() == "1"
    assert fields["Seccomp"].strip() == "2"


def test_sensitive_proc_paths_masked(sb: dsec.Sandbox) -> None:
    assert sb.exec("head -c 64 /proc/kcore | wc -c").stdout.strip() == "0"
    assert sb.exec("cat /proc/kallsyms | head -1").stdout.strip() == ""
    assert sb.exec("echo 1 > /proc/sys/kernel/panic").exit_code != 0
    # the platform's state is not visible
    assert sb.exec("ls /var/lib/dsec 2>&1; find / -name token -path '*dsec*' 2>/dev/null").stdout.find("token") < 0
    assert sb.exec("echo x > /.dsec/busybox").exit_code != 0


def test_agent_cannot_be_killed_read_or_impersonated(sb: dsec.Sandbox) -> None:
    """pid 1 is the platform's agent: signals from inside are dropped, /proc access to it is refused."""
    for sig in ("KILL", "TERM", "STOP", "INT"):
        sb.exec(f"kill -{sig} 1")
    assert sb.exec("echo still serving").stdout == "still serving\n"
    for probe in (
        "cat /proc/1/environ",
        "head -c 1 /proc/1/mem",
        "readlink /proc/1/fd/3",
        "readlink /proc/1/exe",
        "cat /proc/1/maps",
    ):
        res = sb.exec(probe)
        assert res.exit_code != 0 or res.stdout.strip() == "", (probe, res)
    assert sb.exec("echo x > /proc/1/fd/3").exit_code != 0  # the daemon's channel is out of reach
    assert sb.exec("kill -9 -1; echo survived").exit_code in (0, 137)
    assert sb.exec("echo after kill-all").stdout == "after kill-all\n"
