"""Run-time adapter management: vLLM's load/unload bodies, with SGLang's `pinned`."""

from __future__ import annotations

from loraplex.protocol.base import RequestModel


class LoadLoraAdapterRequest(RequestModel):
    lora_name: str  # what clients then send as `model` or `adapter_id`
    lora_path: str  # a local directory inside the adapter roots, a hub repo id, or an s3:// URI
    load_inplace: bool = False  # replace the adapter the name serves (running requests keep theirs)
    pinned: bool = False  # SGLang's: the adapter keeps its device slot once it has one


class UnloadLoraAdapterRequest(RequestModel):
    lora_name: str
