"""The transformers adapter: the only module that touches transformers' cache API.

``KVCache`` is a ``transformers.Cache`` whose layers are ``KVLayer`` objects, each wrapping a
kvfactory ``LayerStore``. It plugs into ``model.generate(past_key_values=cache)`` and also offers
the low-level ``append / gather / clear / size`` interface for code outside transformers.

It also registers kvfactory's attention function with transformers as ``"kvfactory"``
(``attn_implementation="kvfactory"``): SDPA for K/V handed over whole, and for layers whose store
reads in chunks (quantized storage) the chunked attention of ``kvfactory.attention``, which never
decodes the whole layer into floating point.
Tested against transformers 5.24 (see ``pyproject.toml`` for the pinned range).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import PreTrainedModel

from kvfactory import attention
from kvfactory.errors import ConfigError, LayerIndexError, SequenceStateError, ShapeError
from kvfactory.storage.base import LayerStore, MemoryReport, PrefixLayout, check_kv
from kvfactory.storage.forward_lock import ForwardLock
from kvfactory.storage.paged import BlockTableStore
from kvfactory.summaries import MemorySummary, RoutingSummary

if TYPE_CHECKING:
    from kvfactory.config import CacheConfig
    from kvfactory.selectors.base import RoutingContext
    from kvfactory.selectors.metrics import RoutingMetrics
    from kvfactory.storage.blocks import PagedPool
    from kvfactory.storage.workspace import ReadWorkspace

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
ATTENTION = "kvfactory"  # the attn_implementation name of kvfactory_attention
logger = logging.getLogger("kvfactory")


def kvfactory_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                        scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: chunked attention over a deferred read, else SDPA."""
    step = kwargs.get(attention.STEP)
    if step is not None:  # a compiled engine step: no cache update ran, the step stores and reads
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return step.attend(module, query, key, value, scale), None
    read, observer = attention.take(key, getattr(module, "layer_idx", None))
    if isinstance(read, attention.BatchRead):  # an engine step: every sequence attends to its own K/V
        return read.attend(module, query, scaling if scaling is not None else query.shape[-1] ** -0.5,
                           dropout=dropout, **kwargs), None
    if observer is not None:  # an evicting layer: its stored slots decide the mask
        attention_mask = observer.attention_mask(attention_mask, query)
    chunked = isinstance(read, attention.DeferredRead) and query.shape[2] <= attention.MAX_CHUNKED_QUERY \
        and attention.plain_softmax(dropout, kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if chunked:
        out = attention.attend(query, read, attention_mask, scale), None
    else:
        if isinstance(read, attention.NarrowRead):  # a page selector's pages for this query
            key, value, attention_mask = read.narrow(query, attention_mask)
        elif read is not None:
            key, value = read.materialize()
        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                     scaling=scaling, **kwargs)
    if observer is not None:  # an evicting layer scores and evicts now that this step has attended
        observer.observe(query, scale)
    return out


AttentionInterface.register(ATTENTION, kvfactory_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def needs_kvfactory_attention(config: Any) -> bool:
    """Whether a cache config runs inside kvfactory's attention function: eviction policies score and
    selectors read pages there (required), quantized layers decode from the packed codes there
    (faster; elsewhere they are decoded whole first)."""
    return config.eviction is not None or config.selector is not None or config.quantization is not None


def _requires_kvfactory_attention(config: Any) -> bool:
    return config.eviction is not None or config.selector is not None


def _what_needs_it(config: Any) -> str:
    if config.eviction is not None:
        return f"eviction policy '{config.eviction.policy}' (it scores tokens inside attention)"
    if config.selector is not None:
        return f"selector '{config.selector.selector}' (it reads pages inside attention)"
    return "quantized layers (they are read from the packed codes inside attention)"


def _without_attention_dispatch(text_config: Any) -> str | None:
    """The causal-LM class of ``text_config`` if it computes attention without transformers'
    ``AttentionInterface``, else None (unknown classes, such as remote code, are assumed to use it)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(text_config), None)
    if model_class is None or getattr(model_class, "_supports_attention_backend", True):
        return None
    return model_class.__name__


def use_kvfactory_attention(model_config: Any, config: Any) -> None:
    """Switch ``model_config``'s attention function to kvfactory's where ``config`` needs it, and log
    the switch (once: the config then names kvfactory's). The user's ``model.config`` is the object
    the model's attention layers dispatch on, so ``KVCacheFactory(model.config, ...)`` is all a user
    writes; kvfactory's attention is SDPA for everything it does not read itself, so other caches of
    the same model are unaffected.

    ``ConfigError`` where the architecture computes attention without transformers'
    ``AttentionInterface`` and the config cannot work without it (policies, selectors); quantized
    layers then keep the model's attention and are decoded whole for it."""
    if model_config is None or not needs_kvfactory_attention(config):
        return
    text_config = model_config.get_text_config(decoder=True)
    current = getattr(text_config, "_attn_implementation", None)
    if current == ATTENTION:
        return
    model_class = _without_attention_dispatch(text_config)
    if model_class is not None:
        if _requires_kvfactory_attention(config):
            raise ConfigError("model_config", model_class,
                              f"a model whose attention goes through transformers' AttentionInterface for "
                              f"{_what_needs_it(config)}; for this architecture drop that entry and keep "
                              f"storage and quantization, e.g. {{'type': 'paged', 'quantization': 'int4'}}")
        return
    text_config._attn_implementation = ATTENTION
    logger.warning("switched the model's attn_implementation from %r to %r for %s; it is "
                   "SDPA for every other cache", current, ATTENTION, _what_needs_it(config))


def watch_hidden_states(model: torch.nn.Module) -> torch.nn.Module:
    """Hook ``model``'s decoder so that each forward hands the kvfactory cache it ran with the ids of
    the tokens it wrote (prefix caching) and its last hidden state (of the last position, for selectors
    that route from the decoder's state: OVAL), and checks that the cache read K/V the way the model's
    attention expects. Idempotent; kvfactory calls it
    by itself on the first forward of a model after ``create_cache()`` (``_find_models``), so users
    need not. Returns ``model``."""
    decoder = model.get_decoder()
    if not getattr(decoder, "_kvfactory_watched", False):
        decoder.register_forward_hook(_after_decoder, with_kwargs=True, always_call=True)
        decoder._kvfactory_watched = True
    return model


def _after_decoder(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """After each decoder forward, also one that raised (``output`` None): the cache's forward ends."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, PackedBatch):
        cache.hidden = None if output is None else getattr(output, "last_hidden_state", None)
        return
    if not isinstance(cache, KVCache):
        return
    try:
        _first_forward.discard(cache)
        if output is None:
            return
        cache.check_attention(getattr(module, "config", None))
        cache.record_tokens(kwargs.get("input_ids"))
        cache.notify_written()
        context = cache.routing_context
        hidden = getattr(output, "last_hidden_state", None)
        if context is not None and hidden is not None:
            context.hidden = hidden[:, -1].detach()
    finally:
        cache.forward_lock.exit()


# Caches whose first forward has not run yet: while there are any, a global forward pre-hook watches
# each transformers model that runs, so the cache receives the decoder's state from its first forward.
_first_forward: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()
_finder: Any = None


def await_first_forward(cache: KVCache) -> None:
    """Watch every transformers model that runs (``watch_hidden_states``) until ``cache``'s first
    forward: the model it runs with is then hooked before its decoder returns."""
    global _finder
    with _lock:
        _first_forward.add(cache)
        if _finder is None:
            _finder = torch.nn.modules.module.register_module_forward_pre_hook(_find_models)


def _find_models(module: torch.nn.Module, args: tuple) -> None:
    if torch.compiler.is_compiling():  # a traced forward (the engine's compiled step) finds no model
        return
    if isinstance(module, PreTrainedModel):
        watch_hidden_states(module)
    _release_model_finder()


def _release_model_finder() -> None:
    """Remove the global forward pre-hook once no cache awaits its first forward (a hook left behind
    would run in every forward, and in one that ``torch.compile`` traces)."""
    global _finder
    with _lock:
        if not _first_forward and _finder is not None:
            _finder.remove()
            _finder = None


def check_kvfactory_attention(implementation: str | None, config: Any) -> None:
    """Eviction policies and selectors work inside kvfactory's attention function: refuse a model set
    to another, which would silently keep or read everything."""
    if implementation not in (None, ATTENTION) and _requires_kvfactory_attention(config):
        raise ConfigError("attn_implementation", implementation,
                          f"'{ATTENTION}' for {_what_needs_it(config)}: the model was switched away from "
                          f"it after the cache was created; create the cache again, or call "
                          f"model.set_attn_implementation('{ATTENTION}')")


def attention_layout(model_config: Any) -> list[int | None]:
    """Per decoder layer: ``None`` for full attention, the window for sliding/chunked attention."""
    text_config = model_config.get_text_config(decoder=True)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
    unsupported = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
    if unsupported:
        raise ConfigError("model_config.layer_types", unsupported,
                          f"only attention layers {ATTENTION_LAYER_TYPES} are supported")
    return [kw.get("sliding_window") for kw in layer_kwargs]


class KVLayer(CacheLayerMixin):
    """One decoder layer's cache over a ``LayerStore``.

    Follows transformers' layer rules: ``get_seq_length`` counts tokens seen, ``get_mask_sizes``
    reports what is stored (for sliding layers only the last ``window - 1`` tokens stay, exactly
    as ``DynamicSlidingWindowLayer``, including its past recording for assisted decoding), and
    positions of kept tokens never shift.
    """

    is_compileable = False
    is_croppable = True

    def __init__(self, store: LayerStore, sliding_window: int | None = None):
        self.store = store
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.record_past = False
        # a prefix cache names blocks once a write completes: a sliding layer gives its past back
        # then (``restrict_to_window``), not while the forward writes (``KVCache.hold_window_until_written``)
        self.hold_window = False
        self.seen = 0
        self.is_initialized = False

    @property
    def keys(self) -> torch.Tensor | None:
        """A copy of the stored keys."""
        return self.store.gather()[0].clone() if self.store.size() else None

    @property
    def values(self) -> torch.Tensor | None:
        """A copy of the stored values."""
        return self.store.gather()[1].clone() if self.store.size() else None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def activate_past_recording(self) -> None:
        """Keep tokens past the window until ``crop`` (assisted decoding may roll drafts back)."""
        self.record_past = True

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store new tokens without reading the cache back."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.store.append(key_states, value_states)
        self._after_write(key_states.shape[-2])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, deferred: bool = False,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens and return the K/V attention reads; ``deferred`` (kvfactory's attention)
        lets a store that reads in chunks return its full-precision tail and leave the rest pending."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.store.append(key_states, value_states)
        # a store that evicts after this step's attention may rewrite memory a returned read points at
        copy = self.store.evicts_during(key_states.shape[-2])
        chunked = deferred and not self.is_sliding and not copy
        read = self.store.deferred_read() if chunked else None
        if read is not None:
            keys, values = read.tail()
        else:
            keys, values = self.store.gather()
        if deferred:  # with no read, this drops what an earlier update left pending
            observer = self.store if self.store.observes_attention and not self.is_sliding else None
            attention.defer(read, keys, self.store.layer_idx, observer)
        if self.is_sliding:  # what the mask covers, also when the past is recorded or was adopted whole
            visible = self.sliding_window - 1 + key_states.shape[-2]
            keys, values = keys[:, :, -visible:], values[:, :, -visible:]
        if copy:
            keys, values = keys.clone(), values.clone()
        self._after_write(key_states.shape[-2])
        return keys, values

    def written(self, key_states: torch.Tensor) -> None:
        """``key_states`` (and their values) were stored in this layer's store by a batched write
        (``kvfactory.storage.paged.append_one_each``: an engine's decode step): count them as
        ``append`` would."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, key_states)
        self._after_write(key_states.shape[-2])

    def _after_write(self, new_tokens: int) -> None:
        self.seen += new_tokens
        if not self.hold_window:
            self.restrict_to_window()
        self.store.retain()

    def restrict_to_window(self) -> None:
        """A sliding layer gives back the tokens before its window (not while recording its past)."""
        if not self.is_sliding or self.record_past:
            return
        excess = self.store.size() - (self.sliding_window - 1)
        if excess > 0:
            self.store.drop_front(excess)

    def adopt(self, ids: torch.Tensor, tokens: int, device: torch.device, window: torch.Tensor | None = None
              ) -> None:
        """Start from the sequence's first ``tokens`` tokens held in blocks ``ids [batch, blocks]`` of
        this layer's pool, from the sequence's block 0: a sliding layer takes only its window's. With
        ``window``, the last of them are in these full-precision window pages after quantized pages
        ``ids`` (``QuantizedStore.adopt_window``)."""
        if window is not None:
            self.store.adopt_window(ids, window, tokens)
        else:
            first = tokens - min(tokens, self.sliding_window - 1) if self.is_sliding else 0
            self.store.adopt(ids, tokens, first)
        self.seen, self.is_initialized, self.device = tokens, True, device

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.is_sliding:  # transformers' sliding-window rule, which also covers past recording, unless
            visible = min(self.seen, self.sliding_window - 1, self.store.size())  # a store keeps less
            return visible + query_length, self.seen - visible
        stored = self.store.size()
        return stored + query_length, self.seen - stored

    def get_max_length(self) -> int:
        return self.sliding_window if self.is_sliding else -1

    def reset(self) -> None:
        self.store.clear()
        self.seen = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (rejected drafts of assisted decoding)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
        if not self.is_initialized:
            return
        removed = -tokens_to_remove
        evicted = self.store.size() < self.seen
        if self.is_sliding and self.seen >= self.sliding_window and not self.record_past:
            raise RuntimeError(f"crop({tokens_to_remove}): the sliding window ({self.sliding_window}) is "
                               f"full and past recording is off; call activate_past_recording() first")
        if evicted and not self.is_sliding and removed:
            raise RuntimeError(f"crop({tokens_to_remove}): this layer holds {self.store.size()} of "
                               f"{self.seen} tokens seen; evicted tokens cannot be rolled back")
        self.store.truncate(self.store.size() - removed)
        self.seen = max(0, self.seen - removed)
        self.restrict_to_window()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.store.select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = self.store.batch_size
        self.store.select_rows(torch.arange(rows).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if indices.dtype == torch.bool:
            indices = indices.nonzero().flatten()
        self.store.select_rows(indices)

    def offload(self) -> None:
        raise NotImplementedError("kvfactory caches do not support transformers' offloading=True")

    prefetch = offload


class SequenceHooks(Protocol):
    """What a cache owned by a ``KVCacheManager`` asks and tells its sequence record
    (``kvfactory.manager.sequence.Sequence``): the manager's state stays in the record."""

    def check_write(self) -> None:
        """Raise ``SequenceStateError`` if the sequence takes no write now (it is paused)."""

    def written(self, cache: KVCache) -> None:
        """A write completed: a forward, or one layer's low-level ``append`` (``cache.written_tokens()``
        names the tokens once every layer holds them)."""

    def truncated(self, cache: KVCache) -> None:
        """Tokens were removed from the end (``crop``) or all of them (``reset``)."""


class KVCache(Cache):
    """A transformers ``Cache`` built by ``KVCacheFactory``; see the module docstring.

    ``seq_id`` names it (``create_cache``, error messages); ``hooks`` is set by a ``KVCacheManager``
    for the caches it owns (``SequenceHooks``), else None.
    """

    def __init__(self, layers: list[KVLayer], shared: PagedPool | None = None, seq_id: str | None = None,
                 config: CacheConfig | None = None, workspace: ReadWorkspace | None = None,
                 model_config: Any = None, routing: RoutingMetrics | None = None,
                 routing_context: RoutingContext | None = None, forward_lock: ForwardLock | None = None,
                 groups: list[tuple[int, ...]] | None = None):
        super().__init__(layers=layers)
        # the layers that share blocks, in the order of the pool's block pools (``KVCacheFactory.groups``)
        self.groups = groups if groups is not None else [(i,) for i in range(len(layers))]
        self.forward_lock = forward_lock or ForwardLock()  # shared with the factory's other caches
        self.shared: PagedPool | None = shared  # the pool of paged storage, shared with the factory
        self.seq_id = seq_id
        self.config: CacheConfig | None = config
        self.workspace: ReadWorkspace | None = workspace  # quantized reads decode into it
        self.model_config = model_config
        self.hooks: SequenceHooks | None = None
        self.routing: RoutingMetrics | None = routing  # a selector's metrics, shared by its layers
        self.routing_context: RoutingContext | None = routing_context  # what its layers' selectors share
        # the config the model's attention dispatch reads: kvfactory's attention allows deferred reads
        self._attention_config = None if model_config is None else model_config.get_text_config(decoder=True)
        self._deferred = False  # the last forward handed K/V to kvfactory's attention in pieces
        self.token_ids: list[int] | None = []  # ids of the tokens written from token 0 (None: unknown)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        implementation = getattr(self._attention_config, "_attn_implementation", None)
        deferred = implementation == ATTENTION
        if layer_idx == 0:  # a forward starts: other threads' forwards on this memory wait for its end
            self.forward_lock.enter()
        self._check_write(layer_idx)
        if layer_idx == 0:  # a forward writes every layer: check every layer's pool before the first
            if self.config is not None and not deferred:
                check_kvfactory_attention(implementation or "unset", self.config)
            self._reserve(key_states, value_states, self.layers)
            self._deferred = deferred
        else:
            self._reserve(key_states, value_states, self.layers[layer_idx:layer_idx + 1])
        return super().update(key_states, value_states, layer_idx, *args, deferred=deferred, **kwargs)

    def _check_write(self, layer_idx: int) -> None:
        """Every write, of every layer: a layer this cache has, of a sequence that is not paused."""
        self._check_layer(layer_idx)
        self._check_live()

    def _check_layer(self, layer_idx: int) -> None:
        """``LayerIndexError`` unless ``layer_idx`` is one of this cache's layers (0 to n - 1)."""
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self.layers):
            raise LayerIndexError(layer_idx, len(self.layers))

    def record_tokens(self, token_ids: torch.Tensor | None) -> None:
        """Note the ids ``[1, n]`` of the tokens just written (the decoder's ``input_ids``): prefix
        caching names blocks by the tokens a cache really holds. Anything else (embeddings fed
        directly, several rows) makes the cache's tokens unknown until ``reset``."""
        if self.token_ids is None:
            return
        if token_ids is None or token_ids.dim() != 2 or token_ids.shape[0] != 1:
            self.token_ids = None
        else:
            self.token_ids.extend(token_ids[0].tolist())

    def written_tokens(self) -> list[int] | None:
        """The ids of every token this cache has seen, from token 0, if known for every layer."""
        tokens = self.token_ids
        if tokens is None or any(layer.seen != len(tokens) for layer in self.layers):
            return None
        return tokens

    def reset(self) -> None:
        with self.forward_lock.held():
            super().reset()
            self.token_ids = []
            if self.hooks is not None:
                self.hooks.truncated(self)

    def crop(self, max_length: int) -> None:
        super().crop(max_length)
        if self.token_ids is not None:
            del self.token_ids[self.get_seq_length():]
        if self.hooks is not None:
            self.hooks.truncated(self)

    def notify_written(self) -> None:
        """A write (a forward, or a low-level append of one layer) completed: tell the hooks, then let
        sliding layers that held their past for them give it back."""
        if self.hooks is not None:
            self.hooks.written(self)
        for layer in self.layers:
            if layer.hold_window:
                layer.restrict_to_window()

    def check_attention(self, decoder_config: Any) -> None:
        """After a forward of the decoder configured by ``decoder_config``: the cache handed K/V over in
        pieces for kvfactory's attention only if that is the attention the decoder ran."""
        text_config = decoder_config.get_text_config(decoder=True) if decoder_config is not None else None
        implementation = getattr(text_config, "_attn_implementation", None)
        if self._deferred and implementation not in (None, ATTENTION):
            self._deferred = False
            raise ConfigError("model_config", implementation,
                              f"the config of the model this cache runs with: the cache was built from a "
                              f"config set to attn_implementation='{ATTENTION}' but the model runs "
                              f"{implementation!r}, so this forward's output is void; build the factory "
                              f"from the model's own config, KVCacheFactory(model.config, ...)")

    def _check_live(self) -> None:
        if self.hooks is not None:
            self.hooks.check_write()

    def fork(self, seq_id: str | None = None) -> KVCache:
        """A cache holding the same tokens that continues on its own: paged blocks are shared by refcount
        and copied on write, so a fork costs no KV memory until one side writes into a shared block.
        ``UnsupportedError`` for strategies that cannot fork yet (dense storage, sparse reads)."""
        self._check_live()
        layers = []
        with self.forward_lock.held():
            stores = [layer.store.fork() for layer in self.layers]
        for layer, store in zip(self.layers, stores, strict=True):
            twin = KVLayer(store, layer.sliding_window)
            twin.seen, twin.record_past = layer.seen, layer.record_past
            twin.is_initialized = layer.is_initialized
            if layer.is_initialized:
                twin.device = layer.device
            layers.append(twin)
        forked = KVCache(layers, shared=self.shared, seq_id=seq_id, config=self.config,
                         workspace=self.workspace, model_config=self.model_config,
                         forward_lock=self.forward_lock, groups=self.groups)
        forked.token_ids = None if self.token_ids is None else list(self.token_ids)
        return forked

    def adopt_blocks(self, ids: list[torch.Tensor], tokens: int, device: torch.device,
                     token_ids: list[int] | None = None, windows: list[torch.Tensor] | None = None) -> None:
        """Start this empty cache from ``tokens`` tokens already in the pool: blocks ``ids`` (per layer group,
        ``groups``, ``[batch, blocks]``), referenced and copied on write (a cached or shared prefix of the
        tokens ``token_ids``, None if unknown); ``windows``: per layer, the full-precision window pages
        ``[1, pages]`` holding the last tokens after quantized pages (``KVLayer.adopt``)."""
        if self.get_seq_length():
            raise SequenceStateError(f"adopt_blocks into a cache holding {self.get_seq_length()} tokens")
        if token_ids is not None and len(token_ids) != tokens:
            raise ShapeError(f"adopt_blocks: {len(token_ids)} token ids for {tokens} tokens")
        for group, group_ids in zip(self.groups, ids, strict=True):
            for layer in group:
                window = None if windows is None else windows[layer]
                self.layers[layer].adopt(group_ids, tokens, device, window)
        self.token_ids = None if token_ids is None else list(token_ids)

    # -- the block-table API of kvfactory.manager (``storage.paged.BlockTableStore``) --------------
    def paged_stores(self) -> list[BlockTableStore] | None:
        """Every layer's store when each is plain paged pages (blocks a manager may share with other
        sequences and swap out in part), else None (quantized pages, eviction policies, dense)."""
        stores = [layer.store for layer in self.layers]
        return stores if all(store.plain_pages for store in stores) else None

    def prefix_stores(self) -> list[LayerStore] | None:
        """Every layer's store when all hold blocks of one layout a prefix cache may name and another
        sequence adopt (``LayerStore.prefix_layout``: plain or quantized pages, also under a page
        selector), else None."""
        stores = [layer.store for layer in self.layers]
        return stores if PrefixLayout.common([store.prefix_layout() for store in stores]) else None

    def prefix_blocks(self) -> list[torch.Tensor] | None:
        """Per layer group (``groups``), the pool blocks ``[blocks]`` of this one-row cache holding the tokens
        it has seen, by their place from token 0 (``PagedStore.sequence_blocks``: ``-1`` where a sliding
        layer gave its past back; quantized pages: the full ones), else None."""
        stores, tokens = self.prefix_stores(), self.get_seq_length()
        if stores is None:
            return None
        ids = [store.sequence_blocks() for store in stores]
        if any(i is None or i.shape[0] != 1 or layer.seen != tokens
               or store.stored_from() + store.size() != tokens  # a window written back after a pause
               for i, store, layer in zip(ids, stores, self.layers, strict=True)):
            return None
        return [ids[group[0]][0] for group in self.groups]

    def share_filled(self, place: int, blocks: list[int]) -> None:
        """Hold ``blocks`` (one per layer group, ``groups``) at block ``place`` of the sequence in place of
        its own filled ones there, which hold the same tokens, where they hold the same bytes too: a
        prefix cache's, found under the same name at the fill point (``LayerStore.share_filled``)."""
        for group, block in zip(self.groups, blocks, strict=True):
            self.layers[group[0]].store.share_filled(place, block)

    def hold_window_until_written(self) -> None:
        """Sliding layers give their past back when a write completes (``notify_written``), not while
        the forward writes, so a prefix cache can name every block of a prompt first."""
        for layer in self.layers:
            layer.hold_window = True

    def pages_from_start(self) -> bool:
        """Every layer is plain pages holding its stored tokens from its first block's start (the
        oldest pages can be swapped out and put back, ``drop_front`` / ``PagedStore.prepend``)."""
        stores = self.paged_stores()
        return stores is not None and all(store.block_ids() is not None for store in stores)

    def drop_front(self, tokens: int) -> None:
        """Give the blocks of the oldest ``tokens`` stored tokens of every layer back (a partial swap)."""
        with self.forward_lock.held():
            for layer in self.layers:
                layer.store.drop_front(tokens)

    def block_requests(self, new_tokens: int, key_like: torch.Tensor, value_like: torch.Tensor
                       ) -> list[tuple[Any, int]]:
        """Pool blocks every layer would take to write ``new_tokens`` more tokens of one row shaped like
        ``key_like`` / ``value_like`` (``[1, kv_heads, any, head_dim]``); a scheduler sums them over the
        sequences of a step and checks the pool (``PagedPool.check``) before it runs."""
        return [request for layer in self.layers
                for request in layer.store.block_requests(new_tokens, 1, key_like, value_like)]

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, layers: list[KVLayer]) -> None:
        """Check the pool has room for ``layers`` to write before any of them does (``CacheFullError``):
        a step is written whole or not at all."""
        if self.shared is not None:
            batch, new_tokens = key_states.shape[0], key_states.shape[-2]
            self.shared.check([request for layer in layers
                   for request in layer.store.block_requests(new_tokens, batch, key_states, value_states)])

    # beams and returned sequences rearrange rows between steps: the routed hidden state follows
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._rows_of_hidden(lambda h: h.index_select(0, beam_idx.to(h.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._rows_of_hidden(lambda h: h.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._rows_of_hidden(lambda h: h[indices.to(h.device)])

    def _rows_of_hidden(self, rearrange: Any) -> None:
        context = self.routing_context
        if context is not None and context.hidden is not None:
            context.hidden = rearrange(context.hidden)

    @property
    def batch_size(self) -> int:
        return max((layer.store.batch_size for layer in self.layers), default=0)

    def memory_report(self) -> MemorySummary:
        """Bytes held by this cache, from its tensors (a dict; ``print`` it for MiB and bytes per token).

        ``allocated``/``used``/``waste`` are summed over layers; ``tokens`` counts tokens seen per
        batch row times rows, so ``bytes_per_token`` is what one sequence token costs in all layers.
        With a shared pool, ``pool_allocated`` is the whole pool's bytes (all its caches and free
        blocks included). Quantized caches add ``workspace``: the floating-point buffer that reads
        decode into, one layer's K/V at a time, shared by every cache of the factory, and
        ``residual`` / ``residual_tokens``: the part of ``allocated`` / ``tokens_stored`` in the
        full-precision window of recent tokens. Evicting caches add ``peak_allocated``: the most
        each layer held (right before an eviction: budget + the step's or chunk's tokens), summed.
        Models with sliding-window layers add ``global_*`` and ``sliding_*`` ``allocated`` and
        ``tokens_stored``: the two kinds apart (sliding layers hold only their window).
        """
        reports = [layer.store.memory_report() for layer in self.layers]
        total = sum(reports, MemoryReport())
        seen = self.get_seq_length() * self.batch_size
        report = MemoryReport(total.allocated, total.used, seen).as_dict() | {"tokens_stored": total.tokens}
        if any(layer.is_sliding for layer in self.layers):
            for kind, sliding in (("global", False), ("sliding", True)):
                part = sum((r for r, layer in zip(reports, self.layers, strict=True)
                            if layer.is_sliding == sliding), MemoryReport())
                report |= {f"{kind}_allocated": part.allocated, f"{kind}_tokens_stored": part.tokens}
        if self.shared is not None:
            report["pool_allocated"] = self.shared.memory_report().allocated
        peaks = [layer.store.peak_bytes() for layer in self.layers]
        if any(peak is not None for peak in peaks):
            report["peak_allocated"] = sum(max(peak or 0, layer_report.allocated)
                                           for peak, layer_report in zip(peaks, reports, strict=True))
        if self.workspace is not None:
            report["workspace"] = self.workspace.nbytes
            windows = [layer.store.residual_report() for layer in self.layers]
            residual = sum((window for window in windows if window is not None), MemoryReport())
            report |= {"residual": residual.allocated, "residual_tokens": residual.tokens}
        return MemorySummary(report)

    def end_prefill(self) -> None:
        """Close the prompt: evicting caches compressing by ratio keep what comes next (a question
        fed after the compressed context) whole."""
        for layer in self.layers:
            layer.store.end_prefill()

    def routing_metrics(self) -> RoutingSummary:
        """A selector's routing metrics (``kvfactory.selectors.metrics``; a dict, readable printed):
        hit rate, recall, bytes read;
        ``unrouted_kv_bytes_per_step``: what the layers no selector routes hold (sliding-window
        layers, read whole by every step), and ``model_read_fraction``: what a step reads of every
        layer's K/V together."""
        if self.routing is None:
            raise ValueError("this cache has no selector: add one to the config, e.g. "
                             "{'name': 'quest', 'read_budget': 0.125}")
        metrics = self.routing.as_dict()
        # sliding-window layers are never routed: every step reads what they hold (their window)
        unrouted = sum(layer.store.memory_report().used for layer in self.layers
                       if not self.routing.records(layer.store))
        read = metrics["kv_bytes_read_per_step"] + unrouted
        full = metrics["kv_bytes_full_per_step"] + unrouted
        return RoutingSummary(metrics | {"unrouted_kv_bytes_per_step": unrouted,
                                         "model_read_fraction": read / full if full else float("nan")})

    def quantization_error(self) -> dict[int, dict[str, float]]:
        """Per quantized layer: the relative MSE of its stored keys and values (sampled on writes)."""
        errors = {i: layer.store.quantization_error() for i, layer in enumerate(self.layers)}
        return {i: error for i, error in errors.items() if error is not None}

    # -- low-level interface (code outside transformers) -----------------------------------
    def append(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor,
               token_ids: torch.Tensor | None = None) -> None:
        """Store ``[batch, kv_heads, tokens, head_dim]`` keys/values in layer ``layer_idx``; layer 0's
        call may name the tokens they belong to (``token_ids [1, tokens]``, for prefix caching:
        without them the cache's tokens are unknown). ``LayerIndexError`` for a layer the cache does
        not have, ``TensorTypeError`` for anything but floating-point tensors, ``ShapeError`` for
        tensors that do not fit each other or the layer."""
        self._check_write(layer_idx)
        check_kv(key, value)
        with self.forward_lock.held():
            self._reserve(key, value, self.layers[layer_idx:layer_idx + 1])
            self.layers[layer_idx].append(key, value)
            if layer_idx == 0:
                self.record_tokens(token_ids)
            self.notify_written()

    def gather(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of all stored keys and values of layer ``layer_idx``."""
        self._check_layer(layer_idx)
        keys, values = self.layers[layer_idx].store.gather()
        return keys.clone(), values.clone()

    def size(self, layer_idx: int = 0) -> int:
        """Tokens stored per batch row in layer ``layer_idx``."""
        self._check_layer(layer_idx)
        return self.layers[layer_idx].store.size()

    def clear(self) -> None:
        """Drop every token and give the memory (pool blocks) back."""
        self.reset()

    free = clear


class PackedBatch(Cache):
    """Several kvfactory caches in one forward without padding (``kvfactory.engine``): the step's
    ``input_ids [1, T]`` hold each sequence's new tokens back to back, with their own positions.
    ``write(key, value, layer_idx)`` stores each sequence's slice of a layer's new K/V in its own cache
    and returns the ``attention.BatchRead`` that kvfactory's attention then runs; ``hidden`` is the
    decoder's last hidden state ``[1, T, hidden]`` after the forward (OVAL routes from it)."""

    is_compileable = False

    def __init__(self, write: Callable[[torch.Tensor, torch.Tensor, int], attention.BatchRead]) -> None:
        super().__init__(layers=[])
        self.write = write
        self.hidden: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        attention.defer(self.write(key_states, value_states, layer_idx), key_states, layer_idx)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def packed_forward(model: PreTrainedModel, input_ids: torch.Tensor, positions: torch.Tensor,
                   batch: PackedBatch, rows: torch.Tensor) -> torch.Tensor:
    """Logits ``[len(rows), vocab]`` of the packed tokens at ``rows`` after one forward of ``model`` over
    ``input_ids [T]`` at ``positions [T]`` through ``batch``. A prepared 4D mask makes transformers skip
    building one (each sequence is masked by the batch's read, never by a ``[T, T]`` mask); the model
    must run kvfactory's attention (``use_engine_attention``)."""
    watch_hidden_states(model)
    placeholder = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=input_ids.device)
    out = model(input_ids=input_ids[None], position_ids=positions[None], cache=batch,
                attention_mask=placeholder, use_cache=True, logits_to_keep=rows)
    return out.logits[0]


def use_engine_attention(model: PreTrainedModel) -> None:
    """Switch ``model`` to kvfactory's attention, which runs packed batches (``ConfigError`` for an
    architecture whose attention bypasses transformers' ``AttentionInterface``)."""
    text_config = model.config.get_text_config(decoder=True)
    model_class = _without_attention_dispatch(text_config)
    if model_class is not None:
        raise ConfigError("model", model_class, "a model whose attention goes through transformers' "
                          "AttentionInterface: the engine batches sequences inside it")
    if getattr(text_config, "_attn_implementation", None) != ATTENTION:
        text_config._attn_implementation = ATTENTION
        logger.warning("switched the model's attn_implementation to %r for kvfactory's engine; it is "
                       "SDPA for every other cache", ATTENTION)


def join_batch(cache: KVCache) -> None:
    """``cache`` runs inside packed batches from now on: its forwards are the engine's, which reports
    tokens written and hidden states itself, so no model needs finding for it."""
    _first_forward.discard(cache)
    _release_model_finder()


def dynamic_cache_bytes(cache: Cache) -> int:
    """Bytes held by a transformers cache (DynamicCache and friends), from its tensors."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.untyped_storage().nbytes()
    return total
