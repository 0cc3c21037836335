"""VMs: cold boot and snapshot restore to the first exec, beside a bare QEMU boot of the same kernel and
initramfs; fork time; how many idle micro-VMs the node holds and the host memory each costs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

from dsec import AsyncClient, AsyncSandbox, DsecError

from .common import Json, connect, host_facts, kill_leftovers, phase, release_node, start_daemon, stop_daemon, summarize
from .density import meminfo, used

LABEL = {"dsec-bench": "vm"}
MEMORY = "192Mi"
TARGET_RESTORE_SPEEDUP = 5.0
TARGET_COLD_VS_BARE = 1.2
TARGET_IDLE = 64
TARGET_IDLE_MIB = 160.0
PROBE_LINE = b"dsec-probe-ok"


async def bare_boot(machine: str, accel: str, samples: int) -> Json:
    """QEMU alone, booting dsec's kernel and initramfs to the first line its userspace prints."""
    # the baseline must boot the very guest and QEMU binary the node uses: only the kind's modules build
    # and find them (nothing public hands them out)
    from dsec.kinds.microvm import guest, qemu
    from dsec.kinds.microvm.agent_build import build_agent
    from dsec.kinds.microvm.backend import VM_CACHE

    assets = await guest.prepare(VM_CACHE, await build_agent(VM_CACHE / "agent"))
    mmio = machine == "microvm"
    argv = [
        qemu.binary(), "-machine", f"{machine},accel={accel}" + (",x-option-roms=off,rtc=on" if mmio else ""),
        "-cpu", "host" if accel == "kvm" else "max", "-m", MEMORY.removesuffix("Mi"), "-smp", "1",
        "-nodefaults", "-no-user-config", "-nographic", "-no-reboot", "-serial", "stdio",
        "-kernel", str(assets.kernel), "-initrd", str(assets.initrd),
        "-append", "console=ttyS0 panic=-1 reboot=t quiet dsec.probe=1" + _tsc(accel),
    ]  # fmt: skip
    times = []
    for _ in range(samples):
        started = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        assert proc.stdout is not None
        seen = b""
        try:
            async with asyncio.timeout(120):
                while PROBE_LINE not in seen:
                    chunk = await proc.stdout.read(4096)
                    if not chunk:
                        raise RuntimeError(f"bare QEMU ({machine}) ended before its first userspace line")
                    seen = seen[-64:] + chunk
            times.append(time.perf_counter() - started)
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    return summarize(times)


def _tsc(accel: str) -> str:
    """The same calibration hint dsec's own VMs get under TCG (without it busy hosts hang some boots)."""
    from dsec.kinds.microvm import qemu  # the hint as the kind computes it, so the baseline boots alike

    khz = qemu.host_tsc_khz() if accel == "tcg" else None
    return f" tsc_early_khz={khz}" if khz else ""


async def first_exec(client: AsyncClient, kind: str, image: str) -> tuple[float, AsyncSandbox]:
    started = time.perf_counter()
    sb = await AsyncSandbox.create(image=image, kind=kind, client=client, memory=MEMORY, labels=LABEL, timeout=3600)
    await sb.exec(["true"])
    return time.perf_counter() - started, sb


async def cold_boots(console: Console, client: AsyncClient, kind: str, image: str, samples: int) -> Json:
    times = []
    with phase(console, f"{kind}: cold boots", samples) as tick:
        for _ in range(samples):
            took, sb = await first_exec(client, kind, image)
            info = await sb.info()
            if info.started_from != "boot":
                raise RuntimeError(f"a {kind} VM meant to boot cold started from {info.started_from}")
            await sb.kill()
            times.append(took)
            tick()
    return summarize(times) | {"accelerator": info.accelerator}


async def restores(console: Console, client: AsyncClient, kind: str, image: str, samples: int) -> Json:
    """The first VM of a shape boots and saves a template in the background; the next ones restore."""
    deadline = time.monotonic() + 600
    while True:
        _, sb = await first_exec(client, kind, image)
        started_from = (await sb.info()).started_from
        await sb.kill()
        if started_from == "snapshot":
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {kind} template was saved within 10 minutes")
        await asyncio.sleep(2)
    times = []
    with phase(console, f"{kind}: restores from the template", samples) as tick:
        for _ in range(samples):
            took, sb = await first_exec(client, kind, image)
            if (await sb.info()).started_from != "snapshot":
                raise RuntimeError(f"a {kind} VM meant to restore booted")
            await sb.kill()
            times.append(took)
            tick()
    return summarize(times)


async def forks(client: AsyncClient, kind: str, image: str, sizes: list[int]) -> Json:
    _, parent = await first_exec(client, kind, image)
    out: Json = {}
    try:
        await parent.exec("echo state > /root/state")
        for n in sizes:
            started = time.perf_counter()
            copies = await parent.fork(n, labels=LABEL)
            await asyncio.gather(*(c.exec(["cat", "/root/state"]) for c in copies))
            out[f"fork_{n}_to_first_exec_s"] = round(time.perf_counter() - started, 3)
            await asyncio.gather(*(c.kill() for c in copies))
    finally:
        await parent.kill()
    return out


async def idle(console: Console, client: AsyncClient, image: str, n: int, concurrency: int) -> Json:
    """Hold ``n`` idle micro-VMs (restored from the template) and read what the host gave them."""
    await asyncio.sleep(2)
    before = meminfo()
    gate = asyncio.Semaphore(concurrency)
    made: list[AsyncSandbox] = []
    failures: dict[str, int] = {}
    with phase(console, f"microvm: holding {n} idle VMs", n) as tick:

        async def one() -> None:
            async with gate:
                try:
                    made.append(
                        await AsyncSandbox.create(
                            image=image, kind="microvm", client=client, memory=MEMORY, labels=LABEL, timeout=3600
                        )
                    )
                except DsecError as e:
                    failures[e.code] = failures.get(e.code, 0) + 1
                tick()

        await asyncio.gather(*(one() for _ in range(n)))
    await asyncio.sleep(5)
    after = meminfo()
    held = len(made)
    answering = 0
    for sb in made:
        with contextlib.suppress(DsecError):
            await sb.exec(["true"], timeout=30)
            answering += 1
    await asyncio.gather(*(sb.kill() for sb in made), return_exceptions=True)
    per = (used(after) - used(before)) / held if held else 0.0
    return {
        "wanted": n,
        "held": held,
        "answering_while_full": answering,
        "failures": failures,
        "host_memory_per_vm_mib": round(per / 2**20, 1),
        "host_memory_used_delta_mib": round((used(after) - used(before)) / 2**20, 1),
    }


async def run(console: Console, kinds: list[str], samples: int, idle_n: int, state_dir: Path) -> Json:
    image = "dsec/busybox"
    figures: Json = {}
    # cold boots: a daemon that never restores, so every VM boots
    os.environ["DSEC_VM_TEMPLATES"] = "0"
    try:
        proc = start_daemon(state_dir / "cold")
    finally:
        os.environ.pop("DSEC_VM_TEMPLATES", None)
    try:
        client = await connect(proc, state_dir / "cold")
        await client.build_image(image)
        for kind in kinds:
            figures[kind] = {"cold_boot_to_first_exec": await cold_boots(console, client, kind, image, samples)}
        await kill_leftovers(console, client, LABEL)
        await client.aclose()
    finally:
        stop_daemon(proc)
        release_node(state_dir / "cold")
    accel = figures[kinds[0]]["cold_boot_to_first_exec"]["accelerator"]
    for kind in kinds:
        machine = "microvm" if kind == "microvm" else "q35"
        console.print(f"{kind}: bare QEMU boots ({machine})")
        figures[kind]["bare_qemu_boot_to_first_userspace_line"] = await bare_boot(machine, accel, samples)
    proc = start_daemon(state_dir / "warm")
    try:
        client = await connect(proc, state_dir / "warm")
        for kind in kinds:
            figures[kind]["restore_to_first_exec"] = await restores(console, client, kind, image, samples)
            figures[kind] |= await forks(client, kind, image, [1, 4])
        if idle_n and "microvm" in kinds:
            figures["microvm"]["idle"] = await idle(console, client, image, idle_n, concurrency=4)
        await kill_leftovers(console, client, LABEL)
        await client.aclose()
    finally:
        stop_daemon(proc)
        release_node(state_dir / "warm")
    for kind in kinds:
        f = figures[kind]
        cold, bare, restore = (
            f[k]["p50_ms"]
            for k in ("cold_boot_to_first_exec", "bare_qemu_boot_to_first_userspace_line", "restore_to_first_exec")
        )
        f["ratios"] = {"cold_over_restore_p50": round(cold / restore, 2), "cold_over_bare_p50": round(cold / bare, 2)}
    figures["accelerator"] = accel
    return figures


def main(kinds: list[str], samples: int, idle_n: int, json_out: Path, state_dir: Path) -> int:
    console = Console()
    try:
        figures = asyncio.run(run(console, kinds, samples, idle_n, state_dir))
    except (DsecError, RuntimeError) as e:
        console.print(f"[red]vm bench failed[/red]: {e}")
        return 1
    targets: dict[str, bool] = {}
    for kind in kinds:
        ratios = figures[kind]["ratios"]
        targets[f"{kind}: restore >= {TARGET_RESTORE_SPEEDUP}x faster than cold"] = (
            ratios["cold_over_restore_p50"] >= TARGET_RESTORE_SPEEDUP
        )
        targets[f"{kind}: cold boot <= {TARGET_COLD_VS_BARE}x bare QEMU"] = (
            ratios["cold_over_bare_p50"] <= TARGET_COLD_VS_BARE
        )
    if "idle" in figures.get("microvm", {}):
        held = figures["microvm"]["idle"]
        targets[f"microvm: >= {TARGET_IDLE} idle VMs held"] = held["held"] >= TARGET_IDLE
        targets[f"microvm: <= {TARGET_IDLE_MIB} MiB host memory per idle VM"] = (
            held["host_memory_per_vm_mib"] <= TARGET_IDLE_MIB
        )
    result = {
        "bench": "vm",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": host_facts(),
        "accelerator": figures.pop("accelerator"),
        "params": {"kinds": kinds, "samples": samples, "idle": idle_n, "memory": MEMORY, "image": "dsec/busybox"},
        "dsec": figures,
        "targets": targets,
    }
    json_out.write_text(json.dumps(result, indent=2) + "\n")
    console.print_json(json.dumps(result))
    return 0
