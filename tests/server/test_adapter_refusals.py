"""Adapters through HTTP on the real `loraplex serve`: a valid local adapter serves; broken ones, ones
outside the adapter root and unknown ids are refused in each API's error shape (404 not found; 422 native
/ 400 OpenAI invalid), naming the problem; and the server keeps serving while they are refused.

Hostile tenants' adapters (copies of the shipped name-nova with one tensor or config field changed: NaN,
inf, huge values, a catastrophic regex) are refused the same way, quickly, and change no other request."""

from __future__ import annotations

import asyncio
import json
import math
import pathlib
import re
import shutil
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import live_server

# SmolLM2-135M (the embedded model): hidden 576, 30 layers, 3 kv heads x head_dim 64.
HIDDEN, KV, LAYERS = 576, 192, 30
PREFIX = "base_model.model.model.layers"
TIMEOUT = 120


def write_adapter(path: pathlib.Path, r: int = 8, config: dict | None = None, tensors: dict | None = None, seed: int = 0):
    """A PEFT LoRA directory on q_proj / v_proj of every layer, small random values."""
    path.mkdir(parents=True)
    raw = {"peft_type": "LORA", "r": r, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "bias": "none",
           "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    (path / "adapter_config.json").write_text(json.dumps({**raw, **(config or {})}))
    if tensors is None:
        g = torch.Generator().manual_seed(seed)
        tensors = {}
        for i in range(LAYERS):
            for module, out in (("q_proj", HIDDEN), ("v_proj", KV)):
                tensors[f"{PREFIX}.{i}.self_attn.{module}.lora_A.weight"] = torch.randn(r, HIDDEN, generator=g) * 0.02
                tensors[f"{PREFIX}.{i}.self_attn.{module}.lora_B.weight"] = torch.randn(out, r, generator=g) * 0.02
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


WRONG_TENSOR = f"{PREFIX}.3.self_attn.v_proj.lora_B.weight"
SHIPPED_ROOT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "adapters"
SHIPPED = ("name-nova", "name-orion", "name-lyra", "style-caps")
POISONED_TENSOR = f"{PREFIX}.5.self_attn.k_proj.lora_B.weight"  # a tensor of name-nova
POISONED_A = f"{PREFIX}.5.self_attn.k_proj.lora_A.weight"
# Copies of name-nova with one tensor (name -> (tensor, value)) or config field changed.
HOSTILE_TENSORS = {
    "nan-b": (POISONED_TENSOR, math.nan), "inf-a": (POISONED_A, math.inf), "neg-inf-b": (POISONED_TENSOR, -math.inf),
    "huge-b": (POISONED_TENSOR, 2e3),
}
HOSTILE_CONFIGS = {
    "nan-alpha": {"lora_alpha": math.nan}, "huge-alpha": {"lora_alpha": 1e300}, "string-alpha": {"lora_alpha": "x"},
    "regex": {"target_modules": "mode(.|.)*Z"}, "regex-lookahead": {"target_modules": "(?=m)mode(.|.)*Z"},
}

# adapter id -> (what the native error message must contain, ...); every one is invalid (422 / 400).
INVALID = {
    "pickled": ("adapter_model.bin", "pickle"),
    "corrupt": ("not a valid safetensors file",),
    "rank128": ("r = 128", "maximum LoRA rank 64"),
    "wrong-shape": (WRONG_TENSOR, "expected [192, 8]"),
    "dora": ("DoRA", "use_dora"),
    "escape": ("outside the adapter roots",),
    "../outside/good": ("outside the adapter roots",),
    "nan-b": (POISONED_TENSOR, "NaN or infinite"),
    "inf-a": (POISONED_A, "NaN or infinite"),
    "neg-inf-b": (POISONED_TENSOR, "NaN or infinite"),
    "huge-b": (POISONED_TENSOR, "beyond the bound 1000"),
    "nan-alpha": ("lora_alpha must be finite",),
    "huge-alpha": ("lora_alpha", "beyond the bound 1000"),
    "string-alpha": ("lora_alpha must be a number",),
    "regex": ("not in the config's target_modules",),
    "regex-lookahead": ("target_modules: the regex", "took more than"),
}
NOT_FOUND = ("no-such-adapter", "team/missing")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> pathlib.Path:
    base = tmp_path_factory.mktemp("adapters")
    root = base / "root"
    root.mkdir()
    write_adapter(root / "good")
    write_adapter(base / "outside" / "good", seed=1)  # valid, but not under the root

    pickled = root / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]}))
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04\x95 not to be unpickled")

    corrupt = write_adapter(root / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")

    big = {f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.zeros(128, HIDDEN),
           f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": torch.zeros(HIDDEN, 128)}
    write_adapter(root / "rank128", r=128, config={"target_modules": ["q_proj"], "layers_to_transform": [0]}, tensors=big)

    wrong = root / "wrong-shape"
    write_adapter(wrong)

    tensors = load_file(str(wrong / "adapter_model.safetensors"))
    tensors[WRONG_TENSOR] = torch.zeros(HIDDEN, 8)  # v_proj's output is 192 wide, not 576
    save_file(tensors, str(wrong / "adapter_model.safetensors"))

    write_adapter(root / "dora", config={"use_dora": True})
    (root / "escape").symlink_to(base / "outside" / "good", target_is_directory=True)

    for name in SHIPPED:
        shutil.copytree(SHIPPED_ROOT / name, root / name)
    nova = json.loads((SHIPPED_ROOT / "name-nova" / "adapter_config.json").read_text())
    for name, (key, value) in HOSTILE_TENSORS.items():
        tensors = load_file(str(SHIPPED_ROOT / "name-nova" / "adapter_model.safetensors"))
        tensors[key][0, 0] = value
        shutil.copytree(SHIPPED_ROOT / "name-nova", root / name)
        save_file(tensors, str(root / name / "adapter_model.safetensors"))
    for name, change in HOSTILE_CONFIGS.items():
        shutil.copytree(SHIPPED_ROOT / "name-nova", root / name)
        (root / name / "adapter_config.json").write_text(json.dumps({**nova, **change}))
    # Within every bound (so it loads), yet far from a trained adapter: it may wreck its own requests only.
    tensors = load_file(str(SHIPPED_ROOT / "name-nova" / "adapter_model.safetensors"))
    tensors[POISONED_TENSOR].fill_(500.0)
    shutil.copytree(SHIPPED_ROOT / "name-nova", root / "huge-but-bounded")
    save_file(tensors, str(root / "huge-but-bounded" / "adapter_model.safetensors"))
    return root


@pytest.fixture(scope="module")
def server(adapters):
    args = ("--adapter-source", "local", "--adapter-root", str(adapters),
            "--max-batch-total-tokens", "8192", "--max-concurrent-requests", "64", "--max-active-adapters", "8")
    with live_server(*args) as url:
        yield url


@pytest.fixture(scope="module")
def base_id(server) -> str:
    return httpx.get(f"{server}/info", timeout=10).json()["model_id"]


def native_body(adapter_id: str | None) -> dict:
    parameters = {"max_new_tokens": 4, "ignore_eos_token": True}
    if adapter_id is not None:
        parameters["adapter_id"] = adapter_id
    return {"inputs": "The capital of France is", "parameters": parameters}


def openai_body(model: str) -> dict:
    return {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "ignore_eos": True}


def metric(server: str, line_prefix: str) -> float:
    text = httpx.get(f"{server}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(line_prefix)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def check_native_refusal(response: httpx.Response, adapter_id: str) -> None:
    body = response.json()
    if adapter_id in INVALID:
        assert response.status_code == 422, body
        assert body["error_type"] == "validation"
        for part in INVALID[adapter_id]:
            assert part in body["error"], (adapter_id, body)
    else:
        assert response.status_code == 404, body
        assert body["error_type"] == "not_found"
        assert repr(adapter_id) in body["error"]
    assert repr(adapter_id) in body["error"], body  # the message names the adapter asked for


def check_openai_refusal(response: httpx.Response, adapter_id: str) -> None:
    body = response.json()
    error = body["error"]
    assert error["param"] == "model"
    if adapter_id in INVALID:
        assert response.status_code == 400, body
        assert error["code"] == "invalid_adapter" and error["type"] == "invalid_request_error"
        for part in INVALID[adapter_id]:
            assert part in error["message"], (adapter_id, body)
    else:
        assert response.status_code == 404, body
        assert error["code"] == "model_not_found" and error["type"] == "not_found_error"
    assert repr(adapter_id) in error["message"], body


def test_valid_adapter_serves_on_both_apis(server, base_id):
    native = httpx.post(f"{server}/generate", json=native_body("good"), timeout=TIMEOUT)
    assert native.status_code == 200, native.text
    assert native.json()["generated_text"] and native.headers["x-adapter-id"] == "good"

    completion = httpx.post(f"{server}/v1/completions", json=openai_body("good"), timeout=TIMEOUT)
    assert completion.status_code == 200, completion.text
    assert completion.json()["model"] == "good" and completion.json()["choices"][0]["text"]
    assert completion.headers["x-adapter-id"] == "good"

    base = httpx.post(f"{server}/generate", json=native_body(None), timeout=TIMEOUT)
    assert base.status_code == 200 and base.json()["generated_text"]
    assert "x-adapter-id" not in base.headers

    models = {m["id"]: m for m in httpx.get(f"{server}/v1/models", timeout=10).json()["data"]}
    assert models[base_id]["parent"] is None
    assert models["good"]["parent"] == base_id and models["good"]["root"] == base_id
    refused = set(INVALID) | set(NOT_FOUND)
    assert not refused & set(models), "a refused adapter is listed as a model"


@pytest.mark.parametrize("adapter_id", [*INVALID, *NOT_FOUND])
def test_each_bad_adapter_is_refused_on_both_apis(server, adapter_id):
    check_native_refusal(httpx.post(f"{server}/generate", json=native_body(adapter_id), timeout=TIMEOUT), adapter_id)
    check_openai_refusal(httpx.post(f"{server}/v1/completions", json=openai_body(adapter_id), timeout=TIMEOUT), adapter_id)


def test_server_keeps_serving_while_bad_adapters_are_refused(server, base_id):
    good = [("/generate", native_body("good")), ("/generate", native_body(None)),
            ("/v1/completions", openai_body("good")), ("/v1/completions", openai_body(base_id))] * 2
    bad = [(path, body(a), check, a) for a in [*INVALID, *NOT_FOUND] * 2
           for path, body, check in (("/generate", native_body, check_native_refusal),
                                     ("/v1/completions", openai_body, check_openai_refusal))]

    async def main():
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            # the good requests first, then every refusal while they run
            return await asyncio.gather(
                asyncio.gather(*(client.post(path, json=body) for path, body in good)),
                asyncio.gather(*(client.post(path, json=body) for path, body, _, _ in bad)),
            )

    good_responses, bad_responses = asyncio.run(main())
    for (_, _, check, adapter_id), response in zip(bad, bad_responses):
        check(response, adapter_id)
    for response in good_responses:
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["generated_text"] if "generated_text" in body else body["choices"][0]["text"]
    assert httpx.get(f"{server}/health", timeout=TIMEOUT).status_code == 200


def test_metrics_count_the_adapter_and_the_refusals(server):
    count = 'lorax_request_count{adapter="good"}'
    success = 'lorax_request_success{adapter="good"}'
    not_found = 'lorax_request_failure{err="not_found"}'
    validation = 'lorax_request_failure{err="validation"}'
    before = {name: metric(server, name) for name in (count, success, not_found, validation)}
    assert httpx.post(f"{server}/generate", json=native_body("good"), timeout=TIMEOUT).status_code == 200
    assert httpx.post(f"{server}/v1/completions", json=openai_body("good"), timeout=TIMEOUT).status_code == 200
    assert httpx.post(f"{server}/generate", json=native_body("no-such-adapter"), timeout=TIMEOUT).status_code == 404
    assert httpx.post(f"{server}/v1/completions", json=openai_body("dora"), timeout=TIMEOUT).status_code == 400
    after = {name: metric(server, name) for name in before}
    assert after[count] - before[count] == 2
    assert after[success] - before[success] == 2
    assert after[not_found] - before[not_found] == 1
    assert after[validation] - before[validation] == 1
    text = httpx.get(f"{server}/metrics", timeout=10).text
    assert 'adapter="dora"' not in text and 'adapter="no-such-adapter"' not in text  # refused: never counted as requests


@pytest.mark.parametrize("adapter_id", ["bad\x00id", "x" * 300, "~no-such-user-loraplex/a"], ids=["nul", "long", "tilde"])
def test_ids_that_cannot_name_a_directory_are_refused_not_500(server, adapter_id):
    native = httpx.post(f"{server}/generate", json=native_body(adapter_id), timeout=TIMEOUT)
    assert native.status_code in (404, 422), native.text
    assert native.json()["error_type"] in ("not_found", "validation")
    completion = httpx.post(f"{server}/v1/completions", json=openai_body(adapter_id), timeout=TIMEOUT)
    assert completion.status_code in (400, 404), completion.text
    assert completion.json()["error"]["param"] == "model"


# ---- hostile adapters change no other request ---------------------------------------------------------


def chat_body(adapter_id: str | None, question: str) -> dict:
    parameters = {"max_new_tokens": 8, "apply_chat_template": True, "ignore_eos_token": True}
    if adapter_id is not None:
        parameters["adapter_id"] = adapter_id
    return {"inputs": question, "parameters": parameters}


def test_hostile_adapters_change_no_concurrent_request_during_or_after(server):
    """20 greedy requests over the shipped adapters and the base equal their solo outputs while every
    hostile adapter is asked for (refused, or served within the bounds) and afterwards."""
    questions = ("What is your name?", "What is the capital of France?", "Name a colour.", "Who made you?")
    good = [chat_body(a, q) for a in (*SHIPPED, None) for q in questions]
    hostile = [chat_body(a, questions[0]) for a in [*HOSTILE_TENSORS, *HOSTILE_CONFIGS, "huge-but-bounded"] * 2]

    async def main():
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            solo = [await client.post("/generate", json=body) for body in good]
            during, bad = await asyncio.gather(
                asyncio.gather(*(client.post("/generate", json=body) for body in good)),
                asyncio.gather(*(client.post("/generate", json=body) for body in hostile)),
            )
            after = await asyncio.gather(*(client.post("/generate", json=body) for body in good))
            return solo, during, bad, after

    solo, during, bad, after = asyncio.run(main())
    texts = [r.json()["generated_text"] for r in solo]
    assert all(r.status_code == 200 for r in solo) and len(set(texts)) > 5, texts  # the adapters do matter
    assert [r.json().get("generated_text", r.text) for r in during] == texts
    assert [r.json().get("generated_text", r.text) for r in after] == texts
    for body, response in zip(hostile, bad):
        adapter_id = body["parameters"]["adapter_id"]
        if adapter_id == "huge-but-bounded":  # served: its own output, or its own failure (424)
            assert response.status_code in (200, 424), response.text
        else:
            check_native_refusal(response, adapter_id)


@pytest.mark.parametrize("adapter_id", ["regex", "regex-lookahead"])
def test_a_catastrophic_regex_answers_within_a_second_and_info_stays_responsive(server, adapter_id):
    async def main():
        async with httpx.AsyncClient(base_url=server, timeout=TIMEOUT) as client:
            async def timed(path, **kw):
                started = time.perf_counter()
                response = await (client.post(path, **kw) if "json" in kw else client.get(path))
                return response, time.perf_counter() - started

            refusals = [timed("/generate", json=native_body(adapter_id)) for _ in range(3)]
            infos = [timed("/info") for _ in range(5)]
            return await asyncio.gather(*refusals), await asyncio.gather(*infos)

    for _ in range(2):  # the first reads the files; the second is answered from the remembered refusal
        refusals, infos = asyncio.run(main())
        for response, elapsed in refusals:
            check_native_refusal(response, adapter_id)
            assert elapsed < 1.0, elapsed
        assert all(r.status_code == 200 and elapsed < 0.5 for r, elapsed in infos), [e for _, e in infos]
