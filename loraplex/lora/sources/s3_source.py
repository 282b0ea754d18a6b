"""Adapters from S3 (LoRAX's `s3` adapter source), read with boto3.

An id names the adapter's directory (its adapter_config.json and adapter_model.safetensors) as LoRAX does:
`s3://bucket/path`; or `path` inside the bucket PREDIBASE_MODEL_BUCKET names; or, without that variable,
`bucket/path`. Credentials and region come from boto3's usual chain (AWS_ACCESS_KEY_ID, AWS_PROFILE, an instance
role, ...); S3_ENDPOINT_URL (or R2_ACCOUNT_ID, for Cloudflare R2) points it at another S3-compatible store.

The files are downloaded into a temporary directory, read, and deleted: the store's CPU cache keeps the loaded
adapter, and a later load reads the bucket's current files.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile
from typing import Iterator

from loraplex.lora.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from loraplex.lora.errors import AdapterInvalid, AdapterNotFound

S3_PREFIX = "s3://"


def bucket_and_prefix(adapter_id: str) -> tuple[str, str]:
    """(bucket, key prefix of the adapter's directory), as LoRAX reads an s3 id."""
    if adapter_id.startswith(S3_PREFIX):
        bucket, _, prefix = adapter_id[len(S3_PREFIX):].partition("/")
    elif os.environ.get("PREDIBASE_MODEL_BUCKET"):
        bucket, prefix = os.environ["PREDIBASE_MODEL_BUCKET"], adapter_id
    else:
        bucket, _, prefix = adapter_id.partition("/")
    prefix = prefix.strip("/")
    if not bucket or not prefix:
        raise AdapterInvalid(f"adapter {adapter_id!r}: an s3 adapter id is s3://bucket/path, bucket/path, or a path "
                             "inside PREDIBASE_MODEL_BUCKET")
    return bucket, prefix


def _client():
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:
        raise AdapterInvalid("the s3 adapter source needs boto3: pip install boto3") from exc
    endpoint = os.environ.get("S3_ENDPOINT_URL")
    if os.environ.get("R2_ACCOUNT_ID"):
        endpoint = f"https://{os.environ['R2_ACCOUNT_ID']}.r2.cloudflarestorage.com"
    return boto3.client("s3", endpoint_url=endpoint, config=Config(retries={"max_attempts": 5, "mode": "standard"}))


@contextlib.contextmanager
def s3_adapter_dir(adapter_id: str) -> Iterator[pathlib.Path]:
    """A local directory holding the adapter's files while the context lasts."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, prefix = bucket_and_prefix(adapter_id)
    client = _client()
    with tempfile.TemporaryDirectory(prefix="loraplex-s3-") as directory:
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            try:
                client.download_file(bucket, f"{prefix}/{name}", os.path.join(directory, name))
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code", "")
                if code in ("404", "NoSuchKey", "NoSuchBucket", "403", "AccessDenied"):
                    raise AdapterNotFound(f"adapter {adapter_id!r}: s3://{bucket}/{prefix}/{name} not found or not "
                                          f"readable ({code})") from exc
                where = f"s3://{bucket}/{prefix}/{name}"
                raise AdapterNotFound(f"adapter {adapter_id!r}: reading {where} failed: {exc}") from exc
            except BotoCoreError as exc:  # no credentials, no endpoint, ...
                raise AdapterNotFound(f"adapter {adapter_id!r}: S3 is not reachable: {exc}") from exc
        yield pathlib.Path(directory)


class S3Source:
    """Adapters in S3 buckets (an AdapterSource): canonical id `s3://bucket/path`, however the bucket was named."""

    def canonical_id(self, adapter_id: str) -> str:
        bucket, prefix = bucket_and_prefix(adapter_id)
        return f"{S3_PREFIX}{bucket}/{prefix}"

    def directory(self, canonical_id: str):
        return s3_adapter_dir(canonical_id)
