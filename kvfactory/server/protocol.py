"""The OpenAI API's request and response shapes for ``/v1/completions`` and ``/v1/chat/completions``.

Requests are pydantic models (types only); values are checked where generation is defined, by
``SamplingParams``, whose ``ConfigError`` names the field. Defaults are OpenAI's: ``temperature``
1, ``top_p`` 1, ``max_tokens`` 16 for completions; chat has no OpenAI default, so it takes the
server's (``--max-tokens``). ``top_k`` and ``ignore_eos`` are extensions (as in vLLM). Fields that
would change what the answer means and are not implemented (``n`` > 1, ``logprobs``, ``echo``,
``suffix``, ``best_of`` > 1, ``tools``, non-zero ``presence_penalty`` / ``frequency_penalty``, a
``logit_bias``) are refused, other unknown fields ignored.

Responses are plain dicts in OpenAI's shapes: ``text_completion`` / ``chat.completion`` objects
and their streamed chunks, with ``usage`` (and ``prompt_tokens_details.cached_tokens``, the
prompt tokens found in the prefix cache).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, ValidatorFunctionWrapHandler, field_validator
from pydantic_core import PydanticCustomError

from kvfactory.engine import RequestOutput, SamplingParams
from kvfactory.errors import ConfigError
from kvfactory.server.errors import APIError

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _one_of(message: str):
    """A wrap validator that reports a failed union as one error at the field: ``message``."""
    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("union", message) from None
    return validate


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    _stop = field_validator("stop", mode="wrap")(_one_of("expected a string or a list of strings"))

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The request's ``SamplingParams``; ``APIError`` 400 naming the field at fault."""
        for field, message in self._refused().items():
            raise APIError(400, f"{field}: {message}", field)
        field, max_tokens = self._max_tokens()
        try:
            return SamplingParams(max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                                  temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                  seed=self.seed, stop=() if self.stop is None else self.stop,
                                  ignore_eos=self.ignore_eos)
        except ConfigError as exc:
            field = field if exc.key == "max_tokens" else exc.key
            raise APIError(400, f"{field}={exc.value!r}: expected {exc.allowed}", field) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _max_tokens(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens

    def _refused(self) -> dict[str, str]:
        """Fields set to what this server does not do, and why."""
        refused = {"n": f"{self.n} asked; only n=1 is supported"} if self.n != 1 else {}
        for field in ("presence_penalty", "frequency_penalty"):
            if getattr(self, field) != 0:
                refused[field] = f"{getattr(self, field)!r} asked; penalties are not supported (only 0)"
        if self.logit_bias:
            refused["logit_bias"] = "not supported"
        return refused


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    _prompt = field_validator("prompt", mode="wrap")(_one_of("expected a string or a list of token ids"))

    def _refused(self) -> dict[str, str]:
        refused = super()._refused()
        for field, unset in (("echo", self.echo is False), ("logprobs", self.logprobs is None),
                             ("suffix", self.suffix is None), ("best_of", self.best_of in (None, 1))):
            if not unset:
                refused[field] = "not supported"
        return refused


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]

    _content = field_validator("content", mode="wrap")(_one_of("expected a string or a list of text parts"))

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are given
    logprobs: bool = False
    tools: list[Any] | None = None

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text} for m in self.messages]

    def _max_tokens(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def _refused(self) -> dict[str, str]:
        refused = super()._refused()
        if not self.messages:
            refused["messages"] = "give at least one message"
        if self.logprobs:
            refused["logprobs"] = "not supported"
        if self.tools:
            refused["tools"] = "not supported"
        return refused


# -- responses -----------------------------------------------------------------------------------------
def usage(output: RequestOutput) -> dict[str, Any]:
    completion = len(output.token_ids)
    return {"prompt_tokens": output.prompt_tokens, "completion_tokens": completion,
            "total_tokens": output.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": output.cached_tokens}}


def completion(response_id: str, created: int, model: str, output: RequestOutput) -> dict[str, Any]:
    choice = {"index": 0, "text": output.text, "finish_reason": output.finish_reason, "logprobs": None}
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": usage(output)}


def completion_chunk(response_id: str, created: int, model: str, text: str, finish_reason: str | None,
                     include_usage: bool) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    return _chunk({"id": response_id, "object": "text_completion", "created": created, "model": model,
                   "choices": [choice]}, include_usage)


def chat_completion(response_id: str, created: int, model: str, output: RequestOutput) -> dict[str, Any]:
    choice = {"index": 0, "message": {"role": "assistant", "content": output.text},
              "finish_reason": output.finish_reason, "logprobs": None}
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [choice], "usage": usage(output)}


def chat_chunk(response_id: str, created: int, model: str, delta: dict[str, str], finish_reason: str | None,
               include_usage: bool) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    return _chunk({"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [choice]}, include_usage)


def usage_chunk(chunk_object: str, response_id: str, created: int, model: str, output: RequestOutput
                ) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    return {"id": response_id, "object": chunk_object, "created": created, "model": model, "choices": [],
            "usage": usage(output)}


def _chunk(chunk: dict[str, Any], include_usage: bool) -> dict[str, Any]:
    return {**chunk, "usage": None} if include_usage else chunk  # OpenAI: null on all but the last
