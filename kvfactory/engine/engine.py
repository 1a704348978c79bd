"""``Engine``: many users' requests over one model and one KV pool, one packed forward per step.

Each request gets a cache from a ``KVCacheManager`` over the shared pool (prefix caching, host tier
for swapping), built from any paged kvfactory config: plain, int8 or int4 pages, an eviction
budget, a page selector. A step asks the ``Scheduler`` which tokens to feed, runs them through the
model in one forward without padding (``kvfactory.cache.packed_forward`` and ``StepBatch``),
samples the next token of every sequence that finished its prompt or decoded, and reports what each
request gained (``RequestOutput``), so callers stream token by token.

A failure that belongs to one request (its admission or resume, its logits or draw, its text) ends
that request alone with ``finish_reason='error'`` and the cause; the step goes on for the others,
whose tokens are those they would have had anyway. A failure of the shared forward itself fails the
requests in that forward; requests waiting or swapped out go on.

Preemption defaults to swapping: on a CPU the host tier is the same memory as the pool, so moving a
sequence's K/V out and back costs a copy, where recompute costs its whole prefill again (vLLM, whose
GPU pool sits across PCIe from the host, recomputes by default). Configs whose caches cannot be
paused (page selectors) and a full host tier fall back to recompute, and the swap metrics say which
happened.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from typing import Any

import torch

from kvfactory.cache import PackedBatch, join_batch, packed_forward, use_engine_attention
from kvfactory.engine.batch import Segment, StepBatch
from kvfactory.engine.compiled import CompiledDecode, layer_codes
from kvfactory.engine.compiled_prefill import CompiledPrefill
from kvfactory.engine.metrics import EngineMetrics
from kvfactory.engine.params import SamplingParams
from kvfactory.engine.request import Request, RequestOutput, RequestStatus
from kvfactory.engine.sampler import Sampler
from kvfactory.engine.scheduler import Plan, RequestFailed, Scheduler
from kvfactory.engine.weights import pack_linear_weights
from kvfactory.errors import CacheFullError, ConfigError, KVFactoryError
from kvfactory.manager import KVCacheManager
from kvfactory.manager.tiered import PrefixTiers
from kvfactory.quantization.ragged import PackedPlan
from kvfactory.sizing import KVShape
from kvfactory.tiers import Tier

logger = logging.getLogger("kvfactory.engine")
PREEMPTION = ("swap", "recompute")
NOTHING_TO_READ: futures.Future = futures.Future()  # a request whose prompt the tiers add nothing to
NOTHING_TO_READ.set_result(None)


class AdmissionError(KVFactoryError, ValueError):
    """A request that can never run (too long for the model or the pool); nothing was queued."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


class EngineMemory:
    """The scheduler's view of the pool (``scheduler.Memory``), through the manager."""

    def __init__(self, manager: KVCacheManager, preemption: str, like: tuple[torch.Tensor, torch.Tensor],
                 metrics: EngineMetrics) -> None:
        self.manager, self.preemption, self.like, self.metrics = manager, preemption, like, metrics
        self.cache_hooks: list[Callable[[Any], None]] = []  # called with each request's new cache
        self._needs: dict[tuple[str, int, int], list] = {}  # a scheduling pass asks again as its plan grows

    def requests(self, plan: Plan) -> list:
        needs = []
        for request, tokens in plan:
            cache = self.manager.get(request.request_id)
            key = (request.request_id, tokens, cache.get_seq_length())
            if key not in self._needs:
                self._needs[key] = cache.block_requests(tokens, *self.like)
            needs += self._needs[key]
        return needs

    def new_step(self) -> None:
        """Forget what the last scheduling pass asked: its writes changed the stores."""
        self._needs.clear()

    def fits(self, plan: Plan) -> bool:
        try:
            self.manager.pool.check(self.requests(plan))
        except CacheFullError:
            return False
        return True

    def prepare(self, request: Request) -> None:
        if request.tier_read is None:
            request.tier_read = self.manager.read_tiers(request.prompt_ids) or NOTHING_TO_READ

    def ready(self, request: Request) -> bool:
        return request.tier_read is None or request.tier_read.done()

    def admit(self, request: Request) -> None:
        manager = self.manager
        try:
            read = None if request.tier_read is None else request.tier_read.result()
            prompt = request.tokens if manager.prefix_caching else None
            cache = manager.create(request.request_id, prompt=prompt, tier_chunks=read)
            join_batch(cache)
            for hook in self.cache_hooks:
                hook(cache)
            request.computed = manager.cached_tokens(request.request_id)
        except Exception as exc:  # this request's admission (a tier load, a hook) failed: it alone ends
            self.release(request)
            raise RequestFailed(f"admission failed: {type(exc).__name__}: {exc}") from exc
        if not request.output_ids:  # a first admission (not a recompute)
            request.cached_tokens = request.computed
            self.metrics.prefix_tokens(len(request.prompt_ids), request.computed)

    def release(self, request: Request) -> None:
        if request.request_id in self.manager:
            self.manager.free(request.request_id)
        request.computed = 0

    def preempt(self, request: Request) -> RequestStatus:
        if self.preemption == "swap":
            try:
                self.manager.pause(request.request_id)
                self.metrics.preempted("swap")
                return RequestStatus.SWAPPED
            except KVFactoryError as err:  # sparse caches (UnsupportedError), a full host tier
                logger.info("request %s: swap refused (%s); recomputing instead", request.request_id, err)
        self.release(request)
        self.metrics.preempted("recompute")
        return RequestStatus.WAITING

    def fits_resume(self, request: Request, plan: Plan) -> bool:
        cache = self.manager.get(request.request_id)
        restore = [(request, cache.get_seq_length() or request.computed)]
        try:  # a paused cache is empty: what it restores costs what writing its tokens would
            self.manager.pool.check(self.requests(plan[:-1]) + self.requests(restore + plan[-1:]))
        except CacheFullError:
            return False
        return True

    def resume(self, request: Request) -> None:
        try:
            self.manager.resume(request.request_id)
        except Exception as exc:
            raise RequestFailed(f"resuming from the host tier failed: {type(exc).__name__}: {exc}") from exc


class Engine:
    """Continuous batching over ``model`` (a transformers causal LM) with kvfactory caches.

    ``cache_config`` is any paged kvfactory config (default: plain pages); ``pool_tokens`` (tokens per
    layer) or ``pool_bytes`` (in all) sizes the shared pool, else the config's own pool options do.
    ``max_num_batched_tokens`` caps the tokens of one forward, ``max_num_seqs`` the sequences holding
    K/V, ``max_waiting`` the queue (``EngineFullError`` beyond it: a server answers 503).
    ``preemption``: ``swap`` (default) or ``recompute``; ``host_bytes`` bounds the host tier swapped
    sequences wait in.
    ``prefill_first``: steps that prefill carry no decode tokens (``scheduler``: wider decode
    batches, decodes paused while a prompt prefills); default: mixed steps.
    ``pack_weights``: give the model's linear layers a copy of their weights laid out for the steps,
    which every step multiplies by (``weights``: kvfactory's panels on one AVX-512 thread, else
    oneDNN's blocked layout; a decode step reads the weights 1.5 to 2.7x faster, for the weights'
    bytes more memory); the model keeps it after the engine.
    ``compile_step``: run decode steps of two or more sequences over plain pages or KIVI pages through
    ``torch.compile`` (``compiled``), and prefill steps of 128 tokens or more (``weights.GEMM_ROWS``)
    over plain or KIVI pages of full-attention layers (``compiled_prefill``, None where it does not
    apply);
    both compiled when the engine is made, about a minute each for SmolLM2; the decode step's weights
    are frozen into its graph, so train or load new weights into a new engine; off with
    ``in_place_decode=False``.
    """

    def __init__(self, model: Any, tokenizer: Any, cache_config: dict[str, Any] | None = None, *,
                 pool_tokens: int | None = None, pool_bytes: int | None = None,
                 max_num_batched_tokens: int = 512, max_num_seqs: int = 16,
                 max_waiting: int = 256, preemption: str = "swap", prefix_caching: bool | None = None,
                 host_bytes: int | None = None, in_place_decode: bool = True,
                 prefill_first: bool = False, tiers: Tier | None = None, tier_codec: str = "identity",
                 chunk_tokens: int = 256, pack_weights: bool = True, compile_step: bool = False) -> None:
        if preemption not in PREEMPTION:
            raise ConfigError("preemption", preemption, f"one of {PREEMPTION}")
        limits = {"max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs,
                  "max_waiting": max_waiting}
        for name, value in limits.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, value, "an integer >= 1")
        config = dict(cache_config or {"type": "paged"})
        if pool_tokens is not None and pool_bytes is not None:
            raise ConfigError("pool_bytes", pool_bytes, "unset when pool_tokens is given (one pool size)")
        for key, size in (("pool_tokens", pool_tokens), ("pool_bytes", pool_bytes)):
            if size is not None:
                config = _with_pool(config, key, size)
        self.model, self.tokenizer = model, tokenizer
        use_engine_attention(model)
        if pack_weights:
            pack_linear_weights(model)
        weight = next(model.parameters())
        prefix_tiers = None if tiers is None else PrefixTiers(tiers, model.config, weight.dtype, tier_codec,
                                                              chunk_tokens, weight.device)
        self.manager = KVCacheManager(model.config, config, prefix_caching=prefix_caching,
                                      host_bytes=host_bytes, tiers=prefix_tiers,
                                      warn_unused_prefix_cache=False)  # a server's traffic: a metric
        text = model.config.get_text_config(decoder=True)
        self.max_model_len: int | None = getattr(text, "max_position_embeddings", None)
        self.device = next(model.parameters()).device
        self.metrics = EngineMetrics(self)
        like = self._kv_like()
        self.memory = EngineMemory(self.manager, preemption, like, self.metrics)
        # an empty cache that answers what a request's writes would take (``_check_fits``): made once, so
        # its stores work out their block layouts (a codec's encoded block) once, not at every admission
        self._probe = self.manager.factory.create_cache()
        join_batch(self._probe)
        codes = layer_codes(self._probe, like, text.num_attention_heads) if compile_step else None
        if compile_step and codes is None:
            raise ConfigError("compile_step", compile_step, "False for this cache config: the compiled "
                              "decode step covers plain pages and KIVI pages (int4, int2) of full-attention "
                              "layers, with no eviction policy or page selector")
        # eviction policies compress a prompt as a whole when it is written: prefill them in one step
        chunked = self.manager.factory.config.eviction is None
        self.scheduler = Scheduler(self.memory, max_num_seqs, max_num_batched_tokens, chunked_prefill=chunked,
                                   prefill_first=prefill_first)
        self.max_waiting = max_waiting
        self.in_place_decode = in_place_decode
        self._packed_plans: dict[tuple[int, ...], PackedPlan] = {}  # each layer group's quantized pages' read
        # what the last step's forward computed: (first position, end) per sequence, and the rows that
        # gave logits; for cost accounting (``kvfactory.roofline``)
        self.computed_spans: list[tuple[int, int]] = []
        self.logit_rows = 0
        compiling = codes is not None and in_place_decode
        self.compiled = CompiledDecode(model, like, codes, self._probe.groups) if compiling else None
        self.compiled_prefill = CompiledPrefill(model, like, codes, self._probe.groups) \
            if compiling and CompiledPrefill.covers(self._probe, like, text.num_attention_heads) else None
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self.eos = _eos_ids(model)
        self._ids = itertools.count()
        self._aborted: list[RequestOutput] = []

    def on_new_cache(self, hook: Callable[[Any], None]) -> None:
        """Call ``hook(cache)`` with each request's cache when it is created (at admission, and again
        after a preemption by recompute): how a watcher such as OVAL's ``DriftRetrainer`` sees every
        sequence's shadow samples."""
        self.memory.cache_hooks.append(hook)

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request (text, or token ids); returns its id. ``AdmissionError`` (naming the field)
        when it could never run, ``EngineFullError`` when the queue is full; nothing is queued then."""
        params = params or SamplingParams()
        if self.tokenizer is None and (isinstance(prompt, str) or params.stop):
            raise AdmissionError("prompt" if isinstance(prompt, str) else "stop",
                                 "an engine without a tokenizer takes token ids and no stop strings")
        if isinstance(prompt, str):
            _check_text(prompt)
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            ids = [int(t) for t in prompt]
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise AdmissionError("request_id", f"request id {request_id!r} is in use")
        if not ids:
            raise AdmissionError("prompt", "the prompt is empty: give at least one token")
        self._check_fits(len(ids), params.max_tokens)
        if len(self.scheduler.waiting) >= self.max_waiting:
            raise EngineFullError(len(self.scheduler.waiting), self.max_waiting)
        request = Request(request_id, ids, params)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and give its blocks back; its last output (``finish_reason='abort'``), or None
        if it is unknown or finished already."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return None
        self._finish(request, "abort")
        self.metrics.update_gauges()  # no step may follow to refresh them
        output = self._output(request, [])
        self._aborted.append(output)
        return output

    def fail(self, request_id: str, cause: str) -> RequestOutput | None:
        """End a request with ``finish_reason='error'`` and ``cause`` (a caller's own failure handling);
        its last output, or None if it is unknown or finished already."""
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return None
        output = self._fail(request, cause)
        self.metrics.update_gauges()
        return output

    def has_unfinished(self) -> bool:
        return bool(len(self.scheduler))

    # -- stepping ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward over what the scheduler picks; the outputs of the requests that advanced
        (and of those aborted since the last step)."""
        outputs, self._aborted = self._aborted, []
        self.computed_spans, self.logit_rows = [], 0
        self.memory.new_step()
        plan = self.scheduler.schedule()
        failed, self.scheduler.failed = self.scheduler.failed, []
        outputs += [self._fail(request, cause) for request, cause in failed]
        for request, _ in plan:  # admitted: its chunks are in its cache now
            request.tier_read = None
        if not plan:
            reads = [r.tier_read for r in self.scheduler.waiting if r.tier_read is not None]
            if reads and not any(read.done() for read in reads):  # idle until a read ends: not spinning
                futures.wait(reads, timeout=0.05, return_when=futures.FIRST_COMPLETED)
            return self._end_step(outputs)
        started = time.perf_counter()
        sampled = [request for request, tokens in plan if request.computed + tokens == request.length]
        try:
            with torch.inference_mode():
                logits = self._forward(plan)
        except Exception as exc:  # the shared forward: what it cannot attribute fails its own requests only
            logger.exception("request(s) %s: the step's forward failed", [r.request_id for r, _ in plan])
            outputs += [self._fail(request, f"the step's forward failed: {type(exc).__name__}: {exc}")
                        for request, _ in plan]
            return self._end_step(outputs)
        self.computed_spans = [(request.computed - tokens, request.computed) for request, tokens in plan]
        self.logit_rows = len(sampled)
        with torch.inference_mode():
            draws = self.sampler(logits, sampled)
        now = time.perf_counter()
        self.metrics.step(plan, len(sampled) - len(draws.failures), now - started)
        for i, (request, token) in enumerate(zip(sampled, draws.tokens, strict=True)):
            if token is None:
                outputs.append(self._fail(request, draws.failures[i]))
                continue
            try:
                outputs.append(self._append(request, token, now))
            except Exception as exc:  # detokenizing or stop matching for this request alone
                outputs.append(self._fail(request, f"{type(exc).__name__}: {exc}"))
        return self._end_step(outputs)

    def _end_step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """``outputs``, after the step: the compiled decode step's kept blocks given back once no sequence
        decodes (also after a failed forward), the gauges updated."""
        if self.compiled is not None and not self.scheduler.running:
            self.compiled.release()
        self.metrics.update_gauges()
        return outputs

    def generate(self, prompts: Iterable[str | list[int]], params: SamplingParams | None = None
                 ) -> list[RequestOutput]:
        """Run ``prompts`` as one offline batch to the end; their final outputs, in order."""
        ids = [self.add_request(prompt, params) for prompt in prompts]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for output in self.step():
                if output.finished:
                    final[output.request_id] = output
        for request_id in ids:
            self.requests.pop(request_id, None)
        return [final[i] for i in ids]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None
               ) -> Iterator[RequestOutput]:
        """One request's outputs step by step (other queued requests advance too)."""
        request_id = self.add_request(prompt, params)
        while True:
            for output in self.step():
                if output.request_id == request_id:
                    yield output
                    if output.finished:
                        self.requests.pop(request_id, None)
                        return

    def stats(self) -> dict[str, Any]:
        """Queues, pool and prefix cache, preemptions, bytes the compiled decode step keeps decoded
        (numbers only)."""
        scheduler = self.scheduler
        return {"running": len(scheduler.running), "waiting": len(scheduler.waiting),
                "swapped": len(scheduler.swapped), "preemptions": scheduler.preemptions,
                "decoded_bytes": 0 if self.compiled is None else self.compiled.decoded_bytes,
                **self.manager.stats()}

    def forget(self, request_id: str) -> None:
        """Drop a finished request's record (``generate`` and ``stream`` do it themselves)."""
        request = self.requests.get(request_id)
        if request is not None and request.finished:
            del self.requests[request_id]

    # -- internals -----------------------------------------------------------------------------
    def _forward(self, plan: Plan) -> torch.Tensor:
        segments, ids, positions, rows, at = [], [], [], [], 0
        for request, tokens in plan:
            cache = self.manager.get(request.request_id)
            segments.append(Segment(cache, at, at + tokens))
            ids.extend(request.tokens[request.computed:request.computed + tokens])
            positions.append(torch.arange(request.computed, request.computed + tokens))
            at += tokens
            if request.computed + tokens == request.length:
                rows.append(at - 1)
        input_ids = torch.tensor(ids, device=self.device)
        positions = torch.cat(positions).to(self.device)
        with self.manager.pool.forward_lock.held():
            planned = self.compiled.plan(segments) if self.compiled is not None and len(rows) == len(plan) \
                else None
            prefill = self.compiled_prefill.plan(segments) \
                if planned is None and self.compiled_prefill is not None else None
            if planned is not None:
                logits, hidden = self.compiled.forward(input_ids, positions, planned), None
            elif prefill is not None:
                kept = torch.tensor(rows, dtype=torch.long, device=self.device)
                logits, hidden = self.compiled_prefill.forward(input_ids, positions, prefill, kept), None
            else:
                batch = PackedBatch(StepBatch(segments, self.in_place_decode,
                                              packed_plans=self._packed_plans).write)
                logits = packed_forward(self.model, input_ids, positions, batch,
                                        torch.tensor(rows, dtype=torch.long, device=self.device))
                hidden = batch.hidden
            for segment, (request, tokens) in zip(segments, plan, strict=True):
                cache = segment.cache
                cache.record_tokens(input_ids[segment.start:segment.end][None])
                cache.notify_written()
                if cache.routing_context is not None and hidden is not None:
                    cache.routing_context.hidden = hidden[0, segment.end - 1][None]
                request.computed += tokens
        return logits

    def _append(self, request: Request, token: int, now: float) -> RequestOutput:
        request.output_ids.append(token)
        self.metrics.token(request, now)
        if self.tokenizer is not None:  # without one, requests are token ids in and out
            request.text = self.tokenizer.decode(request.output_ids, skip_special_tokens=True)
        params = request.params
        reason = None
        hits = [at for at in (request.text.find(s) for s in params.stop) if at >= 0]
        if hits:
            request.text, reason = request.text[:min(hits)], "stop"
        elif token in params.stop_token_ids or (token in self.eos and not params.ignore_eos):
            reason = "stop"
        elif len(request.output_ids) >= params.max_tokens:
            reason = "length"
        if reason is not None:
            self._finish(request, reason)
        return self._output(request, request.output_ids[request.sent_tokens:])

    def _finish(self, request: Request, reason: str) -> None:
        self.metrics.finished(request, reason)
        self.scheduler.finish(request)
        self.sampler.forget(request.request_id)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason

    def _fail(self, request: Request, cause: str) -> RequestOutput:
        """End ``request`` alone (``finish_reason='error'``, its blocks freed): something about it broke
        a step, which goes on for every other request."""
        logger.error("request %s failed: %s", request.request_id, cause)
        request.error = cause
        self._finish(request, "error")
        self.memory.release(request)  # also one the scheduler no longer queues (a failed resume)
        return self._output(request, [])

    def _output(self, request: Request, new_ids: list[int]) -> RequestOutput:
        text = request.settled_text()
        output = RequestOutput(request.request_id, new_ids, text[request.sent_text:],
                               list(request.output_ids), text, request.finished, request.finish_reason,
                               len(request.prompt_ids), request.cached_tokens, request.error)
        request.sent_text, request.sent_tokens = len(text), len(request.output_ids)
        return output

    def _check_fits(self, prompt: int, max_tokens: int) -> None:
        total = prompt + max_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            field = "prompt" if prompt >= self.max_model_len else "max_tokens"
            raise AdmissionError(field, f"prompt ({prompt} tokens) + max_tokens ({max_tokens}) = {total} "
                                 f"exceeds the model's context of {self.max_model_len} tokens")
        bounded = self.manager.factory.config.eviction is not None  # a policy keeps a budget of the rest
        try:
            needs = self._probe.block_requests(prompt if bounded else total, *self.memory.like)
            self.manager.pool.check_capacity(needs)
        except CacheFullError as err:
            raise AdmissionError("max_tokens" if prompt < total else "prompt",
                                 f"prompt ({prompt} tokens) + max_tokens ({max_tokens}) can never fit in the "
                                 f"KV pool: {err}") from None

    def _kv_like(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty K/V shaped like one layer's writes, for asking stores what a write would take."""
        shape = KVShape.from_config(self.model.config)
        dtype = next(self.model.parameters()).dtype
        like = torch.empty(1, shape.kv_heads, 0, shape.head_dim, dtype=dtype, device=self.device)
        return like, like


class EngineFullError(KVFactoryError, RuntimeError):
    """The waiting queue is full; try again later (a server answers 503 with Retry-After)."""

    def __init__(self, waiting: int, limit: int) -> None:
        self.waiting, self.limit = waiting, limit
        super().__init__(f"the engine's queue is full: {waiting} requests wait (max_waiting={limit})")


def _with_pool(config: dict[str, Any], key: str, size: int) -> dict[str, Any]:
    """``config`` with its paged storage sized by ``key`` (``pool_tokens`` or ``pool_bytes``) = ``size``."""
    if config.get("type") != "composite":
        return {**config, key: size}
    strategies = [dict(entry) for entry in config.get("strategies", [])]
    storage = [entry for entry in strategies if entry.get("name") in ("paged", "dense")]
    if storage:
        storage[0][key] = size
    else:
        strategies.insert(0, {"name": "paged", key: size})
    return {**config, "strategies": strategies}


def _check_text(prompt: str) -> None:
    """``AdmissionError`` for a prompt that is not Unicode text (a lone surrogate, which JSON's
    ``\\ud800`` escapes can carry and no tokenizer can encode)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise AdmissionError("prompt", f"the prompt is not valid Unicode text: {exc.reason} "
                             f"({prompt[exc.start:exc.end]!r} at character {exc.start})") from None


def _eos_ids(model: Any) -> set[int]:
    generation = getattr(model, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None) if generation is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}
