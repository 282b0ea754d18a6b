"""Tiny 4-bit checkpoints in each published layout, written by the tests' own packers (independent of loraplex's
readers: each packs from the format's documented layout, element by element in vectorised form), plus the float
model whose weights are the dequantized ones (the reference).

- GPTQ v1: qweight int32 [K/8, N], feature 8i + j in nibble j of word i; qzeros int32 [G, N/8], column 8c + j in
  nibble j of word c, holding zero - 1; scales fp16 [G, N]; g_idx int32 [K].
- AWQ gemm: qweight int32 [K, N/8] and qzeros [G, N/8], nibble i of word c holding column 8c + ORDER[i],
  ORDER = 0, 2, 4, 6, 1, 3, 5, 7; scales fp16 [G, N].
- compressed-tensors pack-quantized: compressed-tensors' own pack_to_int32 (signed values, packed along K; zero
  points packed along N).
"""

from __future__ import annotations

import copy
import json
import pathlib

import torch

from loraplex.quantization.w4a16.mode import quantize_groups

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pack_nibbles(values: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """int32 words of 8 values 0..15 along `dim`: nibble i (bits 4i..) holds element order[i] of each eight."""
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // 8, 8)
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for i, element in enumerate(order):
        word |= v[..., element] << (4 * i)
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # the same 32 bits, signed
    return word.movedim(-1, dim).contiguous()


def quantized_linear(weight: torch.Tensor, group: int, symmetric: bool, act_order: bool, seed: int):
    """(q [K, N], zeros [G, N], scales fp16 [G, N], g_idx [K] or None, dequantized weight [N, K]) in the original
    feature order. Act-order assigns features to groups through a random permutation, as GPTQ's desc_act does."""
    n, k = weight.shape
    size = k if group == -1 else group
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(k)
    q_sorted, zeros, scales = quantize_groups(weight[:, perm], size, symmetric)
    q = torch.empty_like(q_sorted)
    q[perm] = q_sorted
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // size).to(torch.int32)
    per_feature = g_idx.long()
    dequantized = ((q.float() - zeros[per_feature]) * scales.float()[per_feature]).t().contiguous()
    return q, zeros, scales, (g_idx if act_order else None), dequantized


def gptq_tensors(q, zeros, scales, g_idx, size):
    k = q.shape[0]
    stored_zeros = (zeros.to(torch.int64) - 1) & 0xF
    if g_idx is None:
        g_idx = (torch.arange(k) // size).to(torch.int32)
    return {"qweight": pack_nibbles(q, 0), "qzeros": pack_nibbles(stored_zeros, 1), "scales": scales,
            "g_idx": g_idx}


def awq_tensors(q, zeros, scales, g_idx, size):
    assert g_idx is None
    return {"qweight": pack_nibbles(q, 1, AWQ_ORDER), "qzeros": pack_nibbles(zeros, 1, AWQ_ORDER), "scales": scales}


def compressed_tensors_tensors(q, zeros, scales, g_idx, size, symmetric: bool):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    k, n = q.shape
    signed = (q.to(torch.int16) - 8).to(torch.int8).t().contiguous()  # [N, K]
    tensors = {"weight_packed": pack_to_int32(signed, 4), "weight_scale": scales.t().contiguous(),
               "weight_shape": torch.tensor([n, k])}
    if not symmetric:
        zero_points = (zeros.to(torch.int16) - 8).to(torch.int8).t().contiguous()  # [N, G]
        tensors["weight_zero_point"] = pack_to_int32(zero_points, 4, packed_dim=0)
    if g_idx is not None:
        tensors["weight_g_idx"] = g_idx
    return tensors


def quantization_config(fmt: str, group: int, symmetric: bool, act_order: bool) -> dict:
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": symmetric,
                "checkpoint_format": "gptq"}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "dynamic": False,
               "strategy": "channel" if group == -1 else "group", "group_size": None if group == -1 else group,
               "actorder": "group" if act_order else None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head"]}


def write_checkpoint(hf_model, path: pathlib.Path, fmt: str, group: int, symmetric: bool = False,
                     act_order: bool = False):
    """Save `hf_model` quantized in `fmt` (gptq, awq, compressed-tensors) to `path`; returns the float reference:
    a copy of `hf_model` whose quantized linears hold the dequantized weights."""
    from safetensors.torch import save_file

    reference = copy.deepcopy(hf_model)
    state = {name: t.detach().clone().contiguous() for name, t in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for index, (name, module) in enumerate(reference.named_modules()):
        if name.rpartition(".")[2] not in LINEARS:
            continue
        q, zeros, scales, g_idx, dequantized = quantized_linear(module.weight.detach(), group, symmetric, act_order,
                                                                seed=index)
        with torch.no_grad():
            module.weight.copy_(dequantized)
        size = module.in_features if group == -1 else group
        if fmt == "gptq":
            tensors = gptq_tensors(q, zeros, scales, g_idx, size)
        elif fmt == "awq":
            tensors = awq_tensors(q, zeros, scales, g_idx, size)
        else:
            tensors = compressed_tensors_tensors(q, zeros, scales, g_idx, size, symmetric)
        del state[f"{name}.weight"]
        state.update({f"{name}.{suffix}": t for suffix, t in tensors.items()})
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    config = hf_model.config.to_dict()
    config["quantization_config"] = quantization_config(fmt, group, symmetric, act_order)
    (path / "config.json").write_text(json.dumps(config))
    return reference
