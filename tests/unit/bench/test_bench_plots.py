"""The scale benches' plots, drawn from fixed figures: each is a non-empty PNG; and the pure helpers
they and the benches' JSON rely on (rolling median, Prometheus sums, the overload node's flags)."""

from __future__ import annotations

import builtins
import sys
from pathlib import Path
from typing import Any

import pytest

from dsec_bench import plots
from dsec_bench.burst import Outcome, Spec, latency_figures, run_figures, thin
from dsec_bench.common import metric_sum
from dsec_bench.overload import admitted_at_once, daemon_flags, round_figures

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def is_png(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG_MAGIC


def test_lines_with_a_second_axis(tmp_path: Path) -> None:
    held = [50, 100, 150, 200]
    path = plots.lines(
        tmp_path / "sub" / "memory.png",  # a directory that does not exist yet
        "memory",
        "held",
        "MiB",
        {"used": (held, [52.0, 101.0, 149.5, 205.0])},
        right={"per sandbox": (held, [1.04, 1.01, 1.0, 1.02])},
        right_label="MiB each",
    )
    assert path == tmp_path / "sub" / "memory.png" and is_png(path)


def test_scatter_cdf_rate_and_cumulative(tmp_path: Path) -> None:
    x = list(range(1, 201))
    y = [10.0 + (i % 7) for i in x]
    written = [
        plots.scatter(tmp_path / "lat.png", "latency", "n", "ms", {"client": (x, y)}, log_y=True, window=9),
        plots.cdf(tmp_path / "cdf.png", "phases", {"queue": [0.1, 0.2, 5.0], "runtime": y, "empty": []}),
        plots.rate(tmp_path / "rate.png", "rate", {"created": [i / 100 for i in x]}),
        plots.cumulative(tmp_path / "done.png", "done", {"created": [i / 100 for i in x], "exec": [0.5, 1.0]}),
        plots.lines(tmp_path / "steps.png", "q", "t", "n", {"queued": ([0.0, 1.0, 2.0], [0, 5, 0])}, steps=True),
    ]
    assert all(is_png(p) for p in written)


def test_plots_of_nothing_still_draw(tmp_path: Path) -> None:
    # a run where everything failed has empty series: the plot says so rather than the bench crashing
    assert is_png(plots.cdf(tmp_path / "a.png", "none", {}))
    assert is_png(plots.rate(tmp_path / "b.png", "none", {"created": []}))
    assert is_png(plots.scatter(tmp_path / "c.png", "none", "n", "ms", {"x": ([], [])}, log_y=True, window=5))


def test_rolling_median() -> None:
    assert plots.rolling_median([], 3) == []
    assert plots.rolling_median([5.0, 1.0, 3.0, 100.0, 2.0], 3) == [5.0, 3.0, 3.0, 3.0, 3.0]
    assert plots.rolling_median([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]


def test_missing_matplotlib_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(RuntimeError, match=r"pip install 'dsec\[bench\]'"):
        plots.cdf(tmp_path / "x.png", "x", {"a": [1.0]})
    assert not plots.available()


def test_metric_sum_reads_prometheus_text() -> None:
    text = "\n".join(
        [
            "# HELP dsec_creation_failures_total Creations that did not give a sandbox.",
            "# TYPE dsec_creation_failures_total counter",
            'dsec_creation_failures_total{kind="container",reason="overloaded"} 27.0',
            'dsec_creation_failures_total{kind="microvm",reason="overloaded"} 3.0',
            'dsec_creation_failures_total{kind="container",reason="backend_error"} 1.0',
            'dsec_creation_failures_created{kind="container",reason="overloaded"} 1.7e9',
            "dsec_admission_wait_seconds_count 5.0",
        ]
    )
    assert metric_sum(text, "dsec_creation_failures_total", reason="overloaded") == 30.0
    assert metric_sum(text, "dsec_creation_failures_total", kind="container") == 28.0
    assert metric_sum(text, "dsec_admission_wait_seconds_count") == 5.0
    assert metric_sum(text, "dsec_absent") == 0.0


def test_overload_node_admits_exactly_n_over_factor() -> None:
    spec = Spec(cpu=0.01)
    assert admitted_at_once(1000, 10) == 100 and admitted_at_once(30, 10) == 3 and admitted_at_once(5, 10) == 1
    flags = daemon_flags(30, 10, spec)
    assert flags[flags.index("--cpu-capacity") + 1] == "0.03" and flags[flags.index("--cpu-ratio") + 1] == "1"


def outcome(i: int, *, error: str | None = None, retry_after: float | None = None) -> Outcome:
    if error is not None:
        return Outcome(i, sent=0.0, error=error, retry_after=retry_after, refused_at=0.01)
    timings = {"queue": 0.5, "rootfs": 0.02, "runtime": 0.05, "total": 0.57, "first_exec": 0.004}
    return Outcome(i, sent=0.0, created=0.6 + i / 100, first_exec=0.61 + i / 100, timings=timings)


def test_run_figures_count_rate_success_and_phases() -> None:
    outcomes = [outcome(i) for i in range(9)] + [outcome(9, error="backend_error")]
    f = run_figures(outcomes, {"daemon_cpu_ms_per_creation": 1.0})
    assert (f["n"], f["succeeded"], f["failed"], f["success_rate"]) == (10, 9, 1, 0.9)
    assert f["failures"] == {"backend_error": 1}
    assert f["creations_per_s"] == round(9 / 0.68, 2)
    lat = f["latency"]
    assert lat["daemon_service"]["p50_ms"] == pytest.approx(70.0)  # total - queue
    assert {"client_create", "client_create_to_first_exec", "daemon_queue", "daemon_first_exec"} <= set(lat)
    assert latency_figures([]) == {}


def test_overload_round_figures_hold_the_invariant() -> None:
    outcomes = [outcome(i) for i in range(3)]
    outcomes += [outcome(i, error="overloaded", retry_after=1.5) for i in range(3, 30)]
    f = round_figures(outcomes, 27.0, {"queued": 24.0})
    assert (f["served"], f["refused_429"], f["refused_with_retry_after"], f["failed"]) == (3, 27, 27, 0)
    assert f["served_plus_refused_is_n"] and f["daemon_answered_429"] == 27
    assert f["retry_after_s"] == {"min": 1.5, "max": 1.5}
    # a 429 without a Retry-After, and an error that is not a 429, are told apart
    outcomes[3] = outcome(3, error="overloaded")
    outcomes[4] = outcome(4, error="backend_error")
    f = round_figures(outcomes, 26.0, {})
    assert (f["refused_429"], f["refused_with_retry_after"], f["failed"]) == (26, 25, 1)
    assert not f["served_plus_refused_is_n"] and f["failures"] == {"backend_error": 1}


def test_thin_keeps_the_node_samples_short() -> None:
    samples = [{"t": i} for i in range(1000)]
    kept = thin(samples, keep=100)
    assert 100 <= len(kept) <= 101 and kept[0] == {"t": 0}
    assert thin(samples[:10]) == samples[:10]
