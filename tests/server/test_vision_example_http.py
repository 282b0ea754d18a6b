"""The example vision models (`loraplex serve --model-id loraplex/smollm2-shapes`, LLaVA-NeXT, and
`loraplex/smollm2-mllama-shapes`, Mllama) over HTTP: each names the colour of held-back pictures (a seed the
training never used) through the OpenAI client with a data URL and through the native API with ![](...), and
the picture is what decides the answer."""

from __future__ import annotations

import asyncio
import base64
import io
import random

import httpx
import pytest

from loraplex.example_models.mllama import EXAMPLE_MLLAMA_MODEL_ID
from loraplex.example_models.vision import EXAMPLE_VISION_MODEL_ID, QUESTIONS, colour_in_answer, make_shape_image
from tests.helpers import live_server

HELD_BACK_SEED = 987_654  # training and its evaluation use other seeds
PICTURES = 20


def data_url(image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module", params=[EXAMPLE_VISION_MODEL_ID, EXAMPLE_MLLAMA_MODEL_ID])
def server(request):
    with live_server("--model-id", request.param, "--max-batch-total-tokens", "16384") as url:
        yield url, request.param


@pytest.fixture(scope="module")
def pictures():
    rng = random.Random(HELD_BACK_SEED)
    return [make_shape_image(rng) for _ in range(PICTURES)]


def test_names_the_colour_of_held_back_pictures_on_both_apis(server, pictures):
    from openai import AsyncOpenAI

    server, _ = server
    client = AsyncOpenAI(base_url=f"{server}/v1", api_key="-", timeout=300)

    async def ask_openai(picture, i):
        reply = await client.chat.completions.create(model="", max_tokens=12, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(picture.image)}},
                                         {"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]}]}])
        return reply.choices[0].message.content

    async def ask_native(http, picture, i):
        body = {"inputs": f"![]({data_url(picture.image)}){QUESTIONS[i % len(QUESTIONS)]}",
                "parameters": {"max_new_tokens": 12, "apply_chat_template": True}}
        response = await http.post("/generate", json=body)
        assert response.status_code == 200, response.text
        return response.json()["generated_text"]

    async def main():
        async with httpx.AsyncClient(base_url=server, timeout=300) as http:
            return await asyncio.gather(
                asyncio.gather(*(ask_openai(p, i) for i, p in enumerate(pictures))),
                asyncio.gather(*(ask_native(http, p, i) for i, p in enumerate(pictures))),
            )

    openai_answers, native_answers = asyncio.run(main())
    for answers in (openai_answers, native_answers):
        right = sum(colour_in_answer(a) == p.colour for a, p in zip(answers, pictures))
        assert right >= 0.9 * len(pictures), list(zip(answers, [p.colour for p in pictures]))
    # The picture decides: the answers name more than a couple of different colours.
    assert len({colour_in_answer(a) for a in openai_answers}) >= 4


def test_info_says_it_takes_images(server):
    server, model_id = server
    info = httpx.get(f"{server}/info", timeout=30).json()
    assert info["model_id"] == model_id and info["input_modalities"] == ["text", "image"]
