"""Images are decoded within a budget of decoded bytes (width x height x 3), counted from their headers before
any pixel is decoded (issue 58, item 3): a request past max_decoded_bytes_per_request is refused 413 naming
it; requests that together pass max_decoded_bytes_total wait their turn and all succeed; one that could never
fit is refused; the budget comes back however a request ends (bad image, processor error, cancellation)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from PIL import ImageFile

from loraplex.multimodal import DecodeBudget, MediaConfig, MediaDecodeError, open_images
from tests.multimodal.images import bomb_png
from tests.server.test_images_http import call, chat, data_url, llava, make_app, png  # noqa: F401 (llava: fixture)

NEW = 5


class DecodeSpy:
    """Counts pixel decodes (ImageFile.load) and the budget in use at each; each decode takes a little
    longer, so concurrent requests overlap."""

    def __init__(self, monkeypatch, budget: DecodeBudget, delay: float = 0.0) -> None:
        self.calls = 0
        self.peak_in_use = 0
        self.lock = threading.Lock()
        original = ImageFile.ImageFile.load

        def load(image, *args, **kwargs):
            with self.lock:
                self.calls += 1
                self.peak_in_use = max(self.peak_in_use, budget.in_use)
            if delay:
                time.sleep(delay)
            return original(image, *args, **kwargs)

        monkeypatch.setattr(ImageFile.ImageFile, "load", load)


def native(urls: list[str]) -> dict:
    images = " ".join(f"![]({u})" for u in urls)
    return {"inputs": f"w5 {images} w6", "parameters": {"max_new_tokens": NEW, "ignore_eos_token": True}}


@pytest.fixture
def served(llava):  # noqa: F811
    apps = []

    def serve(**media):
        config = MediaConfig(**media)
        app, engine = make_app(llava, config)
        apps.append(engine)
        return app, config.decode_budget

    yield serve
    for engine in apps:
        engine.shutdown()


def test_a_request_past_its_budget_is_refused_before_any_pixel_is_decoded(served, monkeypatch):
    app, budget = served(max_decoded_bytes_per_request=200_000)
    spy = DecodeSpy(monkeypatch, budget)
    two = [data_url(png(size=(200, 200), seed=i)) for i in range(2)]  # 2 x 120,000 bytes decoded
    openai, generate = call(app, ("POST", "/v1/chat/completions", chat(two)), ("POST", "/generate", native(two)))
    assert openai.status_code == 413, openai.text
    assert generate.status_code == 413, generate.text
    message = openai.json()["error"]["message"]
    assert "decode to 240000 bytes" in message and "max_decoded_bytes_per_request = 200000" in message, message
    assert "max_decoded_bytes_per_request = 200000" in generate.json()["error"]
    assert spy.calls == 0  # not one pixel decoded
    assert budget.peak == 0 and budget.in_use == 0  # nothing was even reserved

    (one,) = call(app, ("POST", "/v1/chat/completions", chat(two[:1])))  # 120,000: within the budget
    assert one.status_code == 200, one.text
    assert spy.calls > 0 and budget.peak == 120_000 and budget.in_use == 0


def test_requests_past_the_server_budget_are_decoded_one_after_another(served, monkeypatch):
    app, budget = served(max_decoded_bytes_total=100_000)
    spy = DecodeSpy(monkeypatch, budget, delay=0.02)
    request = 2 * 100 * 100 * 3  # two 100 x 100 images: 60,000 bytes, so one request at a time
    bodies = [("POST", "/v1/chat/completions", chat([data_url(png(size=(100, 100), seed=2 * i + j)) for j in range(2)]))
              for i in range(3)]
    bodies.append(("POST", "/generate", native([data_url(png(size=(100, 100), seed=9 + j)) for j in range(2)])))
    started = time.perf_counter()
    responses = call(app, *bodies)
    elapsed = time.perf_counter() - started
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    assert spy.peak_in_use == request and budget.peak == request  # never two requests' images at once
    assert budget.waits >= 1  # they did arrive together: some waited for the budget
    assert budget.in_use == 0 and budget.waiting == 0
    print(f"4 requests, one at a time: {elapsed:.2f} s")


def test_a_request_that_could_never_fit_the_server_budget_is_refused(served, monkeypatch):
    app, budget = served(max_decoded_bytes_total=100_000)
    spy = DecodeSpy(monkeypatch, budget)
    big = [data_url(png(size=(150, 150), seed=i)) for i in range(2)]  # 135,000 bytes: within the per-request budget
    (response,) = call(app, ("POST", "/v1/chat/completions", chat(big)))
    assert response.status_code == 413, response.text
    assert "max_decoded_bytes_total = 100000" in response.json()["error"]["message"]
    assert spy.calls == 0 and budget.in_use == 0 and budget.waiting == 0


def test_the_budget_is_released_after_failures(served, llava, monkeypatch):  # noqa: F811
    app, budget = served(max_decoded_bytes_total=100_000)
    good = data_url(png(size=(100, 100), seed=1))
    truncated = data_url(bomb_png(100, 100))  # a valid header, its pixel data cut short: fails in decoding
    bad_decode = ("POST", "/v1/chat/completions", chat([good, truncated]))
    responses = call(app, bad_decode, bad_decode, ("POST", "/generate", native([truncated])))
    assert [r.status_code for r in responses] == [422, 422, 422], [r.text for r in responses]
    assert "image 2 of 2: cannot decode the PNG image" in responses[0].json()["error"]["message"]
    assert 0 < budget.peak <= 100_000 and budget.in_use == 0 and budget.waiting == 0

    processor = type(llava[3])
    original = processor.__call__

    def failing(self, *args, images=None, **kwargs):
        if images and images[0].size == (100, 100):
            raise ValueError("the processor refuses")
        return original(self, *args, images=images, **kwargs)

    monkeypatch.setattr(processor, "__call__", failing)
    (refused,) = call(app, ("POST", "/v1/chat/completions", chat(good)))
    assert refused.status_code == 400 and "the processor refuses" in refused.text
    assert budget.in_use == 0
    monkeypatch.setattr(processor, "__call__", original)

    ok = call(app, *[("POST", "/v1/chat/completions", chat([good, good]))] * 2)
    assert [r.status_code for r in ok] == [200, 200] and budget.in_use == 0


def test_a_cancelled_request_gives_its_budget_back_waiting_or_decoding(monkeypatch):
    config = MediaConfig(max_decoded_bytes_total=100_000)
    budget = config.decode_budget
    image = data_url(png(size=(100, 100)))  # 30,000 bytes decoded
    decoding = threading.Event()
    finish = threading.Event()
    original = ImageFile.ImageFile.load

    def slow_load(self, *args, **kwargs):
        decoding.set()
        finish.wait(10)
        return original(self, *args, **kwargs)

    async def scenario():
        held = open_images([image, image], config)  # 60,000: the second request (60,000) must wait
        await held.__aenter__()
        waiter = asyncio.create_task(_load(config, [image, image]))
        behind = asyncio.create_task(_load(config, [image]))  # 30,000 would fit, but waits its turn (FIFO)
        while budget.waiting < 2:
            await asyncio.sleep(0.001)
        assert budget.in_use == 60_000 and not behind.done()
        waiter.cancel()  # the client went away while waiting
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert await behind == 1  # the head left: the one behind it went ahead
        assert budget.waiting == 0 and budget.in_use == 60_000
        await held.__aexit__(None, None, None)
        assert budget.in_use == 0

        monkeypatch.setattr(ImageFile.ImageFile, "load", slow_load)
        mid_decode = asyncio.create_task(_load(config, [image]))
        await asyncio.to_thread(decoding.wait, 10)
        mid_decode.cancel()  # cancelled while a thread decodes: the bytes stay reserved until it ends
        with pytest.raises(asyncio.CancelledError):
            await mid_decode
        assert budget.in_use == 30_000
        finish.set()
        while budget.in_use:
            await asyncio.sleep(0.001)

    asyncio.run(asyncio.wait_for(scenario(), 20))
    assert budget.in_use == 0 and budget.waiting == 0


async def _load(config: MediaConfig, urls: list[str]) -> int:
    async with open_images(urls, config) as images:
        return len(images)


def test_budget_is_first_come_first_served_and_checked():
    async def scenario():
        budget = DecodeBudget(10)
        await budget.acquire(6)
        big = asyncio.create_task(budget.acquire(8))
        await asyncio.sleep(0)
        small = asyncio.create_task(budget.acquire(2))  # would fit now, but the 8 came first
        await asyncio.sleep(0)
        assert not big.done() and not small.done() and budget.waiting == 2
        budget.release(6)
        await asyncio.gather(big, small)
        assert budget.in_use == 10 and budget.peak == 10 and budget.waits == 2
        with pytest.raises(ValueError):
            await budget.acquire(11)

    asyncio.run(scenario())


def test_decode_errors_keep_their_type_and_config_checks_the_budgets():
    config = MediaConfig()
    assert config.max_decoded_bytes_per_request == 512 * 1024 * 1024
    assert config.max_decoded_bytes_total == 1024 * 1024 * 1024
    assert config.decode_budget is not MediaConfig().decode_budget  # one per server
    for name in ("max_decoded_bytes_per_request", "max_decoded_bytes_total"):
        with pytest.raises(ValueError, match=name):
            MediaConfig(**{name: 0})

    async def bad():
        async with open_images([data_url(bomb_png(10, 10))], config):
            pass

    with pytest.raises(MediaDecodeError, match="image 1 of 1"):
        asyncio.run(bad())
    assert config.decode_budget.in_use == 0
