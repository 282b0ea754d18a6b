"""The grammar engine is readied as the server starts, on a thread of its own (issue 58): the first structured-output
request used to import it and read the tokenizer into it while holding the interpreter, stalling every client
(`/health` too) for a second or two."""

from __future__ import annotations

import threading

from fastapi.testclient import TestClient

from loraplex.config import EngineConfig, ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.server.app import create_app


def test_the_grammar_engine_is_ready_before_the_first_structured_request(embedded):
    engine = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=2048))
    cache = engine.inputs.grammars
    prepared_on = []
    prepare = cache.prepare
    cache.prepare = lambda: prepared_on.append(threading.current_thread().name) or prepare()
    app = create_app(AsyncEngine(engine), ServerConfig())
    started = [t for t in threading.enumerate() if t.name == "loraplex-grammars"]
    for thread in started:
        thread.join(timeout=60)
    assert prepared_on[:1] == ["loraplex-grammars"] and cache._grammars is not None
    assert not cache._used  # readied only: the grammar masks come at the first structured request
    with TestClient(app) as client:
        answer = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "response_format": {"type": "json_object"}})
        assert answer.status_code == 200
    assert cache._used
