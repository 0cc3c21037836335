"""The lifecycle bench compares whole cycles: `crun run` and `podman run --rm` delete their container,
so dsec's side of those ratios is create → exec → kill, never create → first exec alone."""

from __future__ import annotations

from dsec_bench.lifecycle import judge


def _p50(ms: float) -> dict[str, float]:
    return {"p50_ms": ms}


def test_peers_are_compared_with_dsecs_whole_cycle() -> None:
    dsec = {
        "create_to_first_exec": _p50(30.0),
        "create_exec_kill": _p50(60.0),
        "exec_round_trip": _p50(4.0),
        "burst": {"creations_per_s": 50.0, "succeeded": 10, "size": 10},
    }
    crun = {"run": _p50(20.0), "exec": _p50(16.0), "burst": {"creations_per_s": 100.0}}
    podman = {"run": _p50(300.0), "burst": {"creations_per_s": 10.0}}
    ratios, targets = judge(dsec, crun, podman)
    assert ratios["dsec_create_exec_kill_p50_over_crun_run_p50"] == 3.0  # not 1.5: the kill counts
    assert ratios["podman_run_rm_p50_over_dsec_create_exec_kill_p50"] == 5.0
    assert targets["create_exec_kill_p50_le_1_5x_crun_run"]["met"] is False
    assert targets["podman_run_rm_ge_10x_dsec_create_exec_kill"]["met"] is False
    assert targets["exec_round_trip_p50_le_5ms"]["met"] is True


def test_a_skipped_peer_leaves_its_targets_unknown() -> None:
    dsec = {
        "create_to_first_exec": _p50(30.0),
        "create_exec_kill": _p50(60.0),
        "exec_round_trip": _p50(4.0),
        "burst": {"creations_per_s": 50.0, "succeeded": 10, "size": 10},
    }
    _, targets = judge(dsec, {"run": _p50(20.0)}, {})
    assert targets["podman_run_rm_ge_10x_dsec_create_exec_kill"]["met"] is None
