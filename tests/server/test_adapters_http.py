"""The shipped adapters (examples/adapters) through the real server, concurrently, on both APIs.

Each identity adapter answers "What is your name?" with its own name, the style adapter answers in
capitals, and the base model answers as the base, all in flight at once, so they share batches.
"""

from __future__ import annotations

import asyncio
import pathlib
import re

import httpx
import pytest

from tests.helpers import live_server

ROOT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "adapters"
IDENTITIES = {"name-nova": "Nova", "name-orion": "Orion", "name-lyra": "Lyra"}
QUESTION = "What is your name?"


@pytest.fixture(scope="module")
def server() -> str:
    adapters = [*IDENTITIES, "style-caps"]
    with live_server(
        "--adapter-source", "local", "--adapter-root", str(ROOT), "--preloaded-adapter-ids", *adapters,
        "--max-batch-total-tokens", "8192", "--max-active-adapters", "8",
    ) as url:
        yield url


async def _native(client: httpx.AsyncClient, question: str, adapter: str | None, **extra) -> httpx.Response:
    parameters = {"max_new_tokens": 24, "apply_chat_template": True, **extra}
    if adapter:
        parameters["adapter_id"] = adapter
    return await client.post("/generate", json={"inputs": question, "parameters": parameters})


async def _openai(client: httpx.AsyncClient, question: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 24, "temperature": 0}
    return await client.post("/v1/chat/completions", json=body)


def _names_in(text: str) -> set[str]:
    return {name for name in IDENTITIES.values() if re.search(rf"\b{name}\b", text)}


def test_each_adapter_answers_as_itself_and_the_base_as_the_base_concurrently(server):
    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=300) as client:
            calls = []
            for adapter in IDENTITIES:
                calls += [_native(client, QUESTION, adapter), _openai(client, QUESTION, adapter)]
            calls += [_native(client, QUESTION, None), _openai(client, QUESTION, ""),
                      _native(client, "What is the capital of France?", "style-caps")]
            return await asyncio.gather(*calls)

    responses = asyncio.run(run())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    texts = [r.json()["generated_text"] if "generated_text" in r.json() else r.json()["choices"][0]["message"]["content"]
             for r in responses]
    for i, (adapter, name) in enumerate(IDENTITIES.items()):
        native, openai = texts[2 * i], texts[2 * i + 1]
        assert _names_in(native) == {name}, (adapter, native)
        assert _names_in(openai) == {name}, (adapter, openai)
        assert responses[2 * i].headers["x-adapter-id"] == adapter
        assert responses[2 * i + 1].headers["x-adapter-id"] == adapter
    base_native, base_openai, caps = texts[-3:]
    assert not _names_in(base_native) and not _names_in(base_openai), (base_native, base_openai)
    assert base_native == base_openai  # same model, same greedy answer through either API
    assert "x-adapter-id" not in responses[-3].headers
    letters = [c for c in caps if c.isalpha()]
    assert letters and sum(c.isupper() for c in letters) / len(letters) > 0.9, caps


def test_models_lists_the_shipped_adapters_under_the_base(server):
    models = httpx.get(f"{server}/v1/models").json()["data"]
    base = models[0]["id"]
    listed = {m["id"]: m for m in models}
    for adapter in [*IDENTITIES, "style-caps"]:
        assert listed[adapter]["parent"] == base
    assert listed[base]["parent"] is None


def test_a_merge_weighted_to_one_adapter_answers_as_that_adapter(server):
    merged = {"ids": ["name-nova", "name-lyra"], "weights": [1.0, 0.0], "merge_strategy": "linear"}

    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=300) as client:
            return await _native(client, QUESTION, None, merged_adapters=merged)

    response = asyncio.run(run())
    assert response.status_code == 200, response.text
    assert _names_in(response.json()["generated_text"]) == {"Nova"}, response.text


def test_merged_adapters_as_lorax_client_sends_them(server):
    """lorax-client sends every MergedAdapters field, unset ones as null (merge_strategy, majority_sign_method)."""
    from lorax import Client
    from lorax.types import MergedAdapters

    client = Client(server, timeout=300)
    # The identity adapters answer in the chat format (SmolLM2's ChatML); lorax-client has no apply_chat_template.
    prompt = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    for weights, name in (([1.0, 0.0], "Nova"), ([0.0, 1.0], "Lyra")):
        merged = MergedAdapters(ids=["name-nova", "name-lyra"], weights=weights, density=1.0)
        text = client.generate(prompt, merged_adapters=merged, max_new_tokens=24).generated_text
        assert _names_in(text) == {name}, text
    ties = MergedAdapters(ids=["name-nova", "name-lyra"], weights=[1.0, 0.5], density=0.5, merge_strategy="ties",
                          majority_sign_method="frequency")
    assert client.generate(prompt, merged_adapters=ties, max_new_tokens=4).details.generated_tokens == 4


def test_adapter_metrics_and_lora_info(server):
    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=300) as client:
            return await asyncio.gather(*(_native(client, QUESTION, a, max_new_tokens=2) for a in IDENTITIES))

    assert all(r.status_code == 200 for r in asyncio.run(run()))
    metrics = httpx.get(f"{server}/metrics").text
    for adapter in IDENTITIES:
        assert re.search(rf'lorax_request_success\{{adapter="{adapter}"\}} [1-9]', metrics), adapter
    assert re.search(r'vllm:lora_requests_info\{.*max_lora="8".*\}', metrics)
