"""Embeddings pooled as the checkpoint says (checkpoints/pooling_config.py: sentence-transformers' modules.json,
1_Pooling/config.json, Normalize, the default prompt) or as --pooling says, against the same arithmetic in
transformers on the same weights (sentence-transformers itself is not installed here)."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch
from fastapi.testclient import TestClient

from loraplex.checkpoints.pooling_config import EmbeddingPooling, read_pooling
from loraplex.config import EngineConfig, ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.engine.loading import load_model
from loraplex.params import Pooling
from loraplex.server.app import create_app

TEXT = "Embeddings map text to vectors."
TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def sentence_transformers_dir(root: pathlib.Path, modes: dict, normalize: bool = True, prompt: str = "",
                              include_prompt: bool = True, weights: pathlib.Path | None = None) -> pathlib.Path:
    """A checkpoint directory with sentence-transformers' files (the weights linked from `weights` when given)."""
    root.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(weights) if weights else ():
        os.symlink(weights / name, root / name)
    pooling = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    (root / "modules.json").write_text(json.dumps([TRANSFORMER, pooling, *([NORMALIZE] if normalize else [])]))
    (root / "1_Pooling").mkdir()
    (root / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 576,
                                                                 "include_prompt": include_prompt, **modes}))
    if prompt:
        (root / "config_sentence_transformers.json").write_text(
            json.dumps({"prompts": {"query": prompt, "document": ""}, "default_prompt_name": "query"}))
    return root


@pytest.mark.parametrize("modes,normalize,expected", [
    ({"pooling_mode_mean_tokens": True}, True, Pooling("mean", True)),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, False, Pooling("first", False)),
    ({"pooling_mode_lasttoken": True}, True, Pooling("last", True)),
    ({"pooling_mode_max_tokens": True}, False, Pooling("max", False)),
])
def test_the_checkpoint_names_its_pooling(tmp_path, modes, normalize, expected):
    read = read_pooling(sentence_transformers_dir(tmp_path / "m", modes, normalize, prompt="query: "))
    assert read.pooling == expected and read.prompt == "query: " and read.refusal is None


@pytest.mark.parametrize("modes,include_prompt,why", [
    ({"pooling_mode_weightedmean_tokens": True}, True, "weightedmean"),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}, True, "mean_tokens"),
    ({"pooling_mode_mean_tokens": True}, False, "include_prompt"),
])
def test_what_cannot_be_computed_exactly_is_a_refusal(tmp_path, modes, include_prompt, why):
    read = read_pooling(sentence_transformers_dir(tmp_path / "m", modes, prompt="query: ", include_prompt=include_prompt))
    assert why in read.refusal


def test_without_the_files_the_default_is_the_last_token_normalised(tmp_path):
    assert read_pooling(tmp_path) == EmbeddingPooling() and EmbeddingPooling().pooling == Pooling("last", True)


@torch.inference_mode()
def reference(model, tokenizer, text: str, method: str, normalize: bool) -> torch.Tensor:
    hidden = model.model(torch.tensor([tokenizer(text)["input_ids"]])).last_hidden_state[0].float()
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "first": hidden[0], "max": hidden.amax(0)}[method]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


@pytest.fixture(scope="module")
def st_checkpoint(tmp_path_factory, embedded):
    from loraplex.checkpoints.sources import resolve_model

    root = tmp_path_factory.mktemp("st") / "model"
    return sentence_transformers_dir(root, {"pooling_mode_mean_tokens": True}, True, prompt="query: ",
                                     weights=resolve_model(None).path)


def embed(loaded, text: str, **server) -> tuple[int, dict]:
    status, body, _ = embed_and_info(loaded, text, **server)
    return status, body


def embed_and_info(loaded, text: str, **server) -> tuple[int, dict, dict]:
    """The embedding answer, and /info's `embeddings` (the pooling the routes use)."""
    engine = AsyncEngine(Engine(loaded, EngineConfig(device="cpu", max_batch_total_tokens=2048)))
    try:
        with TestClient(create_app(engine, ServerConfig(**server))) as client:
            response = client.post("/v1/embeddings", json={"input": text})
            info = client.get("/info").json()["embeddings"]
    finally:
        engine.shutdown()
    return response.status_code, response.json(), info


def test_a_sentence_transformers_checkpoint_embeds_as_it_says(st_checkpoint, embedded_hf):
    from transformers import AutoTokenizer

    loaded = load_model(EngineConfig(model_id=str(st_checkpoint), device="cpu"))
    assert loaded.pooling.pooling == Pooling("mean", True) and loaded.pooling.prompt == "query: "
    tokenizer = AutoTokenizer.from_pretrained(st_checkpoint)
    status, body, info = embed_and_info(loaded, TEXT)
    assert info == {"pooling": "mean", "normalize": True, "prompt": "query: ", "refused": None,
                    "from": "the checkpoint's sentence-transformers configuration"}
    want = reference(embedded_hf, tokenizer, "query: " + TEXT, "mean", True)  # the prompt goes first
    got = torch.tensor(body["data"][0]["embedding"])
    assert status == 200 and torch.nn.functional.cosine_similarity(got, want, dim=0) >= 0.99999
    assert body["usage"]["prompt_tokens"] == len(tokenizer("query: " + TEXT)["input_ids"])
    status, body = embed(loaded, TEXT, pooling="max")  # --pooling wins; the checkpoint's Normalize stays
    want = reference(embedded_hf, tokenizer, "query: " + TEXT, "max", True)
    got = torch.tensor(body["data"][0]["embedding"])
    assert status == 200 and torch.nn.functional.cosine_similarity(got, want, dim=0) >= 0.99999


def test_a_pooling_the_server_cannot_compute_is_refused_until_pooling_is_given(embedded):
    import dataclasses

    refusing = dataclasses.replace(embedded, pooling=EmbeddingPooling(refusal="its pooling (weightedmean) is not served"))
    status, body, info = embed_and_info(refusing, TEXT)
    assert status == 400 and "weightedmean" in body["error"]["message"] and "--pooling" in body["error"]["message"]
    assert "weightedmean" in info["refused"]
    status, _ = embed(refusing, TEXT, pooling="cls")
    assert status == 200
