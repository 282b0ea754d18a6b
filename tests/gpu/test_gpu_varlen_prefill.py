"""Prefill attention in variable-length launches (`layers/kernels/varlen_prefill.py`: fresh prompts in one, prompts
resumed over cached context in another) against the torch reference's per-sequence prefill, in a step that mixes
fresh prompts (not contiguous), resumed prompts and decode rows (run on a CUDA machine: `python -m pytest
tests/gpu`; not in `make test`)."""

import pytest
import torch

from loraplex.layers.attention import PagedAttention, TorchAttentionBackend, TritonAttentionBackend
from loraplex.layers.forward_context import AttentionMetadata, DecodeGroup
from loraplex.layers.kernels.varlen_prefill import resumed_varlen_usable, varlen_usable
from tests.gpu.test_gpu_parity import DEVICE

TOLERANCE = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
BLOCK = 16
# (new rows, tokens after the step): fresh, decode, fresh, resumed over 30 cached, fresh of one row, fresh, resumed
# over 290 cached
SEQS = [(5, 5), (1, 20), (37, 37), (10, 40), (1, 1), (70, 70), (7, 297)]


def mixed_step(heads, kv_heads, dim, dtype, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    rows = sum(new for new, _ in SEQS)
    q = torch.randn(rows, heads, dim, generator=g, device=DEVICE).to(dtype)
    k, v = (torch.randn(rows, kv_heads, dim, generator=g, device=DEVICE).to(dtype) for _ in range(2))
    widest = -(-max(total for _, total in SEQS) // BLOCK)
    num_blocks = len(SEQS) * widest + 2
    cache = [torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=g, device=DEVICE).to(dtype) for _ in range(2)]
    tables = torch.randperm(num_blocks, generator=g, device=DEVICE)[: len(SEQS) * widest].view(len(SEQS), widest)
    starts, slots = [0], []
    for s, (new, total) in enumerate(SEQS):
        starts.append(starts[-1] + new)
        slots += [int(tables[s, p // BLOCK]) * BLOCK + p % BLOCK for p in range(total - new, total)]
    decode = [s for s, (new, _) in enumerate(SEQS) if new == 1 and SEQS[s][1] > 1]
    decode_rows = torch.tensor([starts[s] for s in decode], device=DEVICE)
    group = DecodeGroup(torch.tensor(decode, device=DEVICE), decode_rows,
                        torch.tensor([SEQS[s][1] for s in decode], device=DEVICE), max(SEQS[s][1] for s in decode))
    md = AttentionMetadata(slot_mapping=torch.tensor(slots, device=DEVICE), block_tables=tables,
                           seq_lens=[total for _, total in SEQS], query_start_loc=starts, decode_groups=[group],
                           prefill_seqs=[s for s in range(len(SEQS)) if s not in decode])
    return q, k, v, cache, md


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(32, 8, 128), (9, 3, 64), (4, 4, 32)], ids=["gqa-8b", "gqa-135m", "mha"])
@pytest.mark.parametrize("window", [None, 8])
def test_varlen_launches_match_the_reference_prefill(dtype, shape, window):
    heads, kv_heads, dim = shape
    layer = PagedAttention(0, heads, kv_heads, dim, dim ** -0.5, sliding_window=window)
    q, k, v, cache, md = mixed_step(heads, kv_heads, dim, dtype)
    assert varlen_usable(q, kv_heads), "the variable-length kernel should run on this GPU in 16-bit floats"
    assert resumed_varlen_usable(q, kv_heads), "its causal mask should align queries to the end of their keys"
    expected = TorchAttentionBackend().forward(layer, q, k, v, [c.clone() for c in cache], md)
    got = TritonAttentionBackend().forward(layer, q, k, v, [c.clone() for c in cache], md)
    assert md.step_cache["fresh prompts"].others == [3, 6]  # the resumed prompts took the second launch
    assert md.step_cache["resumed prompts"].cu_seqlens_k.tolist() == [0, 40, 337]
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCE[dtype])


def test_float32_keeps_the_reference_path():
    q = torch.zeros(3, 4, 32, device=DEVICE)
    assert not varlen_usable(q, 4)
