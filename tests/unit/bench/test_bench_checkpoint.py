"""The checkpoint bench's pure parts: the diffs it writes, its statistics and ratios, the targets, the JSON
it writes, the summary and the plots, and the refusal of an unknown kind before any daemon starts."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from dsec import InvalidRequest
from dsec.cli.main import app
from dsec_bench import checkpoint as ck
from dsec_bench import plots

MS = 0.001


def size_entry(ours_ms: float, alt_ms: float, rounds: int = 5, **extra: Any) -> dict[str, Any]:
    """A measured size whose every operation takes ``ours_ms`` and every alternative ``alt_ms``."""
    samples: dict[str, list[float]] = {m: [] for m in ck.MEASURES}
    for ours, alt in ck.OPS.values():
        samples[ours] = [ours_ms * MS] * rounds
        samples[alt] = [alt_ms * MS] * rounds
    samples["rollback_call"] = [ours_ms * 0.8 * MS] * rounds
    samples["fork8_call"] = [ours_ms * 0.5 * MS] * rounds
    measurements, raw, ratios = ck.figures(samples)
    entry = {"diff": ck.Diff.of("small", 8192).facts(), "checkpoint_bytes": 4096, "measurements": measurements}
    return entry | {"ratios": ratios, "samples_ms": raw} | extra


def measured(small: tuple[float, float], big: tuple[float, float]) -> dict[str, Any]:
    return {"status": "measured", "small": size_entry(*small), "big": size_entry(*big)}


REFUSED = {
    "status": "refused",
    "refused": {"code": "invalid_request", "message": "sandboxes of kind 'function' cannot take checkpoints yet"},
}


def test_the_diffs_are_spread_over_a_few_files_of_random_bytes() -> None:
    small, big = ck.diffs(200)
    assert small.name == "small" and sum(small.sizes) == ck.FILES * ck.SMALL_FILE_BYTES < 16 << 10
    assert big.name == "big" and sum(big.sizes) == 200 << 20 and len(big.sizes) == ck.FILES
    odd = ck.Diff.of("big", 10)
    assert odd.sizes == (3, 3, 2, 2) and sum(odd.sizes) == 10
    script = big.script()
    assert script.startswith(f"mkdir -p {ck.DIR} && ") and script.count("/dev/urandom") == ck.FILES
    assert f"head -c {50 << 20} /dev/urandom > {ck.DIR}/f-1" in script
    assert not ck.DIR.startswith(("/tmp", "/var/tmp"))  # a snapshot scrubs those: the alternative would lose the diff
    assert big.facts() == {"files": ck.FILES, "bytes": 200 << 20, "path": ck.DIR}


def test_a_round_changes_what_the_restored_check_looks_at() -> None:
    # the check after going back fails on the changed files: it removes f-1 and adds the marker
    assert f"rm {ck.DIR}/f-1" in ck.change(3) and f"> {ck.DIR}/marker" in ck.change(3)
    assert f"[ ! -e {ck.DIR}/marker ]" in ck.RESTORED and f"[ -e {ck.DIR}/f-1 ]" in ck.RESTORED
    assert ck.change(1) != ck.change(2)


def test_the_disk_limit_holds_the_diff_and_two_checkpoints() -> None:
    assert ck.disk_for(4) == "1024Mi"
    assert ck.disk_for(200) == "1056Mi"
    assert ck.disk_for(1000) == "4256Mi"


def test_figures_summarize_each_measure_and_keep_the_samples() -> None:
    samples: dict[str, list[float]] = {m: [] for m in ck.MEASURES}
    samples["checkpoint"] = [0.010, 0.020, 0.030]
    samples["snapshot"] = [0.100, 0.200, 0.300]
    measurements, raw, ratios = ck.figures(samples)
    assert set(measurements) == set(raw) == {"checkpoint", "snapshot"}  # nothing for what was not measured
    assert measurements["checkpoint"]["n"] == 3 and measurements["checkpoint"]["p50_ms"] == 20.0
    assert raw["snapshot"] == [100.0, 200.0, 300.0]
    assert ratios == {
        "snapshot_over_checkpoint": 10.0,
        "recreate_over_rollback": None,
        "create8_over_fork8": None,
        "create8_over_fork8_pooled": None,
    }


def test_ratios_are_the_alternatives_p50_over_ours() -> None:
    ratios = size_entry(20.0, 130.0)["ratios"]
    assert ratios == {
        "snapshot_over_checkpoint": 6.5,
        "recreate_over_rollback": 6.5,
        "create8_over_fork8": 6.5,
        "create8_over_fork8_pooled": 6.5,
    }
    zero = {"checkpoint": {"p50_ms": 0.0}, "snapshot": {"p50_ms": 5.0}}
    assert ck.ratios(zero)["snapshot_over_checkpoint"] is None


def test_judge_meets_the_targets() -> None:
    targets = ck.judge({"container": measured((40.0, 400.0), (45.0, 900.0))})
    assert {k: t["met"] for k, t in targets.items()} == {
        "container_rollback_small_p50_le_50ms": True,
        "container_fork8_small_p50_le_500ms": True,
        "container_fork8_big_p50_le_500ms": True,
        "container_rollback_small_ge_5x_recreate": True,
        "container_fork8_small_ge_5x_create8": True,
        "container_fork8_pooled_small_ge_5x_create8": True,
        "container_rollback_big_ge_5x_recreate": True,
        "container_fork8_big_ge_5x_create8": True,
        "container_fork8_pooled_big_ge_5x_create8": True,
    }
    rollback = targets["container_rollback_small_p50_le_50ms"]
    assert rollback["value"] == 40.0 and rollback["rollback_call_p50_ms"] == 32.0
    assert targets["container_rollback_big_ge_5x_recreate"]["value"] == 20.0
    json.dumps(targets)


def test_judge_misses_and_right_at_the_targets() -> None:
    # a rollback of 58.8 ms, forks of 0.6 s, the alternative barely slower
    targets = ck.judge({"container": measured((58.8, 66.0), (600.0, 700.0))})
    assert targets["container_rollback_small_p50_le_50ms"]["met"] is False
    assert targets["container_fork8_big_p50_le_500ms"]["met"] is False
    assert targets["container_fork8_small_p50_le_500ms"]["met"] is True
    assert targets["container_rollback_small_ge_5x_recreate"] == {
        "target": targets["container_rollback_small_ge_5x_recreate"]["target"],
        "value": 1.12,
        "met": False,
    }
    at = ck.judge({"container": measured((50.0, 250.0), (500.0, 2500.0))})
    assert all(t["met"] for t in at.values()), at


def test_judge_unknowns_are_not_misses() -> None:
    nothing: tuple[dict[str, Any], ...] = (
        {},
        {"function": REFUSED},
        {"container": {"status": "failed", "error": {"message": "x"}}},
    )
    for kinds in nothing:
        targets = ck.judge(kinds)
        assert len(targets) == 9 and all(t["value"] is None and t["met"] is None for t in targets.values())
    # the small size measured, the big one failed before any figure
    half: dict[str, Any] = {"status": "failed", "small": size_entry(30.0, 300.0), "big": size_entry(30.0, 300.0)}
    half["big"]["measurements"], half["big"]["ratios"] = {}, {}
    targets = ck.judge({"container": half})
    assert targets["container_fork8_small_p50_le_500ms"]["met"] is True
    assert targets["container_fork8_big_p50_le_500ms"]["met"] is None


def test_a_refusal_is_a_result_and_an_error_a_failure() -> None:
    failed = measured((30.0, 300.0), (30.0, 300.0))
    failed["big"]["error"] = {"code": "backend_error", "message": "crun died", "stage": "fork"}
    kinds = {"container": failed, "function": REFUSED, "vm": {"status": "failed", "error": {"message": "no qemu"}}}
    assert ck.failures(kinds) == ["container big: crun died", "vm: no qemu"]
    assert ck.failures({"container": measured((1.0, 2.0), (1.0, 2.0)), "function": REFUSED}) == []


def test_error_body_names_the_code_and_the_stage() -> None:
    e = InvalidRequest("sandboxes of kind 'vm' cannot take checkpoints yet")
    assert ck.error_body(e, "checkpoint") == {"code": "invalid_request", "message": str(e), "stage": "checkpoint"}
    assert ck.error_body(RuntimeError("`true`: exit 1"), "fork") == {
        "code": "RuntimeError",
        "message": "`true`: exit 1",
        "stage": "fork",
    }


def result(kinds: dict[str, Any]) -> dict[str, Any]:
    params = {"kinds": list(kinds), "rounds": 5, "big_mb": 200}
    return ck.build_result("2026-01-01T00:00:00+00:00", params, {"version": "0.1.0", "kinds": kinds})


def test_the_json_has_the_benches_shape() -> None:
    kinds = {"container": measured((40.0, 400.0), (45.0, 900.0)), "function": REFUSED}
    data = json.loads(json.dumps(result(kinds)))
    assert {"bench", "when", "host", "params", "kinds", "targets", "failures"} <= set(data)
    assert data["bench"] == "checkpoint" and data["daemon_version"] == "0.1.0" and data["failures"] == []
    assert set(data["measures"]) == set(ck.MEASURES)
    assert data["kinds"]["function"]["refused"]["code"] == "invalid_request"
    small = data["kinds"]["container"]["small"]
    assert set(small["measurements"]) == set(small["samples_ms"]) == set(ck.MEASURES)
    assert {"p50_ms", "p99_ms", "n"} <= set(small["measurements"]["rollback_first_exec"])
    assert set(small["ratios"]) == set(ck.RATIOS)
    for t in data["targets"].values():
        assert {"target", "value", "met"} <= set(t)


def test_print_summary_shows_figures_refusals_errors_and_targets() -> None:
    failed = measured((40.0, 400.0), (45.0, 900.0))
    failed["big"]["error"] = {"code": "backend_error", "message": "crun died", "stage": "fork"}
    console = Console(file=io.StringIO(), width=200)
    ck.print_summary(console, result({"container": failed, "function": REFUSED}))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "back to it → first exec" in text and "rollback call" in text and "fork(8) call" in text
    assert "10.0×" in text and "20.0×" in text
    assert "function: refused (invalid_request)" in text and "cannot take checkpoints yet" in text
    assert "container big failed at fork: crun died" in text
    assert "met" in text and "p50 ≤ 50 ms" in text


@pytest.mark.skipif(not plots.available(), reason="matplotlib is not installed")
def test_draw_plots_the_measured_kinds_only(tmp_path: Path) -> None:
    kinds = {"container": measured((40.0, 400.0), (45.0, 900.0)), "function": REFUSED}
    names = ck.draw(tmp_path, kinds)
    assert names == ["checkpoint-container-p50.png", "checkpoint-container-rollback-cdf.png"]
    for name in names:
        png = (tmp_path / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert ck.draw(tmp_path / "none", {"function": REFUSED}) == []


def test_an_unknown_kind_is_refused_before_a_daemon_starts(tmp_path: Path) -> None:
    args = ["bench", "checkpoint", "--kinds", "container,pod", "--state-dir", str(tmp_path / "state")]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "--kinds takes container, function, microvm, vm" in res.output
    assert not (tmp_path / "state").exists()
