"""The Triton paged-attention decode kernel against the torch backend's decode (the reference), and the engine's
greedy tokens with each backend (run on a CUDA machine: `python -m pytest tests/gpu`; not in `make test`)."""

import random

import pytest
import torch

from loraplex.layers.attention import PagedAttention, TorchAttentionBackend, TritonAttentionBackend
from loraplex.layers.forward_context import AttentionMetadata, DecodeGroup
from loraplex.params import SamplingParams
from tests.gpu.test_gpu_parity import DEVICE, SMOLLM2_SHAPE
from tests.helpers import engine_for, load_ours, ours_from_hf, tiny_hf_model, tiny_mpt
from tests.models.test_llama_family_parity import GEMMA2

if not torch.cuda.is_available():
    pytest.fail("tests/gpu needs a CUDA device", pytrace=False)

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def decode_case(heads, kv_heads, dim, seq_lens, dtype, block_size=16, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    num_blocks = len(seq_lens) * -(-max(seq_lens) // block_size) + 3
    k = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g, device=DEVICE).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g, device=DEVICE).to(dtype)
    q = torch.randn(len(seq_lens), heads, dim, generator=g, device=DEVICE).to(dtype)
    widest = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * widest + 3
    blocks = torch.randperm(num_blocks, generator=g, device=DEVICE)[: len(seq_lens) * widest].view(len(seq_lens), widest)
    lens = torch.tensor(seq_lens, device=DEVICE)
    group = DecodeGroup(torch.arange(len(seq_lens), device=DEVICE), torch.arange(len(seq_lens), device=DEVICE), lens,
                        max(seq_lens))
    md = AttentionMetadata(slot_mapping=lens, block_tables=blocks, seq_lens=seq_lens,
                           query_start_loc=list(range(len(seq_lens) + 1)), decode_groups=[group], prefill_seqs=[])
    return q, k, v, md


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(32, 8, 128), (9, 3, 64), (4, 4, 32)], ids=["gqa-8b", "gqa-135m", "mha"])
@pytest.mark.parametrize("modifier", ["plain", "window", "alibi", "softcap-window"])
def test_kernel_matches_the_torch_decode(dtype, shape, modifier):
    heads, kv_heads, dim = shape
    seq_lens = [1, 7, 16, 17, 100, 1000, 2049, 33]
    slopes = torch.tensor([2 ** (-8 * (h + 1) / heads) for h in range(heads)]) if modifier == "alibi" else None
    # Gemma 2's: a cap of 2 on scores of unit-variance inputs (most scores reach it), every other layer sliding
    softcap = 2.0 if modifier == "softcap-window" else None
    layer = PagedAttention(0, heads, kv_heads, dim, dim ** -0.5, sliding_window=50 if "window" in modifier else None,
                           alibi_slopes=slopes, softcap=softcap)
    q, k, v, md = decode_case(heads, kv_heads, dim, seq_lens, dtype)
    expected = TorchAttentionBackend()._decode(layer, q, k, v, md, 0).float()
    got = TritonAttentionBackend()._decode(layer, q, k, v, md, 0).float()
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("model", ["smollm2-shape", "mistral-window", "mpt-alibi", "gemma2"])
def test_engine_tokens_with_either_backend(model, monkeypatch, tmp_path):
    if model == "mpt-alibi":  # MPT's checkpoint names need the loader's mapping
        ours, config = load_ours(tiny_mpt(), tmp_path)
        ours = ours.to(DEVICE)
    else:
        kind, overrides = {"smollm2-shape": ("llama", SMOLLM2_SHAPE), "mistral-window": ("mistral", {"sliding_window": 24}),
                           "gemma2": ("gemma2", {**GEMMA2, "sliding_window": 24})}[model]
        ours, config = ours_from_hf(tiny_hf_model(kind, **overrides).to(DEVICE), device=DEVICE)
    rng = random.Random(0)
    vocab = config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(3, 90))] for _ in range(8)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("LORAPLEX_ATTENTION_BACKEND", backend)  # read when the engine's runner is made
        engine = engine_for(ours, config, device=DEVICE)
        assert type(engine.runner.backend).__name__.lower().startswith(backend)
        runs[backend] = [r.token_ids for r in engine.generate(prompts, params)]
    assert runs["triton"] == runs["torch"]
