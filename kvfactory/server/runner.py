"""``AsyncEngine``: the engine on a thread of its own, for asyncio request handlers.

``Engine`` is not thread-safe, so one background thread owns it. That thread runs what handlers
post to its inbox (add a request, abort one, read the stats), steps while any request is
unfinished, and otherwise sleeps on the inbox's condition. Each request's outputs reach its handler
through an ``asyncio.Queue`` of its own, fed from the engine thread with ``call_soon_threadsafe``.

A request that fails inside a step (``finish_reason='error'``) reaches its handler as
``RequestFailedError``; the other requests of that step go on.

Adding a request is a round trip to the engine thread, so ``AdmissionError`` and ``EngineFullError``
reach the handler before it starts a response (a 400 or a 503, never a broken stream). Aborting only
posts: a handler being cancelled (its client went away) cannot wait for anything.

``shutdown`` stops taking requests, aborts those left and reports the pool (``pool_state``): no
sequence may remain, and no block may stay allocated but idle prefix-cache blocks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from kvfactory.engine import Engine, RequestOutput, SamplingParams
from kvfactory.errors import KVFactoryError

logger = logging.getLogger("kvfactory.server")
T = TypeVar("T")


class ShuttingDownError(KVFactoryError, RuntimeError):
    """The server is stopping: no new request is taken (a 503)."""


class RequestFailedError(KVFactoryError, RuntimeError):
    """This request failed inside the engine (a 500, or an error event ending its stream); the
    others went on."""


class EngineStepError(RequestFailedError):
    """A step failed outside any request's own work (the scheduler itself): every request in flight
    failed with it."""


def pool_state(engine: Engine) -> dict[str, Any]:
    """The queues and the pool as ``/health`` reports them. ``blocks_held``: pool blocks in use
    (all layers) less the idle prefix-cache blocks, those only the prefix cache keeps for later
    prompts (and evicts when the pool needs room); 0 when no request holds K/V."""
    stats = engine.stats()
    keys = ("running", "waiting", "swapped", "sequences", "pool_blocks", "pool_blocks_used",
            "prefix_cached_blocks", "host_bytes", "preemptions")
    return {**{key: stats[key] for key in keys}, "blocks_held": stats["pool_blocks_held"]}


class RequestStream:
    """One request's outputs in order (``async for``); ends after the finished one. ``abort`` stops
    the request (its blocks go back to the pool); it does nothing once the request finished."""

    def __init__(self, runner: AsyncEngine, request_id: str, queue: asyncio.Queue) -> None:
        self.runner, self.request_id, self.queue = runner, request_id, queue
        self.finished = False  # its last output (or an error) was read
        self._aborted = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, Exception):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        """Ask the engine to stop the request; its abort output still arrives on the stream."""
        if not (self.finished or self._aborted):
            self._aborted = True
            logger.info("request %s: aborted (its client went away or the server is stopping)",
                        self.request_id)
            self.runner.abort(self.request_id)


class AsyncEngine:
    """Owns ``engine`` on one background thread (``start`` from the event loop that will await it)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.accepting = False
        self._wake = threading.Condition()
        self._inbox: list[Callable[[], None]] = []
        self._stopping = False
        self._stopped = False  # the thread took its last commands: later ones are refused
        self._queues: dict[str, asyncio.Queue] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._final: dict[str, Any] = {}
        self._draining = False
        self.drained = threading.Event()  # set once draining and no request is left in flight

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvfactory-engine", daemon=True)
        self._thread.start()
        self.accepting = True

    async def add(self, prompt: str | list[int], params: SamplingParams, request_id: str) -> RequestStream:
        """Queue a request; its stream. Raises the engine's ``AdmissionError`` / ``EngineFullError``, or
        ``ShuttingDownError``, with nothing queued."""
        if not self.accepting:
            raise ShuttingDownError("the server is shutting down")
        queue: asyncio.Queue = asyncio.Queue()
        try:
            await asyncio.wrap_future(self._call(lambda: self._add(prompt, params, request_id, queue)))
        except asyncio.CancelledError:  # the handler went away: the request may have been queued
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, queue)

    def abort(self, request_id: str) -> None:
        """Stop a request (unknown or finished ones are left alone); returns at once."""
        self._post(lambda: self._abort(request_id))

    def drain(self, timeout: float) -> None:
        """Stop taking requests (``add`` raises ``ShuttingDownError``) and abort those still unfinished
        ``timeout`` seconds from now (their streams end with ``finish_reason='abort'``); ``drained`` is
        set once none is left. Safe to call from a signal handler."""
        self.accepting, self._draining = False, True
        if self._loop is None:  # it never started: nothing is in flight
            self.drained.set()
            return
        self._loop.call_soon_threadsafe(self._loop.call_later, timeout, self._post, self._abort_all)
        self._post(lambda: None)  # wake the engine thread, which sets ``drained`` once nothing is left

    async def stats(self) -> dict[str, Any]:
        """``pool_state`` of the engine, read on its thread."""
        return await asyncio.wrap_future(self._call(lambda: pool_state(self.engine)))

    async def shutdown(self) -> dict[str, Any]:
        """Stop taking requests, abort the unfinished ones, stop the thread; ``pool_state`` after it,
        with ``aborted``: how many requests were still unfinished."""
        self.accepting = False
        if self._thread is None:
            return {}
        with self._wake:
            self._stopping = True
            self._wake.notify()
        await asyncio.to_thread(self._thread.join)
        return self._final

    # -- the engine thread -------------------------------------------------------------------------
    def _post(self, command: Callable[[], None]) -> bool:
        """Queue ``command`` for the engine thread; False once it stopped taking commands."""
        with self._wake:
            if self._stopped:
                return False
            self._inbox.append(command)
            self._wake.notify()
            return True

    def _call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the engine thread; its result or exception (``ShuttingDownError`` once the
        thread stopped) in the future."""
        future: Future[T] = Future()

        def command() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except Exception as exc:  # handed to the awaiting handler
                future.set_exception(exc)

        if not self._post(command):
            future.set_exception(ShuttingDownError("the server is shutting down"))
        return future

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._inbox or self._stopping or self.engine.has_unfinished()):
                    if self._draining and not self._queues:
                        self.drained.set()
                    self._wake.wait()
                commands, self._inbox = self._inbox, []
                stopping = self._stopped = self._stopping
            for command in commands:
                command()
            if stopping:
                self._stop()
                return
            if self.engine.has_unfinished():
                self._step()

    def _add(self, prompt: str | list[int], params: SamplingParams, request_id: str,
             queue: asyncio.Queue) -> None:
        self.engine.add_request(prompt, params, request_id)
        self._queues[request_id] = queue

    def _abort(self, request_id: str) -> None:
        output = self.engine.abort(request_id)
        if output is not None:
            self._deliver(output)
        self._queues.pop(request_id, None)
        self.engine.forget(request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed: failing the %d requests in flight", len(self._queues))
            cause = f"the engine failed: {type(exc).__name__}: {exc}"
            for request_id, queue in list(self._queues.items()):
                del self._queues[request_id]  # its handler gets the error, not an abort
                self._send(queue, EngineStepError(cause))
                self.engine.fail(request_id, cause)
                self.engine.forget(request_id)
            return
        for output in outputs:
            self._deliver(output)

    def _deliver(self, output: RequestOutput) -> None:
        queue = self._queues.get(output.request_id)
        if queue is None:  # aborted already: its handler is gone
            return
        failed = output.finish_reason == "error"
        self._send(queue, RequestFailedError(f"the request failed: {output.error}") if failed else output)
        if output.finished:
            del self._queues[output.request_id]
            self.engine.forget(output.request_id)

    def _send(self, queue: asyncio.Queue, item: RequestOutput | Exception) -> None:
        self._loop.call_soon_threadsafe(queue.put_nowait, item)

    def _abort_all(self) -> None:
        if self._queues:
            logger.info("aborting the %d requests still unfinished", len(self._queues))
        for request_id in list(self._queues):
            self._abort(request_id)

    def _stop(self) -> None:
        aborted = len(self._queues)
        self._abort_all()
        self._final = {**pool_state(self.engine), "aborted": aborted}
