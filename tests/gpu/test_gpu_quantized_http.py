"""What users run, on every quantized mode: `loraplex serve` on the GPU (CUDA graphs on), 64 concurrent streamed
requests over 16 PEFT adapters and the base model, and not one failed request (CUDA only:
`python -m pytest tests/gpu`)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from tests.helpers import live_server, tiny_seq2seq_tokenizer
from tests.lora.peft_helpers import ALL_PROJECTIONS, peft_model

if not torch.cuda.is_available():
    pytest.fail("tests/gpu needs a CUDA device", pytrace=False)

ADAPTERS = 16
CLIENTS = 64
# A small Llama whose every linear fits each mode's kernels (multiples of 16, groups of 128).
SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random Llama (bfloat16, with a real tokenizer) and 16 random PEFT adapters over all its projections."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("quantized-http")
    tokenizer = tiny_seq2seq_tokenizer("bart")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=0, eos_token_id=2, pad_token_id=1, **SHAPE)
    model = LlamaForCausalLM(config).eval()
    model.to(torch.bfloat16).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    for i in range(ADAPTERS):
        peft_model(model.float(), seed=i, r=8, lora_alpha=16, target_modules=list(ALL_PROJECTIONS)).save_pretrained(
            root / "adapters" / f"a{i}")
    return root


MODES = {
    "bf16": [],
    "int8": ["--quantize", "bitsandbytes"],
    "nf4": ["--quantize", "bitsandbytes-nf4"],
    "fp8": ["--quantize", "fp8"],
    "fp8-kv8": ["--quantize", "fp8", "--kv-cache-dtype", "fp8"],
}


async def _one(client: httpx.AsyncClient, url: str, i: int) -> tuple[bool, str]:
    """A streamed request (native or OpenAI completions, on adapter i % 17; the 17th: the base model): ok when no
    event is an error and it ends having generated the 32 tokens asked (OpenAI chunks may carry several tokens'
    text, so their count says nothing)."""
    adapter = None if i % (ADAPTERS + 1) == ADAPTERS else f"a{i % (ADAPTERS + 1)}"
    if i % 2:
        body = {"inputs": f"request {i} tells a story", "parameters": {"max_new_tokens": 32, "ignore_eos_token": True,
                                                                       **({"adapter_id": adapter} if adapter else {})}}
        path = "/generate_stream"
    else:
        body = {"model": adapter or "", "prompt": f"request {i} tells a story", "max_tokens": 32, "stream": True,
                "ignore_eos": True}
        path = "/v1/completions"
    events = []
    async with client.stream("POST", url + path, json=body) as response:
        if response.status_code != 200:
            return False, f"{path}: {response.status_code} {await response.aread()}"
        async for line in response.aiter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                events.append(json.loads(line[5:]))
    failed = [e for e in events if "error" in e]
    if path == "/generate_stream":
        done = bool(events) and (events[-1].get("details") or {}).get("generated_tokens") == 32
    else:
        done = any(c.get("finish_reason") == "length" for e in events for c in e.get("choices", ()))
    return (not failed and done), f"{path}: {failed[:1] or events[-1:]}"


@pytest.mark.parametrize("mode", list(MODES))
def test_64_concurrent_streams_over_16_adapters_none_fails(checkpoint, mode):
    args = ["--model-id", str(checkpoint / "model"), "--adapter-source", "local", "--adapter-root",
            str(checkpoint / "adapters"), "--max-active-adapters", str(ADAPTERS + 1), *MODES[mode]]

    async def main(url):
        async with httpx.AsyncClient(timeout=300) as client:
            results = await asyncio.gather(*(_one(client, url, i) for i in range(CLIENTS)))
            metrics = (await client.get(url + "/metrics")).text
        return results, metrics

    with live_server(*args, ready_timeout=400) as url:
        results, metrics = asyncio.run(main(url))
    bad = [why for ok, why in results if not ok]
    assert not bad, f"{len(bad)}/{CLIENTS} requests failed under {mode}: {bad[:3]}"
    failures = [line for line in metrics.splitlines()
                if line.startswith("lorax_request_failure{") and float(line.rsplit(" ", 1)[1]) != 0]
    assert not failures, failures
