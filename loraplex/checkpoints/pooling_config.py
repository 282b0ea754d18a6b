"""How a checkpoint says its embeddings are made: the sentence-transformers files beside the weights.

`modules.json` lists the modules a sentence-transformers model runs after the transformer: a `Pooling` module (its
`config.json` names the pooling: `pooling_mode_lasttoken`, `_mean_tokens`, `_cls_token`, `_max_tokens`) and maybe a
`Normalize` one; `config_sentence_transformers.json` may name a default prompt (an instruction put before every
text, e.g. "query: "). Without these files a decoder model embeds as vLLM embeds one: its last token's final hidden
state, L2-normalised; an encoder-decoder model (T5, BART) pools its encoder's output: the mean, L2-normalised. The
pooling of an encoder-decoder model always reads the encoder's output. What loraplex cannot compute exactly (another pooling mode, several at once, a prompt left out
of the pooled rows) is kept as a refusal: the model still generates, and its embedding routes say why they cannot.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

from loraplex.params import Pooling

MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "first",
         "pooling_mode_max_tokens": "max"}
MAX_CONFIG_BYTES = 1 << 20  # these files are a few hundred bytes
DEFAULT = Pooling("last", normalize=True)


@dataclass(frozen=True)
class EmbeddingPooling:
    pooling: Pooling = DEFAULT
    prompt: str = ""  # put before every text input (the checkpoint's default prompt)
    source: str = "the default for decoder models"  # where it was read, for the start-up log
    refusal: str | None = None  # why this checkpoint's embeddings cannot be served as it defines them


def _json(path: pathlib.Path):
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{path.name} is larger than {MAX_CONFIG_BYTES} bytes")
    return json.loads(path.read_text())


ENCODER_DEFAULT = EmbeddingPooling(Pooling("mean", normalize=True), source="the default for encoder-decoder models")


def default_pooling(encoder_decoder: bool) -> EmbeddingPooling:
    """A model's pooling where its checkpoint names none."""
    return ENCODER_DEFAULT if encoder_decoder else EmbeddingPooling()


def read_pooling(directory: pathlib.Path, encoder_decoder: bool = False) -> EmbeddingPooling:
    """The checkpoint's pooling (sentence-transformers files), or the default: an encoder-decoder model's is the mean
    of its encoder's output, as sentence-T5 pools it. Unreadable files are a ValueError."""
    default = default_pooling(encoder_decoder)
    modules_file = directory / "modules.json"
    if not modules_file.is_file():
        return default
    modules = _json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError("modules.json must be a list of modules")
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
    if "Pooling" not in kinds:
        return default
    config = _json(directory / str(kinds["Pooling"].get("path", "")) / "config.json")
    chosen = [mode for key, mode in MODES.items() if config.get(key)]
    others = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in MODES)
    prompt = _default_prompt(directory)
    source = "the checkpoint's sentence-transformers configuration"
    refusal = None
    if others or len(chosen) != 1:
        refusal = (f"its sentence-transformers pooling ({', '.join(others + [k for k in MODES if config.get(k)])}) is "
                   f"not served: one of {', '.join(MODES)} is")
    elif prompt and config.get("include_prompt") is False:
        refusal = "its pooling leaves the prompt's tokens out (include_prompt: false), which is not served"
    pooling = Pooling(chosen[0], normalize="Normalize" in kinds) if len(chosen) == 1 else DEFAULT
    return EmbeddingPooling(pooling, prompt, source, refusal)


def _default_prompt(directory: pathlib.Path) -> str:
    path = directory / "config_sentence_transformers.json"
    if not path.is_file():
        return ""
    config = _json(path)
    name, prompts = config.get("default_prompt_name"), config.get("prompts") or {}
    return str(prompts.get(name, "")) if name else ""
