"""OpenAI's /v1/embeddings (through the `openai` client) and LoRAX's /embed on a live server: the embedded model and a
shipped adapter, against transformers (and PEFT) pooling the same weights: the last token's final hidden state,
L2-normalised."""

from __future__ import annotations

import base64
import pathlib
import struct

import httpx
import openai
import pytest
import torch

from tests.helpers import live_server

ROOT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "adapters"
TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors, one per input."]


@pytest.fixture(scope="module")
def server() -> str:
    with live_server("--adapter-source", "local", "--adapter-root", str(ROOT), "--max-batch-total-tokens", "8192",
                     "--max-concurrent-requests", "16") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="-")


@torch.inference_mode()
def reference(model, tokenizer, text: str) -> torch.Tensor:
    ids = tokenizer(text)["input_ids"]  # special tokens added, as the route adds them
    hidden = model.model(torch.tensor([ids])).last_hidden_state[0, -1].float()
    return torch.nn.functional.normalize(hidden, dim=0)


@pytest.fixture(scope="module")
def hf_tokenizer(embedded_hf):
    from transformers import AutoTokenizer

    from loraplex.checkpoints.sources import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(None).path)


def cosine(vector, want: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(vector), want, dim=0).item()


def test_the_base_model_embeds_as_transformers(client, embedded_hf, hf_tokenizer):
    response = client.embeddings.create(model="", input=TEXTS)
    assert [d.index for d in response.data] == [0, 1]
    for text, data in zip(TEXTS, response.data):
        assert cosine(data.embedding, reference(embedded_hf, hf_tokenizer, text)) >= 0.99999
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(len(hf_tokenizer(t)["input_ids"])
                                                                              for t in TEXTS)


def test_an_adapter_embeds_as_peft(client, embedded_hf, hf_tokenizer):
    import copy

    import peft

    tuned = peft.PeftModel.from_pretrained(copy.deepcopy(embedded_hf), str(ROOT / "name-nova")).eval()
    response = client.embeddings.create(model="name-nova", input=TEXTS[0])
    want = reference(tuned.base_model.model, hf_tokenizer, TEXTS[0])
    assert cosine(response.data[0].embedding, want) >= 0.99999
    base = client.embeddings.create(model="", input=TEXTS[0]).data[0].embedding
    assert cosine(base, want) < 0.9999  # the adapter moved the vector: the comparison means something


def test_token_ids_dimensions_and_base64(client, hf_tokenizer):
    ids = hf_tokenizer(TEXTS[0])["input_ids"]
    whole = client.embeddings.create(model="", input=TEXTS[0]).data[0].embedding
    by_ids = client.embeddings.create(model="", input=[ids, ids[:5]]).data
    assert cosine(by_ids[0].embedding, torch.tensor(whole)) >= 0.99999 and len(by_ids) == 2
    short = client.embeddings.create(model="", input=TEXTS[0], dimensions=64).data[0].embedding
    head = torch.nn.functional.normalize(torch.tensor(whole[:64]), dim=0)  # the first 64, normalised again
    assert len(short) == 64 and cosine(short, head) >= 0.99999
    raw = httpx.post(str(client.base_url) + "embeddings",
                     json={"input": TEXTS[0], "encoding_format": "base64"}).json()["data"][0]["embedding"]
    decoded = struct.unpack(f"<{len(whole)}f", base64.b64decode(raw))
    assert torch.allclose(torch.tensor(decoded), torch.tensor(whole), atol=1e-6)


def test_embeddings_are_counted_apart_by_route(server):
    from prometheus_client.parser import text_string_to_metric_families

    def counted() -> dict:
        text = httpx.get(server + "/metrics").text
        return {(s.name, s.labels.get("route")): s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.name.startswith("loraplex_embedding_") and s.name.endswith("_total")}

    before = counted()
    assert httpx.post(server + "/v1/embeddings", json={"input": [[5, 6, 7], [8, 9]]}).status_code == 200
    assert httpx.post(server + "/embed", json={"inputs": "Hi"}).status_code == 200
    after = counted()
    gained = {key: after[key] - before.get(key, 0) for key in after}
    assert gained[("loraplex_embedding_inputs_total", "/v1/embeddings")] == 2
    assert gained[("loraplex_embedding_tokens_total", "/v1/embeddings")] == 5
    assert gained[("loraplex_embedding_inputs_total", "/embed")] == 1


def test_lorax_embed(server, client):
    body = {"inputs": TEXTS[1], "parameters": {"adapter_id": "name-nova"}}
    answer = httpx.post(server + "/embed", json=body, timeout=60)
    assert answer.status_code == 200 and answer.headers["x-adapter-id"] == "name-nova"
    expected = client.embeddings.create(model="name-nova", input=TEXTS[1]).data[0].embedding
    assert cosine(answer.json()["embeddings"], torch.tensor(expected)) >= 0.99999


@pytest.mark.parametrize("body,field", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [10**9]}, "input"),
    ({"input": "word " * 200_000}, "input"),
    ({"input": "hi", "dimensions": 100_000}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_inputs_are_refused_naming_the_field(server, body, field):
    response = httpx.post(server + "/v1/embeddings", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert field in (error.get("param") or "") + error["message"], error


def test_lorax_embed_refusals_take_the_native_shape(server):
    for body in ({"inputs": ""}, {"inputs": "hi", "parameters": {"adapter_id": "no-such-adapter"}}):
        response = httpx.post(server + "/embed", json=body, timeout=60)
        assert response.status_code in (404, 422) and "error_type" in response.json(), response.text
