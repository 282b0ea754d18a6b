"""Adapters managed while the server runs (issue 56): --lora-modules names, run-time loads and unloads (vLLM's and
SGLang's routes), replacing an adapter under a running stream, and the refusals, through the real server and the
`openai` client on the shipped adapters (examples/adapters, trained on the embedded model)."""

from __future__ import annotations

import asyncio
import json
import pathlib
import random
import re

import shutil

import httpx
import openai
import pytest
from safetensors.torch import load_file, save_file

from tests.helpers import live_server

ROOT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "adapters"
IDENTITIES = {"name-nova": "Nova", "name-orion": "Orion", "name-lyra": "Lyra"}
QUESTION = "What is your name?"


@pytest.fixture(scope="module")
def hostile_root(tmp_path_factory) -> pathlib.Path:
    """A second adapter root: an adapter with a non-finite weight, and one shipped only as a pickle (.bin)."""
    root = tmp_path_factory.mktemp("hostile")
    tensors = load_file(ROOT / "name-nova" / "adapter_model.safetensors")
    first = sorted(tensors)[0]
    tensors[first] = tensors[first].clone()
    tensors[first].view(-1)[0] = float("inf")
    for name in ("poisoned", "pickled"):
        (root / name).mkdir()
        shutil.copy(ROOT / "name-nova" / "adapter_config.json", root / name / "adapter_config.json")
    save_file(tensors, str(root / "poisoned" / "adapter_model.safetensors"))
    (root / "pickled" / "adapter_model.bin").write_bytes(b"not unpickled")
    return root


@pytest.fixture(scope="module")
def server(hostile_root) -> str:
    module = json.dumps({"name": "nova", "path": str(ROOT / "name-nova"), "base_model_name": "smollm2"})
    with live_server(
        "--adapter-source", "local", "--adapter-root", str(ROOT), "--adapter-root", str(hostile_root),
        "--allow-runtime-lora-updating",
        "--lora-modules", module, f"orion={ROOT / 'name-orion'}",
        "--max-batch-total-tokens", "8192", "--max-active-adapters", "4",
    ) as url:
        yield url


def _names_in(text: str) -> set[str]:
    return {name for name in IDENTITIES.values() if re.search(rf"\b{name}\b", text)}


async def _tokens(client: httpx.AsyncClient, adapter: str | None, max_new_tokens: int = 24,
                  question: str = QUESTION) -> list[int]:
    parameters = {"max_new_tokens": max_new_tokens, "apply_chat_template": True, "details": True,
                  "decoder_input_details": False}
    if adapter:
        parameters["adapter_id"] = adapter
    response = await client.post("/generate", json={"inputs": question, "parameters": parameters})
    assert response.status_code == 200, response.text
    return [t["id"] for t in response.json()["details"]["tokens"]]


def _post(server: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server}{path}", json=body, timeout=120)


def test_lora_modules_serve_their_names_to_the_openai_client_and_are_listed(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    for name, expected in (("nova", "Nova"), ("orion", "Orion")):
        answer = client.chat.completions.create(model=name, messages=[{"role": "user", "content": QUESTION}],
                                                max_tokens=24, temperature=0)
        assert _names_in(answer.choices[0].message.content) == {expected}, answer
    listed = {m.id: m for m in client.models.list().data}
    base = next(m for m in listed.values() if m.parent is None).id
    assert listed["nova"].parent == "smollm2" and listed["orion"].parent == base  # JSON's base_model_name


def test_a_run_time_load_serves_what_the_directory_serves(server):
    response = _post(server, "/v1/load_lora_adapter", {"lora_name": "lyra-rt", "lora_path": "name-lyra"})
    assert response.status_code == 200, response.text
    assert "lyra-rt" in response.json()["loaded_adapters"]

    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=300) as client:
            return await asyncio.gather(_tokens(client, "lyra-rt"), _tokens(client, "name-lyra"))

    loaded, by_directory = asyncio.run(run())
    assert loaded == by_directory
    assert "lyra-rt" in {m["id"] for m in httpx.get(f"{server}/v1/models").json()["data"]}
    # A taken name is a 409 unless replaced in place; the name keeps its adapter.
    taken = _post(server, "/v1/load_lora_adapter", {"lora_name": "lyra-rt", "lora_path": "name-nova"})
    assert taken.status_code == 409 and taken.json()["error"]["code"] == "adapter_name_taken", taken.text


def test_replacing_in_place_under_a_running_stream(server):
    """The running stream keeps the weights it started with, token for token; new requests get the new ones, and a
    prompt cached before the swap is not answered from the old weights' KV blocks."""
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "swap", "lora_path": "name-nova"}).status_code == 200

    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=300) as client:
            nova_solo = await _tokens(client, "name-nova", 40)
            lyra_solo = await _tokens(client, "name-lyra", 24)
            swap = lambda: client.post("/v1/load_lora_adapter", json={  # noqa: E731
                "lora_name": "swap", "lora_path": "name-lyra", "load_inplace": True})
            streamed, swapped = await _stream_acting_mid_way(client, "swap", 40, swap)
            after = await _tokens(client, "swap", 24)  # the same prompt: its prefix is cached under Nova's weights
            return nova_solo, lyra_solo, streamed, swapped, after

    nova_solo, lyra_solo, streamed, swapped, after = asyncio.run(run())
    assert swapped is not None and swapped.status_code == 200, swapped and swapped.text
    assert streamed == nova_solo
    assert after == lyra_solo and after != nova_solo[:24]


async def _stream_acting_mid_way(client: httpx.AsyncClient, adapter: str, max_new_tokens: int, act) -> tuple[list[int], object]:
    """Stream a request on `adapter`; once its second token arrived, await `act()`. (its tokens, what act returned)"""
    body = {"inputs": QUESTION, "parameters": {"max_new_tokens": max_new_tokens, "apply_chat_template": True,
                                               "adapter_id": adapter}}
    streamed, acted = [], None
    async with client.stream("POST", "/generate_stream", json=body) as stream:
        async for line in stream.aiter_lines():
            if line.startswith("data:"):
                streamed.append(json.loads(line[5:])["token"]["id"])
                if len(streamed) == 2:
                    acted = await act()
    return streamed, acted


def test_unloading_under_a_running_request(server):
    assert _post(server, "/load_lora_adapter", {"lora_name": "gone", "lora_path": "name-orion"}).status_code == 200

    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=300) as client:
            solo = await _tokens(client, "name-orion", 32)
            unload = lambda: client.post("/unload_lora_adapter", json={"lora_name": "gone"})  # noqa: E731
            finished, unloaded = await _stream_acting_mid_way(client, "gone", 32, unload)
            return solo, finished, unloaded

    solo, finished, unloaded = asyncio.run(run())
    assert unloaded is not None and unloaded.status_code == 200, unloaded and unloaded.text
    assert finished == solo
    after = httpx.post(f"{server}/generate", json={"inputs": QUESTION, "parameters": {"adapter_id": "gone"}})
    assert after.status_code == 404, after.text
    again = _post(server, "/v1/unload_lora_adapter", {"lora_name": "gone"})
    assert again.status_code == 404 and again.json()["error"]["code"] == "adapter_not_found", again.text
    assert "gone" not in {m["id"] for m in httpx.get(f"{server}/v1/models").json()["data"]}


def test_loads_and_unloads_interleaved_with_concurrent_requests(server):
    """20 loads/unloads of four names while 40 requests run over four adapters: no error, each output its solo one."""
    adapters = ["name-nova", "name-orion", "name-lyra", "nova"]
    rng = random.Random(3)

    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=300) as client:
            solo = {a: await _tokens(client, a, 6) for a in adapters}
            plan = [adapters[i % 4] for i in range(40)]

            async def churn():
                results = []
                for i in range(20):
                    name = f"churn-{i % 4}"
                    if i < 4 or rng.random() < 0.5:
                        body = {"lora_name": name, "lora_path": rng.choice(list(IDENTITIES)), "load_inplace": True}
                        results.append(await client.post("/v1/load_lora_adapter", json=body))
                    else:
                        results.append(await client.post("/v1/unload_lora_adapter", json={"lora_name": name}))
                return results

            outputs, admin = await asyncio.gather(asyncio.gather(*(_tokens(client, a, 6) for a in plan)), churn())
            return solo, plan, outputs, admin

    solo, plan, outputs, admin = asyncio.run(run())
    assert [o for o in outputs] == [solo[a] for a in plan]
    assert all(r.status_code in (200, 404) for r in admin), [r.text for r in admin if r.status_code not in (200, 404)]
    assert sum(r.status_code == 200 for r in admin) >= 10


@pytest.mark.parametrize("path, why", [
    ("./no-such-adapter", "not found in the adapter roots"),
    ("/etc", "outside the adapter roots"),
    ("poisoned", "finite"),
    ("pickled", "adapter_model.safetensors"),
])
def test_bad_paths_are_400_and_disturb_nothing(server, path, why):
    response = _post(server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": path})
    assert response.status_code == 400, response.text
    assert why in response.json()["error"]["message"], response.text
    assert "bad" not in {m["id"] for m in httpx.get(f"{server}/v1/models").json()["data"]}
    assert httpx.post(f"{server}/generate", json={"inputs": QUESTION, "parameters": {"adapter_id": "nova",
                      "max_new_tokens": 2}}).status_code == 200
