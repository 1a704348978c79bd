"""Dynamic pages (``kvfactory.selectors.layout``): the entropy sizer, the layout, the bases over
pages of varying size, token reads from the pool and exact sparse steps over them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import attn_implementation, generate
from test_selectors import PAGE, reference, sparse
from tiny_models import left_padded_batch, random_prompt, tiny_model
from transformers import DynamicCache

from kvfactory import KVCacheFactory
from kvfactory.selectors import layout as layout_module
from kvfactory.selectors.base import RoutingContext
from kvfactory.selectors.layout import PageLayout, attention_entropy, page_starts
from kvfactory.selectors.metrics import RoutingMetrics
from kvfactory.selectors.pages import DynamicPageBases
from kvfactory.selectors.sparse import DynamicRead, SparseStore
from kvfactory.selectors.spec import SelectorSpec
from kvfactory.storage.paged import PagedStore

MAX_PAGE = 8


def sizes_of(starts: torch.Tensor, n: int) -> torch.Tensor:
    return torch.diff(starts, append=torch.tensor([n]))


def test_pages_are_cut_where_entropy_jumps_and_shrink_where_it_is_high() -> None:
    gen = torch.Generator().manual_seed(0)
    noise = 0.01 * torch.rand(400, generator=gen)
    entropy = torch.cat([0.1 + noise[:200], 0.9 + noise[200:]])
    starts = page_starts(entropy, page_size=16, max_page=32, jump=1.0)
    sizes = sizes_of(starts, 400)
    assert starts[0] == 0 and bool((torch.diff(starts) > 0).all()) and 200 in starts.tolist()
    assert int(sizes.min()) >= 1 and int(sizes.max()) <= 32 and int(sizes.sum()) == 400
    low, high = sizes[starts < 200].float().mean(), sizes[starts >= 200].float().mean()
    assert low > 4 * high, (low, high)
    assert page_starts(torch.tensor([0.5]), 16, 32, 1.0).tolist() == [0]
    assert page_starts(torch.zeros(0), 16, 32, 1.0).numel() == 0


def test_chunked_entropy_is_each_querys_entropy_over_its_chunk_and_overlap(monkeypatch) -> None:
    monkeypatch.setattr(layout_module, "CHUNK", 8)
    monkeypatch.setattr(layout_module, "OVERLAP", 3)
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 2, 30, 4, generator=gen)
    query = torch.randn(2, 4, 20, 4, generator=gen)  # the last 20 of 30 tokens, 2 query heads per KV head
    got = attention_entropy(query, keys, 0.5)
    for i in range(20):
        pos, chunk_start = 10 + i, 10 + i // 8 * 8
        first = max(0, chunk_start - 3)
        k = keys[:, :, first:pos + 1].repeat_interleave(2, dim=1)
        probs = (query[:, :, i:i + 1] @ k.transpose(-1, -2) * 0.5).softmax(-1)
        entropy = -(probs * probs.log()).sum(-1).mean()
        seen = max(pos + 1 - first, 2)
        assert got[i] == pytest.approx(float(entropy / torch.tensor(seen).log()), abs=1e-5)


def test_layout_places_prefill_cuts_then_decoded_pages() -> None:
    layout = PageLayout(page_size=4, max_page=MAX_PAGE, jump=1.0)
    layout.cut(torch.linspace(0, 1, 10))
    prefill = layout.pages
    assert layout.length == 10 and int(layout.sizes().max()) <= MAX_PAGE
    for length in range(11, 20):  # decoded tokens, one a step: pages of page_size after the prefill's
        layout.cover(length)
    assert layout.starts[prefill:].tolist() == [10, 14, 18] and layout.sizes().tolist()[-3:] == [4, 4, 1]
    assert layout.page_of(9, 12).tolist() == [prefill - 1, prefill, prefill]
    assert sum(size * count for size, count in layout.histogram().items()) == 19
    layout.truncate(15)
    layout.truncate(15)
    assert layout.length == 15 and layout.starts[prefill:].tolist() == [10, 14]
    layout.clear()
    assert layout.pages == 0 and layout.length == 0


@pytest.mark.parametrize("with_mean", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dynamic_bases_reduce_each_pages_keys(with_mean: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    layout = PageLayout(page_size=4, max_page=MAX_PAGE, jump=0.5)
    keys = torch.randn(2, 3, 40, 6, generator=gen)
    layout.cut(torch.rand(30, generator=gen))
    bases = DynamicPageBases(layout, with_mean, dtype)
    bases.append(keys[:, :, :30])
    for t in range(30, 40):  # decoded tokens fill pages across appends
        bases.append(keys[:, :, t:t + 1])
    assert bases.length == 40 and bases.pages == layout.pages
    page = layout.page_of(0, 40)
    step = 0 if dtype == torch.float32 else 2 ** -10  # float16: bounds rounded outward by < 1 ulp
    for p in range(layout.pages):
        members = keys[:, :, page == p]
        kmax, kmin = bases.kmax[:, :, p].float(), bases.kmin[:, :, p].float()
        hi, lo = members.amax(2), members.amin(2)
        assert (kmax >= hi).all() and (kmax - hi <= step * hi.abs()).all()
        assert (kmin <= lo).all() and (lo - kmin <= step * lo.abs()).all()
        if with_mean:
            torch.testing.assert_close(bases.kmean[:, :, p].float(), members.mean(2),
                                       **({} if step == 0 else {"atol": 1e-3, "rtol": 1e-3}))


def test_paged_store_reads_any_tokens() -> None:
    gen = torch.Generator().manual_seed(3)
    store = PagedStore(page_size=PAGE)
    keys, values = torch.randn(2, 3, 23, 5, generator=gen), torch.randn(2, 3, 23, 5, generator=gen)
    store.append(keys[:, :, :9], values[:, :, :9])
    store.append(keys[:, :, 9:], values[:, :, 9:])
    positions = torch.randint(0, 23, (2, 3, 11), generator=gen)
    got_k, got_v = store.read_tokens(positions)
    index = positions[..., None].expand(-1, -1, -1, 5)
    assert torch.equal(got_k, keys.gather(2, index)) and torch.equal(got_v, values.gather(2, index))


def dynamic_store(keys: torch.Tensor, values: torch.Tensor, prefill: int, gen: torch.Generator,
                  **options) -> SparseStore:
    """A Quest store over dynamic pages whose first ``prefill`` tokens were cut by a prefill query."""
    b, h, _, d = keys.shape
    spec = SelectorSpec.parse("quest", {"read_budget": 0.3, "dense_layers": 0, "dynamic_pages": True,
                                        "max_page": MAX_PAGE} | options)
    store = SparseStore(PagedStore(page_size=PAGE), spec.build_selector(), spec, RoutingMetrics(),
                        RoutingContext(), 1)
    store.bind(0)
    store.append(keys[:, :, :prefill], values[:, :, :prefill])
    assert store.deferred_read() is None  # a prefill reads whole
    store.observe(torch.randn(b, 2 * h, prefill, d, generator=gen), d ** -0.5)  # the sizer cuts it
    assert store.layout.length == prefill
    return store


@pytest.mark.parametrize("new", [1, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_a_dynamic_step_is_exact_attention_over_the_tokens_it_reads(new: int, masked: bool) -> None:
    gen = torch.Generator().manual_seed(4)
    b, hkv, d, t = 2, 2, 8, 90
    keys, values = (torch.randn(b, hkv, t + new, d, generator=gen) for _ in range(2))
    store = dynamic_store(keys, values, t, gen)
    store.append(keys[:, :, t:], values[:, :, t:])
    read = store.deferred_read()
    assert isinstance(read, DynamicRead)
    query = torch.randn(b, 2 * hkv, new, d, generator=gen)
    causal = torch.arange(t + new)[None, :] <= torch.arange(t, t + new)[:, None]
    mask = None
    if masked:  # row 1 is left-padded by 6 tokens
        real = torch.ones(b, t + new, dtype=torch.bool)
        real[1, :6] = False
        mask = (causal[None] & real[:, None])[:, None]
    keys_read, values_read, mask_read = read.narrow(query, mask)
    out = F.scaled_dot_product_attention(query, keys_read, values_read, attn_mask=mask_read, scale=d ** -0.5,
                                         enable_gqa=True).transpose(1, 2)
    layout = store.layout
    chosen = read.read.gather(-1, layout.page_of(0, t + new).expand(b, hkv, -1))  # [B, Hkv, T] tokens read
    allowed = chosen[:, :, None] & (causal if mask is None else mask[:, 0, None])
    torch.testing.assert_close(out, reference(query, keys, values, allowed, d ** -0.5), rtol=1e-5, atol=1e-5)
    sizes = layout.sizes()
    assert bool(read.read[..., 0].all()) and bool(read.read[..., -1].all())  # sink and local pages
    assert bool(read.read[..., layout.page_of(t, t + 1)].all())  # the step's new tokens
    tail = min(int(layout.starts[layout.page_of(t, t + 1)]), int(layout.starts[-1]))  # local and new pages
    always, read_tokens = int(sizes[0]) + t + new - tail, chosen.sum(-1)
    budget = store.spec.tokens_to_read(t + new)
    assert always <= read_tokens.min() and read_tokens.max() <= max(always, budget)


def test_dynamic_pages_in_a_padded_batch_read_their_token_budget() -> None:
    model = tiny_model("llama")
    inputs = left_padded_batch([70, 52], seed=4)
    with attn_implementation(model, "kvfactory"):
        config = sparse("quest", read_budget=0.3, shadow_every=2, dynamic_pages=True, max_page=MAX_PAGE)
        cache = KVCacheFactory(model.config, config).create_cache()
        out = generate(model, inputs, cache, max_new_tokens=9, min_new_tokens=9)
    assert all(torch.isfinite(step).all() for step in out.logits)
    metrics = cache.routing_metrics()
    assert metrics["steps"] == 8 and metrics["shadow_samples"] == 4 * 2
    data = (metrics["kv_bytes_read_per_step"] - metrics["index_bytes_read_per_step"]) \
        / metrics["kv_bytes_full_per_step"]
    assert 0.1 < data <= 0.3 + 1e-6  # at most the budget, always-read pages included
    assert 0 <= metrics["hit_rate"] <= 1 and 0 < metrics["recall"] <= 1 + 1e-6
    layout = cache.routing_context.shared["pages.layout"]
    assert layout.length == 70 + 8 and len(layout.histogram()) > 1


@pytest.mark.parametrize("model_id", ["llama", "qwen2", "gemma"])
def test_reading_every_dynamic_page_matches_dynamic_cache(model_id: str) -> None:
    model = tiny_model(model_id)
    inputs = {"input_ids": random_prompt(40)}
    with attn_implementation(model, "kvfactory"):
        ref = generate(model, inputs, DynamicCache(config=model.config), max_new_tokens=10, min_new_tokens=10)
        config = sparse("quest", read_budget=1.0, dynamic_pages=True)
        cache = KVCacheFactory(model.config, config).create_cache()
        out = generate(model, inputs, cache, max_new_tokens=10, min_new_tokens=10)
    assert torch.equal(ref.sequences, out.sequences)
    assert cache.routing_context.shared["pages.layout"].length == 49

