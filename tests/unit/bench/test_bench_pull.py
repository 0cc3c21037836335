"""`dsec bench pull`'s pure parts, with no process started: the task images it generates (the same bytes
for the same parameters, the sizes asked for, busybox in the base), the registry's access log and what a
round cost it, the I/O and storage accounting, podman's command lines, and the figures, ratios and targets
the JSON carries."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest

from dsec_bench import plots
from dsec_bench.pull import Outcome, Round, draw, judge, side_figures
from dsec_bench.pullside import (
    Podman,
    io_delta,
    mounts_under,
    parse_proc_io,
    tree_bytes,
    written,
)
from dsec_bench.registry import config, parse_access_log, skopeo_argv, traffic
from dsec_bench.taskimages import BIG_RANGE, Family, base_split, file_sizes, write_family

KB, MB = 1000, 1000 * 1000


@pytest.fixture
def busybox(tmp_path: Path) -> Path:
    path = tmp_path / "busybox"
    path.write_bytes(b"\x7fELF not really busybox" * 100)
    return path


def _family(directory: Path, busybox: Path, **changes: Any) -> Family:
    args: dict[str, Any] = {
        "k": 3,
        "base_bytes": 2 * MB,
        "base_layers": 2,
        "task_bytes": 20 * KB,
        "incompressible": 0.35,
        "busybox": busybox,
    }
    return write_family(directory, **(args | changes))


def _members(blob: Path) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob.read_bytes()))) as tar:
        return {m.name: m for m in tar.getmembers()}


# ---- the images -------------------------------------------------------------------------------------------


def test_the_same_parameters_give_the_same_digests(tmp_path: Path, busybox: Path) -> None:
    a = _family(tmp_path / "a", busybox)
    b = _family(tmp_path / "b", busybox)
    assert a.base == b.base and a.tasks == b.tasks
    other = _family(tmp_path / "c", busybox, seed="another")
    assert {x.digest for x in other.base}.isdisjoint({x.digest for x in a.base})


def test_layers_are_the_sizes_asked_for_and_the_blobs_their_digests(tmp_path: Path, busybox: Path) -> None:
    family = _family(tmp_path / "f", busybox)
    base, tasks = family.base, family.tasks
    # file contents as asked; the tar adds headers (and the first layer busybox and /etc)
    assert 2 * MB <= sum(x.tar_size for x in base) < 2 * MB + 600 * KB
    assert all(20 * KB <= x.tar_size < 60 * KB for x in tasks)
    assert len({x.digest for x in tasks}) == 3  # each image's own layer is its own
    for layer in (*base, *tasks):
        blob = family.layout / "blobs" / "sha256" / layer.digest.removeprefix("sha256:")
        assert "sha256:" + hashlib.sha256(blob.read_bytes()).hexdigest() == layer.digest
        assert blob.stat().st_size == layer.size
        assert "sha256:" + hashlib.sha256(gzip.decompress(blob.read_bytes())).hexdigest() == layer.diff_id
    # a mix: some of it compresses, some does not
    first = base[0]
    assert 0 < first.incompressible_bytes < first.tar_size
    assert first.incompressible_bytes < first.size < first.tar_size
    assert family.unique_layer_bytes == sum(x.size for x in (*base, *tasks))


def test_the_base_has_busybox_and_its_applets(tmp_path: Path, busybox: Path) -> None:
    family = _family(tmp_path / "f", busybox)
    first = family.base[0]
    members = _members(family.layout / "blobs" / "sha256" / first.digest.removeprefix("sha256:"))
    assert members["bin/busybox"].isfile() and members["bin/busybox"].mode == 0o755
    assert members["bin/true"].issym() and members["bin/true"].linkname == "busybox"
    assert members["bin"].isdir()  # directories come before what they hold
    assert len(members) > 20  # many files, not one


def test_the_layout_names_each_image_over_the_shared_base(tmp_path: Path, busybox: Path) -> None:
    family = _family(tmp_path / "f", busybox)
    layout: Path = family.layout
    index = json.loads((layout / "index.json").read_text())
    names = [m["annotations"]["org.opencontainers.image.ref.name"] for m in index["manifests"]]
    assert names == ["task-00", "task-01", "task-02"] == list(family.names)
    for entry, task in zip(index["manifests"], family.tasks, strict=True):
        manifest = json.loads((layout / "blobs" / "sha256" / entry["digest"].removeprefix("sha256:")).read_text())
        digests = [x["digest"] for x in manifest["layers"]]
        assert digests == [*(x.digest for x in family.base), task.digest]
        cfg = json.loads(
            (layout / "blobs" / "sha256" / manifest["config"]["digest"].removeprefix("sha256:")).read_text()
        )
        assert cfg["architecture"] == "amd64" and len(cfg["rootfs"]["diff_ids"]) == 3
    summary = family.summary()
    assert summary["images"] == 3 and len(summary["base_layers"]) == 2
    json.dumps(summary)


def test_file_sizes_add_up_and_mix_small_and_large() -> None:
    import random

    sizes = list(file_sizes(random.Random("x"), 300 * MB))
    assert sum(sizes) == 300 * MB
    assert min(sizes) < 4 * KB and max(sizes) >= BIG_RANGE[0]
    assert len(sizes) > 1000


def test_the_base_splits_halving_and_whole() -> None:
    assert base_split(700, 3) == [400, 200, 100]
    assert sum(base_split(300 * MB + 1, 3)) == 300 * MB + 1
    assert base_split(5, 1) == [5]


# ---- the registry -----------------------------------------------------------------------------------------

DIGEST = "sha256:" + "ab" * 32
LOG = f"""time="2026-12-05T18:00:00Z" level=warning msg="No HTTP secret provided"
127.0.0.1 - - [05/Dec/2026:18:00:01 +0000] "GET /v2/ HTTP/1.1" 200 2 "" "dsec"
127.0.0.1 - - [05/Dec/2026:18:00:01 +0000] "GET /v2/bench/pull/task-00/manifests/1 HTTP/1.1" 200 733 "" "dsec"
127.0.0.1 - - [05/Dec/2026:18:00:02 +0000] "GET /v2/bench/pull/task-00/blobs/{DIGEST} HTTP/1.1" 200 1000000 "" "dsec"
127.0.0.1 - - [05/Dec/2026:18:00:02 +0000] "GET /v2/bench/pull/task-01/blobs/{DIGEST} HTTP/1.1" 206 500 "" "podman"
127.0.0.1 - - [05/Dec/2026:18:00:02 +0000] "HEAD /v2/bench/pull/task-01/blobs/{DIGEST} HTTP/1.1" 200 - "" "x"
127.0.0.1 - - [05/Dec/2026:18:00:03 +0000] "GET /v2/bench/pull/task-09/manifests/1 HTTP/1.1" 404 96
"""


def test_the_access_log_is_read_line_by_line() -> None:
    requests = parse_access_log(LOG)
    assert [r.method for r in requests] == ["GET", "GET", "GET", "GET", "HEAD", "GET"]
    assert requests[2].blob == DIGEST and requests[2].size == 1_000_000 and requests[2].agent == "dsec"
    assert requests[1].manifest and requests[1].blob is None
    assert requests[4].size == 0  # "-": no body
    assert requests[5].status == 404 and requests[5].agent == ""


def test_traffic_counts_bytes_and_blobs_fetched_twice() -> None:
    t = traffic(parse_access_log(LOG))
    assert t["requests"] == 6
    assert t["bytes"] == 2 + 733 + 1_000_000 + 500 + 96
    assert t["blob_gets"] == 2 and t["distinct_blobs"] == 1 and t["blobs_fetched_more_than_once"] == 1
    assert t["blob_bytes"] == 1_000_500
    assert t["manifest_gets"] == 2 and t["heads"] == 1 and t["errors"] == 1
    assert traffic([])["bytes"] == 0


def test_the_registry_config_logs_access_and_stays_on_loopback(tmp_path: Path) -> None:
    cfg = config(tmp_path, "127.0.0.1:5999")
    assert cfg["log"]["accesslog"]["disabled"] is False
    assert cfg["http"]["addr"] == "127.0.0.1:5999" and "tls" not in cfg["http"] and "auth" not in cfg
    assert cfg["storage"]["filesystem"]["rootdirectory"] == str(tmp_path / "storage")


def test_skopeo_pushes_the_blobs_as_written() -> None:
    argv = skopeo_argv("skopeo", Path("/l"), "task-00", "127.0.0.1:5", "bench/pull/task-00:1")
    assert "--preserve-digests" in argv and "--dest-tls-verify=false" in argv
    assert argv[-2:] == ["oci:/l:task-00", "docker://127.0.0.1:5/bench/pull/task-00:1"]


# ---- I/O, storage, podman ---------------------------------------------------------------------------------

PROC_IO = (
    "rchar: 10\nwchar: 20\nsyscr: 1\nsyscw: 2\nread_bytes: 4096\nwrite_bytes: 81920\ncancelled_write_bytes: 8192\n"
)


def test_proc_io_and_what_reached_the_disk() -> None:
    figures = parse_proc_io(PROC_IO)
    assert figures == {"read_bytes": 4096, "write_bytes": 81920, "cancelled_write_bytes": 8192}
    assert written(figures) == 73728
    assert written({"write_bytes": 1, "cancelled_write_bytes": 5}) == 0


def test_io_delta_sums_processes_and_counts_a_new_one_whole() -> None:
    before = {1: {"write_bytes": 100}, 2: {"write_bytes": 50}}
    after = {1: {"write_bytes": 300}, 3: {"write_bytes": 70, "cancelled_write_bytes": 10}}
    delta = io_delta(before, after)
    assert delta["write_bytes"] == 200 + 70 and delta["cancelled_write_bytes"] == 10  # 2 is gone: not counted


def test_mounts_under_deepest_first_with_escapes() -> None:
    info = "\n".join(
        [
            "22 1 8:1 / / rw - ext4 /dev/vda rw",
            "30 22 0:40 / /w/podman/root/overlay rw - overlay overlay rw",
            "31 30 0:41 / /w/podman/root/overlay/abc/merged rw - overlay overlay rw",
            "32 22 0:42 / /w/podman/root\\040x rw - tmpfs tmpfs rw",
            "33 22 0:43 / /w/podman/rootless rw - tmpfs tmpfs rw",
        ]
    )
    assert mounts_under(info, Path("/w/podman/root")) == ["/w/podman/root/overlay/abc/merged", "/w/podman/root/overlay"]
    assert mounts_under(info, Path("/w/podman/root x")) == ["/w/podman/root x"]


def test_tree_bytes_counts_a_hard_link_once(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(os.urandom(64 * 1024))
    alone = tree_bytes(tmp_path)
    os.link(tmp_path / "d" / "f", tmp_path / "g")
    assert tree_bytes(tmp_path) == alone >= 64 * 1024
    assert tree_bytes(tmp_path / "missing") == 0


def test_podman_runs_on_its_own_storage(tmp_path: Path) -> None:
    podman = Podman.fresh("podman", tmp_path / "disk", tmp_path / "shm")
    pull = podman.pull_argv("127.0.0.1:5/bench/pull/task-00:1")
    run = podman.run_argv("127.0.0.1:5/bench/pull/task-00:1", "never")
    for argv in (pull, run):
        assert argv[argv.index("--root") + 1] == str(tmp_path / "disk" / "root")
        assert argv[argv.index("--runroot") + 1] == str(tmp_path / "shm" / "runroot")
        assert "--tmpdir" in argv and "--tls-verify=false" in argv
    assert run[-1] == "/bin/true" and "--rm" in run and "--pull=never" in run
    assert (tmp_path / "disk" / "downloads").is_dir()


# ---- figures, targets, JSON -------------------------------------------------------------------------------


def _round(dones: list[float], registry_bytes: int, written_bytes: int, requests: int = 1, failed: int = 0) -> Round:
    outcomes = [Outcome(f"r{i}", ready=t - 0.1, done=t) for i, t in enumerate(dones)]
    outcomes += [Outcome(f"f{i}", error="create: image_not_found: x") for i in range(failed)]
    reg = {"requests": requests, "bytes": registry_bytes}
    io = {"write_bytes": written_bytes + 10, "cancelled_write_bytes": 10, "read_bytes": 0}
    return Round(outcomes, max(dones, default=0) + 0.5, reg, io, written_bytes // 2, None)


def _rounds(**changes: Round) -> dict[str, dict[str, object]]:
    rounds = {
        "cold": {"dsec": _round([1.0, 2.0, 4.0], 1050, 100), "podman": _round([5.0, 9.0, 10.0], 3000, 400)},
        "warm": {"dsec": _round([0.2, 0.3], 0, 1), "podman": _round([1.0, 2.0], 0, 1)},
        "second_node": {"dsec": _round([1.0, 1.5], 0, 50, requests=0)},
    }
    for key, r in changes.items():
        label, side = key.split("__")
        rounds[label][side] = r
    return {label: {side: side_figures(r) for side, r in sides.items()} for label, sides in rounds.items()}


def test_side_figures_first_and_last_image() -> None:
    f = side_figures(_round([3.0, 1.0, 2.0], 10, 100, failed=1))
    assert f["n"] == 4 and f["succeeded"] == 3 and f["failures"] == {"create: image_not_found": 1}
    assert f["first_error"] == "f0: create: image_not_found: x"
    assert f["first_ready_s"] == 0.9 and f["last_ready_s"] == 2.9 and f["last_done_s"] == 3.0
    assert f["done_s"] == [1.0, 2.0, 3.0]
    assert f["disk"]["written_bytes"] == 100 and f["disk"]["storage_growth_bytes"] == 50


def test_judge_against_the_issues_targets() -> None:
    ratios, targets = judge(_rounds(), unique_layer_bytes=1000)
    assert ratios["cold_podman_over_dsec_all_done"] == 2.5
    assert ratios["cold_dsec_registry_bytes_over_unique_layer_bytes"] == 1.05
    assert ratios["cold_podman_registry_bytes_over_unique_layer_bytes"] == 3.0
    assert ratios["cold_dsec_over_podman_disk_written"] == 0.25
    assert all(t["met"] is True for t in targets.values()), targets
    json.dumps({"ratios": ratios, "targets": targets})


def test_judge_misses_and_unknowns() -> None:
    slow = _rounds(cold__dsec=_round([6.0, 8.0], 2000, 300), second_node__dsec=_round([1.0], 0, 1, requests=3))
    _, targets = judge(slow, unique_layer_bytes=1000)
    assert targets["all_ready_2x_faster_than_podman"]["met"] is False
    assert targets["registry_bytes_le_1_1x_unique_layers"]["met"] is False
    assert targets["disk_written_le_0_5x_podman"]["met"] is False
    assert targets["second_node_asks_registry_nothing"]["met"] is False
    # a side with a failed image: its targets are unknown, not met
    failed = _rounds(cold__podman=_round([5.0], 3000, 400, failed=1))
    _, targets = judge(failed, unique_layer_bytes=1000)
    assert targets["all_ready_2x_faster_than_podman"]["met"] is None
    assert targets["registry_bytes_le_1_1x_unique_layers"]["met"] is True  # dsec's own figure stands
    # an access log that was not understood (a cold node that asked nothing): no registry figure stands
    unread = _rounds(cold__dsec=_round([1.0, 2.0], 0, 100, requests=0))
    _, targets = judge(unread, unique_layer_bytes=1000)
    assert targets["registry_bytes_le_1_1x_unique_layers"]["met"] is None
    assert targets["second_node_asks_registry_nothing"]["met"] is None
    # podman skipped: only dsec's targets are known
    rounds = _rounds()
    for label in ("cold", "warm"):
        rounds[label].pop("podman")
    ratios, targets = judge(rounds, unique_layer_bytes=1000)
    assert ratios["cold_podman_over_dsec_all_done"] is None
    assert targets["disk_written_le_0_5x_podman"]["met"] is None
    assert targets["second_node_asks_registry_nothing"]["met"] is True


def test_plots_of_a_run(tmp_path: Path) -> None:
    if not plots.available():
        pytest.skip(plots.MISSING)
    names = draw(tmp_path, "bench-pull", _rounds())
    assert names == ["bench-pull-cycles.png", "bench-pull-bytes.png"]
    for name in names:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
