"""Page selectors (sparse decode): one shared matrix over every registered selector, plus Quest's
bound, the page summaries and the routing metrics against direct computations."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_generation, attn_implementation, generate, tiny_router
from tiny_models import TINY_HIDDEN, left_padded_batch, random_prompt, tiny_config, tiny_model
from transformers import AutoModelForCausalLM, DynamicCache

from kvfactory import ConfigError, KVCacheFactory, KVCacheManager, models
from kvfactory.codecs.spec import QuantizationSpec
from kvfactory.quantization.store import QuantizedStore
from kvfactory.selectors import SELECTORS, PageSummaries, register_selector
from kvfactory.selectors.base import RoutingContext
from kvfactory.selectors.metrics import RoutingMetrics
from kvfactory.selectors.oval import load_router, router_path
from kvfactory.selectors.oval.files import load_module
from kvfactory.selectors.oval.lowrank import LowRankScorer
from kvfactory.selectors.oval.router import Router
from kvfactory.selectors.quest import QuestSelector
from kvfactory.selectors.recent import RecentSelector
from kvfactory.selectors.sparse import PROMPT_WINDOW, SparseRead, SparseStore
from kvfactory.selectors.spec import SelectorSpec
from kvfactory.storage.paged import PagedStore
from kvfactory.storage.workspace import ReadWorkspace

NAMES = sorted(SELECTORS)
SPARSE = sorted(name for name, cls in SELECTORS.items() if not cls.reads_all)
PAGE = 4
INT4 = {"name": "quantized", "codec": "int4", "group_size": 8, "residual": 8}


def own_options(selector: str, hidden: int = TINY_HIDDEN, kv_heads: int = 2, head_dim: int = 16,
                layers: tuple[int, ...] = (0, 1), query_heads: int = 4) -> dict:
    """What a selector needs besides the shared options: OVAL a router of the model's shape."""
    if selector != "oval":
        return {}
    return {"router": tiny_router(hidden, kv_heads, head_dim, layers, query_heads=query_heads)}


def sparse(selector: str, quantized: bool = False, **options) -> dict:
    entry = {"name": selector, "dense_layers": 0} | own_options(selector) | options
    strategies = [{"name": "paged", "page_size": PAGE}, *([INT4] if quantized else []), entry]
    return {"type": "composite", "strategies": strategies}


def store_with(selector: str, keys: torch.Tensor, values: torch.Tensor, codec: str | None = None,
               query_heads: int | None = None, **options) -> SparseStore:
    """A one-layer sparse store holding ``keys`` / ``values``, for queries of ``query_heads`` heads (the
    KV heads' by default)."""
    b, h, _, d = keys.shape
    own = own_options(selector, hidden=5, kv_heads=h, head_dim=d, layers=(0,), query_heads=query_heads or h)
    spec = SelectorSpec.parse(selector, {"read_budget": 0.25, "dense_layers": 0} | own | options)
    inner = PagedStore(page_size=PAGE)
    if codec is not None:  # quantized pages: a 6-token full-precision window, KIVI groups of 8
        quantization = QuantizationSpec(codec=codec, residual=6, group_size=8)
        inner = QuantizedStore(inner, *quantization.codecs(0, 1), 6, ReadWorkspace())
    context = RoutingContext(hidden=torch.randn(b, 5))  # the decoder state OVAL routes from
    store = SparseStore(inner, spec.build_selector(), spec, RoutingMetrics(), context, 1)
    store.bind(0)
    store.attach(PagedStore.make_shared({"page_size": PAGE}, 1))
    store.append(keys, values)
    assert not isinstance(store.deferred_read(), SparseRead)  # a prefill reads whole
    return store


@pytest.mark.parametrize(("entry", "key"), [
    ({"name": "quest", "read_budget": 0}, "strategies[1].read_budget"),
    ({"name": "quest", "read_budget": 1.5}, "strategies[1].read_budget"),
    ({"name": "quest", "read_budget": "0.1"}, "strategies[1].read_budget"),
    ({"name": "quest", "read_budget": 0.1, "top_k": 4}, "strategies[1].read_budget"),
    ({"name": "quest", "top_k": 0}, "strategies[1].top_k"),
    ({"name": "quest", "sink_pages": -1}, "strategies[1].sink_pages"),
    ({"name": "quest", "shadow_every": 1.5}, "strategies[1].shadow_every"),
    ({"name": "quest", "seed": 1}, "strategies[1].seed"),
    ({"name": "random", "seed": "x"}, "strategies[1].seed"),
    ({"name": "quest", "prompt_weight": -0.5}, "strategies[1].prompt_weight"),
    ({"name": "quest", "prompt_weight": float("inf")}, "strategies[1].prompt_weight"),
    ({"name": "quest", "prompt_pages": 0.5}, "strategies[1].prompt_pages"),
])
def test_invalid_selector_configs_name_the_key(entry: dict, key: str) -> None:
    config = {"type": "composite", "strategies": [{"name": "paged"}, entry]}
    with pytest.raises(ConfigError) as err:
        KVCacheFactory(tiny_model("llama").config, config)
    assert err.value.key == key


@pytest.mark.parametrize(("option", "value", "names"), [
    ("bases_dtype", "float32", "summary_dtype"), ("prompt_mix", 1.0, "prompt_weight"),
    ("dynamic_pages", True, "removed"), ("max_page", 32, "removed"), ("entropy_jump", 2.0, "removed"),
    ("decay", False, "always applied"), ("bound_scale", 0.5, "paper's bound"),
    ("aggregate", "softmax", "best bound"), ("prompt_window", 8, "last 32 queries"),
    ("graph", 0.3, "co-occurrence graph was removed"), ("window", 128, "co-occurrence graph"),
    ("rebuild_every", 100, "co-occurrence graph"),
])
def test_old_option_spellings_name_what_to_write_instead(option: str, value, names: str) -> None:
    config = {"type": "composite", "strategies": [{"name": "paged"}, {"name": "quest", option: value}]}
    with pytest.raises(ConfigError, match=names) as err:
        KVCacheFactory(tiny_model("llama").config, config)
    assert err.value.key == f"strategies[1].{option}"


def test_a_registered_selector_keeps_its_own_field_of_a_removed_name() -> None:
    """``window`` was OVAL's graph option; a user's selector with a ``window`` field still gets it."""

    @dataclass
    class Windowed(RecentSelector):
        window: int = 4

    register_selector("windowed-test", Windowed)
    try:
        assert SelectorSpec.parse("windowed-test", {"window": 9}).build_selector().window == 9
        with pytest.raises(ConfigError, match="co-occurrence graph"):
            SelectorSpec.parse("oval", {"window": 9})
    finally:
        SELECTORS.pop("windowed-test")


def test_the_dynamic_pages_preset_names_its_removal() -> None:
    from kvfactory.presets import load_preset

    with pytest.raises(ConfigError, match="dynamic pages were removed"):
        load_preset("quest-dynamic@0.125")
    assert load_preset("quest@0.125")["strategies"][1] == {"name": "quest", "read_budget": 0.125}


@pytest.mark.parametrize(("strategies", "match"), [
    ([{"name": "dense"}, {"name": "quest"}], "paged storage"),
    ([{"name": "paged"}, {"name": "eviction", "policy": "h2o", "budget": 8}, {"name": "quest"}], "budget"),
    ([{"name": "paged"}, {"name": "quest"}, {"name": "recent"}], "one selector"),
])
def test_selectors_refuse_what_they_cannot_read(strategies: list, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        KVCacheFactory(tiny_model("llama").config, {"type": "composite", "strategies": strategies})


def test_selectors_refuse_a_model_switched_away_from_kvfactory_attention_before_any_write() -> None:
    model = tiny_model("llama")
    with attn_implementation(model, "sdpa"):
        cache = KVCacheFactory(model.config, sparse("quest")).create_cache()
        model.set_attn_implementation("sdpa")
        with pytest.raises(ConfigError, match="attn_implementation"):
            model(random_prompt(12), past_key_values=cache)
    assert cache.get_seq_length() == 0 and cache.size(0) == 0


@pytest.mark.parametrize(("options", "stored", "pages"), [
    ({"read_budget": 0.125}, 64, 8), ({"read_budget": 0.125}, 10, 2), ({"read_budget": 0.125}, 1, 1),
    ({"top_k": 5}, 64, 5), ({"top_k": 5}, 3, 3),
    ({"read_budget": 0.125, "sink_pages": 2, "local_pages": 3}, 64, 8),
    ({"read_budget": 0.05, "sink_pages": 2, "local_pages": 3}, 64, 5), ({}, 64, 8),
])
def test_pages_to_read_counts_the_always_read_pages(options: dict, stored: int, pages: int) -> None:
    assert SelectorSpec("quest", **options).pages_to_read(stored) == pages


def stored_bound(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """The value of ``dtype`` nearest ``x`` on the side that keeps it a bound."""
    low = x.to(dtype)
    wrong = low.float() < x if up else low.float() > x
    return torch.where(wrong, low.nextafter(torch.tensor(float("inf" if up else "-inf"), dtype=dtype)), low)


@pytest.mark.parametrize("with_mean", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_page_summaries_hold_each_pages_key_bounds(with_mean: bool, dtype: torch.dtype) -> None:
    """Exact in float32; in float16 the maxima are rounded up and the minima down, to the nearest
    float16 on that side, and the means to nearest."""
    gen = torch.Generator().manual_seed(0)
    summaries, chunks = PageSummaries(PAGE, with_mean, dtype), []
    for n in (5, 1, 1, 7, 16, 3, 0, 2):
        chunks.append(torch.randn(2, 3, n, 6, generator=gen) * 3)
        summaries.append(chunks[-1])
    keys = torch.cat(chunks, 2)
    t = keys.shape[2]
    assert summaries.length == t and summaries.pages == -(-t // PAGE) and summaries.features.dtype == dtype
    padded = torch.cat([keys, keys[:, :, -1:].expand(2, 3, summaries.pages * PAGE - t, 6)], 2)
    pages = padded.view(2, 3, summaries.pages, PAGE, 6)
    kmax, kmin = stored_bound(pages.amax(3), dtype, up=True), stored_bound(pages.amin(3), dtype, up=False)
    assert torch.equal(summaries.kmax, kmax) and torch.equal(summaries.kmin, kmin)
    assert (summaries.kmax.float() >= pages.amax(3)).all() and (summaries.kmin.float() <= pages.amin(3)).all()
    if with_mean:
        sums = torch.zeros(2, 3, summaries.pages * PAGE, 6)
        sums[:, :, :t] = keys
        counts = torch.tensor([min(PAGE, t - p * PAGE) for p in range(summaries.pages)], dtype=torch.float32)
        means = sums.view(2, 3, summaries.pages, PAGE, 6).sum(3) / counts[:, None]
        tolerance = {"atol": 1e-5, "rtol": 1.3e-6} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}
        torch.testing.assert_close(summaries.kmean.float(), means, **tolerance)
    summaries.select_rows(torch.tensor([1, 1, 0]))
    assert torch.equal(summaries.kmax, kmax[[1, 1, 0]])


def test_page_summaries_with_token_codes_keep_the_codes_alone() -> None:
    """A selector scoring tokens from their codes (OVAL's query scorer) reads no bounds: none are kept."""
    gen = torch.Generator().manual_seed(0)
    summaries, chunks = PageSummaries(PAGE), []
    summaries.set_token_codes(lambda keys: (keys[..., :2] * 10).round().to(torch.int8))
    for n in (5, 1, 16, 3):
        chunks.append(torch.randn(2, 3, n, 6, generator=gen))
        summaries.append(chunks[-1])
    keys = torch.cat(chunks, 2)
    assert summaries.length == 25 and summaries.pages == -(-25 // PAGE)
    assert torch.equal(summaries.codes, (keys[..., :2] * 10).round().to(torch.int8).transpose(2, 3))
    assert summaries.scored is summaries.codes or torch.equal(summaries.scored, summaries.codes)
    assert summaries.nbytes == summaries._codes.nbytes  # no bounds beside them
    summaries.select_rows(torch.tensor([1, 0]))
    assert torch.equal(summaries.codes[0], (keys[1, ..., :2] * 10).round().to(torch.int8).transpose(1, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quest_bound_is_at_least_every_key_score_of_the_page(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 2, 40, 8, generator=gen)
    summaries = PageSummaries(PAGE, dtype=dtype)
    summaries.append(keys)
    queries = torch.randn(1, 2, 1, 8, generator=gen)  # one query head per KV head: the bound is Quest's
    quest = QuestSelector()
    bound = quest.page_scores(queries, summaries, RoutingContext())
    exact = (queries @ keys.transpose(-1, -2)).view(1, 2, 10, PAGE).amax(-1)
    assert (bound >= exact - 1e-5).all()
    # the bound is tight for a page whose keys share one sign pattern per channel (a single key)
    single = PageSummaries(1, dtype=dtype)
    single.append(keys)
    tolerance = {} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-3}
    torch.testing.assert_close(quest.page_scores(queries, single, RoutingContext()),
                               (queries @ keys.transpose(-1, -2))[:, :, 0], **tolerance)


def test_quest_scores_each_query_heads_bound_and_keeps_the_best() -> None:
    """A page's score: the best of a KV head's query heads' ``q · centre + |q| · half-width`` (the
    paper's bound, ``sum_c max(q_c min_c, q_c max_c)``), for every page at once."""
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 3, 40, 8, generator=gen) * torch.linspace(0.2, 3.0, 8)
    summaries = PageSummaries(PAGE, dtype=torch.float32)
    summaries.append(keys)
    queries = torch.randn(2, 3, 4, 8, generator=gen) * 2  # 4 query rows per KV head
    pages = keys.view(2, 3, -1, PAGE, 8)
    centre, half = (pages.amax(3) + pages.amin(3)) / 2, (pages.amax(3) - pages.amin(3)) / 2
    rows = queries @ centre.transpose(-1, -2) + queries.abs() @ half.transpose(-1, -2)  # [B, H, R, P]
    bound = (queries[..., None, :] * pages.amax(3)[:, :, None]).maximum(
        queries[..., None, :] * pages.amin(3)[:, :, None]).sum(-1)  # the paper's form
    torch.testing.assert_close(rows, bound, rtol=1e-5, atol=1e-5)
    scores = QuestSelector().page_scores(queries, summaries, RoutingContext())
    torch.testing.assert_close(scores, rows.amax(2), rtol=1e-5, atol=1e-5)


def reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
              scaling: float) -> torch.Tensor:
    """Attention of ``query [B, Hq, q, D]`` over the ``allowed [B, Hkv, q, T]`` tokens: ``[B, q, Hq, D]``."""
    b, hq, q, d = query.shape
    hkv = keys.shape[1]
    scores = query.view(b, hkv, hq // hkv, q, d) @ keys[:, :, None].transpose(-1, -2) * scaling
    scores = scores.masked_fill(~allowed[:, :, None], float("-inf"))
    return (scores.softmax(-1) @ values[:, :, None]).view(b, hq, q, -1).transpose(1, 2)


@pytest.mark.parametrize("selector", SPARSE)
@pytest.mark.parametrize("new", [1, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_a_sparse_step_is_exact_attention_over_its_pages(selector: str, new: int, masked: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    b, hkv, groups, d, t = 2, 2, 3, 8, 37
    keys, values = (torch.randn(b, hkv, t + new, d, generator=gen) for _ in range(2))
    store = store_with(selector, keys[:, :, :t], values[:, :, :t], query_heads=hkv * groups)
    store.append(keys[:, :, t:], values[:, :, t:])
    read = store.deferred_read()
    assert read is not None and read.tail()[0] is store._new[0]
    query = torch.randn(b, hkv * groups, new, d, generator=gen)
    causal = torch.arange(t + new)[None, :] <= torch.arange(t, t + new)[:, None]  # [q, T]
    mask = None
    if masked:  # row 1 is left-padded by 6 tokens
        real = torch.ones(b, t + new, dtype=torch.bool)
        real[1, :6] = False
        mask = (causal[None] & real[:, None])[:, None]  # [B, 1, q, T], SDPA's boolean mask
    keys_read, values_read, mask_read = read.narrow(query, mask)
    out = F.scaled_dot_product_attention(query, keys_read, values_read, attn_mask=mask_read, scale=d ** -0.5,
                                         enable_gqa=True).transpose(1, 2)
    chosen = torch.zeros(b, hkv, t + new, dtype=torch.bool)
    for i, pages in enumerate(read.pages.view(b * hkv, -1).tolist()):
        for page in pages:
            chosen[i // hkv, i % hkv, page * PAGE:(page + 1) * PAGE] = True
    allowed = chosen[:, :, None] & (causal if mask is None else mask[:, 0, None])
    torch.testing.assert_close(out, reference(query, keys, values, allowed, d ** -0.5), rtol=1e-5, atol=1e-5)
    assert read.pages.shape[-1] == store.spec.pages_to_read(store.summaries.pages)


@pytest.mark.parametrize("codec", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("new", [1, 3])
def test_quantized_pages_read_what_the_whole_layer_holds(codec: str, new: int) -> None:
    """Pages decoded from their packed blocks alone, then the tail (packed part and full-precision
    window), equal the whole layer's decoded K/V at the same positions."""
    gen = torch.Generator().manual_seed(5)
    keys, values = (torch.randn(2, 2, 61 + new, 8, generator=gen) for _ in range(2))
    store = store_with("quest", keys[:, :, :61], values[:, :, :61], codec=codec)
    store.append(keys[:, :, 61:], values[:, :, 61:])
    read = store.deferred_read()
    query = torch.randn(2, 6, new, 8, generator=gen)
    got_k, got_v, mask = read.narrow(query, None)
    whole_k, whole_v = store.gather()
    assert store.inner.quantized_tokens > 0 and store.inner.inner.size() > 0
    quantized_pages = store.inner.quantized_tokens // PAGE
    for row in range(2):
        for head in range(2):
            pages = read.pages[row, head].tolist()
            columns = [p * PAGE + i for p in pages for i in range(PAGE) if p * PAGE + i < store.size()]
            assert got_k.shape[2] == len(columns)
            torch.testing.assert_close(got_k[row, head], whole_k[row, head, columns], rtol=0, atol=1e-6)
            torch.testing.assert_close(got_v[row, head], whole_v[row, head, columns], rtol=0, atol=1e-6)
    assert set(read.pages[0, 0].tolist()) >= set(range(quantized_pages, store.summaries.pages))  # the tail
    assert (mask is None) == (new == 1)


@pytest.mark.parametrize("selector", SPARSE)
def test_sink_local_and_new_token_pages_are_always_read(selector: str) -> None:
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 2, 80, 8, generator=gen)
    store = store_with(selector, keys[:, :, :70], keys[:, :, :70], sink_pages=2, local_pages=1)
    store.append(keys[:, :, 70:], keys[:, :, 70:])  # 10 new tokens: pages 17..19 of 20
    read = store.deferred_read()
    read.narrow(torch.randn(1, 2, 10, 8, generator=gen), None)
    for head_pages in read.pages[0].tolist():
        assert {0, 1, 17, 18, 19} <= set(head_pages) and head_pages[-1] == 19  # the last page last
        assert len(head_pages) == 5  # read_budget 0.25 of 20 pages


def test_prompt_weight_defaults_to_the_selectors_own() -> None:
    assert SelectorSpec.parse("quest", {}).prompt_weight == 2.0  # Quest's documented default
    assert SelectorSpec.parse("quest", {"prompt_weight": 0}).prompt_weight == 0.0
    assert SelectorSpec.parse("recent", {}).prompt_weight == 0.0  # the control baselines stay pure
    assert SelectorSpec.parse("recent", {"prompt_weight": 2}).prompt_weight == 2.0


def test_quest_ranks_its_attention_shares_plus_the_prompts() -> None:
    """The shares weighed against the prompt's: the best head's bound as a logit at attention's
    temperature; with no prompt, Quest's own order."""
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(1, 2, 64, 8, generator=gen)
    store = store_with("quest", keys, keys)
    queries = torch.randn(1, 2, 3, 8, generator=gen)
    scores = store.selector.page_scores(queries, store.summaries, store.context)
    assert torch.equal(store.selector.with_prompt(scores, torch.zeros_like(scores), 8).argsort(-1),
                       scores.argsort(-1))  # no prompt: Quest's own order
    q, bounds = queries[:, :, :, None], store.summaries.bounds.float()  # the bound: each channel's larger
    best = (q * bounds[:, :, None, :, :8]).maximum(q * bounds[:, :, None, :, 8:]).sum(-1).amax(2)
    torch.testing.assert_close(scores, best, rtol=1e-3, atol=1e-4)
    shares = (best * 8 ** -0.5).softmax(-1)
    prompt = torch.rand(scores.shape, generator=gen) * 0.2
    ranked = store.selector.with_prompt(scores, prompt, 8)
    assert torch.equal(ranked.argsort(-1), (shares + prompt).argsort(-1))


@pytest.mark.parametrize("weight", [0.0, 0.5])
def test_prompt_weight_keeps_what_the_prompts_last_queries_attended_to(weight: float) -> None:
    gen = torch.Generator().manual_seed(7)
    keys = torch.randn(1, 2, 80, 8, generator=gen)
    query = torch.randn(1, 2, 80, 8, generator=gen)
    window = PROMPT_WINDOW  # the prompt's last queries the prompt term reads
    query[:, :, -window:] = query[:, :, -1:] + 0.1 * torch.randn(1, 2, window, 8, generator=gen)  # a question
    keys[:, :, 20:24] = query[:, :, -1:] * 3  # page 5: what the prompt's last queries look up
    store = store_with("recent", keys, keys, prompt_weight=weight)
    store.attention_mask(None, query)
    store.observe(query, 8 ** -0.5)  # the prefill's attention call
    if not weight:
        assert store.prompt_mass is None
    else:
        scores = (query[:, :, -window:] @ keys.mT * 8 ** -0.5).masked_fill(
            torch.arange(80) > torch.arange(80 - window, 80)[:, None], float("-inf"))
        expected = scores.softmax(-1).mean(2).view(1, 2, 20, PAGE).sum(-1)
        torch.testing.assert_close(store.prompt_mass, expected)
        assert expected[..., 5].min() > 0.5
        ranked = torch.randn(1, 2, 20, generator=gen)  # the selector's scores, as logits
        torch.testing.assert_close(store.with_prompt_mass(ranked, 8, 1, 19), ranked[..., 1:19].softmax(-1)
                                   + weight * expected[..., 1:19] / expected[..., 1:19].sum(-1, keepdim=True))
    store.append(keys[:, :, :1], keys[:, :, :1])  # a decode step: pages 0..20, 6 read
    read = store.deferred_read()
    read.narrow(torch.randn(1, 2, 1, 8, generator=gen), None)
    assert all((5 in pages) == bool(weight) for pages in read.pages[0].tolist())
    assert read.pages.shape[-1] == 6  # the budget is unchanged: recent gives up its oldest page
    store.select_rows(torch.tensor([0, 0]))
    assert store.prompt_mass is None or store.prompt_mass.shape[0] == 2
    store.truncate(40)
    assert store.prompt_mass is None  # positions changed: what the prompt pointed at is forgotten


def test_recent_reads_the_sink_and_the_newest_pages() -> None:
    keys = torch.randn(1, 2, 41, 8)
    store = store_with("recent", keys[:, :, :40], keys[:, :, :40], read_budget=0.4)
    store.append(keys[:, :, 40:], keys[:, :, 40:])
    read = store.deferred_read()
    read.narrow(torch.randn(1, 2, 1, 8), None)
    assert read.pages[0].sort(-1).values.tolist() == [[0, 7, 8, 9, 10]] * 2  # ceil(0.4 * 11 pages)


def test_random_pages_repeat_with_their_seed() -> None:
    keys = torch.randn(1, 2, 81, 8)
    picks = []
    for seed in (5, 5, 6):
        store = store_with("random", keys[:, :, :80], keys[:, :, :80], seed=seed)
        store.append(keys[:, :, 80:], keys[:, :, 80:])
        read = store.deferred_read()
        read.narrow(torch.randn(1, 2, 1, 8), None)
        picks.append(read.pages)
    assert torch.equal(picks[0], picks[1]) and not torch.equal(picks[0], picks[2])


def test_reading_every_quantized_page_matches_the_quantized_cache() -> None:
    model = tiny_model("llama")
    inputs = {"input_ids": random_prompt(40)}
    plain = {"type": "composite", "strategies": [{"name": "paged", "page_size": PAGE}, INT4]}
    with attn_implementation(model, "kvfactory"):
        ref = generate(model, inputs, KVCacheFactory(model.config, plain).create_cache(), max_new_tokens=8,
                       min_new_tokens=8)
        out = generate(model, inputs, KVCacheFactory(model.config, sparse("quest", True, read_budget=1.0))
                       .create_cache(), max_new_tokens=8, min_new_tokens=8)
    assert_same_generation(ref, out)


@pytest.mark.parametrize("model_id", ["llama", "qwen2", "mistral-sw8", "gemma"])
@pytest.mark.parametrize("config", [sparse("full"), sparse("quest", read_budget=1.0)],
                         ids=["full", "quest-1.0"])
def test_reading_every_page_matches_dynamic_cache(model_id: str, config: dict) -> None:
    model = tiny_model(model_id)
    inputs = {"input_ids": random_prompt(30)}
    with attn_implementation(model, "kvfactory"):
        ref = generate(model, inputs, DynamicCache(config=model.config), max_new_tokens=10, min_new_tokens=10)
        cache = KVCacheFactory(model.config, config).create_cache()
        out = generate(model, inputs, cache, max_new_tokens=10, min_new_tokens=10)
    assert_same_generation(ref, out)
    metrics = cache.routing_metrics()
    if model_id == "mistral-sw8":  # every layer slides: each reads its window whole, no selector runs
        assert metrics["steps"] == 0
    else:
        assert metrics["steps"] == 9 and metrics["read_fraction"] == 1.0


@pytest.mark.parametrize("selector", SPARSE)
@pytest.mark.parametrize("quantized", [False, True], ids=["paged", "paged+int4"])
def test_sparse_decode_reads_its_budget_in_a_padded_batch(selector: str, quantized: bool) -> None:
    model = tiny_model("llama")
    inputs = left_padded_batch([60, 45], seed=4)
    with attn_implementation(model, "kvfactory"):
        config = sparse(selector, quantized, read_budget=0.25, shadow_every=2)
        cache = KVCacheFactory(model.config, config).create_cache()
        out = generate(model, inputs, cache, max_new_tokens=9, min_new_tokens=9)
    assert all(torch.isfinite(step).all() for step in out.logits)
    metrics = cache.routing_metrics()
    assert metrics["steps"] == 8 and metrics["shadow_samples"] == 4 * 2  # every 2nd step, 2 layers
    data = (metrics["kv_bytes_read_per_step"] - metrics["index_bytes_read_per_step"]) \
        / metrics["kv_bytes_full_per_step"]
    if quantized:  # 4 or 5 of 16 to 17 pages, the full-precision window among them
        assert 0.2 < data < 0.6
    else:  # 16 to 17 pages stored, 4 or 5 read, plus what scoring read against a token's float32 key
        # and value (2 x 16 channels): Quest 2 float16 key vectors per page (maxima, minima), OVAL's
        # query scorer 4 int8 codes per token
        per_token = {"oval": 4}.get(selector, 2 * 16 * 2 / PAGE) if SELECTORS[selector].reads_summaries else 0
        summaries = per_token / (2 * 16 * 4)
        assert 4 / 17 + summaries - 0.01 < metrics["read_fraction"] < 5 / 16 + summaries + 0.01
    assert 0 <= metrics["hit_rate"] <= 1
    assert 0 < metrics["recall"] <= metrics["oracle_recall"] + 1e-6 <= 1 + 2e-6  # none beats the oracle
    assert 0 < metrics["page_utilisation"] <= 1
    assert metrics["router_latency_p99_ms"] >= metrics["router_latency_p50_ms"] >= 0


@pytest.mark.parametrize("selector", SPARSE)
def test_tokens_read_split_into_always_selected_and_whole(selector: str) -> None:
    """With 1 dense layer of 2, half the tokens are read whole; the routed layer reads its budget
    of the stored tokens within one page, the sink, local and new-token pages among them."""
    model = tiny_model("llama")
    budget = 0.25
    with attn_implementation(model, "kvfactory"):
        config = sparse(selector, read_budget=budget, dense_layers=1)
        cache = KVCacheFactory(model.config, config).create_cache()
        inputs = {"input_ids": random_prompt(121, seed=3)}
        generate(model, inputs, cache, max_new_tokens=12, min_new_tokens=12)
    m = cache.routing_metrics()
    parts = m["always_read_fraction"] + m["selected_read_fraction"]
    assert m["token_read_fraction"] == pytest.approx(parts + m["whole_read_fraction"])
    assert m["whole_read_fraction"] == pytest.approx(0.5)  # both layers store the same tokens
    stored = 121  # the fewest tokens a decode step saw: one page of slack is at most PAGE / stored
    assert abs(parts - budget / 2) <= PAGE / stored / 2
    assert (PAGE + 1) / 133 / 2 <= m["always_read_fraction"] < parts  # the sink page and the new token
    assert m["selected_read_fraction"] > 0


def test_shadow_metrics_follow_their_definitions() -> None:
    metrics = RoutingMetrics()
    mass = torch.tensor([[[0.5, 0.1, 0.3, 0.1], [0.4, 0.3, 0.2, 0.1]]])  # [B=1, Hkv=2, 4 pages]
    read = torch.tensor([[[True, True, False, False], [False, True, True, True]]])  # 2 and 3 pages
    metrics.record_shadow(read, mass)
    # head 0: true top-2 {0, 2}, read {0, 1}: hit 1/2, recall 0.6; head 1: top-3 {0, 1, 2}: 2/3, 0.6
    values = metrics.as_dict()
    assert values["shadow_samples"] == 1 and values["recall"] == pytest.approx(0.6)
    assert values["hit_rate"] == pytest.approx((1 / 2 + 2 / 3) / 2)
    assert values["oracle_recall"] == pytest.approx((0.8 + 0.9) / 2)  # the true top 2 and top 3
    metrics.record_shadow(torch.zeros_like(read), mass)  # a head that read nothing: the oracle reads 0
    assert metrics.as_dict()["oracle_recall"] == pytest.approx((0.8 + 0.9) / 2 / 2)


def test_a_cache_without_selector_has_no_routing_metrics() -> None:
    cache = KVCacheFactory(tiny_model("llama").config, {"type": "paged"}).create_cache()
    with pytest.raises(ValueError, match="no selector"):
        cache.routing_metrics()


def test_memory_report_counts_the_page_summaries() -> None:
    model = tiny_model("llama")
    with attn_implementation(model, "kvfactory"):
        plain = KVCacheFactory(model.config, {"type": "paged", "page_size": PAGE}).create_cache()
        quest = KVCacheFactory(model.config, sparse("quest")).create_cache()
        for cache in (plain, quest):
            model(random_prompt(20), past_key_values=cache)
    # per layer: 5 pages x 2 KV heads x (max, min) x head_dim 16 x float16
    assert quest.memory_report()["allocated"] - plain.memory_report()["allocated"] == 2 * 5 * 2 * 2 * 16 * 2


def test_oval_receives_the_decoders_hidden_state_from_a_plain_model() -> None:
    """No watch_hidden_states, no attention switch: the cache's first forward hooks the model."""
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    prefetch = tiny_router(TINY_HIDDEN, 2, 16, (0, 1), "prefetch")
    cache = KVCacheFactory(model.config, sparse("oval", router=prefetch, read_budget=0.25)).create_cache()
    generate(model, {"input_ids": random_prompt(40)}, cache, max_new_tokens=3, min_new_tokens=3)
    assert cache.routing_context.hidden.shape == (1, TINY_HIDDEN)
    assert cache.routing_metrics()["steps"] == 2


def test_a_router_for_another_model_is_refused(tmp_path) -> None:
    model = tiny_model("llama")
    with attn_implementation(model, "kvfactory"):
        other = tiny_router(32, 2, 16, (0, 1), "prefetch")
        cache = KVCacheFactory(model.config, sparse("oval", router=other, read_budget=0.5)).create_cache()
        with pytest.raises(ConfigError, match="hidden size 64"):
            generate(model, {"input_ids": random_prompt(40)}, cache, max_new_tokens=3, min_new_tokens=3)
        other = tiny_router(64, 2, 8, (0, 1))  # a query scorer for 8-channel heads
        cache = KVCacheFactory(model.config, sparse("oval", router=other, read_budget=0.5)).create_cache()
        with pytest.raises(ConfigError, match="2 KV heads of 16 channels"):
            generate(model, {"input_ids": random_prompt(40)}, cache, max_new_tokens=3, min_new_tokens=3)
        other = tiny_router(64, 2, 16, (1,))  # a query scorer for layer 1 alone
        with pytest.raises(ConfigError, match="router trained for layer 0"):
            KVCacheFactory(model.config, sparse("oval", router=other, read_budget=0.5)).create_cache()
    with pytest.raises(ConfigError, match="router"):
        KVCacheFactory(model.config, sparse("oval", router=str(tmp_path / "missing.safetensors")))
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not a router")
    with pytest.raises(ConfigError, match="kvfactory oval train"):
        Router.load(broken)


def test_the_shipped_router_is_the_one_trained_for_the_model() -> None:
    """``"embedded"`` and ``"embedded-gate"`` resolve per model: SmolLM2's router for SmolLM2 (every
    layer), Gemma 3 270M's for its full-attention layers 5, 11 and 17; a model none was trained for
    is told the command."""
    models_layers = (("smollm2", range(2, 30)), ("gemma3-270m", (5, 11, 17)))
    for (name, layers), shipped in itertools.product(models_layers, ("embedded", "embedded-gate")):
        config = sparse("oval", router=shipped, read_budget=0.125, dense_layers=2)
        factory = KVCacheFactory(models.load_config(name), config)
        assert sorted(factory.layer_selectors) == list(layers)
        routers = {spec.options["router"] for spec in factory.layer_selectors.values()}
        router = load_router(routers.pop())
        assert not routers and router.shape.model == name
        assert router.kind == ("query" if shipped == "embedded" else "gate")
    with pytest.raises(ConfigError, match="'embedded' for gemma3-270m, smollm2 only.*kvfactory oval train"):
        KVCacheFactory(tiny_model("llama").config, sparse("oval", router="embedded", read_budget=0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_page_embeddings_follow_the_summaries_and_score_as_the_raw_features(dtype: torch.dtype) -> None:
    """OVAL reads each page's router embedding (projection applied to the page) instead of its raw
    features (projection applied to the query): the same logits for every full page, embedded as it
    fills (a step never ranks the page it writes), with only the open page's features held beside
    the embeddings."""
    router = Router.load(tiny_router(64, 2, 16, (0, 1), "prefetch"))
    gen = torch.Generator().manual_seed(3)
    summaries = PageSummaries(PAGE, with_mean=True, dtype=dtype)
    summaries.set_embedding(lambda features: router.embed_pages(features, 1))
    plain = PageSummaries(PAGE, with_mean=True, dtype=dtype)  # the same keys, every page's features
    for n in (6, 1, 1, 7, 16, 3, 1):
        keys = torch.randn(2, 2, n, 16, generator=gen)
        summaries.append(keys)
        plain.append(keys)
    hidden = torch.randn(2, 64, generator=gen)
    raw = router.logits(router.key_vectors(hidden)[:, 1], plain.features, None)
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    embedded = router.logits(router.routing_queries(hidden)[:, 1], summaries.embedded, None)
    full = summaries.length // PAGE
    assert 0 < full < summaries.pages  # full pages and an open one
    torch.testing.assert_close(embedded[..., :full], raw[..., :full], **tolerance)
    assert summaries.scored is summaries.embedded or torch.equal(summaries.scored, summaries.embedded)
    held_features = summaries.nbytes - summaries._embedded.nbytes
    assert held_features == plain.features[:, :, :1].nbytes  # one page's, not all pages'
    with pytest.raises(ValueError, match="open page's features only"):
        _ = summaries.features
    with pytest.raises(ValueError, match="before any token is appended"):
        summaries.set_embedding(None)
    summaries.select_rows(torch.tensor([1, 1]))
    plain.select_rows(torch.tensor([1, 1]))
    expected = router.embed_pages(plain.features, 1).detach().to(dtype)
    torch.testing.assert_close(summaries.embedded[:, :, :full], expected[:, :, :full])


def test_decode_steps_embed_a_page_once_it_fills() -> None:
    """A decode step never ranks the page it writes, so single-token appends embed a page when it fills
    (and the open page where the embedding buffer grows, so its slot holds numbers), not at every token."""
    router = Router.load(tiny_router(64, 2, 16, (0, 1), "prefetch"))
    calls = []
    summaries = PageSummaries(PAGE, with_mean=True)
    def embed(features: torch.Tensor) -> torch.Tensor:
        calls.append(features.shape[2])  # pages embedded by this call
        return router.embed_pages(features, 1)
    summaries.set_embedding(embed)
    expected = 0
    for key in torch.randn(1, 2, 10 * PAGE, 16, generator=torch.Generator().manual_seed(5)).split(1, dim=2):
        capacity = None if summaries._embedded is None else summaries._embedded.shape[2]
        summaries.append(key)
        expected += summaries.length % PAGE == 0 or capacity != summaries._embedded.shape[2]
    assert calls == [1] * expected and expected < 2 * 10  # a page per call; 40 tokens, 10 pages


def test_a_router_file_round_trips_and_names_its_kind(tmp_path) -> None:
    path = tiny_router(64, 2, 16, (0, 1), "prefetch")
    router = Router.load(path)
    again = Router.load(path)
    hidden = torch.randn(3, 64)
    assert router.shape == again.shape and router.shape.layers == (0, 1)
    torch.testing.assert_close(router.key_vectors(hidden), again.key_vectors(hidden), rtol=0, atol=0)
    scorer = load_module(tiny_router(64, 2, 16, (0, 1)))
    assert isinstance(scorer, LowRankScorer) and scorer.shape.layers == (0, 1)
    again = load_module(tiny_router(64, 2, 16, (0, 1)))
    for name, tensor in scorer.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name
    with pytest.raises(ConfigError, match="a prefetch router"):
        Router.load(tiny_router(64, 2, 16, (0, 1)))
    # the prefetch router shipped before files named their kind still loads
    assert isinstance(load_module(router_path("embedded-prefetch")), Router)
    assert isinstance(load_module(router_path("embedded")), LowRankScorer)


@pytest.mark.parametrize("selector", SPARSE)
def test_beams_and_returned_sequences_carry_the_routed_rows(selector: str) -> None:
    model = tiny_model("llama")
    inputs = {"input_ids": random_prompt(40)}
    with attn_implementation(model, "kvfactory"):
        for kwargs in ({"num_beams": 3}, {"do_sample": True, "num_return_sequences": 2}):
            ref = generate(model, inputs, DynamicCache(config=model.config), seed=0, max_new_tokens=8,
                           min_new_tokens=8, **kwargs)
            whole = KVCacheFactory(model.config, sparse(selector, read_budget=1.0)).create_cache()
            assert_same_generation(ref, generate(model, inputs, whole, seed=0, max_new_tokens=8,
                                                 min_new_tokens=8, **kwargs))
            cache = KVCacheFactory(model.config, sparse(selector, read_budget=0.25)).create_cache()
            out = generate(model, inputs, cache, seed=0, max_new_tokens=8, min_new_tokens=8, **kwargs)
            assert out.sequences.shape[1] == 48 and cache.routing_metrics()["steps"] == 7
            assert cache.routing_context.hidden.shape[0] == cache.batch_size


def test_row_rearrangements_move_the_routed_hidden_state() -> None:
    model = tiny_model("llama")
    with attn_implementation(model, "kvfactory"):
        prefetch = tiny_router(TINY_HIDDEN, 2, 16, (0, 1), "prefetch")
        cache = KVCacheFactory(model.config, sparse("oval", router=prefetch)).create_cache()
        model(random_prompt(12).repeat(3, 1), past_key_values=cache)
    hidden = torch.arange(3.0)[:, None].expand(3, TINY_HIDDEN).clone()
    cache.routing_context.hidden = hidden
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert cache.routing_context.hidden[:, 0].tolist() == [2, 2, 0]
    cache.batch_repeat_interleave(2)
    assert cache.routing_context.hidden[:, 0].tolist() == [2, 2, 2, 2, 0, 0]
    cache.batch_select_indices(torch.tensor([0, 5]))
    assert cache.routing_context.hidden[:, 0].tolist() == [2, 0] and cache.batch_size == 2


@pytest.mark.parametrize("selector", SPARSE)
def test_a_page_selector_shares_cached_prefixes_and_reads_as_if_computed(selector: str) -> None:
    """Under a page selector a prompt reuses a cached prefix's blocks; the page summaries are made from
    the adopted keys, so the sparse decode picks and generates exactly what computing the prompt does."""
    model = tiny_model("llama")
    config = sparse(selector, read_budget=0.25)
    with attn_implementation(model, "kvfactory"):
        manager = KVCacheManager(model.config, config)
        assert manager.prefix_caching
        system = random_prompt(24, seed=1)
        # the uncached part holds the prompt's last PROMPT_WINDOW queries, whose page mass the ranking takes
        prompts = [torch.cat([system, random_prompt(PROMPT_WINDOW + 4, seed=s)], 1) for s in (2, 3)]
        outputs = [generate(model, {"input_ids": ids}, manager.create(f"s{i}", prompt=ids[0]),
                            max_new_tokens=6) for i, ids in enumerate(prompts)]
        assert [manager.cached_tokens(f"s{i}") for i in range(2)] == [0, 24]
        alone = KVCacheFactory(model.config, config).create_cache()  # the same prompt, computed whole
        expected = generate(model, {"input_ids": prompts[1]}, alone, max_new_tokens=6)
        manager.close()
    assert_same_generation(expected, outputs[1])
