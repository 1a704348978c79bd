"""kvfactory's vLLM connector on Gemma 3 270M (sliding window 512 in 15 of 18 layers, one KV head of
256 channels) in real vLLM processes over a real Redis server: a second process loads the first
one's 1,024-token prefix and answers 7 concurrent requests with ``model.generate``'s greedy tokens.

With a KV connector that does not declare vLLM's hybrid allocator (``SupportsHMA``), vLLM gives
sliding layers the same block table as full-attention ones, so a chunk holds every layer's K/V of
its tokens and loads whole; the sliding layers' attention still reads only their window.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from redis_server import RedisServer
from vllm_process import require_vllm, run_vllm

from kvfactory.models import converted_model_dir
from kvfactory.tiers import ChunkKey, layer_parts

PREFIX, CHUNK, NEW = 1024, 256, 12

pytestmark = pytest.mark.slow
require_vllm()


@pytest.fixture(scope="module")
def runs(gemma3_shared_prefix, tmp_path_factory) -> dict[str, Any]:
    """The first prompt in one process, then the other 7 at once in a second, over one Redis."""
    prompts, _ = gemma3_shared_prefix
    tmp = tmp_path_factory.mktemp("vllm-gemma3")
    server = RedisServer(maxmemory="512mb")
    tiers = {"tiers": [server.url]}
    model = converted_model_dir("gemma3-270m")
    try:
        out = {"first": run_vllm(tmp, "first", model, NEW, prompts=prompts[:1], connector=tiers, ttft=[]),
               "second": run_vllm(tmp, "second", model, NEW, prompts=prompts[1:], connector=tiers, ttft=[])}
        out["keys"] = sorted(key.decode() for key in redis.Redis.from_url(server.url).keys("kvfactory:*"))
    finally:
        server.kill()
    return out


def test_a_second_process_answers_as_generate_from_the_first_ones_chunks(gemma3_shared_prefix, runs) -> None:
    _, references = gemma3_shared_prefix
    assert runs["first"]["outputs"] == references[:1]
    assert runs["second"]["outputs"] == references[1:]
    loaded = 7 * PREFIX // CHUNK  # each of the 7 requests loads the prefix's 4 chunks
    assert runs["second"]["metrics"]["vllm:kvfactory_chunks_loaded_total"] == loaded
    redis_stats = runs["second"]["stats"]["redis"]  # each step reads a chunk its requests share once
    parts = 8  # the values each chunk is stored as, each a range of layers
    assert PREFIX // CHUNK * parts <= redis_stats["hits"] <= loaded * parts and redis_stats["errors"] == 0
    assert runs["second"]["metrics"]["vllm:kvfactory_chunks_saved_total"] == 0  # it computed no chunk anew


def test_a_chunk_holds_every_layer_of_the_hybrid_model(runs) -> None:
    keys = [ChunkKey.parse(key) for key in runs["keys"]]
    assert {key.layout for key in keys} == {"L18-H1-D256-T256-float32"}
    chunks: dict[str, list[tuple[int, int]]] = {}
    for key in keys:
        chunks.setdefault(key.prefix, []).append(key.layers)
    assert len(chunks) == PREFIX // CHUNK
    assert all(sorted(parts) == layer_parts(18, 8) for parts in chunks.values())
