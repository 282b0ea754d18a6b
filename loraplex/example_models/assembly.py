"""What the shipped example models have in common: committed parts, a cache key, a cached assembly.

An example model (`loraplex/smollm2-shapes` in `loraplex.example_models.vision`, `loraplex/smollm2-mllama-shapes`
in `loraplex.example_models.mllama`) is the embedded SmolLM2-135M-Instruct plus parts trained in this repo.
Only the parts are committed, under `examples/vision/<name>/`: the trained tensors (`PARTS_FILE`,
named as in the full checkpoint, plus `ADDED_EMBEDDINGS`: rows appended to the token embeddings),
the added tokenizer entries (`TOKENIZER_ADDITIONS`) and the files copied as they are (`COPIED_FILES`).

`ExampleParts.cached_dir` assembles the full transformers-format checkpoint from them and the embedded
model's directory, once, under loraplex's cache dir (`$LORAPLEX_CACHE`, else the platform's user cache
dir) in `vision/<name>-<key>`: written into a temp dir, then renamed (the entry appears whole or not
at all). The key hashes the parts' files, the SmolLM2 directory and the model's assembly version, so
changed parts give a new directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import time
from dataclasses import dataclass
from typing import Callable

from loraplex.checkpoints.cache import build_cached_dir, cache_dir, print_to_stderr
from loraplex.checkpoints.sources import resolve_model

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
PARTS_FILE = "vision_parts.safetensors"  # trained tensors, under their names in the full checkpoint
ADDED_EMBEDDINGS = "added_embed_tokens"  # in PARTS_FILE: rows appended to the token embeddings
TOKENIZER_ADDITIONS = "tokenizer_additions.json"  # added_tokens entries appended to SmolLM2's tokenizer.json
# Copied as they are into the assembled directory.
COPIED_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer_config.json",
    "processor_config.json",
    "chat_template.jinja",
)


@dataclass(frozen=True)
class ExampleParts:
    """One example model's committed parts and how its assembled directory is cached."""

    model_id: str  # "loraplex/<name>"; the cache entry is vision/<name>-<key>
    default_dir: pathlib.Path  # the committed parts: <repo>/examples/vision/<name>
    version: str  # the assembly version: bump when the output changes for the same parts
    script: str  # what remakes the parts, relative to the repository root
    needed: tuple[str, ...] = (*COPIED_FILES, PARTS_FILE, TOKENIZER_ADDITIONS)

    def parts_dir(self, parts_dir: str | os.PathLike | None) -> pathlib.Path:
        return pathlib.Path(parts_dir).expanduser().resolve() if parts_dir is not None else self.default_dir

    def files(self, parts_dir: pathlib.Path) -> list[pathlib.Path]:
        """The parts' files, in a fixed order; FileNotFoundError naming those that are missing."""
        missing = [name for name in self.needed if not (parts_dir / name).is_file()]
        if missing:
            where = os.path.relpath(self.default_dir, REPO_ROOT)
            raise FileNotFoundError(
                f"{parts_dir}: the parts of the example model {self.model_id} are missing ({', '.join(missing)}); "
                f"they are committed in the loraplex repository under {where} (a wheel does not ship them), "
                f"and {self.script} remakes them"
            )
        return [parts_dir / name for name in self.needed]

    def cache_key(self, parts_dir: pathlib.Path, base_dir: pathlib.Path) -> str:
        digest = hashlib.sha256(f"assembly {self.version}\nbase {base_dir.resolve()}\n".encode())
        for path in self.files(parts_dir):
            digest.update(f"{path.name}\n".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
        return digest.hexdigest()[:16]

    def cached_dir(
        self,
        assemble: Callable[[pathlib.Path, pathlib.Path, pathlib.Path], object],
        progress: Callable[[str], None] = print_to_stderr,
        parts_dir: str | os.PathLike | None = None,
    ) -> pathlib.Path:
        """The assembled directory: from the cache, or made now by `assemble(out, parts, base)`."""
        parts = self.parts_dir(parts_dir)
        self.files(parts)  # a clear error before the base model is converted
        base = resolve_model(None, progress=progress).path
        name = self.model_id.rsplit("/", 1)[-1]
        final = cache_dir() / "vision" / f"{name}-{self.cache_key(parts, base)}"

        def build(tmp: pathlib.Path) -> None:
            started = time.perf_counter()
            progress(f"assembling {self.model_id} from {parts} and {base} (once; cached in {final.parent})")
            assemble(tmp, parts, base)
            progress(f"assembled {self.model_id} in {time.perf_counter() - started:.1f}s")

        return build_cached_dir(final, build)


def check_base_config(base_dir: pathlib.Path, expected: dict, parts_dir: pathlib.Path, what: str) -> None:
    """The embedded model's config.json has `expected`'s values, else the parts were made for another base."""
    base_config = json.loads((base_dir / "config.json").read_text())
    for key, value in expected.items():
        if base_config.get(key) != value:
            raise ValueError(
                f"the embedded model's {key} is {base_config.get(key)}, {what} expects {value}: the parts in "
                f"{parts_dir} were made for another base model"
            )


def copy_parts_files(parts_dir: pathlib.Path, base_dir: pathlib.Path, out: pathlib.Path) -> None:
    """Into `out`: `COPIED_FILES` as they are, and SmolLM2's tokenizer.json with `TOKENIZER_ADDITIONS` appended."""
    for name in COPIED_FILES:
        shutil.copyfile(parts_dir / name, out / name)
    tokenizer = json.loads((base_dir / "tokenizer.json").read_text(encoding="utf-8"))
    taken = {entry["id"] for entry in tokenizer["added_tokens"]}
    for entry in json.loads((parts_dir / TOKENIZER_ADDITIONS).read_text()):
        if entry["id"] in taken:
            raise ValueError(f"token id {entry['id']} ({entry['content']}) is already taken in {base_dir}/tokenizer.json")
        tokenizer["added_tokens"].append(entry)
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False, indent=2), encoding="utf-8")
