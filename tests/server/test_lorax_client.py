"""Conformance with LoRAX's own Python client (lorax-client 0.6.3) against a live server."""

from __future__ import annotations

import pytest
from lorax import Client
from lorax.errors import ValidationError

from tests.helpers import live_server


@pytest.fixture(scope="module")
def client():
    with live_server("--max-batch-total-tokens", "8192") as url:
        yield Client(url, timeout=120)


def test_generate_with_details(client):
    response = client.generate("The capital of France is", max_new_tokens=8)
    details = response.details
    assert response.generated_text and details.generated_tokens == len(details.tokens) == 8
    assert details.finish_reason.value in ("length", "eos_token")
    assert all(t.logprob <= 0 for t in details.tokens)


def test_generate_stream_joins_to_the_same_text(client):
    whole = client.generate("The capital of France is", max_new_tokens=12).generated_text
    pieces, final = [], None
    for event in client.generate_stream("The capital of France is", max_new_tokens=12):
        pieces.append(event.token.text)
        final = event
    assert final.generated_text == "".join(pieces) == whole
    assert final.details.generated_tokens == len(pieces) > 1


def test_decoder_input_details_and_alternatives(client):
    response = client.generate("One, two, three,", max_new_tokens=3, decoder_input_details=True, return_k_alternatives=2)
    prefill = response.details.prefill
    assert prefill[0].logprob is None and all(t.logprob <= 0 for t in prefill[1:])
    for token in response.details.tokens:
        assert len(token.alternative_tokens) == 2
        assert token.alternative_tokens[0].logprob >= token.alternative_tokens[1].logprob


def test_validation_errors_are_typed(client):
    with pytest.raises(ValidationError, match="top_p"):
        client.generate("hi", top_p=1.5)
    with pytest.raises(ValidationError, match="max total tokens"):
        client.generate("hi", max_new_tokens=100000)
    assert client.generate("hi", max_new_tokens=1).details.generated_tokens == 1


def test_every_generate_parameter(client):
    """Each of lorax-client's generate parameters, at once, as the client serialises them (nulls included)."""
    kwargs = dict(
        do_sample=True, max_new_tokens=6, ignore_eos_token=True, repetition_penalty=1.1,
        return_full_text=True, seed=7, stop_sequences=["zzzz"], temperature=0.7, top_k=20, top_p=0.9, truncate=64,
        typical_p=0.95, watermark=False, decoder_input_details=True, return_k_alternatives=2, details=True,
    )
    prompt = "Once upon a time"
    first = client.generate(prompt, **kwargs)
    assert first.generated_text.startswith(prompt) and first.details.generated_tokens == 6
    assert first.details.prefill and all(len(t.alternative_tokens) == 2 for t in first.details.tokens)
    assert client.generate(prompt, **kwargs).generated_text == first.generated_text  # seeded
    # best_of > 1 the client allows only without a seed
    best = client.generate(prompt, **{**kwargs, "seed": None, "best_of": 2})
    assert len(best.details.best_of_sequences) == 1  # the other sequence
    unstreamed = ("decoder_input_details", "details", "return_k_alternatives")  # generate_stream lacks these
    stream_kwargs = {k: v for k, v in kwargs.items() if k not in unstreamed}
    events = list(client.generate_stream(prompt, **stream_kwargs))
    assert len(events) == 6 and events[-1].details.generated_tokens == 6
    # TGI's watermarking is not served: true is refused by name, never accepted and ignored
    with pytest.raises(ValidationError, match="watermark"):
        client.generate(prompt, **{**kwargs, "watermark": True})


def test_response_format_through_the_client(client):
    import json

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    response = client.generate("Name a city as JSON:", max_new_tokens=24,
                               response_format={"type": "json_object", "schema": schema})
    assert "city" in json.loads(response.generated_text)
