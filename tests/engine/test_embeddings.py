"""Embedding requests in the engine (engine/worker/pooling.py): a prompt's final hidden rows pooled into one vector,
in the same steps as generation, against transformers' last hidden state on the same weights (and PEFT's, for an
adapter)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraplex.params import Pooling, SamplingParams
from tests.lora.peft_helpers import peft_model, save_and_load

PROMPTS = [[1, 450, 3700, 17, 29, 88, 1024, 7, 300], [9, 9, 1201, 55, 77, 300, 14, 2048, 31, 5, 600, 4000, 12]]
EMBED = SamplingParams(max_new_tokens=1)


def embed(pooling: Pooling) -> SamplingParams:
    return dataclasses.replace(EMBED, pooling=pooling)


@torch.inference_mode()
def reference(model, ids: list[int], pooling: Pooling) -> torch.Tensor:
    """transformers: the final (normed) hidden state of the decoder, pooled the same way."""
    hidden = model.model(torch.tensor([ids])).last_hidden_state[0].float()
    vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "first": hidden[0]}[pooling.method]
    return torch.nn.functional.normalize(vector, dim=0) if pooling.normalize else vector


def cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a), b, dim=0).item()


@pytest.mark.parametrize("pooling", [Pooling("last"), Pooling("mean"), Pooling("first"), Pooling("mean", False)],
                         ids=lambda p: f"{p.method}{'' if p.normalize else '-raw'}")
def test_vectors_equal_transformers_beside_a_generation(make_engine, embedded_hf, pooling):
    engine = make_engine()
    plain = SamplingParams(max_new_tokens=6, ignore_eos=True)
    alone = engine.generate([PROMPTS[0]], plain)[0].token_ids
    outputs = engine.generate([PROMPTS[0], *PROMPTS], [plain, embed(pooling), embed(pooling)])
    assert outputs[0].token_ids == alone and outputs[0].embedding is None  # the generation, untouched
    for out, ids in zip(outputs[1:], PROMPTS):
        want = reference(embedded_hf, ids, pooling)
        assert out.finished and out.token_ids == [] and out.num_generated_tokens == 0
        assert len(out.embedding) == want.shape[0] and cosine(out.embedding, want) >= 0.99999
        if pooling.normalize:
            assert abs(torch.tensor(out.embedding).norm().item() - 1.0) < 1e-5
        else:
            torch.testing.assert_close(torch.tensor(out.embedding), want, rtol=1e-4, atol=1e-4)
    assert engine.scheduler.allocator.num_used == 0  # every block given back


@pytest.mark.parametrize("method", ["mean", "first", "last"])
def test_a_prompt_prefilled_in_chunks_pools_as_one(make_engine, method):
    long = [int(t) for t in torch.randint(3, 40000, (150,), generator=torch.Generator().manual_seed(4))]
    whole = make_engine().generate([long], embed(Pooling(method)))[0].embedding
    chunked = make_engine(max_batch_prefill_tokens=64, max_input_length=200, max_total_tokens=256)
    assert cosine(chunked.generate([long], embed(Pooling(method)))[0].embedding, torch.tensor(whole)) >= 0.99999


def test_the_prefix_cache_serves_last_token_pooling(make_engine):
    engine = make_engine(prefix_caching=True)
    shared = [int(t) for t in torch.randint(3, 40000, (70,), generator=torch.Generator().manual_seed(5))]
    first = engine.generate([shared], embed(Pooling("last")))[0].embedding
    again = engine.generate([shared], embed(Pooling("last")))[0].embedding
    assert engine.scheduler.prefix_hits > 0 and cosine(again, torch.tensor(first)) >= 0.99999
    hits = engine.scheduler.prefix_hits
    engine.generate([shared], embed(Pooling("mean")))  # every row must run: nothing looked up
    assert engine.scheduler.prefix_hits == hits


def test_an_adapter_embeds_as_peft(make_engine, embedded_hf, tmp_path):
    engine = make_engine(max_active_adapters=2)
    peft = peft_model(embedded_hf, seed=3, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    adapter = save_and_load(peft, tmp_path / "a", "tenant", engine.lora.base_shapes)
    base, tuned = engine.generate([PROMPTS[1], PROMPTS[1]], embed(Pooling("mean")), adapters=[None, adapter])
    with torch.inference_mode():
        hidden = peft.base_model.model.model(torch.tensor([PROMPTS[1]])).last_hidden_state[0].float()
    want = torch.nn.functional.normalize(hidden.mean(dim=0), dim=0)
    assert cosine(tuned.embedding, want) >= 0.99999
    assert cosine(base.embedding, want) < 0.999  # the adapter moved the vector: the comparison means something


def test_embeddings_of_three_adapters_beside_generations_equal_their_runs_alone(make_engine, embedded_hf, tmp_path):
    """One batch: embeddings over three adapters and the base, and generations over two of the adapters; each gets the
    vector or the tokens it gets alone (a row's adapter never reaches another row)."""
    engine = make_engine(max_active_adapters=4)
    adapters = [save_and_load(peft_model(embedded_hf, seed=s, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
                              tmp_path / f"a{s}", f"a{s}", engine.lora.base_shapes) for s in (11, 12, 13)]
    plain = SamplingParams(max_new_tokens=5, ignore_eos=True)
    jobs = [(PROMPTS[0], embed(Pooling("mean")), adapters[0]), (PROMPTS[1], plain, adapters[1]),
            (PROMPTS[1], embed(Pooling("last")), adapters[2]), (PROMPTS[0], plain, adapters[2]),
            (PROMPTS[1], embed(Pooling("mean")), None), (PROMPTS[0], embed(Pooling("last")), adapters[1])]
    alone = [engine.generate([p], [sp], adapters=[a])[0] for p, sp, a in jobs]
    together = engine.generate([p for p, _, _ in jobs], [sp for _, sp, _ in jobs], adapters=[a for _, _, a in jobs])
    for one, mixed, (_, params, _) in zip(alone, together, jobs):
        if params.pooling is None:
            assert mixed.token_ids == one.token_ids
        else:
            assert cosine(mixed.embedding, torch.tensor(one.embedding)) >= 0.99999
    base = engine.generate([PROMPTS[0]], [embed(Pooling("mean"))])[0].embedding
    assert cosine(together[0].embedding, torch.tensor(base)) < 0.9999  # the adapters matter: the check means something


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_encoder_decoder_models_pool_their_encoders_output(family, tmp_path):
    """T5 and BART: the mean of the encoder's output, L2-normalised (sentence-T5's pooling; the default for
    encoder-decoder models), against transformers' encoder, beside a generation."""
    from tests.helpers import engine_for, load_ours, tiny_t5
    from tests.models.test_bart_parity import tiny_bart

    hf = tiny_t5(gated=True, seed=3) if family == "t5" else tiny_bart()
    ours, config = load_ours(hf, tmp_path / family)
    engine = engine_for(ours, config)
    assert engine.pooling.pooling == Pooling("mean", True)
    inputs = [[5, 17, 42, 99, 7, 150, 3, 2], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 2]]
    plain = SamplingParams(max_new_tokens=4, ignore_eos=True)
    alone = engine.generate([inputs[0]], plain)[0].token_ids
    outs = engine.generate([inputs[0], *inputs], [plain, embed(engine.pooling.pooling), embed(engine.pooling.pooling)])
    assert outs[0].token_ids == alone
    with torch.inference_mode():
        for out, ids in zip(outs[1:], inputs):
            encoded = hf.get_encoder()(torch.tensor([ids])).last_hidden_state[0].float()
            assert cosine(out.embedding, torch.nn.functional.normalize(encoded.mean(0), dim=0)) >= 0.99999


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "mixtral",
                                  "qwen2_moe"])
def test_every_decoder_family_embeds_as_transformers(kind):
    """Mean pooling (it reads every row) of the final normed hidden state, per family, against transformers'."""
    from tests.helpers import engine_for, ours_from_hf, tiny_hf_model

    hf = tiny_hf_model(kind, seed=1, **({"pad_token_id": 0} if kind == "phi3" else {}))
    ours, config = ours_from_hf(hf)
    ids = [5, 17, 42, 99, 7, 150, 3, 200, 64, 31]
    out = engine_for(ours, config).generate([ids], embed(Pooling("mean")))[0]
    with torch.inference_mode():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0].float()
    assert cosine(out.embedding, torch.nn.functional.normalize(hidden.mean(0), dim=0)) >= 0.99999


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_an_encoder_adapter_embeds_as_peft(family, tmp_path):
    """A LoRA on the encoder moves an encoder-decoder model's embedding exactly as PEFT's encoder says."""
    from tests.helpers import engine_for, load_ours, tiny_t5
    from tests.lora.test_encoder_decoder_lora import CASES
    from tests.models.test_bart_parity import tiny_bart

    hf = tiny_t5(gated=True, seed=7) if family == "t5" else tiny_bart(seed=7)
    ours, config = load_ours(hf, tmp_path / family)
    engine = engine_for(ours, config, max_active_adapters=2)
    tuned = peft_model(hf, seed=2, **CASES[family]["encoder"])
    adapter = save_and_load(tuned, tmp_path / "adapter", "encoder", engine.lora.base_shapes)
    ids = [5, 17, 42, 99, 7, 150, 3, 2]
    base, moved = engine.generate([ids, ids], embed(Pooling("mean")), adapters=[None, adapter])
    with torch.inference_mode():
        encoded = tuned.get_encoder()(torch.tensor([ids])).last_hidden_state[0].float()
    want = torch.nn.functional.normalize(encoded.mean(0), dim=0)
    assert cosine(moved.embedding, want) >= 0.99999 and cosine(base.embedding, want) < 0.9999


def test_mpt_embeds_as_transformers(tmp_path):
    from tests.helpers import engine_for
    from tests.models.test_mpt_parity import load_ours, tiny_hf_mpt

    hf = tiny_hf_mpt(d_model=64, n_heads=4)
    hf.save_pretrained(tmp_path / "mpt")
    ours, config = load_ours(tmp_path / "mpt")
    ids = [5, 17, 42, 99, 3, 120, 7, 1, 64, 100]
    out = engine_for(ours, config).generate([ids], embed(Pooling("mean")))[0]
    with torch.inference_mode():
        hidden = hf.transformer(torch.tensor([ids])).last_hidden_state[0].float()
    assert cosine(out.embedding, torch.nn.functional.normalize(hidden.mean(0), dim=0)) >= 0.99999


def test_a_vision_model_embeds_text_as_its_language_model(tmp_path):
    """LLaVA-NeXT: text inputs, pooled from the language model's final normed hidden state, as transformers'."""
    from tests.helpers import engine_for
    from tests.models.test_llava_next_parity import saved, tiny_llava

    hf = tiny_llava(seed=2)
    ours, config = saved(hf, tmp_path / "llava")
    ids = [5, 17, 42, 99, 3, 120, 7, 1, 64, 100]
    out = engine_for(ours, config).generate([ids], embed(Pooling("mean")))[0]
    with torch.inference_mode():
        hidden = hf.model.language_model(torch.tensor([ids])).last_hidden_state[0].float()
    assert cosine(out.embedding, torch.nn.functional.normalize(hidden.mean(0), dim=0)) >= 0.99999
