"""``dsec bench ...``: benchmarks that write JSON, with peers measured side by side in the same run."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console

from dsec import DsecError

# the same stderr console and error line as the rest of `dsec` (dsec.cli.common), kept here so that the bench
# never imports the CLI that registers it
err = Console(stderr=True)

# options most benches take (each bench sets its own default)
JsonOut = Annotated[Path, typer.Option("--json", help="Where to write the JSON results.")]
DaemonState = Annotated[Path, typer.Option(help="State dir of the daemon the bench starts.")]
Repository = Annotated[
    Path | None,
    typer.Option(help="Layer repository of the bench's daemon (default /var/tmp/dsec-images/repository)."),
]
PlotsOut = Annotated[Path, typer.Option(help="Directory for the JSON and its PNG plots.")]

bench_app = typer.Typer(help="Benchmarks that write JSON, with peers measured side by side.", no_args_is_help=True)


@bench_app.command("images")
def bench_images(
    n: Annotated[int, typer.Option("--n", help="Sandboxes in each cold burst.", min=1, max=1024)] = 64,
    json_out: JsonOut = Path("bench-images.json"),
    state_dir: Annotated[Path, typer.Option(help="Where the bench's nodes keep their state.")] = Path(
        "/var/lib/dsec-bench-images"
    ),
    latency_ms: Annotated[float, typer.Option(help="Simulated link: latency per repository request.")] = 5.0,
    bandwidth: Annotated[float, typer.Option(help="Simulated link: bandwidth in MB/s, shared.")] = 100.0,
) -> None:
    """Lazy vs eager layer loading: a cold burst on a >= 500 MB image over a simulated link, plus warm reads,
    pack_diff and snapshot -> new sandbox."""
    from .images import main as images_main

    raise typer.Exit(
        images_main(n=n, json_out=json_out, state_dir=state_dir, latency_ms=latency_ms, bandwidth_mb_s=bandwidth)
    )


@bench_app.command("lazy-reads")
def bench_lazy_reads(
    mb: Annotated[int, typer.Option(help="MB of file contents in the layer.", min=8)] = 512,
    rounds: Annotated[int, typer.Option(help="Rounds; each reads the layer once through every path.", min=1)] = 5,
    json_out: JsonOut = Path("bench-lazy-reads.json"),
    state_dir: Annotated[Path, typer.Option(help="Scratch directory (emptied first, removed after).")] = Path(
        "/var/tmp/dsec-bench-lazy-reads"
    ),
) -> None:
    """A whole layer read with the page cache dropped: through its lazy mount once every chunk was fetched,
    through a local EROFS mount of the same image, and through the fetcher's FUSE file, alternately."""
    from .lazyreads import main as lazy_reads_main

    raise typer.Exit(lazy_reads_main(mb=mb, rounds=rounds, json_out=json_out, state_dir=state_dir))


@bench_app.command("lifecycle")
def bench_lifecycle(
    n: Annotated[int, typer.Option("--n", help="Sequential iterations per system.", min=5)] = 100,
    burst: Annotated[int, typer.Option(help="Sandboxes in the concurrent burst.", min=1)] = 100,
    json_out: JsonOut = Path("bench-lifecycle.json"),
    state_dir: DaemonState = Path("/var/lib/dsec-bench"),
    skip_podman: Annotated[bool, typer.Option(help="Do not measure podman.")] = False,
) -> None:
    """create → exec `true` → destroy for dsec (cold, and from a warm pool), bare crun and podman; exec round
    trip vs crun exec."""
    from .lifecycle import main as bench_main

    raise typer.Exit(bench_main(n=n, burst=burst, json_out=json_out, state_dir=state_dir, skip_podman=skip_podman))


@bench_app.command("function")
def bench_function(
    n: Annotated[int, typer.Option("--n", help="Sequential calls per latency measurement.", min=5)] = 200,
    calls: Annotated[int, typer.Option("--calls", help="Calls per throughput measurement.", min=64)] = 1000,
    json_out: JsonOut = Path("bench-function.json"),
    state_dir: DaemonState = Path("/var/lib/dsec-bench-function"),
    repository: Repository = None,
) -> None:
    """One-shot `true` and python latency and calls/s at concurrency 1/8/64: a warm function pool beside
    a fresh container per call and a bare host subprocess."""
    from .function import main as function_main

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
    json_out: JsonOut = Path("bench-trajectory.json"),
    state_dir: DaemonState = Path("/var/lib/dsec-bench-trajectory"),
    repository: Repository = None,
) -> None:
    """Trajectory log: fast-forward rate of a recorded trajectory (a fresh client issuing the same calls)
    and the logging overhead on live exec latency, a logged and a plain sandbox side by side."""
    from .trajectory import main as trajectory_main

    raise typer.Exit(trajectory_main(n=n, steps=steps, json_out=json_out, state_dir=state_dir, repository=repository))


OUT_DIR = Path("bench-out")
SERVE_ARG = typer.Option(
    "--serve-arg", help="One more flag for the bench's `dsec serve`, e.g. --serve-arg=--cpu-capacity=1 (repeatable)."
)


@bench_app.command("density")
def bench_density(
    kind: Annotated[str, typer.Option(help="container, microvm or function.")] = "container",
    n: Annotated[int, typer.Option("--n", help="Idle sandboxes to hold.", min=1, max=100_000)] = 1000,
    until_full: Annotated[
        bool,
        typer.Option(
            help="Keep creating past --n until the node refuses one (429) or a creation fails; record that N "
            "and what admission saw then."
        ),
    ] = False,
    max_n: Annotated[int, typer.Option("--max", help="With --until-full: give up after this many.", min=1)] = 10_000,
    out: Annotated[Path, typer.Option(help="Directory for density-KIND.json and its PNG plots.")] = OUT_DIR,
    state_dir: DaemonState = Path("/var/lib/dsec-bench"),
    repository: Repository = None,
    image: Annotated[str | None, typer.Option(help="Image of the sandboxes (default dsec/busybox).")] = None,
    concurrency: Annotated[
        int | None, typer.Option(help="Creations in flight at once (default 32; microvm 4).", min=1)
    ] = None,
    sample_every: Annotated[
        int, typer.Option(help="Sample host memory and creation latency every this many held.", min=1)
    ] = 50,
    queue_timeout: Annotated[
        float, typer.Option(help="Seconds a creation may wait for capacity before the node answers 429.", min=0)
    ] = 0.5,
    min_available: Annotated[
        int, typer.Option(help="Stop creating when the host's MemAvailable falls below this many MiB.", min=0)
    ] = 3072,
    serve_arg: Annotated[list[str] | None, SERVE_ARG] = None,
) -> None:
    """Hold N idle sandboxes of a kind: host memory per sandbox, creation latency and rate as the node
    fills, exec latency while full; with --until-full, the N where the node starts refusing."""
    from .density import KINDS
    from .density import main as density_main

    if kind not in KINDS:
        err.print(f"[red]error[/red]: --kind must be one of {', '.join(KINDS)}, not {kind}")
        raise typer.Exit(2)
    raise typer.Exit(
        density_main(
            kind=kind,
            n=n,
            out=out,
            state_dir=state_dir,
            repository=repository,
            until_full=until_full,
            max_n=max_n,
            concurrency=concurrency,
            sample_every=sample_every,
            queue_timeout=queue_timeout,
            min_available_mib=min_available,
            image=image,
            serve_args=serve_arg,
        )
    )


HELD = typer.Option(
    "--held",
    help="Run the bursts with this many idle sandboxes held on the node (repeatable, e.g. --held 0 --held 1000 "
    "--held 3000; default 0): the rate should not fall with what is held.",
    min=0,
    max=20_000,
)


@bench_app.command("burst")
def bench_burst(
    n: Annotated[int, typer.Option("--n", help="Creations fired at once.", min=1, max=10_000)] = 1000,
    kind: Annotated[str, typer.Option(help="container or microvm.")] = "container",
    out: PlotsOut = OUT_DIR,
    state_dir: DaemonState = Path("/var/lib/dsec-bench-burst"),
    repository: Repository = None,
    mode: Annotated[
        list[str] | None,
        typer.Option(
            "--mode",
            help="individual (N create calls at once) and/or batch (one create_many); repeatable, the first is "
            "the headline. Default: both.",
        ),
    ] = None,
    concurrency: Annotated[int, typer.Option(help="individual: create calls in flight at once (0: all N).", min=0)] = 0,
    held: Annotated[list[int] | None, HELD] = None,
    overload: Annotated[
        float,
        typer.Option(
            help="Instead: start the node with capacity for N / this many sandboxes at once, fire N, and check "
            "none fails (each served, possibly after queueing, or answered 429 with Retry-After).",
            min=0,
        ),
    ] = 0,
    raw_queue_timeout: Annotated[
        float, typer.Option(help="--overload: the queue_timeout of the round that sees raw 429s.", min=0)
    ] = 1.0,
    node_queue_timeout: Annotated[
        float,
        typer.Option(help="--overload: the node's --queue-timeout (past it the SDK's round is answered 429).", min=0),
    ] = 30.0,
    serve_arg: Annotated[list[str] | None, SERVE_ARG] = None,
) -> None:
    """N creations at once, each then running its first exec: creations/s, success rate, p50/p99 by phase
    (client and the daemon's timings), the node's queue over time. JSON and PNG plots in --out."""
    from .burst import MODES
    from .burst import main as burst_main

    modes = mode or list(MODES)
    bad = [m for m in modes if m not in MODES]
    if bad or kind not in ("container", "microvm"):
        err.print(f"[red]error[/red]: --mode must be {' or '.join(MODES)} and --kind container or microvm")
        raise typer.Exit(2)
    if overload:
        if overload <= 1:
            err.print("[red]error[/red]: --overload must be more than 1 (times the node's capacity)")
            raise typer.Exit(2)
        from .overload import main as overload_main

        raise typer.Exit(
            overload_main(
                n=n,
                kind=kind,
                factor=overload,
                out=out,
                state_dir=state_dir,
                repository=repository,
                raw_queue_timeout=raw_queue_timeout,
                node_queue_timeout=node_queue_timeout,
                serve_args=serve_arg,
            )
        )
    raise typer.Exit(
        burst_main(
            n=n,
            kind=kind,
            out=out,
            state_dir=state_dir,
            repository=repository,
            modes=modes,
            concurrency=concurrency,
            serve_args=serve_arg,
            held=held,
        )
    )


@bench_app.command("vm")
def bench_vm(
    kind: Annotated[
        list[str] | None, typer.Option("--kind", help="VM kinds to measure (repeatable; default microvm and vm).")
    ] = None,
    samples: Annotated[int, typer.Option(help="Boots, restores and bare QEMU boots per kind.", min=1)] = 5,
    idle: Annotated[int, typer.Option(help="Idle micro-VMs to hold (0: skip).", min=0)] = 64,
    json_out: JsonOut = Path("bench-vm.json"),
    state_dir: Annotated[Path, typer.Option(help="Where the bench's daemons keep their state.")] = Path(
        "/var/lib/dsec-bench-vm"
    ),
) -> None:
    """VM kinds: cold boot and restore to the first exec beside bare QEMU, fork(n), idle VMs held."""
    from .vm import main as vm_main

    kind = kind or ["microvm", "vm"]
    bad = [k for k in kind if k not in ("microvm", "vm")]
    if bad:
        err.print(f"[red]error[/red]: --kind must be microvm or vm, not {', '.join(bad)}")
        raise typer.Exit(2)
    raise typer.Exit(vm_main(kinds=kind, samples=samples, idle_n=idle, json_out=json_out, state_dir=state_dir))


@bench_app.command("gateway")
def bench_gateway(
    n: Annotated[int, typer.Option("--n", help="`true` calls each way.", min=10)] = 500,
    json_out: JsonOut = Path("bench-gateway.json"),
    state_dir: DaemonState = Path("/var/lib/dsec-bench-gateway"),
    repository: Repository = None,
) -> None:
    """Exec round trip straight at a node vs through the cluster gateway, side by side."""
    from .gateway import main as gateway_main

    raise typer.Exit(gateway_main(n=n, json_out=json_out, state_dir=state_dir, repository=repository))


@bench_app.command("e2b")
def bench_e2b(
    n: Annotated[int, typer.Option("--n", help="Calls of each kind of work, each way.", min=10)] = 300,
    creates: Annotated[int, typer.Option(help="Create, first command, kill: rounds each way.", min=1)] = 20,
    json_out: JsonOut = Path("bench-e2b.json"),
    state_dir: DaemonState = Path("/var/lib/dsec-bench-e2b"),
    repository: Repository = None,
) -> None:
    """The unmodified e2b SDK vs dsec's SDK on one daemon and sandbox: command round trip, a 64 KiB file
    written and read back, and create to first command, side by side (needs the e2b package)."""
    from .e2b import main as e2b_main

    raise typer.Exit(e2b_main(n=n, creates=creates, json_out=json_out, state_dir=state_dir, repository=repository))


@bench_app.command("fusion")
def bench_fusion(
    n: Annotated[int, typer.Option("--n", help="Sequential calls per latency measurement.", min=1)] = 200,
    calls: Annotated[int, typer.Option("--calls", help="Calls per throughput measurement.", min=1)] = 400,
    json_out: JsonOut = Path("bench-fusion.json"),
    state_dir: DaemonState = Path("/var/lib/dsec-bench-fusion"),
    repository: Repository = None,
    skip: Annotated[
        list[str] | None, typer.Option("--skip", help="A peer not to measure: podman or crun (repeatable).")
    ] = None,
) -> None:
    """print(1) in Python through the SandboxFusion API (the sandbox-fusion client, as verl calls it) beside a
    fresh container per call on the same image (podman run --rm, crun run): p50 and calls/s at 1/8/32."""
    from .fusion import SYSTEMS
    from .fusion import main as fusion_main

    unknown = set(skip or ()) - set(SYSTEMS[1:])
    if unknown:
        err.print(f"[red]error[/red]: --skip takes {' or '.join(SYSTEMS[1:])}, not {', '.join(sorted(unknown))}")
        raise typer.Exit(2)
    raise typer.Exit(
        fusion_main(
            n=n, calls=calls, json_out=json_out, state_dir=state_dir, repository=repository, skip=set(skip or ())
        )
    )


@bench_app.command("tiers")
def bench_tiers(
    n: Annotated[
        int, typer.Option("--n", help="Creations admitted (and queued) in the admission runs.", min=100)
    ] = 50_000,
    tenants: Annotated[int, typer.Option(help="Tenants the creations are spread over.", min=1)] = 16,
    json_out: JsonOut = Path("bench-tiers.json"),
) -> None:
    """The node's tiers on a creation's path measured alone (no daemon): admission, uncontended and with
    every creation queued, and the state database's writes (docs/scaling.md)."""
    from .tiers import main as tiers_main

    raise typer.Exit(tiers_main(json_out=json_out, n=n, tenants=tenants))


@bench_app.command("pull")
def bench_pull(
    k: Annotated[int, typer.Option("--k", help="Task images, each pulled and run once per round.", min=1, max=99)] = 20,
    base_mb: Annotated[int, typer.Option(help="MB of file contents in the base the images share.", min=1)] = 300,
    base_layers: Annotated[int, typer.Option(help="Layers the base is split into.", min=1, max=8)] = 3,
    task_kb: Annotated[int, typer.Option(help="KB of file contents in each image's own layer.", min=1)] = 512,
    incompressible: Annotated[
        float, typer.Option(help="Share of the files' bytes that are random (gzip cannot shrink them).", min=0, max=1)
    ] = 0.35,
    concurrency: Annotated[int, typer.Option(help="Images in flight at once, on each side.", min=1)] = 8,
    json_out: JsonOut = Path("bench-pull.json"),
    plot: Annotated[bool, typer.Option(help="Draw PNG plots beside the JSON (needs matplotlib).")] = True,
    state_dir: Annotated[
        Path, typer.Option(help="Where the bench keeps its registry, nodes and podman storage while it runs.")
    ] = Path("/var/lib/dsec-bench-pull"),
    skip_podman: Annotated[bool, typer.Option(help="Do not measure podman.")] = False,
) -> None:
    """K task images sharing a large base, from a registry the bench starts on loopback: dsec's create →
    exec → kill against podman pull + run --rm on a cold node, then warm, then a second dsec node on the
    same layer repository; time to the first and last image, registry bytes, bytes written to disk."""
    from .pull import Params
    from .pull import main as pull_main

    params = Params(
        k=k,
        base_mb=base_mb,
        base_layers=base_layers,
        task_kb=task_kb,
        incompressible=incompressible,
        concurrency=concurrency,
    )
    _exit_with(lambda: pull_main(params, json_out=json_out, state_dir=state_dir, plot=plot, skip_podman=skip_podman))


@bench_app.command("soak")
def bench_soak(
    minutes: Annotated[float, typer.Option(help="Minutes of churn.", min=0.1, max=24 * 60)] = 10.0,
    kinds: Annotated[
        str, typer.Option(help="Kinds to churn, comma-separated (default all: container,function,microvm,vm).")
    ] = "container,function,microvm,vm",
    workers: Annotated[int, typer.Option(help="Concurrent container lanes (VMs have one lane).", min=1, max=64)] = 3,
    vm_pause: Annotated[float, typer.Option(help="Seconds the VM lane rests between VM scenarios.", min=0)] = 5.0,
    settle: Annotated[
        float, typer.Option(help="Seconds the node may take to settle, before the baseline and after the churn.", min=5)
    ] = 180.0,
    json_out: JsonOut = Path("bench-soak.json"),
    state_dir: Annotated[
        Path,
        typer.Option(help="State dir of the bench's daemon; its layer repository is kept there (the soak gcs it)."),
    ] = Path("/var/lib/dsec-bench-soak"),
) -> None:
    """Churn create / exec / files / snapshot / fork / network / kill across the kinds, hostile workloads
    mixed in, for --minutes; then account for every host object (mounts, cgroups, uid leases, fds,
    threads, RSS, SQLite rows, caches, temporary files, QEMUs, namespaces, nftables) against the baseline.
    Exits non-zero on a leak or an unexpected error."""
    from .soak import KINDS
    from .soak import main as soak_main

    chosen = _choose(kinds, KINDS, "--kinds")
    _exit_with(
        lambda: soak_main(
            minutes=minutes,
            kinds=chosen,
            workers=workers,
            vm_pause=vm_pause,
            settle_s=settle,
            json_out=json_out,
            state_dir=state_dir,
        )
    )


@bench_app.command("chaos")
def bench_chaos(
    faults: Annotated[
        str, typer.Option(help="Faults to inject, comma-separated (default all).")
    ] = "fetcher,daemon,qemu,crun,state-disk-full,layer-cache-full,sandbox-disk-full",
    json_out: JsonOut = Path("bench-chaos.json"),
    state_dir: Annotated[
        Path, typer.Option(help="Where the bench makes its nodes (each on a tmpfs of its own) and its repository.")
    ] = Path("/var/lib/dsec-bench-chaos"),
    repository: Annotated[
        Path,
        typer.Option(
            help="A local layer repository holding dsec/busybox and dsec/debian:12 (default: that of `dsec serve` "
            "with its defaults): the bench's own repository is "
            "seeded from it by hard links (nothing is written to it)."
        ),
    ] = Path("/var/lib/dsec/images/repository"),
) -> None:
    """Inject one fault at a time (SIGKILL of the fetcher, the daemon, a QEMU, crun mid-create; a full state
    file system, layer cache, or sandbox writable layer) into a node during a burst of 64 creations and
    execs; check every request ended clearly, the node recovered, SQLite and the repository are intact, and
    nothing leaked. Exits non-zero if any fault was not handled."""
    from .chaos import main as chaos_main
    from .faults import FAULTS

    chosen = _choose(faults, FAULTS, "--faults")
    _exit_with(lambda: chaos_main(chosen, state_dir, repository, json_out))


@bench_app.command("checkpoint")
def bench_checkpoint(
    kinds: Annotated[
        str,
        typer.Option(
            help="Kinds to measure, comma-separated (container,function,microvm,vm); a kind that cannot take "
            "checkpoints is recorded with the error it answers."
        ),
    ] = "container",
    rounds: Annotated[int, typer.Option(help="Timed rounds of each operation, per kind and diff size.", min=1)] = 20,
    big_mb: Annotated[int, typer.Option(help="MB of random bytes in the big diff.", min=1, max=16_384)] = 200,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Where to write the JSON results (default OUT/checkpoint.json).")
    ] = None,
    out: Annotated[Path, typer.Option(help="Directory for the PNG plots (and the JSON by default).")] = OUT_DIR,
    state_dir: DaemonState = Path("/var/lib/dsec-bench-checkpoint"),
    repository: Annotated[
        Path | None,
        typer.Option(
            help="Layer repository holding dsec/busybox (default /var/tmp/dsec-images/repository): the bench's "
            "daemon publishes its snapshots into a repository of its own in the state dir, seeded from this "
            "one by hard links (nothing is written to it)."
        ),
    ] = None,
) -> None:
    """checkpoint, rollback → first exec and fork(8) → all answered, with a small and a big diff, against
    snapshot → new image → create (kill + create → first exec; 8 creations → all answered)."""
    from .checkpoint import KINDS
    from .checkpoint import main as checkpoint_main

    chosen = _choose(kinds, KINDS, "--kinds")
    _exit_with(
        lambda: checkpoint_main(
            kinds=chosen,
            rounds=rounds,
            big_mb=big_mb,
            json_out=json_out,
            out=out,
            state_dir=state_dir,
            repository=repository,
        )
    )


def _choose(text: str, allowed: Iterable[str], flag: str) -> list[str]:
    """A comma-separated option's items, each one of ``allowed`` (else exit 2 saying which are)."""
    names = list(allowed)
    chosen = [item.strip() for item in text.split(",") if item.strip()]
    if not chosen or any(item not in names for item in chosen):
        err.print(f"[red]error[/red]: {flag} takes {', '.join(names)}, not {text!r}")
        raise typer.Exit(2)
    return chosen


def _exit_with(run: Callable[[], int]) -> NoReturn:
    """Exit with a bench's status; a DsecError it raises is one error line, not a traceback."""
    try:
        status = run()
    except DsecError as e:
        _fail(e)
    raise typer.Exit(status)


def _fail(e: DsecError) -> NoReturn:
    err.print(f"[red]error[/red] ({e.code}): {e.message}")
    raise typer.Exit(2)
