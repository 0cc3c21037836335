"""The trajectory bench's pure parts: its steps, the checks of a recording and of a replay, the figures of
a fast-forward, best and median, the logging overhead, the targets, the exit status, its arguments."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from dsec.protocol.sandbox import ExecResult
from dsec.sdk.trajectory import PAGE
from dsec_bench import common as bench_common
from dsec_bench import trajectory as tb
from dsec_bench.common import summarize


def replayed(i: int, **change: Any) -> ExecResult:
    return ExecResult(exit_code=0, stdout=tb.expected(i), replayed=True).model_copy(update=change)


def run(
    k: int, steps: int = 10_000, create_s: float = 0.01, replay_s: float = 1.0, problems: int = 0
) -> dict[str, Any]:
    bad = [f"step {i}: ran live, not replayed" for i in range(1, problems + 1)]
    return tb.run_entry(k, steps, create_s, replay_s, [replay_s / steps] * steps, bad, {"daemon": 0.1, "bench": 0.5})


def latency(logged_ms: float, plain_ms: float) -> dict[str, Any]:
    logged, plain = summarize([logged_ms / 1000] * 4), summarize([plain_ms / 1000] * 4)
    return {"logged": logged, "plain": plain, "overhead": tb.overhead(logged, plain), "warmup": tb.WARMUP}


def test_the_reported_page_is_the_sdks() -> None:
    # the bench states the page size rather than import it from the SDK's internals: this keeps it true
    assert tb.SDK_PAGE == PAGE


def test_steps_are_distinct_deterministic_and_cheap() -> None:
    cmds = [tb.step_cmd(i) for i in range(1, 1001)]
    assert len({tuple(c) for c in cmds}) == 1000
    assert tb.step_cmd(7) == tb.step_cmd(7) == ["echo", "step-7"]
    assert tb.expected(7) == "step-7\n"


def test_sandbox_spec_is_the_same_for_every_sandbox_and_outlives_the_recording() -> None:
    spec = tb.sandbox_spec(10_000)
    assert spec == tb.sandbox_spec(10_000)  # a resume must repeat the create exactly
    assert spec["image"] == "dsec/busybox" and spec["kind"] == "container" and spec["labels"] == tb.LABELS
    assert spec["timeout"] >= 600 + 10_000 * 0.1
    json.dumps(spec)


def test_check_live_wants_the_steps_own_output_run_live() -> None:
    assert tb.check_live(3, ExecResult(exit_code=0, stdout="step-3\n")) is None
    assert "expected 'step-3\\n'" in str(tb.check_live(3, ExecResult(exit_code=0, stdout="step-4\n")))
    assert str(tb.check_live(3, ExecResult(exit_code=127, stderr="echo: not found"))).startswith("exit 127")
    assert tb.check_live(3, ExecResult(exit_code=0, stdout="step-3\n", replayed=True)) is not None


def test_verify_accepts_a_faithful_replay() -> None:
    recorded = [tb.expected(i) for i in range(1, 101)]
    assert tb.verify([replayed(i) for i in range(1, 101)], recorded) == []


def test_verify_names_every_mismatch() -> None:
    recorded = [tb.expected(i) for i in range(1, 6)]
    results = [
        replayed(1),
        replayed(2, replayed=False),  # ran live: the fast-forward did not fast-forward
        replayed(3, stdout="step-30\n"),  # another output than the recorded one
        replayed(4, exit_code=1),
        replayed(5),
    ]
    problems = tb.verify(results, recorded)
    assert problems == [
        "step 2: ran live, not replayed",
        "step 3: stdout 'step-30\\n', recorded 'step-3\\n'",
        "step 4: exit 1",
    ]
    # fewer results than recorded steps (a fast-forward cut short) is a mismatch too
    assert tb.verify(results[:3], recorded)[0] == "3 results for 5 recorded steps"


def test_a_mismatch_fails_the_bench() -> None:
    recorded = [tb.expected(i) for i in range(1, 11)]
    results = [replayed(i) for i in range(1, 11)]
    results[6] = replayed(7, stdout="other\n")
    problems = tb.verify(results, recorded)
    entry = tb.run_entry(2, 10, 0.01, 0.002, [0.0002] * 10, problems, {"daemon": 0.0})
    assert entry["mismatches"] == 1 and entry["mismatch_examples"] == [
        "step 7: stdout 'other\\n', recorded 'step-7\\n'"
    ]
    good = [tb.run_entry(k, 10, 0.01, 0.002, [0.0002] * 10, [], {}) for k in (1, 3)]
    lat = latency(4.0, 3.9)
    assert tb.failed(good, lat) == 0
    assert tb.failed([good[0], entry, good[1]], lat) == 1
    # only the sound runs make the figures
    assert tb.aggregate([good[0], entry, good[1]])["runs_ok"] == 2


def test_run_entry_times_the_create_apart() -> None:
    e = tb.run_entry(1, 10_000, 0.02, 1.25, [0.000125] * 10_000, [], {"daemon": 0.05, "bench": 1.2})
    assert e["create_ms"] == 20.0
    assert e["replay_s"] == 1.25 and e["total_s"] == 1.27
    assert e["steps_per_s"] == 8000.0
    assert e["projected_10000_s"] == 1.27  # nothing to extrapolate at 10,000 steps
    assert e["cpu_us_per_step"] == {"daemon": 5.0, "bench": 120.0}
    assert e["per_step"]["n"] == 10_000 and e["per_step"]["p50_ms"] == 0.125
    assert e["mismatches"] == 0 and e["mismatch_examples"] == []
    # fewer steps: the steps scale to 10,000, the create does not
    e = tb.run_entry(1, 500, 0.02, 0.05, [0.0001] * 500, [], {})
    assert e["projected_10000_s"] == pytest.approx(0.02 + 1.0)
    assert tb.run_entry(1, 10, 0.0, 0.0, [], [], {})["steps_per_s"] is None
    many = [f"step {i}: exit 1" for i in range(1, 50)]
    assert len(tb.run_entry(1, 49, 0.0, 1.0, [], many, {})["mismatch_examples"]) == tb.EXAMPLES


def test_aggregate_best_and_median() -> None:
    runs = [run(1, replay_s=2.0, create_s=0.03), run(2, replay_s=1.0, create_s=0.01), run(3, replay_s=1.25)]
    agg = tb.aggregate(runs)
    assert agg["steps_per_s"] == {"best": 10_000.0, "median": 8000.0}
    assert agg["replay_s"] == {"best": 1.0, "median": 1.25}
    assert agg["create_ms"] == {"best": 10.0, "median": 10.0}
    assert agg["total_s"]["best"] == 1.01
    assert agg["runs_ok"] == 3 and agg["runs_failed"] == 0
    failed = tb.aggregate([{"run": 1, "error": "TrajectoryDiverged: x"}, run(2, problems=1)])
    assert failed["runs_ok"] == 0 and failed["runs_failed"] == 2
    assert failed["steps_per_s"] == {"best": None, "median": None}


def test_overhead_is_logged_over_plain_minus_one() -> None:
    o = latency(4.4, 4.0)["overhead"]
    assert o == {"p50": 0.1, "mean": 0.1, "p99": 0.1}
    assert tb.overhead({"p50_ms": 1.0}, {"p50_ms": 0.0})["p50"] is None
    assert tb.overhead({}, {})["mean"] is None


def test_judge_meets_every_target() -> None:
    ff = tb.aggregate([run(1, replay_s=1.5), run(2, replay_s=1.2), run(3, replay_s=1.9)])
    targets = tb.judge(10_000, ff, latency(4.2, 4.0))
    assert {k: t["met"] for k, t in targets.items()} == {
        "ff_steps_per_s_ge_5000": True,
        "ff_10000_steps_le_2s": True,
        "logging_overhead_le_10pct": True,
    }
    rate = targets["ff_steps_per_s_ge_5000"]
    assert rate["value"] == pytest.approx(10_000 / 1.5, abs=0.1)  # the median, not the best
    assert rate["best"] == pytest.approx(10_000 / 1.2, abs=0.1)
    assert targets["ff_10000_steps_le_2s"]["value"] == 1.51
    assert targets["ff_10000_steps_le_2s"]["extrapolated"] is False
    assert targets["logging_overhead_le_10pct"]["value"] == 0.05
    assert targets["logging_overhead_le_10pct"]["mean_value"] == 0.05


def test_judge_misses() -> None:
    # 4,000 steps/s: the create pushes 10,000 steps past 2 s as well; logging costs 35 %
    ff = tb.aggregate([run(k, replay_s=2.5, create_s=0.05) for k in (1, 2, 3)])
    targets = tb.judge(10_000, ff, latency(5.4, 4.0))
    assert {k: t["met"] for k, t in targets.items()} == {
        "ff_steps_per_s_ge_5000": False,
        "ff_10000_steps_le_2s": False,
        "logging_overhead_le_10pct": False,
    }
    assert targets["logging_overhead_le_10pct"]["value"] == 0.35
    # right at the targets: met
    ff = tb.aggregate([run(1, replay_s=1.99, create_s=0.01)])
    assert tb.judge(10_000, ff, latency(4.4, 4.0))["ff_10000_steps_le_2s"]["met"] is True
    assert tb.judge(10_000, ff, latency(4.4, 4.0))["logging_overhead_le_10pct"]["met"] is True


def test_judge_extrapolates_a_shorter_trajectory() -> None:
    ff = tb.aggregate([run(k, steps=500, replay_s=0.05, create_s=0.01) for k in (1, 2, 3)])
    target = tb.judge(500, ff, latency(4.0, 4.0))["ff_10000_steps_le_2s"]
    assert target["extrapolated"] is True and target["steps"] == 500
    assert target["value"] == pytest.approx(0.01 + 1.0)


def test_judge_unknowns_are_not_misses() -> None:
    # every fast-forward and the latency phase failed: nothing measured, nothing judged
    ff = tb.aggregate([{"run": k, "error": "RuntimeError: x"} for k in (1, 2, 3)])
    targets = tb.judge(10_000, ff, {"error": "DsecError: gone"})
    assert all(t["value"] is None and t["met"] is None for t in targets.values())
    assert tb.failed([{"run": 1, "error": "x"}], {"error": "y"}) == 2


def test_validate_refuses_bad_arguments(tmp_path: Path) -> None:
    assert tb.validate(10_000, 500, repository=tmp_path, json_out=tmp_path / "out.json") is None
    assert tb.validate(tb.MIN_STEPS, tb.MIN_N) is None
    assert "--steps must be between 10" in str(tb.validate(9, 500))
    assert "--steps" in str(tb.validate(tb.MAX_STEPS + 1, 500))
    assert "--n must be between 10" in str(tb.validate(10_000, 3))
    assert "--n" in str(tb.validate(10_000, -1))
    assert "not a directory" in str(tb.validate(10_000, 500, repository=tmp_path / "missing"))
    assert "is a directory" in str(tb.validate(10_000, 500, json_out=tmp_path))
    assert "does not exist" in str(tb.validate(10_000, 500, json_out=tmp_path / "no" / "out.json"))
    (tmp_path / "file").write_text("")
    assert "not a directory" in str(tb.validate(10_000, 500, state_dir=tmp_path / "file"))


def test_validate_refuses_a_state_dir_others_cannot_search(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    closed.chmod(0o700)
    assert tb.closed_ancestor(closed / "state" / "deeper") == closed
    why = str(tb.validate(10_000, 500, state_dir=closed / "state"))
    assert str(closed) in why and "700" in why and "chmod o+x" in why
    closed.chmod(0o755)
    assert tb.closed_ancestor(closed / "state") != closed  # (pytest's own base directory may be closed)


def test_main_refuses_bad_arguments_before_starting_a_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_daemon(*_: Any) -> None:
        raise AssertionError("a daemon was started")

    monkeypatch.setattr(bench_common, "start_daemon", no_daemon)  # what private_daemon calls
    out = tmp_path / "out.json"
    assert tb.main(n=500, steps=5, json_out=out, state_dir=tmp_path / "state") == 2
    assert "--steps must be between" in capsys.readouterr().out
    assert tb.main(n=1, steps=100, json_out=out, state_dir=tmp_path / "state") == 2
    assert not out.exists()


def result(ff_runs: list[dict[str, Any]], lat: dict[str, Any], steps: int = 10_000) -> dict[str, Any]:
    rec: dict[str, Any] = {"steps": steps, "create_ms": 80.0, "wall_s": 60.0, "steps_per_s": steps / 60.0}
    rec |= {"per_step": summarize([0.006] * 3), "cpu_us_per_step": {"daemon": 4000.0, "bench": 1500.0}}
    ff = {"runs": ff_runs, **tb.aggregate(ff_runs)}
    return {"record": rec, "fast_forward": ff, "latency": lat, "targets": tb.judge(steps, ff, lat)}


def test_print_summary_shows_runs_errors_and_targets() -> None:
    console = Console(file=io.StringIO(), width=160)
    runs = [run(1), run(2, problems=3), {"run": 3, "error": "TrajectoryDiverged: diverged at call 12"}]
    tb.print_summary(console, result(runs, latency(4.4, 4.0)))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "fast-fwd 1" in text and "3 mismatches" in text and "TrajectoryDiverged" in text
    assert "logging overhead" in text and "+10.0%" in text
    assert "met" in text and "10,000" in text
    console = Console(file=io.StringIO(), width=160)
    tb.print_summary(console, result([run(1)], {"error": "DsecError: no"}))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "live latency failed" in text and "n/a" in text


def test_the_targets_are_the_issues() -> None:
    assert tb.TARGETS == {"steps_per_s": 5000.0, "seconds_for_10000": 2.0, "overhead": 0.10}
    assert tb.TARGET_STEPS == 10_000 and tb.FAST_FORWARDS == 3
