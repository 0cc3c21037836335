"""A TCP connection made inside another process's network namespace, used from the host's.

A socket belongs to the network namespace it was created in, whichever namespace the thread using it is
in later. So a thread of the daemon joins the sandbox's namespace (``setns`` changes only the calling
thread's), creates and connects the socket there, and ends; the socket then serves the event loop like
any other. The thread is used once and thrown away, so no thread of the daemon is ever left in a
sandbox's namespace even if switching back failed.

This reaches the sandbox's loopback, which its network policy does not govern (the policy is about what
leaves the sandbox): nothing outside the sandbox can connect to it except through this.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import socket
import threading

from ..errors import BackendError, PortUnreachable, SandboxGone

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)

__all__ = ["connect_in_netns"]


def _connect(pid: int, port: int, timeout: float) -> socket.socket:
    try:
        target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise SandboxGone(f"the sandbox's process {pid} is gone") from e
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise BackendError(f"cannot enter the sandbox's network namespace: {os.strerror(err)}")
    finally:
        os.close(target)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(("127.0.0.1", port))
    except OSError as e:
        sock.close()
        raise PortUnreachable(f"nothing answers on port {port} inside the sandbox ({e.strerror or e})") from e
    sock.setblocking(False)
    return sock


async def connect_in_netns(pid: int, port: int, timeout: float = 10.0) -> socket.socket:
    """A non-blocking socket connected to 127.0.0.1:``port`` in the network namespace of ``pid``."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[socket.socket] = loop.create_future()

    def run() -> None:
        try:
            result = _connect(pid, port, timeout)
        except BaseException as e:  # handed to the waiting coroutine, never lost with the thread
            loop.call_soon_threadsafe(_settle, done, None, e)
        else:
            loop.call_soon_threadsafe(_settle, done, result, None)

    threading.Thread(target=run, name="dsec-netns-connect", daemon=True).start()
    return await done


def _settle(fut: asyncio.Future[socket.socket], sock: socket.socket | None, err: BaseException | None) -> None:
    if fut.cancelled():  # the caller gave up: the connection it would have had is not leaked
        if sock is not None:
            sock.close()
        return
    if err is not None:
        fut.set_exception(err)
    else:
        assert sock is not None
        fut.set_result(sock)
