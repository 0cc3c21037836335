"""The soak's leak accounting: the diff and its allowances, the counters read from a state dir's files
and databases, and the churn's bookkeeping (no daemon: the integration test runs the real soak)."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
from pathlib import Path

import pytest

from dsec.protocol.sandbox import ExecResult
from dsec.store.sqlite import SCHEMA
from dsec_bench import accounting
from dsec_bench.accounting import EXACT, Allowance, Known, Node
from dsec_bench.churn import EXAMPLES, WORKLOADS, Tally
from dsec_bench.soak import KINDS, RSS_TREND_KIB_H, TREND_FROM_S, Plan, allowances, quiet, steady, trend, trends

TWO_HOURS = Path(__file__).parents[3] / "docs/benchmarks/soak-120min.json"


def verdicts(before: dict[str, int], after: dict[str, int], rules: dict[str, Allowance]) -> dict[str, str]:
    return {r["counter"]: r["verdict"] for r in accounting.diff(before, after, rules)}


def test_an_exact_counter_above_its_baseline_is_a_leak_and_below_it_is_not() -> None:
    rows = accounting.diff(
        {"mounts.sandboxes": 3, "cgroups.unified": 2}, {"mounts.sandboxes": 4, "cgroups.unified": 0}, {}
    )
    by = {r["counter"]: r for r in rows}
    assert by["mounts.sandboxes"] | {} == {
        "counter": "mounts.sandboxes",
        "before": 3,
        "after": 4,
        "delta": 1,
        "limit": 3,
        "verdict": "leak",
    }
    assert by["cgroups.unified"]["verdict"] == "ok" and by["cgroups.unified"]["delta"] == -2
    assert accounting.leaks(rows) == ["mounts.sandboxes"]


def test_a_counter_missing_on_one_side_counts_as_zero() -> None:
    assert verdicts({}, {"qemu.processes": 1}, {}) == {"qemu.processes": "leak"}
    assert verdicts({"qemu.processes": 1}, {}, {}) == {"qemu.processes": "ok"}


def test_host_wide_counters_are_reported_but_never_judged() -> None:
    assert verdicts({"host.cgroups": 1}, {"host.cgroups": 500}, {}) == {"host.cgroups": "info"}


def test_slack_and_ratio_whichever_is_larger() -> None:
    rule = {"daemon.rss_kib": Allowance("rss", slack=100, ratio=0.2)}
    # baseline 1000: 20% is 200, above the slack of 100
    assert verdicts({"daemon.rss_kib": 1000}, {"daemon.rss_kib": 1200}, rule) == {"daemon.rss_kib": "ok"}
    assert verdicts({"daemon.rss_kib": 1000}, {"daemon.rss_kib": 1201}, rule) == {"daemon.rss_kib": "leak"}
    # baseline 100: 20% is 20, the slack of 100 wins
    assert verdicts({"daemon.rss_kib": 100}, {"daemon.rss_kib": 200}, rule) == {"daemon.rss_kib": "ok"}
    assert verdicts({"daemon.rss_kib": 100}, {"daemon.rss_kib": 201}, rule) == {"daemon.rss_kib": "leak"}


def test_a_cap_bounds_the_value_not_the_growth() -> None:
    rule = {"cache.layer_bytes": Allowance("cache", cap=1000)}
    assert verdicts({"cache.layer_bytes": 0}, {"cache.layer_bytes": 1000}, rule)["cache.layer_bytes"] == "ok"
    assert verdicts({"cache.layer_bytes": 0}, {"cache.layer_bytes": 1001}, rule)["cache.layer_bytes"] == "leak"
    # a baseline already above the cap (a cap lowered since) is not held against the run
    assert verdicts({"cache.layer_bytes": 5000}, {"cache.layer_bytes": 5000}, rule)["cache.layer_bytes"] == "ok"


def test_retained_growth_is_reported_as_such_and_is_no_leak() -> None:
    rule = {"sqlite.audit.audit": Allowance("audit", retained=True)}
    rows = accounting.diff({"sqlite.audit.audit": 10}, {"sqlite.audit.audit": 900}, rule)
    assert rows[0]["verdict"] == "retained" and rows[0]["limit"] is None
    assert accounting.leaks(rows) == []
    assert verdicts({"sqlite.audit.audit": 10}, {"sqlite.audit.audit": 10}, rule)["sqlite.audit.audit"] == "ok"


def test_a_bound_by_another_counter_after_the_run() -> None:
    rule = {"daemon.fd.ns_user": Allowance("userns", bound="uids.ranges_used", per=2)}
    before = {"daemon.fd.ns_user": 2, "uids.ranges_used": 1}
    assert verdicts(before, {"daemon.fd.ns_user": 14, "uids.ranges_used": 7}, rule)["daemon.fd.ns_user"] == "ok"
    assert verdicts(before, {"daemon.fd.ns_user": 15, "uids.ranges_used": 7}, rule)["daemon.fd.ns_user"] == "leak"


def test_following_another_counter_allows_only_its_growth() -> None:
    rule = {"daemon.fds": Allowance("fds", follows="daemon.fd.ns_user")}
    before = {"daemon.fds": 30, "daemon.fd.ns_user": 2}
    assert verdicts(before, {"daemon.fds": 40, "daemon.fd.ns_user": 12}, rule)["daemon.fds"] == "ok"
    assert verdicts(before, {"daemon.fds": 41, "daemon.fd.ns_user": 12}, rule)["daemon.fds"] == "leak"
    # the followed counter shrinking gives no room at all
    assert verdicts(before, {"daemon.fds": 31, "daemon.fd.ns_user": 0}, rule)["daemon.fds"] == "leak"


def test_plus_another_counter_adds_its_growth_to_the_slack() -> None:
    rule = {"daemon.rss_kib": Allowance("rss", slack=100, plus="daemon.idempotency_kib")}
    before = {"daemon.rss_kib": 1000, "daemon.idempotency_kib": 10}
    assert verdicts(before, {"daemon.rss_kib": 1150, "daemon.idempotency_kib": 60}, rule)["daemon.rss_kib"] == "ok"
    assert verdicts(before, {"daemon.rss_kib": 1151, "daemon.idempotency_kib": 60}, rule)["daemon.rss_kib"] == "leak"
    # what it reports holding went down: no room beyond the slack
    assert verdicts(before, {"daemon.rss_kib": 1101, "daemon.idempotency_kib": 0}, rule)["daemon.rss_kib"] == "leak"


def test_the_soaks_allowances_leave_every_object_counter_exact() -> None:
    rules = allowances(cpus=2)
    for name in ("mounts.sandboxes", "cgroups.unified", "qemu.processes", "nft.elements", "uids.next_container_base"):
        assert rules.get(name, EXACT) is EXACT
    assert rules["daemon.rss_kib"].plus == "daemon.idempotency_kib" and rules["fetcher.rss_kib"].plus is None
    assert rules["daemon.idempotency_kib"].bound == "daemon.idempotency_limit_kib"  # as the daemon reports it
    # asyncio's default executor on two CPUs, min(32, 2 + 4), and the mount namespace threads (4)
    assert rules["daemon.threads"].slack == 6 + 4
    # a template (memory image and its record) per VM kind and shape: plain and hostile limits
    assert rules["cache.vm_templates"].cap == 8 and allowances(cpus=2, vm_kinds=1)["cache.vm_templates"].cap == 4


# ---- counters read from a state dir -------------------------------------------------------------------


def _state_db(state: Path, rows: list[tuple[str, str, dict[str, object]]]) -> None:
    db = sqlite3.connect(state / "state.db")
    db.executescript(SCHEMA)
    for sid, st, runtime in rows:
        db.execute(
            "INSERT INTO sandboxes (id, kind, image, state, created_at, expires_at, limits, env, labels, runtime) "
            "VALUES (?, 'container', 'dsec/busybox', ?, 0, 0, '{}', '{}', '{}', ?)",
            (sid, st, json.dumps(runtime)),
        )
    db.commit()
    db.close()


def test_sqlite_rows_split_live_and_finished_records(tmp_path: Path) -> None:
    _state_db(
        tmp_path,
        [
            ("sb-1", "running", {"uid_base": 1 << 20}),
            ("sb-2", "stopped", {"uid_base": (1 << 20) + 65536}),
            ("sb-3", "failed", {}),
            ("sb-4", "stopped", {"worker": {"id": "fw-9", "runtime": {"uid_base": (1 << 20) + 2 * 65536}}}),
        ],
    )
    rows = accounting.sqlite_rows(tmp_path)
    assert rows == {"sqlite.state.sandboxes": 1, "sqlite.state.sandboxes_finished": 3}
    node = Node(tmp_path, os.getpid())
    leases = accounting.uid_leases(Known(node))
    assert leases["uids.container_ranges"] == 1 and leases["uids.ranges_used"] == 3


def test_known_names_come_from_records_workers_bundles_and_templates(tmp_path: Path) -> None:
    _state_db(tmp_path, [("sb-a", "stopped", {"worker": {"id": "fw-b", "runtime": {}}})])
    (tmp_path / "sandboxes" / "fw-c").mkdir(parents=True)
    (tmp_path / "vms" / "sb-d").mkdir(parents=True)
    (tmp_path / "vms" / "fork-sb-d-1234.mem").touch()
    (tmp_path / "vm-templates" / "microvm" / ("k" * 32)).mkdir(parents=True)
    node = Node(tmp_path, os.getpid())
    known = Known(node)
    known.scan()
    assert {"sb-a", "fw-b", "fw-c", "sb-d"} <= known.ids and not any(i.startswith("fork-") for i in known.ids)
    assert known.owns(node.template_prefix + "k" * 16) and not known.owns("sb-other")
    assert node.template_prefix.startswith("tpl-") and len(node.template_prefix) == len("tpl-12345678-")
    # a VMM's jail key: its name and a hash of its bundle
    assert any(k.startswith("sb-d.") for k in known.vm_bundles())


def test_files_counts_bundles_temporaries_and_cache_bytes(tmp_path: Path) -> None:
    for d in ("sandboxes/sb-1", "vms/sb-2", "run/crun/sb-1", "images/tmp/pack-1", "images/fetcher/cache/ab"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "vms" / "fork-sb-2-aa.mem").touch()
    (tmp_path / "state.db.tmp").touch()
    (tmp_path / "images" / "fetcher" / "cache" / "ab" / "abcdef").write_bytes(b"x" * 10000)
    out = accounting.files(tmp_path)
    assert out["files.sandbox_bundles"] == out["files.vm_bundles"] == out["files.vm_fork_memory"] == 1
    assert out["files.runtime_states"] == out["files.image_tmp"] == out["files.state_tmp"] == 1
    assert out["cache.layer_chunks"] == 1 and out["cache.layer_bytes"] >= 10000
    assert out["cache.vm_templates"] == 0


def test_fd_kinds_tells_pipes_from_sockets() -> None:
    before = accounting.fd_kinds(os.getpid())
    r, w = os.pipe()
    a, b = socket.socketpair()
    try:
        now = accounting.fd_kinds(os.getpid())
    finally:
        os.close(r)
        os.close(w)
        a.close()
        b.close()
    assert now["pipe"] - before["pipe"] == 2 and now["socket"] - before["socket"] == 2


def test_a_process_that_is_gone_reads_as_minus_one() -> None:
    assert accounting.process("daemon", None) == {"daemon.fds": -1, "daemon.threads": -1, "daemon.rss_kib": -1}
    mine = accounting.process("me", os.getpid())
    assert mine["me.fds"] > 0 and mine["me.threads"] >= 1 and mine["me.rss_kib"] > 0


def test_an_absent_table_has_no_objects() -> None:
    out = accounting.nft_objects("dsec_no_such_table_for_a_test")
    assert set(out.values()) == {0} and "nft.elements" in out


# ---- the soak's bookkeeping ------------------------------------------------------------------------------


def test_quiet_and_steady() -> None:
    assert quiet({"sandbox.processes": 0, "qemu.processes": 0})
    assert not quiet({"sandbox.processes": 0, "files.vm_bundles": 1})
    rules = {"daemon.rss_kib": Allowance("rss", slack=1)}
    assert steady({"a": 1, "daemon.rss_kib": 5, "host.x": 1}, {"a": 1, "daemon.rss_kib": 9, "host.x": 7}, rules)
    assert not steady({"a": 1}, {"a": 2}, rules)


def test_the_tally_keeps_a_few_examples_per_class_whatever_the_count() -> None:
    t = Tally()
    for i in range(1000):
        t.error("SandboxGone", f"message {i}", expected=True)
    t.error("BackendError", "x" * 5000, expected=False)
    t.done("container", "exec", 0.5)
    t.done("container", "exec", 1.5)
    report = t.report()
    assert report["errors"]["expected"] == {"SandboxGone": 1000}
    assert report["errors"]["unexpected"] == {"BackendError": 1}
    assert len(report["errors"]["examples"]["expected"]["SandboxGone"]) == EXAMPLES
    assert len(report["errors"]["examples"]["unexpected"]["BackendError"][0]) == 400
    # a class met both ways keeps its unexpected examples apart, so the one that matters can be found
    t.error("SandboxGone", "basic: gone mid-exec", expected=False)
    examples = t.report()["errors"]["examples"]
    assert examples["unexpected"]["SandboxGone"] == ["basic: gone mid-exec"]
    assert "basic: gone mid-exec" not in examples["expected"]["SandboxGone"]
    assert report["operations"]["container"]["exec"] == {"n": 2, "mean_ms": 1000.0, "max_ms": 1500.0}


def test_plans_pick_only_the_chosen_kinds_and_scenarios_they_support() -> None:
    plan = Plan(kinds=["function", "vm"], minutes=1, workers=1, vm_pause=0, settle=10)
    pick = plan.container_picks()
    picked = {pick()[:2] for _ in range(500)}
    assert {k for k, _ in picked} == {"function"} and ("function", "snapshot") not in picked
    vm = plan.vm_picks()
    steps = [next(vm) for _ in range(6)]
    assert [s[:2] for s in steps] == [
        ("vm", "basic"),
        ("vm", "fork"),
        ("vm", "hostile"),
        ("vm", "basic"),
        ("vm", "fork"),
        ("vm", "hostile"),
    ]
    assert steps[2][2] in WORKLOADS and steps[2][2] != "disk_fill"
    assert set(KINDS) == {"container", "function", "microvm", "vm"}


@pytest.mark.parametrize(
    ("work", "res", "contained"),
    [
        ("fork_bomb", ExecResult(exit_code=None, signal=9, timed_out=True), True),
        ("fork_bomb", ExecResult(exit_code=2, stderr="/bin/sh: can't fork: Resource temporarily unavailable"), True),
        ("fork_bomb", ExecResult(exit_code=0), False),
        ("memory_hog", ExecResult(exit_code=None, signal=9, oom_killed=True), True),
        ("memory_hog", ExecResult(exit_code=None, signal=9, timed_out=True), False),
        ("disk_fill", ExecResult(exit_code=0, stderr="dd: error writing '/var/fill3': No space left on device"), True),
        ("disk_fill", ExecResult(exit_code=None, signal=25), False),
        ("output_flood", ExecResult(truncated=True, timed_out=True, stdout="y\n" * 1000), True),
        ("output_flood", ExecResult(truncated=False, timed_out=True), False),
        ("outlives_timeout", ExecResult(timed_out=True), True),
        ("escape", ExecResult(timed_out=True, duration=1.2), True),
        ("escape", ExecResult(exit_code=0, duration=1.0), False),
    ],
)
def test_hostile_outcomes_are_judged(work: str, res: ExecResult, contained: bool) -> None:
    _cmd, _kwargs, check = WORKLOADS[work]
    assert (check(res) is None) is contained


def test_trend_is_the_slope_of_the_second_half_per_hour() -> None:
    # grows 100 KiB a minute for ten minutes, then stays flat: the second half shows no growth
    warm = [{"t_s": 60.0 * i, "daemon.rss_kib": 1000.0 + 100 * min(i, 10)} for i in range(40)]
    assert trend(warm, "daemon.rss_kib") == 0.0
    leak = [{"t_s": 60.0 * i, "daemon.rss_kib": 1000.0 + 100 * i} for i in range(40)]
    assert trend(leak, "daemon.rss_kib") == 6000.0
    assert trend(leak[:4], "daemon.rss_kib") is None


def test_trend_over_the_last_third() -> None:
    # flat for two thirds, then 60 KiB a minute: the last third sees all of it, the second half less
    rising = [{"t_s": 60.0 * i, "daemon.rss_kib": 1000.0 + 60 * max(0, i - 20)} for i in range(30)]
    assert trend(rising, "daemon.rss_kib", 1 / 3) == 3600.0
    assert trend(rising, "daemon.rss_kib") is not None
    assert trend(rising, "daemon.rss_kib") < 3600.0  # type: ignore[operator]


def test_a_long_churn_judges_resident_memory_by_its_trend() -> None:
    rules = allowances(2)
    before, after = {"daemon.rss_kib": 90_000}, {"daemon.rss_kib": 200_000}  # far over the end-value bound
    plateau = accounting.diff(before, after, rules, {"daemon.rss_kib": 300.0})
    assert [(r["verdict"], r["limit"], r["trend_per_h"]) for r in plateau] == [("ok", RSS_TREND_KIB_H, 300.0)]
    climbing = accounting.diff(before, after, rules, {"daemon.rss_kib": RSS_TREND_KIB_H + 1.0})
    assert [r["verdict"] for r in climbing] == ["leak"]
    # no trend measured (a short churn): the end value against the bound
    assert verdicts(before, after, rules) == {"daemon.rss_kib": "leak"}
    # a counter without a trend rule ignores a trend handed in
    assert verdicts({"daemon.fds": 5}, {"daemon.fds": 6}, rules) == {"daemon.fds": "leak"}
    rows = accounting.diff({"daemon.fds": 5}, {"daemon.fds": 6}, rules, {"daemon.fds": 0.0})
    assert [r["verdict"] for r in rows] == ["leak"]


def test_only_a_long_churn_measures_trends() -> None:
    samples = [{"t_s": 30.0 * i, "daemon.rss_kib": 1000.0 + i, "fetcher.rss_kib": 500.0} for i in range(240)]
    assert trends(samples, TREND_FROM_S - 1) == {}
    rates = trends(samples, TREND_FROM_S)
    assert rates == {"daemon.rss_kib": 120.0, "fetcher.rss_kib": 0.0}


def test_the_two_hour_runs_samples_pass_the_trend_rule_and_a_leak_of_a_kib_per_sandbox_does_not() -> None:
    """The rule, held against the committed two-hour soak: its curve (fast growth while the churn ramps up,
    then a plateau) passes, and the same curve with 1 KiB more for every sandbox the run created fails."""
    run = json.loads(TWO_HOURS.read_text())
    samples = run["resources_over_time"]
    rules = allowances(2)
    before = {"daemon.rss_kib": int(samples[0]["daemon.rss_kib"])}
    after = {"daemon.rss_kib": int(samples[-1]["daemon.rss_kib"])}
    assert verdicts_by_trend(before, after, rules, trends(samples, run["churn_s"])) == "ok"
    created = sum(ops["create"]["n"] for ops in run["operations"].values() if "create" in ops)
    per_hour = created * 3600 / run["churn_s"]  # KiB an hour, at 1 KiB a sandbox
    leaky = [s | {"daemon.rss_kib": s["daemon.rss_kib"] + per_hour * s["t_s"] / 3600} for s in samples]
    assert verdicts_by_trend(before, after, rules, trends(leaky, run["churn_s"])) == "leak"


def verdicts_by_trend(
    before: dict[str, int], after: dict[str, int], rules: dict[str, Allowance], rates: dict[str, float]
) -> str:
    (row,) = accounting.diff(before, after, rules, rates)
    assert "trend_per_h" in row
    return str(row["verdict"])
