"""``dsec bench ...``: benchmarks that write JSON, with peers measured side by side in the same run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import err

bench_app = typer.Typer(help="Benchmarks that write JSON, with peers measured side by side.", no_args_is_help=True)


@bench_app.command("images")
def bench_images(
    n: Annotated[int, typer.Option("--n", help="Sandboxes in each cold burst.", min=1, max=1024)] = 64,
    json_out: Annotated[Path, typer.Option("--json", help="Where to write the JSON results.")] = Path(
        "bench-images.json"
    ),
    state_dir: Annotated[Path, typer.Option(help="Where the bench's nodes keep their state.")] = Path(
        "/var/lib/dsec-bench-images"
    ),
    latency_ms: Annotated[float, typer.Option(help="Simulated link: latency per repository request.")] = 5.0,
    bandwidth: Annotated[float, typer.Option(help="Simulated link: bandwidth in MB/s, shared.")] = 100.0,
) -> None:
    """Lazy vs eager layer loading: a cold burst on a >= 500 MB image over a simulated link, plus warm reads,
    pack_diff and snapshot -> new sandbox."""
    from ..bench.images import main as images_main

    raise typer.Exit(
        images_main(n=n, json_out=json_out, state_dir=state_dir, latency_ms=latency_ms, bandwidth_mb_s=bandwidth)
    )


@bench_app.command("lifecycle")
def bench_lifecycle(
    n: Annotated[int, typer.Option("--n", help="Sequential iterations per system.", min=5)] = 100,
    burst: Annotated[int, typer.Option(help="Sandboxes in the concurrent burst.", min=1)] = 100,
    json_out: Annotated[Path, typer.Option("--json", help="Where to write the JSON results.")] = Path(
        "bench-lifecycle.json"
    ),
    state_dir: Annotated[Path, typer.Option(help="State dir of the daemon the bench starts.")] = Path(
        "/var/lib/dsec-bench"
    ),
    skip_podman: Annotated[bool, typer.Option(help="Do not measure podman.")] = False,
) -> None:
    """create → exec `true` → destroy for dsec, bare crun and podman; exec round trip vs crun exec."""
    from ..bench.lifecycle import main as bench_main

    raise typer.Exit(bench_main(n=n, burst=burst, json_out=json_out, state_dir=state_dir, skip_podman=skip_podman))


@bench_app.command("function")
def bench_function(
    n: Annotated[int, typer.Option("--n", help="Sequential calls per latency measurement.", min=5)] = 200,
    calls: Annotated[int, typer.Option("--calls", help="Calls per throughput measurement.", min=64)] = 1000,
    json_out: Annotated[Path, typer.Option("--json", help="Where to write the JSON results.")] = Path(
        "bench-function.json"
    ),
    state_dir: Annotated[Path, typer.Option(help="State dir of the daemon the bench starts.")] = Path(
        "/var/lib/dsec-bench-function"
    ),
    repository: Annotated[
        Path | None, typer.Option(help="Layer repository holding dsec/busybox and dsec/debian:12.")
    ] = None,
) -> None:
    """One-shot `true` and python latency and calls/s at concurrency 1/8/64: a warm function pool beside
    a fresh container per call and a bare host subprocess."""
    from ..bench.function import main as function_main

    raise typer.Exit(function_main(n=n, calls=calls, json_out=json_out, state_dir=state_dir, repository=repository))


@bench_app.command("trajectory")
def bench_trajectory(
    steps: Annotated[
        int, typer.Option("--steps", help="Exec steps recorded live, then fast-forwarded.", min=10, max=100_000)
    ] = 10000,
    n: Annotated[
        int,
        typer.Option(
            "--n",
            help="Sequential `true` calls on each latency sandbox (logged and plain, alternately).",
            min=10,
            max=100_000,
        ),
    ] = 500,
    json_out: Annotated[Path, typer.Option("--json", help="Where to write the JSON results.")] = Path(
        "bench-trajectory.json"
    ),
    state_dir: Annotated[Path, typer.Option(help="State dir of the daemon the bench starts.")] = Path(
        "/var/lib/dsec-bench-trajectory"
    ),
    repository: Annotated[Path | None, typer.Option(help="Layer repository holding dsec/busybox.")] = None,
) -> None:
    """Trajectory log: fast-forward rate of a recorded trajectory (a fresh client issuing the same calls)
    and the logging overhead on live exec latency, a logged and a plain sandbox side by side."""
    from ..bench.trajectory import main as trajectory_main

    raise typer.Exit(trajectory_main(n=n, steps=steps, json_out=json_out, state_dir=state_dir, repository=repository))


@bench_app.command("density")
def bench_density(
    n: Annotated[int, typer.Option("--n", help="Idle sandboxes to hold.", min=1)] = 1000,
    image: Annotated[str, typer.Option(help="Image of the sandboxes.")] = "dsec/busybox",
    concurrency: Annotated[int, typer.Option(help="Creations in flight at once.", min=1)] = 32,
    json_out: Annotated[Path, typer.Option("--json", help="Where to write the JSON results.")] = Path(
        "bench-density.json"
    ),
    state_dir: Annotated[Path, typer.Option(help="State dir of the daemon the bench starts.")] = Path(
        "/var/lib/dsec-bench"
    ),
) -> None:
    """Hold N idle container sandboxes; host memory per sandbox and exec latency while full."""
    from ..bench.density import main as density_main

    raise typer.Exit(density_main(n=n, json_out=json_out, state_dir=state_dir, image=image, concurrency=concurrency))


@bench_app.command("vm")
def bench_vm(
    kind: Annotated[
        list[str] | None, typer.Option("--kind", help="VM kinds to measure (repeatable; default microvm and vm).")
    ] = None,
    samples: Annotated[int, typer.Option(help="Boots, restores and bare QEMU boots per kind.", min=1)] = 5,
    idle: Annotated[int, typer.Option(help="Idle micro-VMs to hold (0: skip).", min=0)] = 64,
    json_out: Annotated[Path, typer.Option("--json", help="Where to write the JSON results.")] = Path("bench-vm.json"),
    state_dir: Annotated[Path, typer.Option(help="Where the bench's daemons keep their state.")] = Path(
        "/var/lib/dsec-bench-vm"
    ),
) -> None:
    """VM kinds: cold boot and restore to the first exec beside bare QEMU, fork(n), idle VMs held."""
    from ..bench.vm import main as vm_main

    kind = kind or ["microvm", "vm"]
    bad = [k for k in kind if k not in ("microvm", "vm")]
    if bad:
        err.print(f"[red]error[/red]: --kind must be microvm or vm, not {', '.join(bad)}")
        raise typer.Exit(2)
    raise typer.Exit(vm_main(kinds=kind, samples=samples, idle_n=idle, json_out=json_out, state_dir=state_dir))
