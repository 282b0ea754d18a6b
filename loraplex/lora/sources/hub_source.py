"""Hugging Face hub adapters: which snapshot a request may read, asked with that request's own token.

LoRAX issue 479: LoRAX checked a request's `api_token` only when it downloaded an adapter, so once a
private adapter was cached any request could use it. Here the store asks `HubSource.resolve` for every
request (`AdapterStore` may remember a grant for `access_ttl_s`, only for the same repo and token scope)
and keys its cache by the scope, so a grant is never lent to a request without that token.

`HuggingFaceHub`, the real source:
- Online: `model_info(repo, revision, token=)` asks the hub whether this token may read the repo and which
  commit the revision is; then `snapshot_download` at that commit (no second round trip once the files
  are cached). A hub that cannot be reached is AdapterSourceUnavailable (503); a missing revision says so;
  anything else is "not found": a private repo refuses a wrong token the way it refuses a missing repo (401),
  so the two look alike to the client too (and a request that sent no token is told it sent none).
  No `api_token`: huggingface_hub uses the server's own credentials (HF_TOKEN), if it has any: what those
  reach, every client of the server reaches (as in LoRAX).
- Offline (`HF_HUB_OFFLINE`): no token can be checked. The local Hugging Face cache is then taken as the
  operator's, like a local adapter root: every adapter in it is served to every client, with or without
  an `api_token` (which changes nothing). Do not serve offline from a cache holding private adapters that
  not every client may use (an online server downloads private adapters into its cache).

Token scopes (`token_scope`): "public" without a token; otherwise a keyed hash of the token, with a key
drawn when the process starts, so a scope names a token inside this process only and cannot be used to
test a guessed token. The token itself is never stored, logged, or put in a message.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import pathlib
import secrets
from dataclasses import dataclass
from typing import Protocol

from loraplex.lora.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterNotFound
from loraplex.lora.errors import AdapterError, AdapterSourceUnavailable
from loraplex.checkpoints.sources import hub_offline

log = logging.getLogger(__name__)

PUBLIC = "public"
_SCOPE_KEY = secrets.token_bytes(32)


def token_scope(token: str | None) -> str:
    """The cache scope of a request's api_token ("public" for none or an empty one)."""
    if not token:
        return PUBLIC
    return "token-" + hmac.new(_SCOPE_KEY, token.encode(), hashlib.sha256).hexdigest()[:24]


@dataclass(frozen=True)
class Snapshot:
    """An adapter's files as the hub gave them, and the commit they are at."""

    path: pathlib.Path
    revision: str


class HubSource(Protocol):
    def resolve(self, repo_id: str, revision: str | None, token: str | None) -> Snapshot:
        """The snapshot of `repo_id` at `revision` (None: the default branch) that `token` may read.
        Raises AdapterNotFound, naming the adapter by `repo_id`, when there is none or the token may not."""
        ...


class HuggingFaceHub:
    """The Hugging Face hub through huggingface_hub (see the module's docstring)."""

    def resolve(self, repo_id: str, revision: str | None, token: str | None) -> Snapshot:
        from huggingface_hub import HfApi, snapshot_download

        files = [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
        offline = hub_offline()
        try:
            if offline:
                path = snapshot_download(repo_id, revision=revision, allow_patterns=files, local_files_only=True)
                return Snapshot(pathlib.Path(path), pathlib.Path(path).name)  # a snapshot dir is named by its commit
            commit = HfApi().model_info(repo_id, revision=revision, token=token or None).sha
            path = snapshot_download(repo_id, revision=commit, allow_patterns=files, token=token or None)
            return Snapshot(pathlib.Path(path), commit)
        except Exception as exc:  # noqa: BLE001 — every failure is told by its kind, never by its text
            # Neither here nor in the log `exc`'s text: whatever a library writes there, no token may reach it.
            log.info("hub adapter %r: %s", repo_id, type(exc).__name__)
            raise _refusal(exc, repo_id, revision, token, offline) from None


def _refusal(exc: Exception, repo_id: str, revision: str | None, token: str | None, offline: bool) -> AdapterError:
    """What a failed hub call tells the client: the real cause (no network, no such revision, no such repo or
    none this token may read, no token sent), never the exception's own text."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RevisionNotFoundError

    if offline:
        return AdapterNotFound(f"adapter {repo_id!r} not found in the local Hugging Face cache (the hub is offline: "
                               "HF_HUB_OFFLINE)")
    status = getattr(getattr(exc, "response", None), "status_code", None)
    unreachable = isinstance(exc, (ConnectionError, TimeoutError, LocalEntryNotFoundError)) or (
        type(exc).__name__ in _NETWORK_ERRORS) or (isinstance(exc, HfHubHTTPError) and status is not None and status >= 500)
    if unreachable:
        cause = f"HTTP {status}" if status else type(exc).__name__
        return AdapterSourceUnavailable(f"adapter {repo_id!r}: the Hugging Face Hub cannot be reached from this server "
                                        f"({cause}); try again later")
    if isinstance(exc, RevisionNotFoundError):
        return AdapterNotFound(f"adapter {repo_id!r} has no revision {revision!r} on the Hugging Face Hub")
    if token:
        return AdapterNotFound(f"adapter {repo_id!r} not found on the Hugging Face Hub, or not readable with this "
                               "api_token")
    return AdapterNotFound(f"adapter {repo_id!r} not found on the Hugging Face Hub (no api_token was sent: a private "
                           "adapter needs one)")


# Transport failures by name (httpx's and requests', which huggingface_hub may raise, need not be importable).
_NETWORK_ERRORS = {"ConnectError", "ConnectTimeout", "ReadTimeout", "WriteTimeout", "PoolTimeout", "NetworkError",
                   "RemoteProtocolError", "ProxyError", "SSLError", "ConnectionError", "Timeout", "TimeoutException"}
