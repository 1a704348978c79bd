"""``create_app``: an OpenAI-compatible HTTP API over one ``Engine`` (FastAPI, served by uvicorn).

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` answers with
server-sent events, ``data: {chunk}`` and a closing ``data: [DONE]``), ``GET /v1/models``,
``GET /health`` (the queues and the pool, ``runner.pool_state``) and ``GET /metrics`` (the engine's
Prometheus registry).

A request whose client goes away is aborted and its blocks go back to the pool: a stream notices
when starlette cancels its generator, a plain request by polling ``is_disconnected`` while it
waits. The lifespan starts the engine thread and, at shutdown (uvicorn's graceful shutdown, on
SIGTERM), aborts what is left and logs whether the pool is free.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvfactory.engine import AdmissionError, Engine, EngineFullError, SamplingParams
from kvfactory.server import protocol
from kvfactory.server.errors import SERVER, APIError, error_body, install_error_handlers
from kvfactory.server.protocol import ChatCompletionRequest, CompletionRequest
from kvfactory.server.runner import AsyncEngine, RequestFailedError, RequestStream, ShuttingDownError

logger = logging.getLogger("kvfactory.server")
DISCONNECT_POLL = 0.25  # seconds between checks that a non-streaming request's client is still there
DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def create_app(engine: Engine, served_model_name: str, *, max_tokens: int = 256, retry_after: int = 1
               ) -> FastAPI:
    """The API over ``engine`` (which the app's engine thread owns from startup on), answering to
    model name ``served_model_name``. ``max_tokens``: a chat request's when it gives none;
    ``retry_after``: seconds a 503 (a full queue, a stopping server) asks clients to wait."""
    server = OpenAIServer(engine, served_model_name, max_tokens, retry_after)
    app = FastAPI(title="kvfactory", lifespan=server.lifespan)
    app.state.runner = server.runner  # kvfactory.server.serve drains it on SIGTERM
    install_error_handlers(app, engine.metrics.rejected_request)
    app.post("/v1/completions")(server.completions)
    app.post("/v1/chat/completions")(server.chat_completions)
    app.get("/v1/models")(server.list_models)
    app.get("/health")(server.health)
    app.get("/metrics")(server.metrics)
    return app


class OpenAIServer:
    """The routes' handlers around one ``AsyncEngine``."""

    def __init__(self, engine: Engine, name: str, max_tokens: int, retry_after: int) -> None:
        self.runner = AsyncEngine(engine)
        self.name, self.max_tokens, self.retry_after = name, max_tokens, retry_after
        self.tokenizer = engine.tokenizer
        self.vocab = engine.model.get_input_embeddings().num_embeddings
        self.created = int(time.time())

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self.runner.start()
        engine = self.runner.engine
        logger.info("serving %r: max_num_seqs=%d, max_num_batched_tokens=%d, max_waiting=%d, preemption=%s",
                    self.name, engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens,
                    engine.max_waiting, engine.memory.preemption)
        try:
            yield
        finally:
            _log_stopped(await self.runner.shutdown())

    # -- routes ----------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        params = self._params(body, protocol.COMPLETION_MAX_TOKENS)
        if isinstance(body.prompt, list):
            self._check_token_ids(body.prompt)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await self._add(body.prompt, params, response_id, "prompt")
        created = int(time.time())
        if body.stream:
            return _sse(self._completion_events(stream, created, body.include_usage))
        output = await self._final(stream, request)
        return JSONResponse(protocol.completion(response_id, created, self.name, output))

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        params = self._params(body, self.max_tokens)
        if self.tokenizer.chat_template is None:
            raise APIError(400, f"{self.name!r} has no chat template: use /v1/completions", "messages")
        try:
            ids = self.tokenizer.apply_chat_template(body.conversation(), add_generation_prompt=True,
                                                     tokenize=True, return_dict=True)["input_ids"]
        except Exception as exc:  # the model's template refused the conversation (jinja raises anything)
            raise APIError(400, f"messages: the chat template refused them: {exc}", "messages") from None
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self._add(list(ids), params, response_id, "messages")
        created = int(time.time())
        if body.stream:
            return _sse(self._chat_events(stream, created, body.include_usage))
        output = await self._final(stream, request)
        return JSONResponse(protocol.chat_completion(response_id, created, self.name, output))

    async def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created,
                                            "owned_by": "kvfactory",
                                            "max_model_len": self.runner.engine.max_model_len}]}

    async def health(self) -> JSONResponse:
        try:
            if not self.runner.accepting:
                raise ShuttingDownError("the server is shutting down")
            return JSONResponse({"status": "ok", "model": self.name, **await self.runner.stats()})
        except ShuttingDownError:
            return JSONResponse({"status": "shutting down"}, 503)

    async def metrics(self) -> Response:
        return Response(generate_latest(self.runner.engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- helpers ---------------------------------------------------------------------------------
    def _params(self, body: protocol.CompletionRequest | ChatCompletionRequest, default_max_tokens: int
                ) -> SamplingParams:
        if body.model != self.name:
            raise APIError(400, f"model {body.model!r} is not served here; this server serves {self.name!r}",
                           "model")
        return body.sampling_params(default_max_tokens)

    def _check_token_ids(self, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise APIError(400, f"prompt: token ids must lie in [0, {self.vocab}); got {bad[:5]}", "prompt")

    async def _add(self, prompt: str | list[int], params: SamplingParams, request_id: str, prompt_field: str
                   ) -> RequestStream:
        try:
            return await self.runner.add(prompt, params, request_id)
        except AdmissionError as exc:
            field = prompt_field if exc.field == "prompt" else exc.field
            raise APIError(400, str(exc), field) from None
        except EngineFullError as exc:
            raise APIError(503, str(exc), None, SERVER, self._retry, "queue_full") from None
        except ShuttingDownError as exc:
            raise APIError(503, str(exc), None, SERVER, self._retry, "shutting_down") from None

    @property
    def _retry(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}

    async def _final(self, stream: RequestStream, request: Request) -> Any:
        """The request's last output; aborts it if the client goes away first."""
        watcher = asyncio.create_task(_abort_on_disconnect(request, stream))
        outputs = []
        try:
            outputs = [output async for output in stream]
        except RequestFailedError as exc:
            raise APIError(500, str(exc), None, SERVER, reason=None) from None
        finally:
            watcher.cancel()
            stream.abort()
        if outputs[-1].finish_reason == "abort":
            raise APIError(503, "the request was aborted: the server is shutting down", None, SERVER,
                           self._retry, reason=None)
        return outputs[-1]

    async def _completion_events(self, stream: RequestStream, created: int, include_usage: bool
                                 ) -> AsyncIterator[str]:
        response_id = stream.request_id
        try:
            async for output in stream:
                if output.new_text or output.finished:
                    yield _event(protocol.completion_chunk(response_id, created, self.name, output.new_text,
                                                           output.finish_reason, include_usage))
            if include_usage:
                yield _event(protocol.usage_chunk("text_completion", response_id, created, self.name, output))
            yield DONE
        except RequestFailedError as exc:
            yield _event(error_body(str(exc), SERVER))
        finally:  # also when the client went away: starlette cancels this generator
            stream.abort()

    async def _chat_events(self, stream: RequestStream, created: int, include_usage: bool
                           ) -> AsyncIterator[str]:
        response_id = stream.request_id
        try:
            role = {"role": "assistant", "content": ""}
            yield _event(protocol.chat_chunk(response_id, created, self.name, role, None, include_usage))
            async for output in stream:
                if output.new_text or output.finished:
                    delta = {"content": output.new_text} if output.new_text else {}
                    yield _event(protocol.chat_chunk(response_id, created, self.name, delta,
                                                     output.finish_reason, include_usage))
            if include_usage:
                yield _event(protocol.usage_chunk("chat.completion.chunk", response_id, created, self.name,
                                                  output))
            yield DONE
        except RequestFailedError as exc:
            yield _event(error_body(str(exc), SERVER))
        finally:
            stream.abort()


async def _abort_on_disconnect(request: Request, stream: RequestStream) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL)
    stream.abort()


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


def _log_stopped(state: dict[str, Any]) -> None:
    if not state:
        return
    held = state["sequences"], state["blocks_held"]
    if held == (0, 0):
        logger.info("engine stopped (%d requests aborted at the end): the pool is free: 0 sequences, "
                    "0 blocks held (%d prefix-cache blocks kept idle)", state["aborted"],
                    state["prefix_cached_blocks"])
    else:
        logger.error("engine stopped (%d requests aborted at the end) with %d sequences and %d pool "
                     "blocks held", state["aborted"], *held)
