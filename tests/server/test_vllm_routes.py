"""vLLM's GET /version and POST /detokenize (issue 59, in part), in vLLM's shapes."""

from __future__ import annotations

from loraplex import __version__
from loraplex.config import ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.server.app import create_app
from tests.helpers import asgi_calls


def test_version_and_detokenize_round_trip_tokenize(make_engine):
    engine = AsyncEngine(make_engine(max_batch_total_tokens=2048))
    app = create_app(engine, ServerConfig())
    text = "The capital of France is Paris."
    try:
        version, tokenized = asgi_calls(app, ("GET", "/version", None), ("POST", "/tokenize", {"inputs": text}))
        ids = [t["id"] for t in tokenized.json()]
        back, named, unknown, outside = asgi_calls(
            app, ("POST", "/detokenize", {"tokens": ids}),
            ("POST", "/detokenize", {"model": engine.model.model_id, "tokens": ids[:3]}),
            ("POST", "/detokenize", {"model": "no-such-model", "tokens": ids}),
            ("POST", "/detokenize", {"tokens": [ids[0], 10**9]}))
    finally:
        engine.shutdown()
    assert version.json() == {"version": __version__}
    assert back.status_code == 200 and back.json() == {"prompt": engine.model.tokenizer.decode(ids, False)}
    assert text in back.json()["prompt"]
    assert named.status_code == 200 and named.json()["prompt"] == engine.model.tokenizer.decode(ids[:3], False)
    assert unknown.status_code == 404 and unknown.json()["error_type"] == "not_found"
    assert outside.status_code == 422 and "1000000000" in outside.json()["error"]  # the native shape, off /v1/
