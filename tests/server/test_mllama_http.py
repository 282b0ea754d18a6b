"""Mllama over HTTP on a tiny random checkpoint (in process): OpenAI image_url parts and native ![](URL) answer
what transformers answers on the same inputs; prompt details and logprobs work with the image token in the
prompt; /tokenize shows one image token per image; a mismatch of images and image tokens is a 422 (LoRAX's
validation status)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from loraplex.config import EngineConfig, ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.engine.loading import load_model
from loraplex.server.app import create_app
from tests.mllama_fixtures import IMAGE_TOKEN, PAD, meta_row_masking, mllama_processor, save_tiny_mllama, tiny_mllama
from tests.server.test_images_http import call

NEW = 5


def png(size=(60, 30), seed=0) -> bytes:
    pixels = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    hf, processor = tiny_mllama(seed=0), mllama_processor()
    path = save_tiny_mllama(hf, processor, tmp_path_factory.mktemp("mllama"))
    config = EngineConfig(model_id=str(path), device="cpu", max_batch_total_tokens=1024)
    engine = AsyncEngine(Engine(load_model(config), config))
    yield hf, processor, create_app(engine, ServerConfig())
    engine.shutdown()


@torch.inference_mode()
def transformers_answer(hf, processor, prompt: str, images: list[bytes], add_special_tokens: bool) -> list[int]:
    pictures = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = processor(text=prompt, images=[pictures], return_tensors="pt", add_special_tokens=add_special_tokens)
    with meta_row_masking(hf):
        out = hf.generate(**inputs, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=PAD)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def chat(urls: list[str], text="w5 w6") -> dict:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
    return {"model": "", "messages": [{"role": "user", "content": parts}], "max_tokens": NEW, "temperature": 0,
            "ignore_eos": True, "logprobs": True}


def test_openai_and_native_images_answer_as_transformers(served):
    hf, processor, app = served
    image, other = png(seed=1), png(size=(30, 60), seed=2)
    template = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "w5 w6"}]}]
    prompt = processor.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    native_body = {"inputs": f"w5 w6 ![]({data_url(image)}) w7", "parameters": {
        "max_new_tokens": NEW, "ignore_eos_token": True, "details": True, "decoder_input_details": True,
        "repetition_penalty": 1.3, "top_n_tokens": 2}}
    openai, native, openai_other = call(
        app, ("POST", "/v1/chat/completions", chat([data_url(image)])), ("POST", "/generate", native_body),
        ("POST", "/v1/chat/completions", chat([data_url(other)])),
    )
    assert openai.status_code == 200, openai.text
    got = [processor.tokenizer.convert_tokens_to_ids(t["token"]) for t in openai.json()["choices"][0]["logprobs"]["content"]]
    assert got == transformers_answer(hf, processor, prompt, [image], add_special_tokens=False)
    assert openai_other.json()["choices"][0]["message"]["content"] != openai.json()["choices"][0]["message"]["content"]
    assert native.status_code == 200, native.text
    details = native.json()["details"]
    assert [t["id"] for t in details["tokens"]] == transformers_answer_with_penalty(hf, processor, image)
    prefill = details["prefill"]
    image_at = [t["id"] for t in prefill].index(IMAGE_TOKEN)
    assert prefill[image_at]["logprob"] is None and prefill[image_at]["text"] == "<|image|>"
    assert all(t["logprob"] is not None for i, t in enumerate(prefill) if i not in (0, image_at))


@torch.inference_mode()
def transformers_answer_with_penalty(hf, processor, image: bytes) -> list[int]:
    inputs = processor(text="w5 w6 <|image|> w7", images=[[Image.open(io.BytesIO(image)).convert("RGB")]], return_tensors="pt")
    with meta_row_masking(hf):
        out = hf.generate(**inputs, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=PAD, repetition_penalty=1.3)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_tokenize_shows_one_image_token_per_image(served):
    _, _, app = served
    (response,) = call(app, ("POST", "/tokenize", {"inputs": f"w5 ![]({data_url(png(seed=1))}) ![]({data_url(png(seed=2))})"}))
    assert response.status_code == 200, response.text
    assert [t["id"] for t in response.json()].count(IMAGE_TOKEN) == 2


def test_images_without_their_tokens_are_refused_while_others_succeed(served):
    _, _, app = served
    body = {"inputs": "w5 <|image|> <|image|> w6 ![](" + data_url(png(seed=1)) + ")", "parameters": {"max_new_tokens": 2}}
    no_image = {"inputs": "w5 <|image|> w6", "parameters": {"max_new_tokens": 2}}
    bad, unaccompanied, good, info = call(
        app, ("POST", "/generate", body), ("POST", "/generate", no_image),
        ("POST", "/v1/chat/completions", chat([data_url(png(seed=3))])), ("GET", "/info", None),
    )
    assert bad.status_code == 422 and "3 <|image|> tokens and 1 images" in bad.json()["error"], bad.text
    assert unaccompanied.status_code == 422 and "no images" in unaccompanied.json()["error"], unaccompanied.text
    assert good.status_code == 200, good.text
    assert info.json()["model_type"] == "mllama" and info.json()["input_modalities"] == ["text", "image"]
