"""Images over HTTP on a tiny LLaVA-NeXT (in process): OpenAI image_url parts and native ![](URL) answer
what transformers answers on the same inputs; /tokenize shows the placeholders; every refusal has its
status and message while other requests keep succeeding; a text-only model refuses images."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from loraplex.config import EngineConfig, ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.engine.loading import LoadedModel
from loraplex.multimodal import MediaConfig
from loraplex.server.app import create_app
from loraplex.tokenizer import Tokenizer
from tests.models.test_llava_next_parity import IMAGE_TOKEN, processor, saved, tiny_llava
from tests.multimodal.images import bomb_png
from tests.multimodal.servers import start, stop

NEW = 5
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:{% if m['content'] is string %} {{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %} <image>{% else %} {{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %} w0 {% endfor %}{% if add_generation_prompt %}w1{% endif %}"
)


def png(size=(40, 24), seed=0) -> bytes:
    pixels = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, kind="image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    hf = tiny_llava(seed=0)
    ours, config = saved(hf, tmp_path_factory.mktemp("llava"))
    proc = processor()
    proc.chat_template = TEMPLATE
    return hf, ours, config, proc


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "a.png").write_bytes(png(seed=3))
    (root / "secret.png").write_bytes(png(seed=4))
    (root / "allowed" / "escape.png").symlink_to(root / "secret.png")
    (root / "allowed" / "notes.txt").write_text("not an image")
    return root


@pytest.fixture(scope="module")
def image_server():
    server = start()
    yield server
    stop(server)


def make_app(llava, media: MediaConfig):
    hf, ours, config, proc = llava
    loaded = LoadedModel(ours, config, Tokenizer(proc.tokenizer), torch.device("cpu"), torch.float32, "tiny-llava", proc)
    engine = AsyncEngine(Engine(loaded, EngineConfig(device="cpu", max_batch_total_tokens=2048)))
    return create_app(engine, ServerConfig(media=media)), engine


@pytest.fixture(scope="module")
def app(llava, media_dir, image_server):
    media = MediaConfig(allowed_local_media_path=str(media_dir / "allowed"), max_images_per_request=2,
                        max_image_bytes=200_000, max_image_pixels=256 * 256)
    app, engine = make_app(llava, media)
    yield app
    engine.shutdown()


def call(app, *requests):
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120) as c:
            return await asyncio.gather(*(c.request(method, path, json=body) for method, path, body in requests))

    return asyncio.run(main())


def chat(url: str | list[str], text="w5 w6") -> dict:
    urls = [url] if isinstance(url, str) else url
    parts = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"model": "", "messages": [{"role": "user", "content": parts}], "max_tokens": NEW, "temperature": 0,
            "ignore_eos": True}


@torch.inference_mode()
def transformers_answer(llava, prompt: str, images: list[bytes]) -> list[int]:
    hf, _, _, proc = llava
    inputs = proc(text=prompt, images=[Image.open(io.BytesIO(b)).convert("RGB") for b in images], return_tensors="pt",
                  add_special_tokens=False)
    out = hf.generate(**inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def tokens_of(llava, text: str) -> list[int]:
    return llava[3].tokenizer(text, add_special_tokens=False)["input_ids"]


def test_openai_and_native_images_answer_as_transformers(app, llava):
    image = png(seed=1)
    want = transformers_answer(llava, "user: w5 w6 <image> w0 w1", [image])
    native_body = {"inputs": f"w5 w6 ![]({data_url(image)}) w7", "parameters": {"max_new_tokens": NEW,
                   "ignore_eos_token": True, "details": True}}
    openai, native, other = call(
        app, ("POST", "/v1/chat/completions", chat(data_url(image))), ("POST", "/generate", native_body),
        ("POST", "/v1/chat/completions", chat(data_url(png(seed=2)))),
    )
    assert openai.status_code == 200, openai.text
    assert tokens_of(llava, openai.json()["choices"][0]["message"]["content"]) == want
    assert openai.json()["usage"]["prompt_tokens"] > 40  # the image's placeholder tokens count
    assert native.status_code == 200, native.text
    assert [t["id"] for t in native.json()["details"]["tokens"]] == transformers_answer(llava, "w5 w6 <image> w7", [image])
    assert other.json()["choices"][0]["message"]["content"] != openai.json()["choices"][0]["message"]["content"]


def test_tokenize_shows_the_image_tokens(app, llava):
    (response,) = call(app, ("POST", "/tokenize", {"inputs": f"w5 ![]({data_url(png(seed=1))})"}))
    ids = [t["id"] for t in response.json()]
    assert ids[0] == 5 and ids.count(IMAGE_TOKEN) == len(ids) - 1 > 40


def test_info_and_models_say_the_model_takes_images(app):
    info, models = call(app, ("GET", "/info", None), ("GET", "/v1/models", None))
    assert info.json()["input_modalities"] == ["text", "image"]
    assert models.json()["data"][0]["input_modalities"] == ["text", "image"]


def test_refusals_name_the_limit_while_other_requests_succeed(app, media_dir, image_server):
    good = ("POST", "/v1/chat/completions", chat(data_url(png(seed=1))))
    refusals = {
        "max_images_per_request": (chat([data_url(png())] * 3), 413),
        "max_image_pixels": (chat(data_url(bomb_png(1000, 1000))), 413),  # ~100 bytes, 1 MP declared
        "bomb": (chat(data_url(bomb_png(20000, 20000))), 413),
        "max_image_bytes": (chat(data_url(png(size=(256, 256)) + b"\0" * 200_000)), 413),
        "base64": (chat("data:image/png;base64,@@@not-base64@@@"), 400),
        "not an image": (chat(f"file://{media_dir / 'allowed' / 'notes.txt'}"), 415),
        "outside": (chat(str(media_dir / "secret.png")), 400),
        "symlink": (chat(f"file://{media_dir / 'allowed' / 'escape.png'}"), 400),
        "not listed": (chat("http://images.example.com/a.png"), 400),
        "loopback": (chat(image_server.url("/green.png")), 400),
    }
    responses = call(app, good, *(("POST", "/v1/chat/completions", body) for body, _ in refusals.values()), good)
    assert responses[0].status_code == 200 and responses[-1].status_code == 200
    for (name, (_, status)), response in zip(refusals.items(), responses[1:-1]):
        assert response.status_code == status, (name, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], name
    messages = [r.json()["error"]["message"] for r in responses[1:-1]]
    assert messages[0] == "request has 3 images; the limit is max_images_per_request = 2"
    assert "1000000 pixels" in messages[1].replace(",", "") and "max_image_pixels = 65536" in messages[1].replace(",", "")
    assert "max_image_pixels" in messages[2] and "max_image_bytes = 200000" in messages[3]
    assert "outside allowed_local_media_path" in messages[6] and "outside allowed_local_media_path" in messages[7]
    (allowed,) = call(app, ("POST", "/v1/chat/completions", chat(f"file://{media_dir / 'allowed' / 'a.png'}")))
    assert allowed.status_code == 200, allowed.text


def test_a_listed_local_http_host_is_served(llava, image_server):
    app, engine = make_app(llava, MediaConfig(allowed_media_domains=("127.0.0.1",)))
    try:
        (response,) = call(app, ("POST", "/v1/chat/completions", chat(image_server.url("/green.png"))))
        assert response.status_code == 200, response.text
    finally:
        engine.shutdown()


def test_a_text_only_model_refuses_images(make_engine):
    engine = AsyncEngine(make_engine(max_batch_total_tokens=512))
    app = create_app(engine)
    try:
        openai, native = call(
            app, ("POST", "/v1/chat/completions", chat(data_url(png()))),
            ("POST", "/generate", {"inputs": f"Hi ![]({data_url(png())})", "parameters": {"max_new_tokens": 2}}),
        )
    finally:
        engine.shutdown()
    assert openai.status_code == 400 and "does not take images" in openai.json()["error"]["message"]
    assert native.status_code == 422 and "does not take images" in native.json()["error"]
