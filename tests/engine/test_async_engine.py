"""AsyncEngine: concurrent streams, refusals reach only their caller, leaving a stream aborts it."""

import asyncio

import pytest

from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.requests.request import RequestRefused
from loraplex.params import SamplingParams


@pytest.fixture
def async_engine(make_engine):
    engine = AsyncEngine(make_engine(max_batch_total_tokens=2048))
    yield engine
    engine.shutdown()


async def collect(engine, prompt_ids, params):
    return [out async for out in engine.generate(prompt_ids, params)]


def test_concurrent_streams_match_the_sync_engine(async_engine, make_engine, embedded):
    tok = embedded.tokenizer
    prompts = [tok.encode(t) for t in ("Hello there", "The sky is", "1, 2, 3,", "Dogs are")]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(collect(async_engine, p, params) for p in prompts))

    streams = asyncio.run(main())
    expected = make_engine().generate(prompts, params)
    for stream, final in zip(streams, expected):
        assert [o.token.id for o in stream] == final.token_ids
        assert stream[-1].finished and not any(o.finished for o in stream[:-1])
        assert "".join(o.token.text for o in stream) == stream[-1].generated_text == final.generated_text


def test_refusal_reaches_only_its_caller(async_engine, embedded):
    tok = embedded.tokenizer

    async def main():
        too_long = collect(async_engine, tok.encode("hi"), SamplingParams(max_new_tokens=5000))
        fine = collect(async_engine, tok.encode("Hello"), SamplingParams(max_new_tokens=3))
        return await asyncio.gather(too_long, fine, return_exceptions=True)

    refused, fine = asyncio.run(main())
    assert isinstance(refused, RequestRefused) and "max total tokens" in str(refused)
    assert len(fine) == 3 and fine[-1].finished


def test_leaving_a_stream_aborts_and_frees_its_blocks(async_engine, embedded):
    tok = embedded.tokenizer
    engine = async_engine.engine

    async def main():
        stream = async_engine.generate(tok.encode("Tell me a long story"), SamplingParams(max_new_tokens=500, ignore_eos=True))
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.aclose()
        # Commands are applied in order: once a later request has finished, the abort has been applied.
        await collect(async_engine, tok.encode("Hi"), SamplingParams(max_new_tokens=1))
        return seen

    assert asyncio.run(main()) == 3
    assert engine.scheduler.allocator.num_used == 0
    assert not engine.has_unfinished
