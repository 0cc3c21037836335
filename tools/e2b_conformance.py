"""E2B's own Python SDK test suite against dsec's E2B-compatible API (issue 24, docs/e2b.md).

    E2B_REPO=/path/to/e2b-checkout make e2b-conformance
    .venv/bin/python tools/e2b_conformance.py --repo /path/to/e2b-checkout [--json out.json] [PATHS ...]

Nothing is fetched from E2B: the checkout is given (its ``packages/python-sdk`` is installed, as E2B's own
CI installs it, into a venv of its own with the test tools pinned in tools/e2b-conformance.txt). A daemon
of this checkout is started with the E2B listener (its state under ``--state-dir``, kept between runs so
images are built once), E2B's pytest runs against it with only the environment a user would set, and
the result is printed per file: passed, failed, errors, skipped. Tests that need the public internet are
run too but counted apart, each with its reason (INTERNET below), so the share is of what a node with
no internet access can answer.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROJECT = HERE.parent
PINS = HERE / "e2b-conformance.txt"
SDK = Path("packages/python-sdk")
OUTCOMES = ("passed", "failed", "error", "skipped")

# test id prefix -> why it needs the public internet: run, but counted apart, each with its reason
_HUB = "its template builds FROM ubuntu:22.04, pulled from Docker Hub"
_PUBLIC_IPS = "curls https://1.1.1.1 and https://8.8.8.8 from the sandbox"
_HTTPBIN = "its sidecar is E2B's httpbin template (go-httpbin, from Docker Hub)"
INTERNET: dict[str, str] = {
    f"tests/{mode}/{path}": why
    for mode, tpl in (("sync", "template_sync"), ("async", "template_async"))
    for path, why in {
        f"{tpl}/methods/test_make_symlink.py::": _HUB,
        f"{tpl}/methods/test_run_cmd.py::": _HUB,
        f"{tpl}/test_build.py::test_build_template_with_symlinks": _HUB,
        f"{tpl}/test_build.py::test_build_template_with_resolve_symlinks": _HUB,
        f"{tpl}/test_build.py::test_build_template_with_skip_cache": _HUB,
        f"sandbox_{mode}/test_internet_access.py::test_internet_access_enabled": _PUBLIC_IPS,
        f"sandbox_{mode}/test_internet_access.py::test_internet_access_default": _PUBLIC_IPS,
        f"sandbox_{mode}/test_network.py::test_allow_specific_ip_with_deny_all": _PUBLIC_IPS,
        f"sandbox_{mode}/test_network.py::test_deny_specific_ip": _PUBLIC_IPS,
        f"sandbox_{mode}/test_network.py::test_allow_takes_precedence_over_deny": _PUBLIC_IPS,
        f"sandbox_{mode}/test_network.py::test_update_network_applies_restrictions": _PUBLIC_IPS,
        f"sandbox_{mode}/test_network.py::test_update_network_clears_existing_rules": _PUBLIC_IPS,
        f"sandbox_{mode}/test_network.py::test_firewall_transform_injects_headers": _HTTPBIN,
    }.items()
}
# Tests of the SDK alone (no server: E2B's API is mocked in them, or not called) that assert what the SDK
# makes of its environment when nothing is set. They run in a second pass without the E2B_* variables that
# point the other tests at dsec, as E2B's CI runs them.
SDK_ONLY = [
    "tests/test_connection_config.py",
    "tests/test_sandbox_urls.py",
    "tests/test_validate_api_key.py",
    "tests/test_volume_connection_config.py",
    "tests/sync/sandbox_sync/test_config_propagation.py::test_connect_sets_stable_host_routing_headers",
    "tests/async/sandbox_async/test_config_propagation.py::test_connect_sets_stable_host_routing_headers",
    "tests/sync/volume_sync/test_volume.py::test_create_volume_uses_byoc_domain",
    "tests/async/volume_async/test_volume.py::test_create_volume_uses_byoc_domain",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_venv(repo: Path, venv: Path) -> Path:
    """A venv with the checkout's SDK and the pinned test tools; reinstalled when the checkout changes."""
    py = venv / "bin" / "python"
    sdk = (repo / SDK).resolve()
    stamp = venv / ".dsec-installed"
    want = f"{sdk}\n{PINS.read_text()}"
    if py.exists() and stamp.exists() and stamp.read_text() == want:
        return py
    if not py.exists():
        _say(f"creating {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    _say(f"installing the E2B SDK from {sdk} and the test tools (tools/e2b-conformance.txt)")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "-r", str(PINS), str(sdk)], check=True)
    stamp.write_text(want)
    return py


class Daemon:
    """``dsec serve`` of this checkout with the E2B API on a free loopback port."""

    def __init__(self, state: Path, extra: list[str]) -> None:
        self.state = state
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        state.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "dsec", "serve", "--state-dir", str(state), "--e2b-listen", self.url]
        argv += ["--e2b-network", "full", "--log-level", "info", *extra]
        with open(state / "daemon.log", "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"the daemon did not start: see {state / 'daemon.log'}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return (self.state / "token").exists()
        except OSError:
            return False

    def dsec(self, *args: str) -> None:
        env = os.environ | {"DSEC_URL": f"unix://{self.state / 'dsec.sock'}", "DSEC_TOKEN": self.token()}
        subprocess.run([sys.executable, "-m", "dsec", *args], check=True, env=env, stdin=subprocess.DEVNULL)

    def token(self) -> str:
        return (self.state / "token").read_text().strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _pytest(py: Path, repo: Path, env: dict[str, str], args: list[str], workers: int, junit: Path) -> None:
    argv = [str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1"]
    argv += [f"--junitxml={junit}", "-rN", "--tb=line"]
    if workers > 1:
        argv += ["-n", str(workers)]
    subprocess.run([*argv, *args], cwd=repo / SDK, env=env, stdin=subprocess.DEVNULL)


def run_suite(py: Path, repo: Path, daemon: Daemon, paths: list[str], workers: int, out: Path) -> list[Path]:
    """The suite against the daemon, then (for a whole run) the SDK-only tests without its variables; the
    two junit reports."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("E2B_", "DSEC_", "PYTHON"))}
    env = clean | {
        "E2B_API_URL": daemon.url,
        "E2B_SANDBOX_URL": daemon.url,
        "E2B_VOLUME_API_URL": daemon.url,
        "E2B_API_KEY": daemon.token(),
        "E2B_VALIDATE_API_KEY": "false",  # a dsec token is not of E2B's e2b_<hex> form
    }
    whole = not paths
    first = paths or ["tests", *(f"--deselect={t}" for t in SDK_ONLY if "::" in t)]
    first += [f"--ignore={t}" for t in SDK_ONLY if whole and "::" not in t]
    reports = [out / "against-dsec.xml"]
    _pytest(py, repo, env, first, workers, reports[0])
    if whole:
        reports.append(out / "sdk-only.xml")
        _pytest(py, repo, clean, SDK_ONLY, 1, reports[1])
    return [r for r in reports if r.exists()]


def outcome(case: ET.Element) -> tuple[str, str]:
    """The case's outcome and, when it did not pass, the first line of why."""
    for tag in ("failure", "error", "skipped"):
        node = case.find(tag)
        if node is not None:
            name = {"failure": "failed"}.get(tag, tag)
            why = (node.get("message") or node.text or "").strip().splitlines()
            return name, why[0][:300] if why else ""
    return "passed", ""


def collate(reports: list[Path]) -> dict[str, Any]:
    """Per file counts, the counted totals, and the internet-bound tests apart."""
    per_file: dict[str, Counter[str]] = defaultdict(Counter)
    internet: list[dict[str, str]] = []
    failures: list[dict[str, str]] = []
    cases = (case for junit in reports for case in ET.parse(junit).getroot().iter("testcase"))
    for case in cases:
        path = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        test_id = f"{path}::{case.get('name')}"
        result, why = outcome(case)
        reason = next((r for prefix, r in INTERNET.items() if test_id.startswith(prefix)), None)
        if reason is not None:
            internet.append({"test": test_id, "outcome": result, "reason": reason})
            continue
        per_file[path][result] += 1
        if result in ("failed", "error"):
            failures.append({"test": test_id, "outcome": result, "why": why})
    totals: Counter[str] = sum(per_file.values(), Counter())
    counted = sum(totals.values())
    return {
        "totals": {k: totals[k] for k in OUTCOMES} | {"tests": counted},
        "pass_rate": round(totals["passed"] / counted, 4) if counted else 0.0,
        "files": {f: {k: c[k] for k in OUTCOMES} for f, c in sorted(per_file.items())},
        "internet": internet,
        "failures": failures,
    }


def report(result: dict[str, Any]) -> None:
    width = max((len(f) for f in result["files"]), default=20)
    print(f"{'file':<{width}}  passed  failed   error skipped")
    for f, c in result["files"].items():
        print(f"{f:<{width}}  {c['passed']:>6}  {c['failed']:>6}  {c['error']:>6}  {c['skipped']:>6}")
    t = result["totals"]
    print(
        f"\nE2B's suite against dsec: {t['passed']} of {t['tests']} passed ({100 * result['pass_rate']:.1f}%), "
        f"{t['failed']} failed, {t['error']} errors, {t['skipped']} skipped"
    )
    if result["internet"]:
        print(f"\ncounted apart ({len(result['internet'])}): they need the public internet")
        for item in result["internet"]:
            print(f"  {item['outcome']:<7} {item['test']}: {item['reason']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, default=os.environ.get("E2B_REPO"), help="a checkout of e2b-dev/E2B")
    ap.add_argument("--venv", type=Path, default=PROJECT / ".e2b-conformance-venv")
    ap.add_argument("--state-dir", type=Path, default=Path("/var/tmp/dsec-e2b-conformance"))
    ap.add_argument("--json", type=Path, help="write the per-file result here")
    ap.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (1: none)")
    ap.add_argument(
        "--e2b-image",
        default="dsec/e2b-base:1",
        help="the image of E2B's `base` template (default: the built-in shaped like E2B's base; docs/e2b.md)",
    )
    ap.add_argument("--serve-arg", action="append", default=[], help="one more `dsec serve` argument")
    ap.add_argument("paths", nargs="*", help="test files or ids under packages/python-sdk (default: tests)")
    args = ap.parse_args()
    if args.repo is None or not (args.repo / SDK / "tests").is_dir():
        ap.error("give a checkout of e2b-dev/E2B with --repo or E2B_REPO (it must hold packages/python-sdk/tests)")
    py = ensure_venv(args.repo.resolve(), args.venv)
    daemon = Daemon(args.state_dir, ["--e2b-image", args.e2b_image, *args.serve_arg])
    try:
        _say(f"building {args.e2b_image} (the `base` template) if this node has not (a minute or two the first time)")
        daemon.dsec("image", "build", args.e2b_image)
        with tempfile.TemporaryDirectory() as tmp:
            started = time.monotonic()
            reports = run_suite(py, args.repo.resolve(), daemon, args.paths, args.workers, Path(tmp))
            if not reports:
                raise SystemExit("pytest wrote no report: see its output above")
            result = collate(reports)
            result["seconds"] = round(time.monotonic() - started, 1)
    finally:
        daemon.stop()
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
