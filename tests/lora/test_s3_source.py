"""The s3 adapter source against moto's S3 server (a real HTTP endpoint, S3_ENDPOINT_URL as LoRAX reads it): the
id forms LoRAX accepts, a missing adapter as 404, and the adapter serving the same tokens as from a local root."""

from __future__ import annotations

import pathlib

import pytest
from fastapi.testclient import TestClient

from loraplex.config import EngineConfig, ServerConfig
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.engine import Engine
from loraplex.lora.errors import AdapterInvalid
from loraplex.lora.sources.s3_source import bucket_and_prefix
from loraplex.server.app import create_app
from tests.helpers import free_port

ADAPTERS = pathlib.Path(__file__).resolve().parents[2] / "examples" / "adapters"
BUCKET = "tenant-adapters"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server with the shipped style-caps adapter at s3://tenant-adapters/team/style-caps/."""
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    patch = pytest.MonkeyPatch()
    for name, value in {"S3_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
                        "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        patch.setenv(name, value)
    patch.delenv("PREDIBASE_MODEL_BUCKET", raising=False)
    client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}")
    client.create_bucket(Bucket=BUCKET)
    for file in (ADAPTERS / "style-caps").iterdir():
        client.upload_file(str(file), BUCKET, f"team/style-caps/{file.name}")
    yield client
    patch.undo()
    server.stop()


def test_id_forms(monkeypatch):
    monkeypatch.delenv("PREDIBASE_MODEL_BUCKET", raising=False)
    assert bucket_and_prefix("s3://b/x/y/") == ("b", "x/y")
    assert bucket_and_prefix("b/x/y") == ("b", "x/y")
    monkeypatch.setenv("PREDIBASE_MODEL_BUCKET", "models")
    assert bucket_and_prefix("x/y") == ("models", "x/y")
    with pytest.raises(AdapterInvalid):
        bucket_and_prefix("s3://only-a-bucket")


@pytest.fixture(scope="module")
def client(s3, embedded):
    engine = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=4096))
    config = ServerConfig(adapter_source="local", adapter_roots=(str(ADAPTERS),))
    with TestClient(create_app(AsyncEngine(engine), config)) as c:
        yield c


def generate(client, **parameters):
    body = {"inputs": "What is the capital of France?",
            "parameters": {"max_new_tokens": 12, "apply_chat_template": True, **parameters}}
    return client.post("/generate", json=body)


def test_an_s3_adapter_answers_as_the_same_adapter_from_disk(client):
    local = generate(client, adapter_id="style-caps")
    base = generate(client)
    for adapter_id in (f"s3://{BUCKET}/team/style-caps", f"{BUCKET}/team/style-caps"):
        remote = generate(client, adapter_id=adapter_id, adapter_source="s3")
        assert remote.status_code == 200, remote.text
        assert remote.json()["generated_text"] == local.json()["generated_text"] != base.json()["generated_text"]


def test_a_missing_s3_adapter_is_404_and_the_server_goes_on(client):
    missing = generate(client, adapter_id=f"s3://{BUCKET}/team/nothing-here", adapter_source="s3")
    assert missing.status_code == 404 and "not found" in missing.json()["error"]
    assert generate(client).status_code == 200
