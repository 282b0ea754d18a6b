"""Prefix caching through both APIs: vLLM's hit and query counters in /metrics, and `cache_salt` separating
tenants (OpenAI body field, native `parameters.cache_salt`)."""

from __future__ import annotations


import httpx
from tests.helpers import metric_value

PROMPT = ("You are the help desk of a train company. Answer briefly and politely; never promise refunds, and point "
          "travellers to the ticket office for anything about seat reservations or lost luggage. Question: ")


def counter(url: str, name: str) -> float:
    return metric_value(httpx.get(f"{url}/metrics").text, name)


def hits_for(url: str, send) -> float:
    before = counter(url, "vllm:prefix_cache_hits_total")
    send()
    return counter(url, "vllm:prefix_cache_hits_total") - before


def test_hits_are_counted_and_salts_separate_tenants(grammar_server):
    url = grammar_server

    def openai(question: str, salt: str | None = None):
        body = {"prompt": PROMPT + question, "max_tokens": 2, **({"cache_salt": salt} if salt else {})}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200

    def native(question: str, salt: str):
        body = {"inputs": PROMPT + question, "parameters": {"max_new_tokens": 2, "cache_salt": salt}}
        assert httpx.post(f"{url}/generate", json=body, timeout=60).status_code == 200

    queries = counter(url, "vllm:prefix_cache_queries_total")
    openai("when is the first train?")
    assert counter(url, "vllm:prefix_cache_queries_total") > queries
    assert hits_for(url, lambda: openai("can I bring a bike?")) >= 32  # the shared instructions' full blocks
    assert hits_for(url, lambda: openai("can I bring a dog?", salt="tenant-a")) == 0  # another cache space
    assert hits_for(url, lambda: native("can I bring a cat?", salt="tenant-b")) == 0
    assert hits_for(url, lambda: native("can I bring a bird?", salt="tenant-a")) >= 32


def test_an_empty_salt_is_refused(grammar_server):
    response = httpx.post(f"{grammar_server}/v1/completions", json={"prompt": "Hi", "cache_salt": ""}, timeout=30)
    assert response.status_code == 400 and "cache_salt" in response.text
