"""Mixtral and Qwen2-MoE parity with transformers on tiny random weights, loaded from both expert layouts: logits
close, greedy tokens identical through the engine; the router's choices (ties included) are transformers'."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from loraplex.checkpoints.weights import WeightsError
from loraplex.layers.moe import MoeExperts
from loraplex.models.llama import LlamaMLP
from loraplex.models.registry import config_from_hf
from loraplex.params import SamplingParams
from tests.helpers import engine_for, full_logits, load_saved, ours_from_hf
from tests.moe_fixtures import save_stacked, tiny_moe

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 1, 64, 128, 11, 12, 13, 14, 15, 16, 200, 201, 202, 9], [3, 1, 4, 1, 5], [77]]
NEW_TOKENS = 20  # the longest prompt plus these cross a 16-token KV block


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """Tiny models on a shared 2-core machine: a second intra-op thread only spins."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def hf(request):
    return tiny_moe(request.param)


def _hf_greedy(hf, prompt: list[int], new: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy tokens, EOS an ordinary token as in our ignore_eos engine runs (min_new_tokens would
    mask EOS out of the logits instead: the tiny Mixtral's second prompt picks EOS, id 2, at its 17th token)."""
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _greedy(ours, config, prompts=PROMPTS, new: int = NEW_TOKENS) -> list[list[int]]:
    engine = engine_for(ours, config)
    return [r.token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True))]


@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
def test_checkpoint_layouts_match_transformers(hf, layout, tmp_path):
    if layout == "per_expert":
        hf.save_pretrained(tmp_path)  # transformers 5.25 writes each expert's linears by name, as hub checkpoints do
    else:
        save_stacked(hf, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    expert = {"mixtral": "model.layers.0.block_sparse_moe.experts.3.w2.weight",
              "qwen2_moe": "model.layers.0.mlp.experts.5.down_proj.weight"}[hf.config.model_type]
    assert (expert in names) == (layout == "per_expert")
    assert ("model.layers.0.mlp.experts.gate_up_proj" in names) == (layout == "stacked")

    ours, config = load_saved(tmp_path)
    for prompt in PROMPTS[:2]:
        expected = hf(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(full_logits(ours, config, prompt), expected, atol=2e-4, rtol=1e-4)
    assert _greedy(ours, config) == [_hf_greedy(hf, p) for p in PROMPTS]


def test_dense_and_sparse_layers_as_transformers_builds_them(hf):
    ours, config = ours_from_hf(hf)
    theirs = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert [isinstance(getattr(layer.mlp, "experts", None), MoeExperts) for layer in ours.model.layers] == theirs
    assert config.moe.sparse_layers == tuple(theirs)
    if hf.config.model_type == "qwen2_moe":
        assert theirs == [True, False, True]  # mlp_only_layers=[1]
        assert isinstance(ours.model.layers[1].mlp, LlamaMLP)
        assert ours.model.layers[0].mlp.shared_expert.down_proj.in_features == 80
        # decoder_sparse_step 2: only every second layer is sparse
        stepped = config_from_hf({**hf.config.to_dict(), "mlp_only_layers": [], "decoder_sparse_step": 2})
        assert stepped.moe.sparse_layers == (False, True, False)


def test_routing_matters(hf):
    """Permuting the experts (their weights, not the router's rows) changes the output: the router's choice of
    expert decides what each token computes."""
    ours, config = ours_from_hf(hf)
    before = full_logits(ours, config, PROMPTS[0])
    with torch.no_grad():
        for layer in ours.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is not None:
                order = torch.roll(torch.arange(experts.num_experts), 1)
                experts.gate_up_proj.copy_(experts.gate_up_proj[order])
                experts.down_proj.copy_(experts.down_proj[order])
    after = full_logits(ours, config, PROMPTS[0])
    assert (after - before).abs().max() > 0.05 * before.abs().max()


def _tied(hf):
    """Layer 0's router rows u + w, u, u, u - w: for every token experts 1 and 2 have exactly equal logits, ranked
    second and third (between expert 0 and 3), so the top-2 tie-break alone decides between them."""
    torch.manual_seed(5)
    u, w = torch.randn(2, hf.config.hidden_size) * 0.3
    with torch.no_grad():
        hf.model.layers[0].mlp.gate.weight.copy_(torch.stack([u + w, u, u, u - w]))
    return hf


def test_routing_ties_break_as_transformers():
    hf = _tied(tiny_moe("mixtral", seed=3))
    ours, config = ours_from_hf(hf)
    prompt = PROMPTS[0]

    theirs, mine = {}, {}
    hook = hf.model.layers[0].mlp.gate.register_forward_hook(lambda m, a, out: theirs.update(experts=out[2]))
    expected = hf(torch.tensor([prompt])).logits[0].float()
    hook.remove()
    gate = ours.model.layers[0].mlp.gate.register_forward_hook(lambda m, a, out: mine.update(logits=out))
    experts = ours.model.layers[0].mlp.experts.register_forward_pre_hook(lambda m, a: mine.update(experts=a[2]))
    got = full_logits(ours, config, prompt)
    gate.remove(), experts.remove()

    logits = mine["logits"]
    assert torch.equal(logits[:, 1], logits[:, 2]), "the tie is not exact in our router"
    ranked = logits.argsort(dim=-1, descending=True)
    assert set(ranked[:, 1].tolist()) | set(ranked[:, 2].tolist()) == {1, 2}, "the tie is not at the top-2 boundary"
    assert torch.equal(mine["experts"], theirs["experts"]), "a tie broke differently from transformers"
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    assert _greedy(ours, config, PROMPTS[:1]) == [_hf_greedy(hf, prompt)]

    # The tie-break matters: had the other of the two tied experts been taken, the output would differ.
    with torch.no_grad():
        layer = ours.model.layers[0].mlp.experts
        for stacked in (layer.gate_up_proj, layer.down_proj):
            stacked[[1, 2]] = stacked[[2, 1]].clone()
    assert (full_logits(ours, config, prompt) - expected).abs().max() > 0.05 * expected.abs().max()


def test_incomplete_per_expert_checkpoint_is_refused(tmp_path):
    hf = tiny_moe("mixtral")
    hf.save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"model\.layers\.1\.mlp\.experts: .* missing model\.layers\.1\.mlp\.experts\.2\.up_proj"):
        load_saved(tmp_path)


@pytest.mark.parametrize("field, value, message", [
    ("num_experts_per_tok", 9, "num_experts_per_tok 9: more than the 4 experts"),
    ("norm_topk_prob", "yes", "norm_topk_prob must be true or false"),
    ("num_local_experts", -1, "num_local_experts must be an integer"),
    ("mlp_only_layers", ["1"], "mlp_only_layers must be an integer or a list of integers"),
    ("router_jitter_noise", "0", "router_jitter_noise must be a number"),
])
def test_moe_config_fields_are_checked(field, value, message):
    hf = tiny_moe("mixtral").config.to_dict()
    with pytest.raises(ValueError, match=message):
        config_from_hf({**hf, field: value})
