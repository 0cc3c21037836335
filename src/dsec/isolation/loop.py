"""Loop devices over files, attached by ioctl on /dev/loop-control: ``losetup`` and ``mount -o loop``
cost a process each, and their devices stay attached when a caller dies between the two steps.

Every device is attached with autoclear: it detaches itself when its last user (the mount on it, or
the descriptor returned here) goes away, so nothing is left when a mount is undone or fails.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from pathlib import Path

from ..errors import BackendError

_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_CONFIGURE = 0x4C0A
_LOOP_GET_STATUS64 = 0x4C05
_LO_FLAGS_READ_ONLY = 1
_LO_FLAGS_AUTOCLEAR = 4  # the device detaches itself when the mount (its last user) goes away


class _LoopInfo64(ctypes.Structure):
    _fields_ = [
        ("lo_device", ctypes.c_uint64),
        ("lo_inode", ctypes.c_uint64),
        ("lo_rdevice", ctypes.c_uint64),
        ("lo_offset", ctypes.c_uint64),
        ("lo_sizelimit", ctypes.c_uint64),
        ("lo_number", ctypes.c_uint32),
        ("lo_encrypt_type", ctypes.c_uint32),
        ("lo_encrypt_key_size", ctypes.c_uint32),
        ("lo_flags", ctypes.c_uint32),
        ("lo_file_name", ctypes.c_uint8 * 64),
        ("lo_crypt_name", ctypes.c_uint8 * 64),
        ("lo_encrypt_key", ctypes.c_uint8 * 32),
        ("lo_init", ctypes.c_uint64 * 2),
    ]


class _LoopConfig(ctypes.Structure):
    _fields_ = [
        ("fd", ctypes.c_uint32),
        ("block_size", ctypes.c_uint32),
        ("info", _LoopInfo64),
        ("reserved", ctypes.c_uint64 * 8),
    ]


def attach_loop(source: Path, *, read_only: bool = True) -> tuple[int, str]:
    """A self-detaching loop device over ``source``: (open fd on it, its path). Close the fd once the
    device is mounted (the mount then holds it) or after a failed mount (which detaches it)."""
    file_fd = os.open(source, (os.O_RDONLY if read_only else os.O_RDWR) | os.O_CLOEXEC)
    try:
        ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(16):  # another process may take the free device between the two calls
                number = fcntl.ioctl(ctl, _LOOP_CTL_GET_FREE)
                device = f"/dev/loop{number}"
                loop_fd = os.open(device, (os.O_RDONLY if read_only else os.O_RDWR) | os.O_CLOEXEC)
                config = _LoopConfig(fd=file_fd)
                config.info.lo_flags = _LO_FLAGS_AUTOCLEAR | (_LO_FLAGS_READ_ONLY if read_only else 0)
                try:
                    fcntl.ioctl(loop_fd, _LOOP_CONFIGURE, config)
                except OSError as e:
                    os.close(loop_fd)
                    if e.errno == errno.EBUSY:
                        continue
                    raise
                return loop_fd, device
        finally:
            os.close(ctl)
    except OSError as e:
        raise BackendError(f"cannot attach a loop device to {source}: {e.strerror}") from e
    finally:
        os.close(file_fd)  # the loop device holds its own reference
    raise BackendError(f"cannot attach a loop device to {source}: every free device was taken meanwhile")


def attached_loop(source: Path) -> tuple[int, str] | None:
    """A loop device already attached to ``source``, held open (so it cannot detach and be given to
    another file meanwhile), or None. A file system on it may still be alive without any mount on the
    host (a sandbox's mount namespace that has not gone yet holds it): mounting that device again
    reaches the same file system, where a second device over the file would make a second one and
    each would overwrite the other's writes."""
    try:
        st = os.stat(source)
    except FileNotFoundError:
        return None
    for backing in sorted(Path("/sys/block").glob("loop*/loop/backing_file")):
        try:
            if backing.read_text().strip().removesuffix(" (deleted)") != str(source):
                continue
            device = f"/dev/{backing.parts[3]}"
            fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue  # detached meanwhile
        info = _LoopInfo64()
        try:
            fcntl.ioctl(fd, _LOOP_GET_STATUS64, info)  # now that it is held: is it still this file?
        except OSError:
            os.close(fd)
            continue
        if (info.lo_device, info.lo_inode) == (st.st_dev, st.st_ino) and not info.lo_flags & _LO_FLAGS_READ_ONLY:
            return fd, device
        os.close(fd)
    return None
