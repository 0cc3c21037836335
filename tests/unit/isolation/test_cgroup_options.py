"""Reading the v2 hierarchy's options from a mount table: a remount keeps them (it clears what it is
not given), adding favordynmods."""

from __future__ import annotations

from dsec.isolation.cgroups import cgroup2_options

HYBRID = """\
35 25 0:30 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
41 35 0:38 / /sys/fs/cgroup/unified rw,relatime shared:10 - cgroup2 cgroup2 rw
42 35 0:39 / /sys/fs/cgroup/memory rw,relatime shared:11 - cgroup cgroup rw,memory
"""
SYSTEMD = (
    "30 23 0:27 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 "
    "rw,nsdelegate,memory_recursiveprot\n"
)


def test_the_options_of_the_v2_mount_but_its_read_write_flag() -> None:
    assert cgroup2_options(HYBRID, "/sys/fs/cgroup/unified") == []
    assert cgroup2_options(SYSTEMD, "/sys/fs/cgroup") == ["nsdelegate", "memory_recursiveprot"]
    favoured = SYSTEMD.replace("memory_recursiveprot", "memory_recursiveprot,favordynmods")
    assert cgroup2_options(favoured, "/sys/fs/cgroup") == ["nsdelegate", "memory_recursiveprot", "favordynmods"]


def test_no_cgroup2_mount_there() -> None:
    assert cgroup2_options(HYBRID, "/sys/fs/cgroup") is None  # a tmpfs, not the v2 hierarchy
    assert cgroup2_options(HYBRID, "/sys/fs/cgroup/memory") is None
    assert cgroup2_options("", "/sys/fs/cgroup") is None
