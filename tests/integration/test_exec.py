from __future__ import annotations

import time

import dsec


def test_exit_codes_and_signals(sb: dsec.Sandbox) -> None:
    assert sb.exec("exit 0").exit_code == 0
    assert sb.exec("exit 3").exit_code == 3
    res = sb.exec("kill -9 $$")
    assert res.exit_code == 137 and res.signal == 9
    assert sb.exec(["/no/such/binary"]).exit_code == 127


def test_cwd_env_stdin(sb: dsec.Sandbox) -> None:
    res = sb.exec("pwd; echo $A-$B; cat", cwd="/tmp", env={"A": "1", "B": "two words"}, stdin="from stdin")
    assert res.stdout == "/tmp\n1-two words\nfrom stdin"


def test_timeout_kills_whole_tree(sb: dsec.Sandbox) -> None:
    started = time.monotonic()
    res = sb.exec(
        "sleep 1000 & setsid sleep 1001 & (sleep 1002 &) ; echo started; sleep 1003",
        timeout=1.0,
    )
    assert time.monotonic() - started < 10
    assert res.timed_out
    assert res.stdout == "started\n"
    # every process of the step is gone: daemonised (setsid, double fork) ones included
    ps = sb.exec("ps -o args").stdout
    assert "sleep 100" not in ps, ps


def test_output_is_capped_head_and_tail(sb: dsec.Sandbox) -> None:
    # 1 GB of output: the daemon drains it, keeps head and tail, reports the total
    res = sb.exec("head -c 1000000000 /dev/zero | tr '\\0' 'a'; echo; echo END", timeout=300, output_limit=65536)
    assert res.exit_code == 0
    assert res.truncated
    assert res.stdout_bytes == 1_000_000_000 + 5
    assert len(res.stdout) < 70_000
    assert res.stdout.startswith("aaaa") and res.stdout.endswith("\nEND\n")
    assert "truncated by dsec" in res.stdout
    assert sb.exec("echo still fine").stdout == "still fine\n"


def test_both_streams_flooded_at_once(sb: dsec.Sandbox) -> None:
    res = sb.exec("yes out | head -c 20000000 & yes err | head -c 20000000 >&2; wait", output_limit=4096, timeout=120)
    assert res.truncated
    assert res.stdout_bytes == 20_000_000 and res.stderr_bytes == 20_000_000


async def test_many_concurrent_execs_never_mix_streams(daemon: object) -> None:
    """Hundreds of execs in flight across sandboxes: every output reaches its own caller, whole."""
    import asyncio

    sandboxes = await asyncio.gather(*(dsec.AsyncSandbox.create(image="dsec/busybox") for _ in range(6)))
    try:

        async def one(sb: dsec.AsyncSandbox, i: int) -> None:
            token = f"{sb.id}-{i}"
            res = await sb.exec(["sh", "-c", 'cat; echo "$0" >&2', token], stdin=token * 50)
            assert res.stdout == token * 50, (token, res.stdout[:100])
            assert res.stderr == token + "\n"
            assert res.exit_code == 0

        await asyncio.gather(*(one(sb, i) for sb in sandboxes for i in range(40)))
    finally:
        await asyncio.gather(*(sb.kill() for sb in sandboxes))
