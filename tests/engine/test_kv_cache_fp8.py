"""The FP8 KV cache (`--kv-cache-dtype fp8`, layers/kv_quant.py) on the CPU's torch path, which CI runs: logits close
to those over a float cache (prefill and decode steps reading every key back from the cache; T5's cross-attention
states, Mllama's image states, LLaVA's image tokens too), greedy tokens equal wherever the float cache's choice is not a near tie, twice the blocks of a bfloat16
cache for the same memory, prefix-cache hits that give the tokens of a miss, and scales that change what is stored
but not the logits."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.config import EngineConfig
from loraplex.engine.engine import Engine
from loraplex.engine.scheduling.kv_cache import blocks_for
from loraplex.engine.loading import LoadedModel
from loraplex.engine.memory import kv_cache_blocks
from loraplex.engine.requests.request import Request
from loraplex.engine.worker.runner import ModelRunner
from loraplex.engine.scheduling.scheduler import ScheduledRequest
from loraplex.layers.attention import TorchAttentionBackend
from loraplex.layers.forward_context import ForwardContext, forward_context
from loraplex.layers.kv_quant import FP8_KV_DTYPE, KVCacheDtypeError, resolve_kv_cache_dtype, set_kv_scales
from loraplex.params import SamplingParams
from tests.helpers import (encoder_decoder_logits, engine_for, greedy_tokens, image_model_logits, load_ours,
                           ours_from_hf, tiny_hf_model, tiny_t5)
from tests.mllama_fixtures import pictures, request_inputs, tiny_pair

FP8 = FP8_KV_DTYPE
# e4m3 keeps 3 mantissa bits (a relative error up to 1/16 per stored value): the logits of these tiny models move
# by at most this much, in units of their spread (standard deviation over the vocabulary).
LOGIT_TOLERANCE = 0.15


@pytest.fixture(scope="module")
def llama():
    return ours_from_hf(tiny_hf_model("llama", seed=0))


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    """A tiny T5 v1.1 with transformers' own initialisation: tests.helpers.tiny_t5 draws its weights wider (so that
    greedy tokens vary), which makes its attention scores so large that e4m3's rounding of the keys moves its logits
    by their whole spread; calibrated scales do not help there (the rounding is relative)."""
    import transformers

    hf = tiny_t5(gated=True)
    torch.manual_seed(3)
    hf = transformers.T5ForConditionalGeneration(hf.config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return load_ours(hf, tmp_path_factory.mktemp("t5"))


@torch.inference_mode()
def forced_logits(model, config, prompt: list[int], fed: list[int], kv_dtype=None, scales=None):
    """Next-token logits after a prefill of `prompt` and after each of the decode steps that feed `fed` one token at
    a time (each reads every earlier key and value from the cache), and the runner (its caches)."""
    dtype = next(model.parameters()).dtype
    runner = ModelRunner(model, config.num_layers, config.num_kv_heads, config.head_dim, 8, 16, torch.device("cpu"),
                         dtype, kv_cache_dtype=kv_dtype)
    if scales:
        runner.set_kv_scales(scales)
    request = Request("probe", list(prompt), SamplingParams(max_new_tokens=len(fed) + 1), 0, 0.0)
    request.block_ids = list(range(blocks_for(len(prompt) + len(fed), 16)))
    rows = []
    for new in [len(prompt)] + [1] * len(fed):
        batch = runner.batches.build([ScheduledRequest(request, new)])
        with forward_context(ForwardContext(batch.metadata, runner.kv_caches, runner.backend, None)):
            rows.append(model.compute_logits(model(batch.input_ids, batch.positions))[-1].float())
        request.num_computed_tokens += new
        if len(request.output_ids) < len(fed):
            request.output_ids.append(fed[len(request.output_ids)])
    return torch.stack(rows), runner


def assert_close_logits(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within LOGIT_TOLERANCE of the float cache's logits, and the same greedy token wherever the float cache's best
    two are further apart than twice that (most positions: the comparison is not vacuous)."""
    spread = expected.std(dim=-1, keepdim=True)
    error = ((got - expected).abs() / spread).max().item()
    assert error <= LOGIT_TOLERANCE, f"logits moved by {error:.3f} of their spread"
    top2 = expected.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) / spread[:, 0] > 2 * LOGIT_TOLERANCE
    assert decided.float().mean() >= 0.3, "too few positions where the float cache's choice is clear"
    assert torch.equal(got.argmax(-1)[decided], expected.argmax(-1)[decided])


def test_prefill_and_decode_over_an_fp8_cache_match_the_float_cache(llama):
    ours, config = llama
    rng = random.Random(0)
    prompt, fed = [rng.randrange(256) for _ in range(21)], [rng.randrange(256) for _ in range(19)]  # 3 blocks
    expected, _ = forced_logits(ours, config, prompt, fed)
    got, runner = forced_logits(ours, config, prompt, fed, FP8)
    assert all(c.keys.dtype == c.values.dtype == FP8 for c in runner.kv_caches)
    assert_close_logits(got, expected)


def test_t5_self_and_cross_attention_over_an_fp8_cache(t5):
    ours, config = t5
    rng = random.Random(1)
    for encoder_len, decoder_len in [(23, 9), (40, 18)]:
        encoder_ids = [rng.randrange(2, 300) for _ in range(encoder_len)]
        decoder_ids = [0] + [rng.randrange(2, 300) for _ in range(decoder_len - 1)]
        expected = encoder_decoder_logits(ours, config, encoder_ids, decoder_ids)
        got = encoder_decoder_logits(ours, config, encoder_ids, decoder_ids, kv_cache_dtype=FP8)
        assert_close_logits(got, expected)


def test_mllama_image_states_in_an_fp8_state_pool(tmp_path):
    _, processor, model, config = tiny_pair(tmp_path)
    token_ids, images = request_inputs(processor, "<|image|>A picture of", pictures([(40, 60)], seed=0))
    expected = image_model_logits(engine_for(model, config), token_ids, images)
    engine = engine_for(model, config, kv_cache_dtype="fp8")
    assert all(engine.runner.kv_caches[i].keys.dtype == FP8 for i in engine.runner.state_layers)
    assert_close_logits(image_model_logits(engine, token_ids, images), expected)


def test_llava_image_tokens_through_an_fp8_cache(tmp_path):
    from loraplex.multimodal.image_inputs import ImageInputs
    from tests.models.test_llava_next_parity import IMAGE_TOKEN, TALL, image, inputs, processor, saved, tiny_llava

    model, config = saved(tiny_llava(seed=0), tmp_path)
    ids, pixel_values, sizes = inputs(processor(), "w5 w17 <image> w3 w99 w42", [image(TALL, 0)])
    images = ImageInputs.for_prompt(ids, pixel_values, sizes, IMAGE_TOKEN)
    expected = image_model_logits(engine_for(model, config), ids, images)
    assert_close_logits(image_model_logits(engine_for(model, config, kv_cache_dtype="fp8"), ids, images), expected)


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_engine_batch_equals_solo_and_the_stepwise_reference(family, llama, t5):
    """The engine over an FP8 cache (scheduling, block tables, zeroed fresh blocks): requests in one batch get the
    tokens each gets alone; a Llama's are the greedy tokens of the step-by-step reference above."""
    ours, config = llama if family == "llama" else t5
    rng = random.Random(2)
    prompts = [[rng.randrange(2, 256) for _ in range(n)] for n in (5, 30, 17, 2)]
    batched = greedy_tokens(engine_for(ours, config, kv_cache_dtype="fp8"), prompts, 8)
    assert batched == [greedy_tokens(engine_for(ours, config, kv_cache_dtype="fp8"), [p], 8)[0] for p in prompts]
    if family == "llama":
        for prompt, tokens in zip(prompts, batched):
            logits, _ = forced_logits(ours, config, prompt, tokens[:-1], FP8)
            assert logits.argmax(-1).tolist() == tokens


def test_an_fp8_cache_holds_twice_the_tokens_of_a_bfloat16_cache_in_the_same_memory(llama):
    ours, config = llama
    model = ours_from_hf(tiny_hf_model("llama", seed=0), dtype=torch.bfloat16)[0]
    loaded = LoadedModel(model, config, None, torch.device("cpu"), torch.bfloat16, "test-model")
    cfg = EngineConfig(max_total_tokens=16)  # the budget on CPU: the weights' bytes
    auto = kv_cache_blocks(cfg, loaded)
    fp8 = kv_cache_blocks(EngineConfig(max_total_tokens=16, kv_cache_dtype="fp8"), loaded)
    assert auto > 4 and abs(fp8 - 2 * auto) <= 1
    engine = Engine(loaded, EngineConfig(max_total_tokens=16, kv_cache_dtype="fp8"))
    assert engine.kv_capacity_tokens == fp8 * 16 and engine.kv_cache_dtype == FP8


def test_a_prefix_cache_hit_over_an_fp8_cache_gives_the_tokens_of_a_miss(llama):
    ours, config = llama
    rng = random.Random(3)
    shared = [rng.randrange(256) for _ in range(40)]  # two full blocks to share
    prompts = [shared + [rng.randrange(256) for _ in range(n)] for n in (3, 9, 1, 20)]
    misses = greedy_tokens(engine_for(ours, config, kv_cache_dtype="fp8", prefix_caching=False), prompts, 6)
    engine = engine_for(ours, config, kv_cache_dtype="fp8")
    hits = greedy_tokens(engine, prompts[:1], 6) + greedy_tokens(engine, prompts[1:], 6)
    assert engine.scheduler.prefix_hits >= 3 * 32
    assert hits == misses


def test_preempted_requests_recompute_into_an_fp8_cache_with_unchanged_tokens(llama):
    ours, config = llama
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (30, 25, 20, 28)]
    roomy = greedy_tokens(engine_for(ours, config, kv_cache_dtype="fp8"), prompts, 12)
    tight = engine_for(ours, config, kv_cache_dtype="fp8", max_batch_total_tokens=112, max_total_tokens=64,
                       prefix_caching=False)
    assert greedy_tokens(tight, prompts, 12) == roomy
    assert tight.scheduler.num_preemptions > 0, "the test meant to force a preemption"


def test_speculative_drafts_over_an_fp8_cache_give_the_tokens_without_drafts(llama):
    from tests.engine.test_speculative_tiny import repetitive_prompts

    ours, config = llama
    prompts = repetitive_prompts(256, [7, 30, 13, 21])
    want = greedy_tokens(engine_for(ours, config, kv_cache_dtype="fp8"), prompts, 16)
    engine = engine_for(ours, config, kv_cache_dtype="fp8", speculative_tokens=4, block_size=8)
    assert greedy_tokens(engine, prompts, 16) == want
    assert engine.spec_decode.accepted_tokens > 0


def test_scales_change_the_stored_bytes_not_the_logits(llama):
    ours, config = llama
    rng = random.Random(4)
    prompt, fed = [rng.randrange(256) for _ in range(20)], [rng.randrange(256) for _ in range(12)]
    expected, _ = forced_logits(ours, config, prompt, fed)
    _, plain = forced_logits(ours, config, prompt, fed, FP8)
    # Per tensor on layer 0; per KV head on layer 1 (the tiny model has 2).
    scales = {0: (0.004, 0.002), 1: (torch.tensor([0.003, 0.005]), torch.tensor([0.002, 0.001]))}
    got, scaled = forced_logits(ours, config, prompt, fed, FP8, scales)
    assert scaled.kv_caches[1].scales[0].tolist() == pytest.approx([0.003, 0.005])
    for before, after in zip(plain.kv_caches, scaled.kv_caches):
        assert not torch.equal(before.keys.view(torch.uint8), after.keys.view(torch.uint8))
        assert not torch.equal(before.values.view(torch.uint8), after.values.view(torch.uint8))
    assert_close_logits(got, expected)


def test_kv_scales_are_checked():
    backend = TorchAttentionBackend()
    fp8 = backend.allocate_kv_cache(2, 3, 4, 2, 8, FP8, torch.device("cpu"))
    with pytest.raises(ValueError, match="positive"):
        set_kv_scales(fp8, {0: (0.0, 1.0)})
    with pytest.raises(ValueError, match="3 scales for 2 KV heads"):
        set_kv_scales(fp8, {1: (torch.ones(3), 1.0)})
    with pytest.raises(ValueError, match="2 attention layers"):
        set_kv_scales(fp8, {2: (1.0, 1.0)})
    with pytest.raises(ValueError, match="not fp8"):
        set_kv_scales(backend.allocate_kv_cache(1, 3, 4, 2, 8, torch.float32, torch.device("cpu")), {0: (1.0, 1.0)})


def test_fresh_fp8_blocks_are_zeroed_in_every_layer():
    backend = TorchAttentionBackend()
    caches = backend.allocate_kv_cache(2, 4, 4, 2, 8, FP8, torch.device("cpu"))
    for c in caches:
        c.keys.view(torch.uint8).fill_(0x38)  # 1.0
        c.values.view(torch.uint8).fill_(0xB8)  # -1.0
    backend.clear_blocks(caches, [2])
    for c in caches:
        assert not c.keys[2].float().any() and not c.values[2].float().any()
        assert (c.keys[[0, 1, 3]].float() == 1.0).all() and (c.values[[0, 1, 3]].float() == -1.0).all()


def test_the_cache_dtype_resolves_or_is_refused_in_one_line():
    cpu = torch.device("cpu")
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.float32, cpu) == FP8
    with pytest.raises(KVCacheDtypeError, match="expected one of auto, fp8"):
        resolve_kv_cache_dtype("int4", torch.float32, cpu)


@pytest.mark.parametrize("window", [None, 8])
def test_the_triton_backends_prefill_plumbing_reads_an_fp8_cache_as_the_reference(monkeypatch, window):
    """Fresh prompts (their new keys rounded as stored) and prompts resumed over cached context (keys gathered and
    read back), through the Triton backend's variable-length calls with the kernel's CPU stand-in."""
    from loraplex.layers.attention import PagedAttention, TritonAttentionBackend
    from loraplex.layers.kernels import varlen_prefill
    from loraplex.layers.kv_quant import LayerKVCache, quantize
    from tests.unit.test_varlen_plumbing import kernel_stand_in, step

    calls = []
    monkeypatch.setattr(varlen_prefill, "varlen_usable", lambda q, kv_heads: True)
    monkeypatch.setattr(varlen_prefill, "resumed_varlen_usable", lambda q, kv_heads: True)
    monkeypatch.setattr(varlen_prefill, "causal_varlen", lambda *a: calls.append(a) or kernel_stand_in(*a))
    layer = PagedAttention(0, 4, 2, 8, 8**-0.5, sliding_window=window)
    q, k, v, cache, md = step()
    scales = torch.tensor([[0.01, 0.02], [0.03, 0.015]])
    stored = [quantize(cache[0], scales[0]), quantize(cache[1], scales[1])]
    fp8_cache = lambda: LayerKVCache(stored[0].clone(), stored[1].clone(), scales)  # noqa: E731
    expected = TorchAttentionBackend().forward(layer, q, k, v, fp8_cache(), md)
    _, _, _, _, md = step()
    got = TritonAttentionBackend().forward(layer, q, k, v, fp8_cache(), md)
    assert len(calls) == 2  # the fresh prompts' call and the resumed prompts'
    torch.testing.assert_close(got, expected)
