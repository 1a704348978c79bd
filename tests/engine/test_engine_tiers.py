"""The engine's prefix cache over kvfactory's tiers, on the embedded SmolLM2 and a real Redis server:
a second engine (its own pool and prefix cache) loads the first one's system-prompt chunks instead
of computing them, with DynamicCache's greedy output; a tier read that stalls holds up its own
request only; a corrupted chunk or a dead Redis costs recompute, never output."""

from __future__ import annotations

import threading

import pytest
import redis
from helpers import greedy_tokens

from kvfactory.engine import Engine, SamplingParams
from kvfactory.errors import ConfigError
from kvfactory.tiers import ChunkKey, DiskTier, HostTier, RedisTier, TierChain, decode_chunk

pytestmark = pytest.mark.slow
SYSTEM, CHUNK, NEW = 512, 128, 8
GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(wikitext_ids) -> list[list[int]]:
    """One 512-token system prompt, then a 40-token question of each prompt's own."""
    ids = wikitext_ids.tolist()
    return [ids[:SYSTEM] + ids[SYSTEM + 40 * i:SYSTEM + 40 * (i + 1)] for i in range(3)]


def engine_over(smollm2, redis_url: str, codec: str = "identity") -> Engine:
    model, tokenizer = smollm2
    return Engine(model, tokenizer, {"type": "paged", "page_size": 16}, pool_tokens=4096,
                  tiers=TierChain([RedisTier(redis_url, retry_s=60)]), tier_codec=codec, chunk_tokens=CHUNK)


def stored_by(engine: Engine, prompts: list[list[int]]) -> None:
    """``engine`` generates ``prompts``, and its chunks are written (off its thread) before this returns."""
    engine.generate(prompts, GREEDY)
    assert engine.manager.tiers.flush(timeout=60)


def computed(engine: Engine) -> int:
    return int(engine.metrics.prompt_tokens._value.get())


def test_a_second_engine_loads_the_first_ones_prefix_through_redis(smollm2, prompts, redis_url) -> None:
    model, _ = smollm2
    first = engine_over(smollm2, redis_url)
    assert first.generate(prompts[:1], GREEDY)[0].token_ids == greedy_tokens(model, prompts[0], NEW)
    assert first.stats()["tier_chunks_stored"] == len(prompts[0]) // CHUNK  # 4 chunks: 512 of 552 tokens
    assert first.manager.tiers.flush(timeout=60)  # written off the engine's thread: wait for them
    second = engine_over(smollm2, redis_url)  # its own pool and prefix cache: only Redis is shared
    outputs = second.generate(prompts[1:], GREEDY)
    for output, prompt in zip(outputs, prompts[1:], strict=True):
        assert output.token_ids == greedy_tokens(model, prompt, NEW)
    stats = second.stats()
    loaded = len(prompts[1:]) * SYSTEM // CHUNK  # both admitted at once, before either filled a block
    assert stats["tier_chunks_loaded"] == loaded
    assert computed(second) == sum(len(p) - SYSTEM for p in prompts[1:])
    second.metrics.update_gauges()
    assert second.metrics.tier_chunks.labels("chunks_loaded")._value.get() == loaded
    assert second.metrics.tier_stats.labels("redis", "hits")._value.get() == loaded
    assert second.metrics.tier_seconds.labels("load")._value.get() > 0
    assert stats["pool_blocks_held"] == 0


class GatedTier(HostTier):
    """A host tier whose reads wait until ``gate`` is set (a tier that stalls)."""

    def __init__(self) -> None:
        super().__init__(1 << 30)
        self.gate = threading.Event()

    def _get_many(self, keys: list[str]) -> list[bytes | None]:
        assert self.gate.wait(60)
        return super()._get_many(keys)


def test_a_stalled_tier_read_holds_up_its_own_request_only(smollm2, prompts) -> None:
    """The engine reads a waiting request's chunks off its thread: while the read stalls, a request
    that came after it is admitted and decodes step after step; once the read is done the stalled
    request is admitted with the chunks."""
    model, tokenizer = smollm2
    tier = GatedTier()

    def engine_over_tier() -> Engine:
        return Engine(model, tokenizer, {"type": "paged", "page_size": 16}, pool_tokens=4096, tiers=tier,
                      chunk_tokens=CHUNK)

    tier.gate.set()
    stored_by(engine_over_tier(), prompts[:1])
    engine = engine_over_tier()  # its own pool: only the tier holds the system prompt
    tier.gate.clear()
    short = prompts[2][SYSTEM:]  # 40 tokens of its own: no whole chunk to read
    waiting = engine.add_request(prompts[1], GREEDY)
    running = engine.add_request(short, GREEDY)
    advanced = [output.request_id for _ in range(6) for output in engine.step()]
    assert advanced.count(running) == 6 and waiting not in advanced  # it decodes; the other waits
    tier.gate.set()
    outputs = {}
    while engine.has_unfinished():
        outputs |= {output.request_id: output for output in engine.step() if output.finished}
    assert outputs[waiting].token_ids == greedy_tokens(model, prompts[1], NEW)
    assert outputs[waiting].cached_tokens == SYSTEM  # its chunks came from the tier's read
    assert outputs[running].token_ids == greedy_tokens(model, short, NEW)


def test_int8_chunks_load_and_their_agreement_is_measured(smollm2, prompts, redis_url) -> None:
    model, _ = smollm2
    stored_by(engine_over(smollm2, redis_url, "int8"), prompts[:1])
    second = engine_over(smollm2, redis_url, "int8")
    output = second.generate(prompts[1:2], GREEDY)[0].token_ids
    reference = greedy_tokens(model, prompts[1], NEW)
    assert second.stats()["tier_chunks_loaded"] == SYSTEM // CHUNK
    agree = sum(a == b for a, b in zip(output, reference, strict=True))
    assert output[0] == reference[0] and agree >= NEW // 2, f"int8 chunks: {agree} of {NEW} tokens agree"


def test_a_corrupted_chunk_is_discarded_and_recomputed(smollm2, prompts, redis_url) -> None:
    model, _ = smollm2
    stored_by(engine_over(smollm2, redis_url), prompts[:1])
    second = engine_over(smollm2, redis_url)
    key = str(second.manager.tiers.keys(prompts[1])[1])  # the system prompt's second chunk
    client = redis.Redis.from_url(redis_url)
    client.setrange(key, 200, b"\x00" * 64)  # corrupted in place: same length, a wrong checksum
    output = second.generate(prompts[1:2], GREEDY)[0].token_ids
    assert output == greedy_tokens(model, prompts[1], NEW)
    stats = second.stats()
    assert (stats["tier_chunks_loaded"], stats["tier_load_errors"]) == (1, 1)  # the run stops at it
    decode_chunk(client.get(key), ChunkKey.parse(key))  # discarded, computed and stored anew: whole


def test_a_dead_redis_costs_recompute_not_output(smollm2, prompts, redis_server, redis_url) -> None:
    model, _ = smollm2
    stored_by(engine_over(smollm2, redis_url), prompts[:1])
    redis_server.kill()
    second = engine_over(smollm2, redis_url)
    outputs = second.generate(prompts[1:], GREEDY)
    for output, prompt in zip(outputs, prompts[1:], strict=True):
        assert output.token_ids == greedy_tokens(model, prompt, NEW)
    assert second.stats()["tier_chunks_loaded"] == 0
    assert second.manager.tiers.tiers.tiers[0].stats.errors >= 1


def test_tiers_need_plain_pages_and_whole_pages_per_chunk(smollm2, tmp_path) -> None:
    model, tokenizer = smollm2
    tiers = TierChain([DiskTier(tmp_path, 1 << 30)])
    with pytest.raises(ConfigError, match="tiers"):
        Engine(model, tokenizer, {"type": "paged", "quantization": {"codec": "int4"}}, pool_tokens=4096,
               tiers=tiers)
    with pytest.raises(ConfigError, match="chunk_tokens"):
        Engine(model, tokenizer, {"type": "paged", "page_size": 16}, pool_tokens=4096, tiers=tiers,
               chunk_tokens=40)
