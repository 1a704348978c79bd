"""OVAL's co-occurrence graph: counts, the GCN step, its metric, and counts summed over two real
processes (torch.distributed, gloo)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import attn_implementation, generate, tiny_router
from tiny_models import random_prompt, tiny_model

from kvfactory import ConfigError, KVCacheFactory, watch_hidden_states
from kvfactory.selectors.oval.locality import CooccurrenceGraph

STEPS = [[0, 1, 2], [0, 2], [3, 0]]  # pages read in three steps


def graph_of(steps: list[list[int]], **kwargs) -> CooccurrenceGraph:
    graph = CooccurrenceGraph(**kwargs)
    for pages in steps:
        graph.record(torch.tensor(pages))
        graph.end_step()
    return graph


def test_counts_the_pages_read_in_the_same_step() -> None:
    counts = graph_of(STEPS, rebuild_every=1000).counts()
    expected = torch.zeros(4, 4)
    for pages in STEPS:
        for a in pages:
            for b in pages:
                expected[a, b] += 1
    torch.testing.assert_close(counts, expected)
    assert graph_of(STEPS, window=1).counts()[0, 1] == 0  # only the last step is in a window of 1


def test_the_rebuild_normalises_and_the_gcn_step_mixes_neighbours() -> None:
    graph = graph_of(STEPS, rebuild_every=3)
    links = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0], [1, 0, 0, 1.0]])
    degree = links.sum(-1)
    torch.testing.assert_close(graph.adjacency.float(), links / (degree[:, None] * degree[None, :]).sqrt(),
                               atol=0, rtol=1e-3)  # kept in float16
    assert graph.density == pytest.approx(8 / 12)  # 8 of 12 off-diagonal pairs were read together
    scores = torch.tensor([[[1.0, 0.0, 0.0, 0.0, 5.0]]])  # a fifth page, newer than the graph
    mixed = graph.aggregate(scores, 0.5)
    known = scores[..., :4]
    torch.testing.assert_close(mixed[..., :4], 0.5 * known + 0.5 * known @ graph.adjacency.float())
    assert mixed[0, 0, 4] == 5.0 and torch.equal(graph.aggregate(scores, 0.0), scores)


def test_oval_builds_its_graph_during_decode() -> None:
    model = watch_hidden_states(tiny_model("llama"))
    router = tiny_router(64, 2, 16, (0, 1))
    config = {"type": "composite", "strategies": [{"name": "paged", "page_size": 4}, {
        "name": "oval", "router": router, "dense_layers": 0, "read_budget": 0.3, "rebuild_every": 3}]}
    with attn_implementation(model, "kvfactory"):
        cache = KVCacheFactory(model.config, config).create_cache()
        generate(model, {"input_ids": random_prompt(40)}, cache, max_new_tokens=8, min_new_tokens=8)
    graph = cache.routing_context.shared["oval.graph"]
    assert graph.adjacency is not None and 0 < cache.routing_metrics()["graph_density"] <= 1
    with pytest.raises(ConfigError, match="graph"):
        KVCacheFactory(model.config, {"type": "composite", "strategies": [
            {"name": "paged"}, {"name": "oval", "router": router, "graph": 1.5}]})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        own = [[0, 1]] if rank == 0 else [[1, 2], [2, 4]]  # different pages and graph sizes per process
        graph = graph_of(own, rebuild_every=len(own))
        results[rank] = (graph.counts(), graph.adjacency)
    finally:
        dist.destroy_process_group()


def test_two_processes_rebuild_the_same_summed_graph() -> None:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(_free_port(), results), nprocs=2, join=True)
        (counts0, adjacency0), (counts1, adjacency1) = results[0], results[1]
    expected = graph_of([[0, 1]], rebuild_every=1000).counts()
    expected = torch.nn.functional.pad(expected, (0, 3, 0, 3)) + graph_of([[1, 2], [2, 4]]).counts()
    torch.testing.assert_close(counts0, expected)
    torch.testing.assert_close(counts1, expected)
    torch.testing.assert_close(adjacency0, adjacency1)
