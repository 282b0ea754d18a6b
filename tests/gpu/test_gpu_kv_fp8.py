"""The FP8 KV cache's Triton paths against the torch reference (layers/kv_quant.py): the KV write (bit for bit), the
paged decode (GQA, windows, ALiBi; per-KV-head scales), the variable-length prefill over cached context; then the
engine under CUDA graphs with `kv_cache_dtype="fp8"`: batch == solo, graphs == eager, the Triton backend's tokens ==
the torch backend's, scales set after capture read by the graphs (run on a CUDA machine: `python -m pytest
tests/gpu`; not in `make test`)."""

import random

import pytest
import torch

from loraplex.layers.attention import PagedAttention, TorchAttentionBackend, TritonAttentionBackend
from loraplex.layers.kv_quant import FP8_KV_DTYPE, LayerKVCache, dequantize, quantize
from loraplex.params import SamplingParams
from tests.gpu.test_gpu_paged_decode import decode_case
from tests.gpu.test_gpu_parity import DEVICE
from tests.gpu.test_gpu_varlen_prefill import mixed_step
from tests.helpers import engine_for, load_ours, ours_from_hf, tiny_hf_model, tiny_mpt, tiny_t5

if not torch.cuda.is_available():
    pytest.fail("tests/gpu needs a CUDA device", pytrace=False)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("an FP8 KV cache needs compute capability 8.9 (Ada, Hopper)", allow_module_level=True)

FP8 = FP8_KV_DTYPE
# The kernel folds the per-head scales into the scores and the output; the reference multiplies each value back
# first and rounds it to the query's dtype: they differ by that rounding.
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
             torch.float16: dict(atol=5e-3, rtol=5e-3)}


def scales_for(kv_heads: int, seed: int) -> torch.Tensor:
    """Float32 [2, Hkv] scales of 1/50 to 1/25: the random values below (up to ~5) fill e4m3's range unsaturated."""
    g = torch.Generator().manual_seed(seed)
    return (0.02 + 0.02 * torch.rand(2, kv_heads, generator=g)).to(DEVICE)


def as_fp8(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A cache [blocks, block_size, Hkv, D] of random values stored as an FP8 cache stores them."""
    return quantize(cache, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv_heads,dim", [(8, 128), (3, 80)])
def test_the_kv_write_kernel_stores_the_references_bytes(dtype, kv_heads, dim):
    from loraplex.layers.kernels.kv_write import write_kv

    blocks, block_size, rows = 6, 16, 5
    caches = [torch.zeros(blocks, block_size, kv_heads, dim, device=DEVICE, dtype=FP8) for _ in range(2)]
    expected = [c.clone() for c in caches]
    qkv = torch.randn(rows, 3 * kv_heads * dim, device=DEVICE).to(dtype)  # k and v strided views, as a fused product's
    k, v = (t.view(rows, kv_heads, dim) for t in qkv.split(kv_heads * dim, dim=-1)[1:])
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, float("nan")], dtype=dtype)  # saturated both ways; NaN kept
    slots = torch.tensor([3, 17, 40, 95, 64], device=DEVICE)
    scales = scales_for(kv_heads, seed=1)
    write_kv(*caches, slots, k, v, scales)
    TorchAttentionBackend._write_kv(*expected, slots, k, v, scales)
    for got, want in zip(caches, expected):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert caches[0].view(-1, kv_heads, dim)[3, 0, :2].float().tolist() == [448.0, -448.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(32, 8, 128), (9, 3, 64), (4, 4, 32)], ids=["gqa-8b", "gqa-135m", "mha"])
@pytest.mark.parametrize("modifier", ["plain", "window", "alibi"])
def test_paged_decode_over_an_fp8_cache_matches_the_reference(dtype, shape, modifier):
    heads, kv_heads, dim = shape
    seq_lens = [1, 7, 16, 17, 100, 1000, 2049, 33]
    slopes = torch.tensor([2 ** (-8 * (h + 1) / heads) for h in range(heads)]) if modifier == "alibi" else None
    layer = PagedAttention(0, heads, kv_heads, dim, dim ** -0.5, sliding_window=50 if modifier == "window" else None,
                           alibi_slopes=slopes)
    q, k, v, md = decode_case(heads, kv_heads, dim, seq_lens, dtype)
    scales = scales_for(kv_heads, seed=2)
    k, v = as_fp8(k, scales[0]), as_fp8(v, scales[1])
    expected = TorchAttentionBackend()._decode(layer, q, k, v, md, 0, scales).float()
    got = TritonAttentionBackend()._decode(layer, q, k, v, md, 0, scales).float()
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    # Against the float cache the FP8 one rounds: the same attention within e4m3's precision.
    k_float, v_float = dequantize(k, scales[0], dtype), dequantize(v, scales[1], dtype)
    torch.testing.assert_close(got, TorchAttentionBackend()._decode(layer, q, k_float, v_float, md, 0).float(),
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("window", [None, 8])
def test_varlen_prefill_over_an_fp8_cache_matches_the_reference(dtype, window):
    heads, kv_heads, dim = 32, 8, 128
    layer = PagedAttention(0, heads, kv_heads, dim, dim ** -0.5, sliding_window=window)
    q, k, v, cache, md = mixed_step(heads, kv_heads, dim, dtype)
    scales = scales_for(kv_heads, seed=3)
    stored = [as_fp8(cache[0], scales[0]), as_fp8(cache[1], scales[1])]

    def fresh_cache():
        return LayerKVCache(stored[0].clone(), stored[1].clone(), scales)

    expected = TorchAttentionBackend().forward(layer, q, k, v, fresh_cache(), md)
    got = TritonAttentionBackend().forward(layer, q, k, v, fresh_cache(), md)
    assert md.step_cache["resumed prompts"].cu_seqlens_k.tolist() == [0, 40, 337]  # the resumed launch ran
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCE[dtype])


def tokens(engine, batch, new=24):
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    return [r.token_ids for r in engine.generate(batch, params)]


def prompts(count, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 90))] for _ in range(count)]


def model_of(kind, tmp_path, dtype=torch.float32):
    if kind in ("mpt-alibi", "t5"):
        ours, config = load_ours(tiny_mpt() if kind == "mpt-alibi" else tiny_t5(gated=True, seed=3), tmp_path)
        return ours.to(DEVICE, dtype), config
    overrides = {"sliding_window": 24} if kind == "mistral" else {}
    return ours_from_hf(tiny_hf_model(kind, **overrides).to(DEVICE), device=DEVICE, dtype=dtype)


# T5 in float32 only, as tests/gpu/test_gpu_seq2seq.py runs it.
@pytest.mark.parametrize("kind, dtype", [(kind, dtype) for kind in ("llama", "mistral", "mpt-alibi", "t5")
                                         for dtype in (torch.float32, torch.bfloat16)
                                         if not (kind == "t5" and dtype == torch.bfloat16)], ids=str)
def test_engine_with_an_fp8_cache_under_graphs_batch_equals_solo_and_eager(kind, dtype, tmp_path):
    ours, config = model_of(kind, tmp_path, dtype)
    graphed = engine_for(ours, config, device=DEVICE, dtype=dtype, kv_cache_dtype="fp8")
    assert graphed.runner.kv_caches[0].keys.dtype == FP8
    batch = prompts(8, min(config.vocab_size, 300), seed=1)
    together = tokens(graphed, batch)
    solo = [tokens(graphed, [p])[0] for p in batch]
    eager = engine_for(ours, config, device=DEVICE, dtype=dtype, kv_cache_dtype="fp8", cuda_graphs=False)
    without = tokens(eager, batch)
    if dtype == torch.float32:
        assert together == solo == without
    else:  # as tests/gpu/test_gpu_decode_graphs.py: fused kernels reduce in another order, a near tie may flip
        for other in (solo, without):
            first = sum(a[0] == b[0] for a, b in zip(together, other))
            same = sum(a == b for a, b in zip(together, other))
            assert first >= len(batch) - 1 and same >= 0.6 * len(batch), f"{first} first tokens, {same} sequences agree"
    if graphed.runner.decode_graphs is not None:  # decoder-only families
        assert graphed.runner.decode_graphs.num_captured >= 1


@pytest.mark.parametrize("kind", ["llama", "mpt-alibi"])
def test_the_triton_backends_tokens_are_the_torch_backends(kind, tmp_path, monkeypatch):
    """With scales of 1 the kernel and the reference see the same values: only their sums' order differs."""
    ours, config = model_of(kind, tmp_path)
    batch = prompts(8, min(config.vocab_size, 300), seed=2)
    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("LORAPLEX_ATTENTION_BACKEND", backend)
        runs[backend] = tokens(engine_for(ours, config, device=DEVICE, kv_cache_dtype="fp8"), batch, new=40)
    assert runs["triton"] == runs["torch"]


def test_scales_set_after_capture_are_read_by_the_graphs():
    ours, config = ours_from_hf(tiny_hf_model("llama").to(DEVICE), device=DEVICE)
    batch = prompts(4, config.vocab_size, seed=3)
    scales = {i: (0.004, torch.tensor([0.002, 0.003])) for i in range(config.num_layers)}
    graphed = engine_for(ours, config, device=DEVICE, kv_cache_dtype="fp8")
    tokens(graphed, prompts(4, config.vocab_size, seed=4))  # captures the graphs with scales of 1
    graphed.set_kv_scales(scales)
    eager = engine_for(ours, config, device=DEVICE, kv_cache_dtype="fp8", cuda_graphs=False)
    eager.set_kv_scales(scales)
    assert tokens(graphed, batch) == tokens(eager, batch)
    assert graphed.runner.decode_graphs.num_captured >= 1


def test_an_fp8_cache_sized_from_free_memory_holds_twice_the_tokens():
    from loraplex.config import EngineConfig
    from loraplex.engine.loading import LoadedModel
    from loraplex.engine.memory import kv_cache_blocks

    ours, config = ours_from_hf(tiny_hf_model("llama").to(DEVICE), device=DEVICE, dtype=torch.bfloat16)
    loaded = LoadedModel(ours, config, None, torch.device(DEVICE), torch.bfloat16, "test-model")
    torch.cuda.synchronize()
    blocks = {name: kv_cache_blocks(EngineConfig(kv_cache_memory_fraction=0.02, kv_cache_dtype=name,
                                                 max_total_tokens=4096), loaded)  # resolved, as Engine passes it
              for name in ("auto", "fp8")}
    assert abs(blocks["fp8"] / blocks["auto"] - 2) < 0.01, blocks
