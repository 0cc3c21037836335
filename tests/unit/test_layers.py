"""The layers hold at run time too: what the daemon's modules load, what the wire contract loads, and that
nothing of the product loads the benchmarks (dsec_bench) but `dsec bench`."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import dsec


def _loaded(*modules: str) -> list[str]:
    code = f"import json, sys\nimport {', '.join(modules)}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    ours = ("dsec", "dsec_bench")
    return [m for m in json.loads(out.stdout) if m in ours or m.startswith(tuple(f"{p}." for p in ours))]


def test_the_daemon_never_loads_the_client() -> None:
    loaded = _loaded(
        "dsec.daemon", "dsec.server.app", "dsec.e2b.app", "dsec.fusion.app", "dsec.cluster.gateway", "dsec.core.manager"
    )
    assert "dsec.server.app" in loaded
    assert [m for m in loaded if m.startswith("dsec.sdk")] == []
    assert [m for m in loaded if m.startswith("dsec_bench")] == []


def test_the_wire_contract_loads_only_errors_and_units() -> None:
    loaded = _loaded("dsec.protocol.sandbox", "dsec.protocol.node", "dsec.protocol.run", "dsec.protocol.trajectory")
    outside = [m for m in loaded if not m.startswith("dsec.protocol")]
    assert outside == ["dsec", "dsec.errors", "dsec.units"]


def test_the_product_never_loads_the_benchmarks() -> None:
    loaded = _loaded("dsec", "dsec.sdk.aio", "dsec.sdk.sync", "dsec.demo.rollouts", "dsec.cluster.gateway")
    assert "dsec.demo.rollouts" in loaded
    assert [m for m in loaded if m.startswith("dsec_bench")] == []


def test_nothing_of_dsec_loads_the_harness_integrations() -> None:
    # each is an optional extra (mini-swe-agent, ...), loaded only by the harness that selects it
    loaded = _loaded("dsec", "dsec.sdk.sync", "dsec.cli.main", "dsec.daemon", "dsec.demo.rollouts")
    assert [m for m in loaded if m.startswith("dsec.integrations")] == []


def test_the_cli_loads_only_the_bench_command_group() -> None:
    loaded = _loaded("dsec.cli.main")
    assert "dsec_bench.cli" in loaded
    # the benchmarks themselves load with their command, not with the CLI
    assert [m for m in loaded if m.startswith("dsec_bench")] == ["dsec_bench", "dsec_bench.cli"]


def test_the_public_names_still_come_from_dsec() -> None:
    for name in dsec.__all__:
        assert getattr(dsec, name) is not None, name
    assert dsec.Sandbox.__name__ == "Sandbox" and dsec.AsyncClient.__module__ == "dsec.sdk.aio"


def test_no_file_over_600_lines_and_no_function_over_80() -> None:
    """The house rules on size, measured by tools/structure.py (which also prints the import circles)."""
    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("structure", root / "tools" / "structure.py")
    assert spec is not None and spec.loader is not None
    structure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(structure)
    assert structure.oversized(root, structure.modules(root / "src")) == []
