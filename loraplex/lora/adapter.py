"""A PEFT LoRA adapter: its configuration (lora/lora_config.py, read exactly as PEFT applies it) and its weights per
module.

An adapter is an `adapter_config.json` + `adapter_model.safetensors` pair. PEFT saves the tensors of
module `M` (named as in the base model, e.g. `model.layers.3.self_attn.q_proj`) under
`base_model.model.M.lora_A.weight` [r, in] and `base_model.model.M.lora_B.weight` [out, r]; the
module's delta is `scale * B @ A @ x`, with `scale = alpha / r` (or `alpha / sqrt(r)` with rsLoRA) and
r / alpha taken from `rank_pattern` / `alpha_pattern` when a pattern matches the module's name.

`target_parameters` (PEFT's LoRA on a parameter, `ParamWrapper`) is served where it is a linear's weight (e.g. a
mixture of experts' router `gate.weight`: the same delta as a LoRA on the linear, its rank and scale those of the
parameter's name) and on the stacked experts' `gate_up_proj` / `down_proj`, cut into each expert's projections
(lora/step/expert_slices.py).

What we do not serve is refused with a message naming the field or tensor, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import pathlib
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from loraplex.checkpoints.json_files import JsonFileError, read_json_object
from loraplex.lora.errors import AdapterError, AdapterInvalid, AdapterNotFound
from loraplex.lora.step.expert_slices import STACKED_PARAMETERS, is_stacked_experts, stacked_parameter_loras
from loraplex.lora.layout import FlatFormat, Layout
from loraplex.lora.lora_config import LoraConfig, check_scale
from loraplex.lora.packed import PackedModules
from loraplex.lora.weights import LoraWeights
from loraplex.checkpoints.safetensors_header import SafetensorsHeaderError, owned_tensors, read_header, read_owned

__all__ = ["AdapterError", "AdapterInvalid", "AdapterNotFound", "LoraAdapter", "LoraConfig", "LoraWeights"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_TENSOR_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<part>A|B)\.weight$")
_BASE_COPY_KEY = re.compile(r"^(?P<module>.+)\.base_layer\.weight$")


# Bounds on what an adapter may hold, checked at load (and on merges). Trained LoRA factors are
# far below 1 in magnitude and scales (alpha / r) are around 0.5-4; values past these bounds are
# corruption or an attack. Every value must also be finite. Anything that still overflows in the
# arithmetic (e.g. in bfloat16) stays in the adapter's own rows: see `kernels.py`.
MAX_LORA_WEIGHT = 1e3  # largest |entry| of lora_A / lora_B

MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes
MAX_HEADER_BYTES = 16 << 20  # a safetensors header takes ~200 bytes per tensor; thousands of modules fit

def check_weights(name: str, weights: "LoraWeights") -> None:
    """Refuse non-finite or out-of-bound LoRA factors and scales; `name` is the module's tensor prefix."""
    for part, tensor in (("lora_A", weights.a), ("lora_B", weights.b)):
        largest = tensor.detach().abs().amax().item() if tensor.numel() else 0.0
        if not math.isfinite(largest):
            raise AdapterInvalid(f"tensor {name}.{part}.weight holds NaN or infinite values")
        if largest > MAX_LORA_WEIGHT:
            raise AdapterInvalid(
                f"tensor {name}.{part}.weight holds a value of magnitude {largest:g}, beyond the bound {MAX_LORA_WEIGHT:g}"
            )
    check_scale(weights.scale, name)


@dataclass
class LoraAdapter:
    """A loaded adapter: weights per base-model module name (only the modules it targets).

    `adapter_id` is its name for clients, logs and metrics; `key` is what the engine keys its adapters and
    device slots by: the id, unless the store holds several entries under one id (a hub adapter once per
    token scope and revision) and gives each its own `entry_key`, so that they never share a slot.

    `flat`, when set, is one buffer that every module's A and B.T are views of, laid out as
    `layout.Layout.of(modules)` says (`packed` makes it): an install copies it in one piece.

    `load_token`: a load's own random token (the store's loads have one), which the prefix cache keys blocks by
    (`cache_identity`) instead of hashing every weight in a cold load. Two loads of one adapter share no cached KV."""

    adapter_id: str
    modules: dict[str, LoraWeights]
    config: LoraConfig
    entry_key: str | None = None
    flat: torch.Tensor | None = None
    load_token: bytes | None = None

    @property
    def key(self) -> str:
        return self.entry_key or self.adapter_id

    @property
    def max_rank(self) -> int:
        if isinstance(self.modules, PackedModules):
            return self.modules.max_rank
        return max(w.rank for w in self.modules.values())

    @property
    def nbytes(self) -> int:
        if isinstance(self.modules, PackedModules):
            return self.modules.nbytes
        return sum(w.a.nbytes + w.b.nbytes for w in self.modules.values())

    def to(self, device: torch.device | str, dtype: torch.dtype) -> "LoraAdapter":
        modules = {m: w.to(device, dtype) for m, w in self.modules.items()}
        return LoraAdapter(self.adapter_id, modules, self.config, self.entry_key)

    def keyed(self, entry_key: str) -> "LoraAdapter":
        """This adapter under another cache key: the same weights, and whatever was already computed of them (its
        fingerprint, its layout) carried over rather than computed again."""
        copy = dataclasses.replace(self, entry_key=entry_key)
        for cached in ("fingerprint", "layout"):
            if cached in self.__dict__:
                copy.__dict__[cached] = self.__dict__[cached]
        return copy

    def packed(self, form: FlatFormat | None = None) -> "LoraAdapter":
        """This adapter with its weights copied into one buffer (`flat`), in `form` (lora/layout.py) for an adapter in
        host memory; else in the modules' dtype and on their device."""
        if not self.modules:
            return self
        layout = Layout.of(self.modules)
        first = next(iter(self.modules.values()))
        form = form if form is not None and first.a.is_cpu else FlatFormat(first.a.dtype)
        flat = layout.empty(form.dtype, first.a.device, form.pinned)
        for name, (a, b) in layout.views(flat).items():
            w = self.modules[name]
            a.copy_(w.a)
            b.copy_(w.b)
        # Its modules as views made when read (packed.py: a few objects for the garbage collector, not ~640).
        modules = PackedModules(flat, layout, {name: w.scale for name, w in self.modules.items()})
        return dataclasses.replace(self, modules=modules, flat=flat)

    @functools.cached_property
    def layout(self) -> Layout:
        """Where its modules lie in one flat buffer (`flat`'s layout, when it has one); kept for its installs."""
        if isinstance(self.modules, PackedModules):
            return self.modules.layout
        return Layout.of(self.modules)

    @property
    def cache_identity(self) -> bytes:
        """What the prefix cache keys this adapter's blocks by: its load's token, else its fingerprint."""
        return self.load_token if self.load_token is not None else self.fingerprint

    @functools.cached_property
    def fingerprint(self) -> bytes:
        """A digest of what the adapter computes (its weights and scales), not of its name, packed or not: the prefix
        cache keys blocks by it, so an adapter re-uploaded under the same id never reads the KV its old weights made.
        (SHA-256: with the CPU's SHA instructions the fastest of hashlib's, and it is much of a cold adapter's load.)"""
        if self.flat is None:  # hand-built: hashed as the store would pack it
            return self.packed().fingerprint if self.modules else hashlib.sha256().digest()[:16]
        scales = self.modules.scales if isinstance(self.modules, PackedModules) else \
            {name: w.scale for name, w in self.modules.items()}
        digest = hashlib.sha256(repr((sorted(scales.items()), self.layout.entries, str(self.flat.dtype))).encode())
        digest.update(self.flat.detach().cpu().reshape(-1).view(torch.uint8).numpy())  # one pass, off the interpreter
        return digest.digest()[:16]


# Shapes of the base model's LoRA-capable linears: module name -> (in_features, out_features).
BaseShapes = Mapping[str, tuple[int, int]]
# The base model's weight of a module, to check copies that PEFT saves beside the LoRA tensors.
BaseWeight = Callable[[str], torch.Tensor]
# A checkpoint tensor name -> the model's own name (see `adapter_from_tensors`).
CheckpointName = Callable[[str], str]


def _model_name(module: str, checkpoint_name: CheckpointName | None) -> str:
    if checkpoint_name is None:
        return module
    return checkpoint_name(f"{module}.weight").removesuffix(".weight")


# A tensor as the layout check sees it, before or after it is read: its shape, dtype name and whether it holds floats.
TensorSpec = tuple[tuple[int, ...], str, bool]


@dataclass(frozen=True)
class _Layout:
    """Which checkpoint tensors make each module's LoRA, and the base-layer copies PEFT saved beside them."""

    # model module name -> (the name its rank and scale are the config's for, lora_A key, lora_B key): the name PEFT
    # saw, or for a LoRA on a parameter (target_parameters) the parameter's
    modules: dict[str, tuple[str, str, str]]
    base_copies: dict[str, str]  # checkpoint key -> model module name
    # modules whose A and B are parts of the tensors (an expert's projection cut from a LoRA on the stacked
    # experts): module -> (A's index, B's index) into them
    pieces: dict[str, tuple[tuple[slice, ...], tuple[slice, ...]]] = field(default_factory=dict)


def check_layout(
    config: LoraConfig, specs: Mapping[str, TensorSpec], base: BaseShapes, checkpoint_name: CheckpointName | None = None,
) -> _Layout:
    """Check tensor names, shapes and dtypes against the config and the base model: what `adapter_from_tensors`
    checks short of the values. It runs on the file's header first, so nothing is read that could not fit."""
    parts: dict[str, dict[str, str]] = {}
    copies: dict[str, str] = {}
    for key, (shape, _, _) in specs.items():
        name = key.removeprefix(_PREFIX)
        if (copy := _BASE_COPY_KEY.match(name)) is not None:
            # PEFT saves the output head's base weights with an adapter that targets it; an unchanged
            # copy is harmless (compared with the base model's once read), a changed one is not served.
            module = _model_name(copy["module"], checkpoint_name)
            if module not in base or tuple(shape) != tuple(base[module][::-1]):
                raise AdapterInvalid(f"tensor {key}: a base-layer weight that differs from the base model's is not served")
            copies[key] = module
            continue
        if "lora_magnitude_vector" in name:
            raise AdapterInvalid(f"tensor {key}: DoRA (lora_magnitude_vector) is not served")
        if "lora_embedding_" in name:
            raise AdapterInvalid(f"tensor {key}: LoRA on embeddings is not served")
        match = _TENSOR_KEY.match(name)
        if match is None:
            raise AdapterInvalid(f"tensor {key}: not a LoRA A/B weight (only lora_A/lora_B weights are served)")
        parts.setdefault(match["module"], {})[match["part"]] = key
    if not parts:
        raise AdapterInvalid("the adapter has no LoRA tensors")

    modules: dict[str, tuple[str, str, str]] = {}
    pieces: dict[str, tuple[tuple[slice, ...], tuple[slice, ...]]] = {}
    stacked: dict[str, dict[int, tuple[str, str]]] = {}  # experts module PEFT saw -> wrapper depth -> (A, B)
    for saved, ab in sorted(parts.items()):
        module = _model_name(saved, checkpoint_name)
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise AdapterInvalid(f"module {module}: lora_{missing}.weight is missing")
        wrapped, depth = saved, 0
        while wrapped.endswith(".base_layer"):  # PEFT's nested wrappers of several parameters of one module
            wrapped, depth = wrapped.removesuffix(".base_layer"), depth + 1
        if config.target_parameters and (depth or is_stacked_experts(_model_name(wrapped, checkpoint_name), base)):
            stacked.setdefault(wrapped, {})[depth] = (ab["A"], ab["B"])
            continue
        if module not in base:
            raise AdapterInvalid(
                f"tensor {_PREFIX}{module}.lora_A.weight: the base model has no LoRA-capable linear {module!r}"
            )
        if config.targets(saved):
            named = saved
        elif config.targets_parameter(f"{saved}.weight"):  # a LoRA on the linear's weight: the same delta
            named = f"{saved}.weight"
        else:
            raise AdapterInvalid(f"tensor {_PREFIX}{saved}.lora_A.weight: module not in the config's target_modules")
        in_features, out_features = base[module]
        rank = config.rank(named)
        for part, want in (("A", (rank, in_features)), ("B", (out_features, rank))):
            shape, dtype, floating = specs[ab[part]]
            if tuple(shape) != want:
                raise AdapterInvalid(
                    f"tensor {_PREFIX}{module}.lora_{part}.weight has shape {list(shape)}; "
                    f"expected {list(want)} (rank {rank} from adapter_config.json, base linear {in_features}->{out_features})"
                )
            if not floating:
                raise AdapterInvalid(f"tensor {_PREFIX}{module}.lora_{part}.weight has dtype {dtype}; expected floats")
        modules[module] = (named, ab["A"], ab["B"])
    for saved, depths in stacked.items():
        module = _model_name(saved, checkpoint_name)
        if sorted(depths) != list(range(len(depths))):
            raise AdapterInvalid(f"module {saved}: its nested LoRA tensors skip a level ({sorted(depths)})")
        targeted = [p for p in STACKED_PARAMETERS if config.targets_parameter(f"{saved}.{p}")]
        wrappers = [depths[d] for d in range(len(depths))]
        for key in (k for pair in wrappers for k in pair):
            if not specs[key][2]:
                raise AdapterInvalid(f"tensor {key} has dtype {specs[key][1]}; expected floats")
        cut = stacked_parameter_loras(saved, module, wrappers, targeted, base, config.rank, lambda k: specs[k][0])
        for name, piece in cut.items():
            if name in modules:
                raise AdapterInvalid(f"module {name}: a LoRA both of its own and on the stacked experts {saved}")
            modules[name] = (piece.parameter, piece.a_key, piece.b_key)
            pieces[name] = (piece.a_index, piece.b_index)
    return _Layout(modules, copies, pieces)


def adapter_from_tensors(
    adapter_id: str, config: LoraConfig, tensors: Mapping[str, torch.Tensor], base: BaseShapes,
    base_weight: BaseWeight | None = None, checkpoint_name: CheckpointName | None = None,
    form: FlatFormat | None = None,
) -> LoraAdapter:
    """Check PEFT-named tensors against the config and the base model; build the adapter (CPU; checked and kept in
    `form`'s dtype: float32 by default).

    `checkpoint_name` (families whose checkpoints come in several layouts, e.g. LLaVA-NeXT saved by
    transformers 4) maps a base-model tensor name to the model's own: an adapter trained on the other
    layout then loads too. The config's patterns are matched against the names as PEFT saw them."""
    specs = {key: (tuple(t.shape), str(t.dtype).removeprefix("torch."), t.is_floating_point()) for key, t in tensors.items()}
    layout = check_layout(config, specs, base, checkpoint_name)
    for key, module in layout.base_copies.items():
        _check_base_copy(key, module, tensors[key], base_weight)
    modules: dict[str, LoraWeights] = {}
    for module, (saved, a, b) in layout.modules.items():
        a_index, b_index = layout.pieces.get(module, ((), ()))
        modules[module] = LoraWeights(tensors[a][a_index], tensors[b][b_index], config.scale(saved))
        check_scale(modules[module].scale, _PREFIX + module)
    # Converted once, as it is packed; then checked in one pass over the packed buffer (a pass per tensor holds the
    # interpreter hundreds of times: a load beside a running engine should not), per tensor only to name a bad one.
    adapter = LoraAdapter(adapter_id, modules, config).packed(form or FlatFormat(torch.float32))
    if adapter.flat is not None and adapter.flat.numel():
        low, high = torch.aminmax(adapter.flat)  # one pass, no temporary (NaN: both NaN)
        largest = max(-float(low), float(high))
        if not (math.isfinite(largest) and largest <= MAX_LORA_WEIGHT):
            for module, weights in adapter.modules.items():
                check_weights(_PREFIX + module, weights)
    return adapter


def _check_base_copy(key: str, module: str, tensor: torch.Tensor, base_weight: BaseWeight | None) -> None:
    if base_weight is not None:
        original = base_weight(module)
        if tensor.shape == original.shape and torch.allclose(tensor.float(), original.float().cpu(), atol=1e-5, rtol=1e-2):
            return
    raise AdapterInvalid(f"tensor {key}: a base-layer weight that differs from the base model's is not served")


def load_adapter_dir(
    path: pathlib.Path, adapter_id: str, base: BaseShapes, max_rank: int, base_weight: BaseWeight | None = None,
    checkpoint_name: CheckpointName | None = None, form: FlatFormat | None = None,
) -> LoraAdapter:
    """Read a PEFT adapter directory (safetensors only: pickles are refused, never opened).

    Errors name the adapter by `adapter_id` and its files by their names in it, never by `path` (a client
    reads them; where the server keeps adapters is none of its business)."""
    from safetensors import SafetensorError

    config_path, weights_path = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not config_path.is_file():
        raise AdapterNotFound(f"adapter {adapter_id!r}: no {ADAPTER_CONFIG} in the adapter's directory")
    if not weights_path.is_file():
        if (path / "adapter_model.bin").exists():
            raise AdapterInvalid(
                f"adapter {adapter_id!r} has only adapter_model.bin (a pickle); only {ADAPTER_WEIGHTS} is read"
            )
        raise AdapterNotFound(f"adapter {adapter_id!r}: no {ADAPTER_WEIGHTS} in the adapter's directory")
    try:
        raw = read_json_object(config_path, MAX_CONFIG_BYTES)
    except JsonFileError as exc:
        raise AdapterInvalid(f"adapter {adapter_id!r}: {ADAPTER_CONFIG} {exc}") from exc
    try:
        config = LoraConfig.from_dict(raw, max_rank)
        try:
            # The header first: a lying one, or tensors the base model has no place for, are refused
            # before anything is allocated from what the file says.
            header = read_header(weights_path, MAX_HEADER_BYTES)
            check_layout(config, {k: (t.shape, t.dtype, t.floating) for k, t in header.items()}, base, checkpoint_name)
            # Copied into memory of our own, never mapped: a file replaced under a load fails that load, not us.
            tensors = owned_tensors(read_owned(weights_path, header, MAX_HEADER_BYTES), header)
        except OSError as exc:  # its strerror only: the exception's text holds the path
            raise AdapterInvalid(f"{ADAPTER_WEIGHTS} cannot be read ({exc.strerror})") from exc
        except SafetensorsHeaderError as exc:  # names no path
            raise AdapterInvalid(f"{ADAPTER_WEIGHTS} is not a valid safetensors file ({exc})") from exc
        except (SafetensorError, ValueError) as exc:
            reason = str(exc).replace(str(weights_path), ADAPTER_WEIGHTS)  # should safetensors ever name it
            raise AdapterInvalid(f"{ADAPTER_WEIGHTS} is not a valid safetensors file ({reason})") from exc
        return adapter_from_tensors(adapter_id, config, tensors, base, base_weight, checkpoint_name, form)
    except AdapterInvalid as exc:
        raise AdapterInvalid(f"adapter {adapter_id!r}: {exc}") from None
