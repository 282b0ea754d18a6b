"""What a source of adapters is: the extension point for a new one (an internal artifact store, a database, ...).

A source turns the id a client gives into its canonical id (one adapter = one id: one cache entry, metric label and
/v1/models entry) and lends the adapter's files (adapter_config.json, adapter_model.safetensors) as a local
directory while the store reads them. The store does everything else: the checks, packing, the CPU cache, merges
and names. Both methods run on the store's threads (`canonical_id` also on a request's, before the cache: keep it
cheap) and raise AdapterNotFound (404) or AdapterInvalid (422/400), or AdapterSourceUnavailable (503) when the
source cannot be reached. A new source is given to `AdapterStore(sources={"name": source})`; clients then name it
as `adapter_source`. The local directories (local_source.py) and S3 (s3_source.py) are such sources; the Hugging
Face hub has more to it (a request's token, revisions: hub_source.py's `HubSource`) and stays beside them.
"""

from __future__ import annotations

import pathlib
from contextlib import AbstractContextManager
from typing import Protocol


class AdapterSource(Protocol):
    def canonical_id(self, adapter_id: str) -> str:
        """The one id of the adapter `adapter_id` names in this source."""
        ...

    def directory(self, canonical_id: str) -> AbstractContextManager[pathlib.Path]:
        """A local directory holding the adapter's files while the context lasts."""
        ...
