"""``AsyncEngine`` in-process over a tiny model: concurrent requests answer as the engine alone,
admission errors reach the caller before any output, an abort and a shutdown free the pool."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tiny_models import tiny_model
from tiny_tokenizer import tiny_tokenizer

from kvfactory.engine import AdmissionError, Engine, EngineFullError, SamplingParams
from kvfactory.server.runner import AsyncEngine, ShuttingDownError, pool_state

CONFIG = {"type": "paged", "page_size": 4}
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def engine(**kwargs: object) -> Engine:
    return Engine(tiny_model("llama"), tiny_tokenizer(), CONFIG, pool_tokens=256, **kwargs)


def prompts(count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 256, (12 + 3 * i,), generator=gen).tolist() for i in range(count)]


def test_concurrent_requests_answer_as_the_engine_alone() -> None:
    expected = [o.token_ids for o in engine().generate(prompts(4), PARAMS)]

    async def main() -> list[list[int]]:
        runner = AsyncEngine(engine())
        runner.start()

        async def one(i: int, prompt: list[int]) -> list[int]:
            stream = await runner.add(prompt, PARAMS, f"r{i}")
            tokens = []
            async for output in stream:
                tokens += output.new_token_ids
            assert output.finished and output.finish_reason == "length" and output.token_ids == tokens
            return tokens

        answers = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts(4))))
        state = await runner.shutdown()
        assert (state["sequences"], state["blocks_held"], state["aborted"]) == (0, 0, 0)
        return answers

    assert asyncio.run(main()) == expected


def test_admission_errors_reach_the_caller() -> None:
    async def main() -> None:
        runner = AsyncEngine(engine(max_num_seqs=1, max_waiting=1))
        runner.start()
        with pytest.raises(AdmissionError) as caught:
            await runner.add([5] * 300, PARAMS, "too-long")  # more than the pool
        assert caught.value.field == "max_tokens"
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        running = await runner.add(prompts(1)[0], long, "running")
        await running.__anext__()  # it runs: the next one waits
        await runner.add(prompts(1)[0], long, "waiting")
        with pytest.raises(EngineFullError):
            await runner.add(prompts(1)[0], long, "full")
        state = await runner.shutdown()
        assert state["aborted"] == 2 and (state["sequences"], state["blocks_held"]) == (0, 0)
        outputs = [output async for output in running]
        assert outputs[-1].finish_reason == "abort"
        with pytest.raises(ShuttingDownError):
            await runner.add(prompts(1)[0], PARAMS, "late")

    asyncio.run(main())


def test_abort_frees_the_pool() -> None:
    async def main() -> None:
        runner = AsyncEngine(engine())
        runner.start()
        stream = await runner.add(prompts(1)[0], SamplingParams(max_tokens=200, ignore_eos=True), "r")
        await stream.__anext__()
        stream.abort()
        outputs = [output async for output in stream]
        assert outputs[-1].finish_reason == "abort"
        state = await runner.stats()
        assert (state["sequences"], state["blocks_held"], state["running"]) == (0, 0, 0)
        assert state == pool_state(runner.engine)  # idle: the same numbers from this thread
        await runner.shutdown()

    asyncio.run(main())
