"""A sandbox that pauses at its time to live (``on_timeout="pause"``), with dsec's own SDK and a real
container: paused by the reaper with its processes and files, kept, and running again on resume."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

import dsec


def _until(state: str, sb: dsec.Sandbox, timeout: float = 20.0) -> dsec.SandboxInfo:
    deadline = time.monotonic() + timeout
    while (info := sb.info()).state.value != state:
        assert time.monotonic() < deadline, f"still {info.state.value}"
        time.sleep(0.1)
    return info


@pytest.mark.timeout(90)
def test_a_sandbox_paused_at_its_time_to_live_resumes_as_it_was(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    sb = make_sandbox(timeout=2, on_timeout="pause")
    assert sb.info().on_timeout == "pause"
    sb.exec("echo kept > /tmp/kept; sleep 1000 >/dev/null 2>&1 & echo $! > /tmp/pid")
    paused = _until("paused", sb)
    assert paused.expires_at > datetime.now(UTC) + timedelta(days=6)  # kept, not reaped at the next pass
    with pytest.raises(dsec.InvalidState):
        sb.exec("true")
    sb.resume()
    assert sb.exec("cat /tmp/kept; kill -0 $(cat /tmp/pid) && echo alive").stdout == "kept\nalive\n"
    # a plain sandbox still ends at its time to live
    plain = make_sandbox(timeout=1)
    assert _until("stopped", plain).reason == "time to live expired"


def test_pausing_at_the_time_to_live_needs_a_kind_that_pauses(make_sandbox: Callable[..., dsec.Sandbox]) -> None:
    with pytest.raises(dsec.InvalidRequest, match="cannot be paused"):
        make_sandbox(kind="function", on_timeout="pause")
