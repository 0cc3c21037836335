"""Placement: which node a creation goes to, and how a batch is split, from the nodes' reported figures."""

from __future__ import annotations

import pytest

from dsec.cluster.aggregate import merge_metrics, node_total
from dsec.cluster.placement import Demand, NodeView, candidates, chunks, pick, split
from dsec.protocol.sandbox import Limits

GIB = 1 << 30
SMALL = Demand(cpu=0.25, memory=128 << 20)


def node(
    name: str, cpu: float, mem_gib: float = 64, *, alloc: float = 16, queued: int = 0, healthy: bool = True
) -> NodeView:
    return NodeView(name, healthy, cpu, int(mem_gib * GIB), alloc, 64 * GIB, queued)


def test_demand_counts_the_requests_not_the_limits() -> None:
    assert Demand.of(Limits(cpu=2, memory="4Gi")) == Demand(cpu=2.0, memory=1 * GIB)  # a quarter of the limit
    assert Demand.of(Limits(memory="4Gi", memory_request="3Gi")).memory == 3 * GIB


def test_the_node_with_the_most_left_after_placing_comes_first() -> None:
    nodes = [node("a", 4), node("b", 10), node("c", 7)]
    assert candidates(nodes, SMALL) == ["b", "c", "a"]
    assert pick(nodes, SMALL) == "b"


def test_the_tighter_resource_decides() -> None:
    # b has more CPU free, but almost no memory: a leaves a larger share of both
    nodes = [node("a", 6, mem_gib=40), node("b", 12, mem_gib=2)]
    assert candidates(nodes, Demand(cpu=1, memory=1 * GIB)) == ["a", "b"]


def test_nodes_it_does_not_fit_come_last_and_unhealthy_never() -> None:
    nodes = [node("a", 0.1), node("b", 3, healthy=False), node("c", 0.5), node("d", 0.2, mem_gib=0.01)]
    assert candidates(nodes, SMALL) == ["c", "d", "a"]  # c fits; d and a (least short first) for their queues
    assert pick(nodes, SMALL) == "c"
    assert pick([node("a", 0.1)], SMALL) is None


def test_empty_queues_are_preferred() -> None:
    nodes = [node("a", 8, queued=3), node("b", 2)]
    assert candidates(nodes, SMALL) == ["b", "a"]


def test_float_sums_still_fit() -> None:
    assert node("a", 0.1 + 0.2, alloc=1).fits(Demand(cpu=0.3, memory=0))


def test_reserve_release_and_refused() -> None:
    n = node("a", 1)
    n.reserve(SMALL, 3)
    assert n.free_cpu == pytest.approx(0.25)
    n.release(SMALL)
    assert n.free_cpu == pytest.approx(0.5)
    n.refused()
    assert not n.fits(SMALL)


def test_split_follows_free_capacity() -> None:
    nodes = [node("a", 2), node("b", 1), node("c", 1)]
    counts = split(nodes, SMALL, 16)  # 8 + 4 + 4 sandboxes of 0.25 fit exactly
    assert counts == {"a": 8, "b": 4, "c": 4}
    assert nodes[0].free_cpu == 2  # the views given are not changed


def test_split_of_a_small_batch_spreads_it() -> None:
    assert split([node("a", 8), node("b", 8), node("c", 8)], SMALL, 3) == {"a": 1, "b": 1, "c": 1}


def test_what_fits_nowhere_is_spread_by_size_for_the_queues() -> None:
    nodes = [node("a", 0.5, alloc=24), node("b", 0, alloc=8), node("c", 0, healthy=False)]
    counts = split(nodes, SMALL, 10)
    assert counts["a"] >= 2 and sum(counts.values()) == 10 and "c" not in counts
    # the 8 left over go 3:1 by allocatable CPU
    assert counts == {"a": 2 + 6, "b": 2}


def test_split_with_no_healthy_node_places_nothing() -> None:
    assert split([node("a", 8, healthy=False)], SMALL, 5) == {}
    assert split([], SMALL, 5) == {}


def test_chunks_are_consecutive() -> None:
    assert chunks([5, 6, 7, 8, 9], {"a": 2, "b": 3}) == {"a": [5, 6], "b": [7, 8, 9]}


def test_split_scales() -> None:
    nodes = [node(f"n{i:03}", 64, alloc=64) for i in range(200)]
    counts = split(nodes, SMALL, 10_000)
    assert sum(counts.values()) == 10_000 and max(counts.values()) - min(counts.values()) <= 1


def test_metrics_merge_labels_every_sample_and_keeps_families_whole() -> None:
    a = '# HELP up Up.\n# TYPE up gauge\nup 1\n# HELP x_total X.\n# TYPE x_total counter\nx_total{k="v"} 3\n'
    b = '# HELP up Up.\n# TYPE up gauge\nup 0\n# HELP x_total X.\n# TYPE x_total counter\nx_total{k="w"} 4\n'
    lines = merge_metrics([("a", a), ("b", b)]).splitlines()
    assert lines == [
        "# HELP up Up.",
        "# TYPE up gauge",
        'up{node="a"} 1',
        'up{node="b"} 0',
        "# HELP x_total X.",
        "# TYPE x_total counter",
        'x_total{node="a",k="v"} 3',
        'x_total{node="b",k="w"} 4',
    ]


def test_metrics_merge_keeps_a_node_label_the_node_set() -> None:
    text = '# TYPE up gauge\nup{node="self",k="v"} 1\n'
    assert merge_metrics([("a", text)]).splitlines()[-1] == 'up{node="self",k="v"} 1'


def test_node_total_sums() -> None:
    from ...fakes.cluster import status

    total = node_total("cluster", [status("a", 3.0), status("b", 5.0, alloc_cpu=16.0)])
    assert total.node == "cluster"
    assert total.allocatable.cpu == 24.0 and total.free.cpu == 8.0 and total.requested.cpu == 16.0
    assert total.ratios.cpu == 8.0 and total.start_slots == {"container": 16}
