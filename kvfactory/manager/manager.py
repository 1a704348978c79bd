"""``KVCacheManager``: many sequences over one block pool, and their lifecycle.

Every sequence is a normal kvfactory cache for ``model.generate(past_key_values=...)``; they share
the factory's paged pool. The manager adds what serving needs around them:

- ``create`` / ``get`` / ``free`` / ``fork`` (copy-on-write: a fork shares every block until one side
  writes into a shared one) and ``with manager.sequence(id) as cache`` (freed on exit);
- prefix sharing (``prefix.py``): ``create(id, prompt=token_ids)`` starts the cache from the cached full
  blocks of the longest known prefix, so generation prefills only the rest; a sequence's full blocks
  are cached when they fill, under the ids of the tokens really written into them (recorded from
  the decoder's ``input_ids``, never from the declared prompt) while it holds them from its first
  token; they stay cached after ``free``, wait in one eviction-ordered queue once no sequence uses
  them (reused on a prefix hit, evicted from its head when the pool needs room) and can be pinned;
  explicit ``mark_as_shareable`` / ``attach_shared_cache`` too;
- ``pause`` / ``prefetch`` / ``resume``: the sequence's K/V (or only its oldest pages: a partial swap)
  moves to a host tier (CPU tensors, within ``host_bytes``) and its blocks go back to the pool;
  ``prefetch`` moves it back towards the pool's device on a background thread ahead of ``resume``,
  which writes it back bit-exactly; ``swap_out(blocks)`` makes room by swapping out the oldest pages
  of the least recently used sequences (by when the manager last handed them out);
- tiers (``tiered.py``): with ``PrefixTiers``, prompt chunks are stored in kvfactory's tiers (host,
  disk, Redis) when they fill, and a prompt's leading chunks the tiers hold are loaded at ``create``
  instead of computed, so another process reuses them;
- ``save`` / ``load`` (``persist.py``): safetensors + checked metadata, written atomically;
- ``stats()``: sequences, pool blocks, prefix hits and misses, host bytes and bytes moved (it only
  reads).

Each sequence is a ``Sequence`` record (``sequence.py``): its cache, its status (waiting, running,
paused, prefetching, finished; transitions are checked there), its host copy, prefetch and prefix
state. The manager reaches the stores only through the cache's block-table methods
(``KVCache.prefix_blocks``, ``adopt_blocks``, ``pages_from_start``, ``drop_front``) and the pool's.

Quantized pages and eviction policies are managed too: forks share the pages, pauses and saves keep
quantized pages packed (never decoded) and a policy's bookkeeping with its tokens; prefixes are
shared between plain pages (also under a page selector) and partial swaps made between plain pages
only.

Errors are specific (``UnknownSequenceError``, ``SequenceStateError``, ``SequenceFileError``,
``CacheFullError``) and leave the manager as it was.
"""

from __future__ import annotations

import time
import warnings
from collections import abc
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvfactory.cache import KVCache, attention_layout
from kvfactory.config import CacheConfig
from kvfactory.errors import (
    CacheFullError,
    ConfigError,
    SequenceStateError,
    UnknownSequenceError,
    UnsupportedError,
)
from kvfactory.factory import KVCacheFactory
from kvfactory.manager.persist import load_state, save_state
from kvfactory.manager.prefix import PrefixIndex, block_hashes
from kvfactory.manager.sequence import Sequence, SequenceStatus
from kvfactory.manager.state import SequenceState
from kvfactory.manager.tiered import ChunkRun, PrefixTiers
from kvfactory.manager.window_pages import WindowPages
from kvfactory.sizing import KVShape
from kvfactory.storage.base import PrefixLayout
from kvfactory.storage.blocks import BlockPool, PagedPool
from kvfactory.storage.paged import PagedStore

Prompt = abc.Sequence[int] | torch.Tensor

SILENT_LOOKUPS = 8  # prompts looked up without a single cached block before the manager warns
WINDOW_BLOCKS = 32  # prompt blocks whose full-precision window pages stay kept for hits (``WindowPages``)


@dataclass
class _Shared:
    """A prefix marked shareable: its blocks in every layer group, referenced by the manager."""

    ids: list[torch.Tensor]  # per layer group: [1, blocks]
    tokens: int
    token_ids: list[int] | None  # their ids, if the sequence's were known


@dataclass
class _Counters:
    bytes_to_host: int = 0
    bytes_from_host: int = 0
    prefetches: int = 0
    stalls: int = 0  # resumes that waited for their prefetch
    stall_seconds: float = 0.0
    pauses: int = 0
    resumes: int = 0
    forks: int = 0
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    warned: bool = field(default=False, repr=False)


class KVCacheManager:
    """Sequences by id over one paged pool; see the module docstring."""

    def __init__(self, model_config: Any, cache_config: dict[str, Any] | CacheConfig | None = None,
                 pool: PagedPool | None = None, *, prefix_caching: bool | None = None,
                 host_bytes: int | None = None, tiers: PrefixTiers | None = None,
                 warn_unused_prefix_cache: bool = True) -> None:
        if host_bytes is not None and (isinstance(host_bytes, bool) or not isinstance(host_bytes, int)
                                       or host_bytes < 0):
            raise ConfigError("host_bytes", host_bytes, "an integer >= 0 (bytes the host tier may hold) "
                              "or None")
        self.factory = KVCacheFactory(model_config, cache_config or {"type": "paged"}, pool=pool)
        config = self.factory.config
        if not issubclass(config.storage.cls, PagedStore):
            raise ConfigError("kv_cache_config", config.raw, "paged storage (plain, quantized, with an "
                              "eviction policy or a page selector) for a KVCacheManager")
        # prefixes are shared between plain pages and between quantized pages, also under a page selector
        # (its page summaries are made from the adopted keys); not under eviction
        layout = self.factory.prefix_layout()
        if prefix_caching and layout is None:
            raise ConfigError("prefix_caching", True, "False with an eviction policy or with layers whose "
                              "blocks differ (quantized pages of different sizes, full-precision layers "
                              "beside quantized ones); prefixes are shared between plain or quantized "
                              "pages, also under a page selector")
        self.pool: PagedPool = self.factory.pool
        self.page_size = self.pool.page_size
        if prefix_caching is None and config.share_prefix and layout is None:
            warnings.warn("share_prefix (share_system_prompt): prefixes are not shared under an eviction "
                          "policy, whose kept tokens differ per sequence, nor between layers whose blocks "
                          "differ; prefix caching is off", stacklevel=2)
        if prefix_caching is None and config.share_prefix is not None:
            prefix_caching = config.share_prefix and layout is not None
        self.prefix_caching = layout is not None if prefix_caching is None else prefix_caching
        self.layout = layout or PrefixLayout(self.page_size)
        if tiers is not None:
            if not self.prefix_caching or config.selector is not None or config.quantization is not None:
                raise ConfigError("tiers", "given", "prefix caching on plain pages without a page selector")
            if tiers.tokens % self.page_size:
                raise ConfigError("chunk_tokens", tiers.tokens, f"a multiple of the page ({self.page_size})")
        self.tiers = tiers
        self.host_bytes = host_bytes
        self.warn_unused_prefix_cache = warn_unused_prefix_cache
        windows = attention_layout(model_config)  # layers adopting from token 0 are cached as full attention
        self.index = PrefixIndex([None if self.layout.from_start else windows[group[0]]
                                  for group in self.factory.groups], self.layout.block_tokens)
        # quantized pages: a hit also adopts the full-precision window's pages where they were seen
        window_hits = (self.prefix_caching and self.layout.window > 0 and config.selector is None
                       and all(window is None for window in windows))
        self.window_pages = WindowPages(WINDOW_BLOCKS) if window_hits else None
        self.pool.reclaimers.append(self._reclaim)
        self._sequences: dict[str, Sequence] = {}
        self._shared: dict[str, _Shared] = {}
        self._clock = 0
        self._closed = False
        self._prefetcher: ThreadPoolExecutor | None = None
        self.counters = _Counters()

    # -- lifecycle ------------------------------------------------------------------------------
    def create(self, seq_id: str, prompt: Prompt | None = None,
               tier_chunks: ChunkRun | None = None) -> KVCache:
        """A new empty cache for ``seq_id``; with ``prompt`` (its token ids) and prefix caching on, it
        starts holding the longest cached prefix of whole blocks (see ``cached_tokens``), from the
        pool and then from the tiers: ``tier_chunks``, what ``read_tiers`` read, is used instead of
        reading now when it starts where the pool's prefix ends or before."""
        self._check_new(seq_id)
        cache = self.factory.create_cache(seq_id)
        record = Sequence(seq_id, cache)
        if prompt is not None and self.prefix_caching:
            cache.hold_window_until_written()  # sliding layers' blocks are named before given back
            tokens = torch.as_tensor(prompt).flatten().tolist()
            # at least one token is left to prefill, and a quantized layer's full-precision window
            named = block_hashes(tokens[:-1], self.layout.block_tokens)  # chained: a prefix's are a prefix
            found = self.index.match(named[:max(0, len(tokens) - max(1, self.layout.recompute))
                                           // self.layout.block_tokens])
            cached = len(found) * self.layout.block_tokens
            hit = self._window_hit(named, len(found))
            if hit is not None:  # the quantized pages and then the window's pages: nothing to compute again
                blocks, windows = hit
                found = found[:blocks - self.layout.window // self.layout.block_tokens]
                cached = blocks * self.layout.block_tokens
            if found:
                ids = torch.tensor([entry.ids for entry in found]).T  # [layer groups, blocks]
                cache.adopt_blocks([row[None] for row in ids], cached, self._device(), tokens[:cached],
                                   None if hit is None else windows)
                record.cached_tokens, record.hashed_tokens = cached, len(found) * self.layout.block_tokens
                record.window_blocks = 0 if hit is None else blocks
            if self.tiers is not None:
                record.cached_tokens = self._load_chunks(record, tokens, cached, tier_chunks)
            self._count_prompt(len(tokens), record.cached_tokens)
            record.prompt_tokens = len(tokens) - 1
            record.on_written = self._hash_filled
        return self._register(record)

    def read_tiers(self, prompt: Prompt) -> Future[ChunkRun] | None:
        """Start reading the prompt's chunks that the tiers hold after those the pool's prefix cache
        holds now, on a reader thread of the tiers (None without tiers, or with no chunk to read):
        pass the result to ``create`` as ``tier_chunks``, so that creating the cache does not wait
        on a tier."""
        if self.tiers is None or not self.prefix_caching:
            return None
        tokens = torch.as_tensor(prompt).flatten().tolist()
        names = block_hashes(tokens[:-1], self.layout.block_tokens)
        held = next((i for i, name in enumerate(names) if name not in self.index.entries), len(names))
        first = held * self.layout.block_tokens // self.tiers.tokens
        return self.tiers.read(tokens, first) if first < (len(tokens) - 1) // self.tiers.tokens else None

    def allocate(self, seq_id: str, initial_length: int = 0) -> KVCache:
        """The design article's ``allocate``: ``create(seq_id)`` once the pool has room for
        ``initial_length`` tokens of it (``CacheFullError`` otherwise, with nothing created). The
        pool hands out blocks as tokens are written: this checks room, it sets none aside."""
        cache = self.create(seq_id)
        try:
            self.extend(seq_id, initial_length)
        except (CacheFullError, ConfigError):
            self.free(seq_id)
            raise
        return cache

    def extend(self, seq_id: str, new_tokens: int) -> KVCache:
        """The design article's ``extend``: the sequence's cache, once the pool has room for
        ``new_tokens`` more of its tokens (``CacheFullError`` otherwise)."""
        if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 0:
            raise ConfigError("new_tokens", new_tokens, "an integer >= 0")
        cache = self._live(seq_id, "extend").cache
        if new_tokens:
            config = self.factory.model_config
            shape = KVShape.from_config(config)
            dtype = getattr(config, "dtype", None)
            like = torch.empty(1, shape.kv_heads, 0, shape.head_dim,
                               dtype=dtype if isinstance(dtype, torch.dtype) else torch.float32)
            self.pool.check(cache.block_requests(new_tokens, like, like))
        return cache

    def get(self, seq_id: str) -> KVCache:
        record = self._record(seq_id)
        self._touch(record)
        return record.cache

    def record(self, seq_id: str) -> Sequence:
        """The ``Sequence`` record of ``seq_id``: its status, host copy and prefix state (a scheduler
        reads it; the manager's calls change it)."""
        return self._record(seq_id)

    def free(self, seq_id: str) -> None:
        """Drop the sequence; its prompt's full blocks stay cached for later prompts."""
        record = self._record(seq_id)
        record.move("free")
        record.host = record.prefetch = None
        cache = record.cache
        cache.hooks = None
        cache.reset()
        del self._sequences[seq_id]

    def fork(self, seq_id: str, new_id: str) -> KVCache:
        """A new sequence holding ``seq_id``'s tokens in the same blocks (copy-on-write)."""
        self._check_new(new_id)
        source = self._live(seq_id, "fork")
        record = Sequence(new_id, source.cache.fork(new_id), status=source.status)
        self.counters.forks += 1
        return self._register(record)

    @contextmanager
    def sequence(self, seq_id: str, prompt: Prompt | None = None) -> Iterator[KVCache]:
        """``create`` on entry, ``free`` on exit."""
        cache = self.create(seq_id, prompt)
        try:
            yield cache
        finally:
            if seq_id in self._sequences:
                self.free(seq_id)

    def __enter__(self) -> KVCacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Free every sequence, shared prefix and cached block; the manager takes no calls afterwards."""
        if self._closed:
            return
        for seq_id in list(self._sequences):
            self.free(seq_id)
        for shared_id in list(self._shared):
            self.release_shared(shared_id)
        self.index.clear()
        if self.window_pages is not None:
            self.window_pages.clear()
        if self._reclaim in self.pool.reclaimers:
            self.pool.reclaimers.remove(self._reclaim)
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)
            self._prefetcher = None
        self._closed = True

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._sequences

    def __len__(self) -> int:
        return len(self._sequences)

    def sequences(self) -> list[str]:
        return list(self._sequences)

    # -- host tier ------------------------------------------------------------------------------
    def pause(self, seq_id: str, blocks: int | None = None) -> int:
        """Move the sequence's K/V to the host tier and give its blocks back; with ``blocks``, only its
        oldest ``blocks`` pages per layer (a partial swap; the recent ones stay). Returns the bytes moved."""
        record = self._record(seq_id)
        record.check("pause")
        cache = record.cache
        stored = cache.size()
        front = None if blocks is None or blocks * self.page_size >= stored else blocks * self.page_size
        if front is not None and (blocks < 1 or not cache.pages_from_start()):
            raise SequenceStateError(f"pause({seq_id!r}, blocks={blocks}): a partial swap moves >= 1 whole "
                                     f"plain pages from the first stored token")
        state = SequenceState.capture(cache, tokens=front)
        held = self._host_bytes()
        if self.host_bytes is not None and held + state.nbytes > self.host_bytes:
            raise SequenceStateError(f"pause({seq_id!r}): the host tier holds {held} of {self.host_bytes} "
                                     f"bytes, this sequence needs {state.nbytes} more")
        if front is None:
            cache.reset()
        else:
            cache.drop_front(front)
        record.move("pause")
        record.host = state
        self.counters.bytes_to_host += state.nbytes
        self.counters.pauses += 1
        return state.nbytes

    def swap_out(self, blocks: int, keep: abc.Sequence[str] = ()) -> dict[str, int]:
        """Free ``blocks`` pool blocks in every layer group by swapping out the oldest pages of the least
        recently used live sequences (``pause(seq_id, blocks=...)``), sparing ``keep``; returns the
        pages moved per sequence. ``CacheFullError`` when even that is not enough (what was moved stays
        paused)."""
        self._check_open()
        moved: dict[str, int] = {}
        for record in sorted(self._sequences.values(), key=lambda r: r.last_used):
            short = blocks - min((len(p.free) for p in self._pools(None)), default=blocks)
            if short <= 0:
                break
            cache = record.cache
            pages = cache.size() // self.page_size
            if record.seq_id in keep or record.paused or pages == 0:
                continue
            partial = cache.paged_stores() is not None  # else all of it
            moved[record.seq_id] = min(short, pages) if partial else pages
            self.pause(record.seq_id, blocks=moved[record.seq_id] if partial else None)
        pools = self._pools(None)
        free = min((len(p.free) for p in pools), default=0)
        if pools and free < blocks:
            tightest = min(pools, key=lambda p: len(p.free))
            raise CacheFullError(tightest.layer_idx, blocks, free, tightest.num_blocks, self.page_size)
        return moved

    def prefetch(self, seq_id: str) -> None:
        """Start moving a paused sequence's K/V towards the pool's device on a background thread (a
        CUDA stream on GPU), so that ``resume`` only writes blocks; ``resume`` waits for it if needed."""
        record = self._record(seq_id)
        if record.status is SequenceStatus.PREFETCHING:  # once is enough
            return
        record.move("prefetch")
        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfactory-prefetch")
        record.prefetch = self._prefetcher.submit(record.host.staged, self._device())
        self.counters.prefetches += 1

    def resume(self, seq_id: str) -> KVCache:
        """Bring a paused sequence back into the pool (``CacheFullError``: it stays paused)."""
        record = self._record(seq_id)
        record.check("resume")
        cache, state, future = record.cache, record.host, record.prefetch
        if future is not None:
            waited = time.perf_counter()
            if not future.done():
                self.counters.stalls += 1
            state = future.result()
            self.counters.stall_seconds += time.perf_counter() - waited
        try:
            state.restore(cache, self._device())
        except BaseException:
            if not state.front:
                cache.reset()
            raise  # still paused (or prefetching, its staged copy kept for the next resume)
        record.move("resume")
        record.host = record.prefetch = None
        record.hashed_tokens, record.looked_blocks = 0, -1  # its blocks are new: offer them again
        self._hash_filled(record)
        self._touch(record)
        self.counters.bytes_from_host += state.nbytes
        self.counters.resumes += 1
        return cache

    def is_paused(self, seq_id: str) -> bool:
        return self._record(seq_id).paused

    # -- persistence ----------------------------------------------------------------------------
    def save(self, seq_id: str, path: str | Path) -> None:
        """Write the sequence (live or paused) to ``path`` (safetensors, atomically)."""
        record = self._record(seq_id)
        self._check_portable("save")
        state = record.host
        if state is None:
            state = SequenceState.capture(record.cache)
        elif state.front:  # a partial swap: the oldest pages from the host tier, the rest from the pool
            state = state.joined(SequenceState.capture(record.cache))
        save_state(state, path, self.factory.model_config, self.factory.config.raw, seq_id)

    def load(self, path: str | Path, seq_id: str | None = None) -> KVCache:
        """A new sequence from a saved file (its saved id unless ``seq_id``)."""
        self._check_portable("load")
        in_use = next((pool.dtype for pool in self._pools() if pool.refcount.any()), None)
        state, saved_id = load_state(path, self.factory.model_config, self.factory.config.raw, in_use,
                                     evicts=self.factory.config.eviction is not None)
        seq_id = seq_id or saved_id
        cache = self.create(seq_id)
        try:
            state.restore(cache, self._device())
        except BaseException:
            self.free(seq_id)
            raise
        self._sequences[seq_id].move("write")
        return cache

    def _check_portable(self, action: str) -> None:
        """Files hold quantized codes: with scales fixed on first use (``calibrate: true``) they would
        decode only with this factory's scales, so such sequences stay in memory."""
        if self.factory.first_use is not None:
            raise UnsupportedError(f"{action}: the config quantizes with scales fixed by its first 512 "
                                   f"tokens (calibrate: true), which a file cannot carry to another factory; "
                                   f"calibrate offline (`kvfactory calibrate`, then scales: FILE) to save")

    # -- explicit sharing -----------------------------------------------------------------------
    def mark_as_shareable(self, seq_id: str, start: int = 0, end: int | None = None) -> str:
        """Keep tokens ``[start, end)`` of the sequence (``start`` 0: K/V hold absolute positions) for
        ``attach_shared_cache``, pinned until ``release_shared``; returns the shared id (``seq_id``)."""
        cache = self._live(seq_id, "mark_as_shareable").cache
        if cache.prefix_stores() is None or self.layout.kind != "kv":
            raise UnsupportedError(f"mark_as_shareable({seq_id!r}): marked prefixes are shared between plain "
                                   f"pages (quantized pages share whole ones through prefix caching)")
        stored = cache.get_seq_length()
        end = stored if end is None else end
        if start != 0 or not 0 < end <= stored:
            raise SequenceStateError(f"mark_as_shareable({seq_id!r}, {start}, {end}): a shared prefix is "
                                     f"[0, end) with 0 < end <= {stored} tokens held")
        held = cache.prefix_blocks()
        blocks = -(-end // self.page_size)
        if held is None or any(bool((layer_ids[:blocks] < 0).any()) for layer_ids in held):
            raise SequenceStateError(f"mark_as_shareable({seq_id!r}): some layer does not hold one row of "
                                     f"the sequence's tokens from its first (a sliding window gave "
                                     f"them back)")
        if seq_id in self._shared:
            self.release_shared(seq_id)
        ids = [layer_ids[None, :blocks].clone() for layer_ids in held]
        for pool, layer_ids in zip(self._pools(), ids, strict=True):
            pool.incref(layer_ids)
        written = cache.written_tokens()
        self._shared[seq_id] = _Shared(ids, end, None if written is None else written[:end])
        return seq_id

    def attach_shared_cache(self, new_seq_id: str, shared_id: str) -> KVCache:
        """A new sequence starting with the shared prefix ``shared_id`` (blocks shared, copy-on-write)."""
        if shared_id not in self._shared:
            raise UnknownSequenceError(shared_id, list(self._shared))
        self._check_new(new_seq_id)
        shared = self._shared[shared_id]
        cache = self.factory.create_cache(new_seq_id)
        cache.adopt_blocks(shared.ids, shared.tokens, self._device(), shared.token_ids)
        return self._register(Sequence(new_seq_id, cache, cached_tokens=shared.tokens))

    def release_shared(self, shared_id: str) -> None:
        self._check_open()
        if shared_id not in self._shared:
            raise UnknownSequenceError(shared_id, list(self._shared))
        shared = self._shared.pop(shared_id)
        for layer, ids in zip(self._pools(), shared.ids, strict=True):
            layer.decref(ids)

    def pin_prefix(self, prompt: Prompt) -> int:
        """Never reclaim the cached blocks of ``prompt`` (a system prompt); returns how many are pinned."""
        self._check_open()
        tokens = torch.as_tensor(prompt).flatten().tolist()
        return self.index.pin(block_hashes(tokens, self.layout.block_tokens))

    def cached_tokens(self, seq_id: str) -> int:
        """Tokens the sequence started with from cached or shared blocks at ``create``/``attach``."""
        return self._record(seq_id).cached_tokens

    # -- accounting -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Sequences, pool blocks (all layers and kinds), prefix cache and host tier, as numbers; it
        only reads."""
        pools = self._pools(None)
        total = sum(p.num_blocks for p in pools)
        free = sum(len(p.free) for p in pools)
        c, index = self.counters, self.index
        looked = index.hit_blocks + index.missed_blocks
        windows = 0 if self.window_pages is None else self.window_pages.idle_blocks
        return {
            "sequences": len(self._sequences),
            "paused": sum(record.paused for record in self._sequences.values()),
            "shared_prefixes": len(self._shared),
            "pool_blocks": total, "pool_blocks_free": free, "pool_blocks_used": total - free,
            "pool_blocks_held": total - free - index.idle_blocks - windows,  # by sequences, not idle cached
            "prefix_cached_blocks": len(index),
            "prefix_pinned_blocks": sum(e.pinned for e in index.entries.values()),
            "prefix_hit_blocks": index.hit_blocks, "prefix_missed_blocks": index.missed_blocks,
            "prefix_hit_rate": index.hit_blocks / looked if looked else float("nan"),
            "prefix_evicted_blocks": index.evicted,
            "prefix_window_blocks": 0 if self.window_pages is None else len(self.window_pages),
            "prompt_tokens": c.prompt_tokens, "prompt_tokens_cached": c.prompt_tokens_cached,
            "host_bytes": self._host_bytes(), "host_budget_bytes": self.host_bytes,
            "bytes_to_host": c.bytes_to_host, "bytes_from_host": c.bytes_from_host,
            "pauses": c.pauses, "resumes": c.resumes, "forks": c.forks, "prefetches": c.prefetches,
            "prefetch_stalls": c.stalls, "prefetch_stall_seconds": c.stall_seconds,
        } | ({} if self.tiers is None else {f"tier_{name}": value for name, value
                                            in vars(self.tiers.counters).items()})

    # -- internals ------------------------------------------------------------------------------
    def _touch(self, record: Sequence) -> None:
        self._clock += 1
        record.last_used = self._clock

    def _register(self, record: Sequence) -> KVCache:
        record.cache.hooks = record
        self._sequences[record.seq_id] = record
        self._touch(record)
        return record.cache

    def _check_open(self) -> None:
        if self._closed:
            raise SequenceStateError("this KVCacheManager is closed: create a new one")

    def _record(self, seq_id: str) -> Sequence:
        self._check_open()
        try:
            return self._sequences[seq_id]
        except KeyError:
            raise UnknownSequenceError(seq_id, list(self._sequences)) from None

    def _live(self, seq_id: str, action: str) -> Sequence:
        record = self._record(seq_id)
        record.require_live(action)
        return record

    def _check_new(self, seq_id: str) -> None:
        self._check_open()
        if seq_id in self._sequences:
            raise SequenceStateError(f"sequence {seq_id!r} exists already; free it or choose another id")

    def _pools(self, kind: str | None = "kv") -> list[BlockPool]:
        """The block pools of ``kind`` (plain pages; None: every kind), by layer group."""
        return self.pool.block_pools(kind)

    def _device(self) -> torch.device:
        pools = self._pools(None)
        return pools[0].device if pools else torch.device("cpu")

    def _host_bytes(self) -> int:
        return sum(r.host.nbytes for r in self._sequences.values() if r.host is not None)

    def _hash_filled(self, record: Sequence) -> None:
        """The fill point: cache the prompt blocks of ``record`` filled since the last call, named by the
        tokens really written into them (``KVCache.written_tokens``), while every layer still holds the
        sequence from token 0 in one row (``KVCache.prefix_blocks``)."""
        cache, limit, page = record.cache, record.prompt_tokens, self.layout.block_tokens
        if limit is None or record.paused:
            return
        filled = cache.get_seq_length() // page
        if filled == record.looked_blocks:  # blocks fill, and quantized pages flush, as a block ends
            return
        tokens = cache.written_tokens()
        if tokens is None:
            return
        record.looked_blocks = filled
        self._name_windows(record, tokens[:limit])
        if min(len(tokens), limit) // page <= record.hashed_tokens // page:
            return
        blocks = cache.prefix_blocks()
        start = record.hashed_tokens // page
        if blocks is None or min(len(ids) for ids in blocks) <= start:  # no block filled since (quantized
            return  # pages fill a whole group of tokens at a time)
        names = self.index.add_filled(tokens[:limit], self._pools(self.layout.kind), blocks, start)
        self._share_cached(cache, names, blocks, start)
        record.hashed_tokens = len(names) * page
        if self.tiers is not None:
            self._store_chunks(record, tokens, names)

    def _share_cached(self, cache: KVCache, names: list[bytes], blocks: list[torch.Tensor], start: int
                      ) -> None:
        """Blocks of ``cache`` filled from block ``start`` on (``blocks``, per layer group) that the index
        holds under the same ``names`` in other blocks with the same bytes (a window encoding again the
        tokens of a cached prompt's window pages it adopted) are replaced by the index's where the stores
        share filled blocks (``KVCache.share_filled``): held once, read as a shared prefix."""
        for place in range(start, len(names)):
            entry = self.index.entries.get(names[place])
            if entry is not None and min(entry.ids) >= 0 \
                    and any(int(ids[place]) != theirs for ids, theirs in zip(blocks, entry.ids, strict=True)):
                cache.share_filled(place, entry.ids)

    def _name_windows(self, record: Sequence, tokens: list[int]) -> None:
        """Keep the full-precision window pages of the prompt blocks ``tokens`` that fill them
        (``WindowPages``), each layer group's, from those not named yet."""
        if self.window_pages is None:
            return
        groups = self.factory.groups
        views = [record.cache.layers[group[0]].store.window_pages() for group in groups]
        if any(view is None for view in views) or len({view[0] for view in views}) != 1:
            return
        block, per = self.layout.block_tokens, self.layout.block_tokens // self.page_size
        first = views[0][0]
        start = max(first // block, record.window_blocks)
        end = min(len(tokens), record.cache.get_seq_length()) // block
        if end <= start:
            return
        names = block_hashes(tokens[:end * block], block)
        pools = [self.pool.pools[("window", group)] for group in groups]
        for b in range(start, end):
            at = (b * block - first) // self.page_size
            self.window_pages.add(names[b], [(pool, view[1][at:at + per])
                                             for pool, view in zip(pools, views, strict=True)])
        record.window_blocks = end

    def _window_hit(self, names: list[bytes], packed: int) -> tuple[int, list[torch.Tensor]] | None:
        """The most of a prompt's blocks ``names`` (those before its last token) a new sequence can start
        from with the window's pages kept (``WindowPages``) after quantized pages among the ``packed``
        blocks the prefix cache found, if more than ``packed``: the blocks and, per layer, the window's
        pages ``[1, pages]``."""
        if self.window_pages is None:
            return None
        span = self.layout.window // self.layout.block_tokens
        for blocks in range(min(packed + span, len(names)), max(packed, span), -1):
            pages = self.window_pages.find(names[blocks - span:blocks])
            if pages is not None:
                windows: list[torch.Tensor] = [None] * len(self.factory.windows)
                for group, group_pages in zip(self.factory.groups, pages, strict=True):
                    for layer in group:
                        windows[layer] = group_pages
                return blocks, windows
        return None

    def _load_chunks(self, record: Sequence, tokens: list[int], cached: int, read: ChunkRun | None = None
                     ) -> int:
        """Write into ``record``'s cache the prompt chunks after its ``cached`` tokens that the tiers
        hold (leaving at least one token to compute), from ``read`` (chunks already read) or read
        now; the tokens it then holds. When the pool has no room for them they are computed
        instead."""
        tiers, cache, size = self.tiers, record.cache, self.tiers.tokens
        keys = tiers.keys(tokens[:-1])
        first = record.tier_chunks = cached // size  # earlier chunks were stored by whoever computed them
        if read is not None and read.first <= first:
            chunks = read.chunks[first - read.first:len(keys) - read.first]
        else:
            chunks = tiers.load(keys[first:]) if first < len(keys) else []
        if not chunks:
            return cached
        end, skip = (first + len(chunks)) * size, cached - first * size
        device = self._pools()[0].device if self._pools() else tiers.device
        per_layer = [tuple(torch.cat([c[side][layer] for c in chunks], dim=1)[None, :, skip:].to(device)
                           for side in (0, 1)) for layer in range(tiers.layout.layers)]
        try:
            self.pool.check(cache.block_requests(end - cached, *per_layer[0]))
        except CacheFullError:
            return cached
        ids = torch.tensor([tokens[cached:end]])
        for layer, (k, v) in enumerate(per_layer):
            cache.append(layer, k, v, token_ids=ids if layer == 0 else None)
        record.tier_chunks = first + len(chunks)
        return end

    def _store_chunks(self, record: Sequence, tokens: list[int], names: list[bytes]) -> None:
        """Store the prompt chunks of ``record`` that its writes completed and the tiers do not hold,
        read from the cached blocks of their names (``names``: the prompt's full blocks; every layer's,
        also those a sliding layer gave back since they were cached); a chunk whose blocks are no
        longer all cached ends the store."""
        tiers, size = self.tiers, self.tiers.tokens
        done = min(len(tokens), record.prompt_tokens) // size
        if done <= record.tier_chunks:
            return
        keys, per = tiers.keys(tokens[:done * size]), size // self.page_size
        views = sorted((layer, g, pool.layer(layer))  # every layer's tensors, with its group's place
                       for g, pool in enumerate(self._pools()) for layer in pool.layers)
        items = []
        for c in range(record.tier_chunks, done):
            entries = [self.index.entries.get(name) for name in names[c * per:(c + 1) * per]]
            if any(entry is None or min(entry.ids) < 0 for entry in entries):
                done = c
                break
            ids = [torch.tensor(group_ids)
                   for group_ids in zip(*(entry.ids for entry in entries), strict=True)]
            k, v = (torch.stack([view.tensors[name][:, ids[g]].flatten(1, 2) for _, g, view in views])
                    for name in ("k", "v"))  # [layers, kv_heads, chunk tokens, head_dim]
            items.append((keys[c], k.cpu(), v.cpu()))
        tiers.store(items)
        record.tier_chunks = done

    def _reclaim(self) -> bool:
        """Evict the head of the prefix cache's free-block queue (the pool needs room)."""
        return self.index.reclaim()

    def _count_prompt(self, tokens: int, cached: int) -> None:
        c = self.counters
        c.prompt_tokens += tokens
        c.prompt_tokens_cached += cached
        unused = self.index.lookups >= SILENT_LOOKUPS and self.index.hit_blocks == 0
        if self.warn_unused_prefix_cache and not c.warned and unused:
            c.warned = True
            warnings.warn(f"prefix caching is on but none of {self.index.lookups} prompts reused a cached "
                          f"block: prompts share blocks only when they start with the same "
                          f"{self.page_size}-token blocks", stacklevel=3)
