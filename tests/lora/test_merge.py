"""merge_adapters against PEFT's own `add_weighted_adapter`, on a tiny random Llama and PEFT-made adapters."""

from __future__ import annotations

import copy
import json
import math

import peft
import pytest
import torch
from peft.tuners.lora import LoraLayer
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from loraplex.lora.adapter import AdapterInvalid, LoraAdapter, LoraConfig, adapter_from_tensors
from loraplex.lora.merge import merge_adapters, module_order_key

TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
MERGED = "merged"

# Rank 4 throughout, with different targets, alphas (and an alpha_pattern) and one rsLoRA adapter.
MAIN = {
    "first": peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False),
    "second": peft.LoraConfig(
        r=4,
        lora_alpha=16,
        use_rslora=True,
        target_modules=["q_proj", "k_proj", "o_proj", "up_proj", "lm_head"],
        init_lora_weights=False,
    ),
    "third": peft.LoraConfig(
        r=4, lora_alpha=4, alpha_pattern={"o_proj": 12}, target_modules=["v_proj", "o_proj", "down_proj"], init_lora_weights=False
    ),
}
# Overall rank 8 for both, but q_proj is rank 4 in both (so PEFT accepts the pair).
RANK_PATTERN = {
    "rs_patterned": peft.LoraConfig(
        r=8,
        lora_alpha=8,
        use_rslora=True,
        rank_pattern={"q_proj": 4},
        alpha_pattern={"v_proj": 32},
        target_modules=["q_proj", "v_proj", "o_proj"],
        init_lora_weights=False,
    ),
    "patterned": peft.LoraConfig(
        r=8, lora_alpha=16, rank_pattern={"q_proj": 4}, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    ),
}


@pytest.fixture(scope="module")
def base() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY)).float().eval()


def with_adapters(base: LlamaForCausalLM, configs: dict[str, peft.LoraConfig]):
    """A PEFT model (on a copy of `base`) holding `configs`' adapters, and the same adapters as ours."""
    torch.manual_seed(1)
    (first, first_config), *rest = configs.items()
    model = peft.get_peft_model(copy.deepcopy(base), copy.deepcopy(first_config), adapter_name=first)
    for name, config in rest:
        model.add_adapter(name, copy.deepcopy(config))
    shapes = {name: (m.in_features, m.out_features) for name, m in base.named_modules() if isinstance(m, nn.Linear)}
    return model, {name: ours_from_peft(model, name, shapes) for name in configs}


def ours_from_peft(model: peft.PeftModel, name: str, shapes) -> LoraAdapter:
    # As adapter_config.json holds it (enums as their values, sets as lists).
    raw = json.loads(json.dumps(model.peft_config[name].to_dict(), default=sorted))
    # save_embedding_layers=False: targeting lm_head would otherwise add its base weight to the file.
    tensors = peft.get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=False)
    tensors = {key: tensor.detach().clone() for key, tensor in tensors.items()}
    return adapter_from_tensors(name, LoraConfig.from_dict(raw, max_rank=64), tensors, shapes)


def peft_merge(model: peft.PeftModel, names, weights, strategy, density, sign_method, seed) -> dict[str, LoraLayer]:
    """Run PEFT's merge into adapter MERGED, its random draws starting from torch.manual_seed(seed)."""
    lora_model = model.base_model
    inject = lora_model.inject_adapter

    def inject_then_seed(*args, **kwargs):
        # Creating the new adapter's layers draws from the global RNG: seed where the merging begins.
        result = inject(*args, **kwargs)
        torch.manual_seed(seed)
        return result

    lora_model.inject_adapter = inject_then_seed
    lora_model.add_weighted_adapter(
        list(names), list(weights), MERGED, combination_type=strategy, density=density, majority_sign_method=sign_method
    )
    return {
        name: layer
        for name, layer in lora_model.model.named_modules()
        if isinstance(layer, LoraLayer) and MERGED in layer.lora_A
    }


def assert_merges_like_peft(base, configs, names, weights, strategy, density=1.0, sign_method="total", seed=0):
    model, ours = with_adapters(base, configs)
    merged = merge_adapters(
        MERGED,
        [ours[n] for n in names],
        weights,
        strategy,
        density=density,
        majority_sign_method=sign_method,
        generator=torch.Generator().manual_seed(seed),
    )
    theirs = peft_merge(model, names, weights, strategy, density, sign_method, seed)

    assert sorted(merged.modules) == sorted(theirs)
    for module, layer in theirs.items():
        got = merged.modules[module]
        a, b = layer.lora_A[MERGED].weight, layer.lora_B[MERGED].weight
        if strategy == "cat":  # PEFT pads each module's stacked factors with zeros up to the summed rank
            assert got.rank <= a.shape[0]
            assert not a[got.rank:].any() and not b[:, got.rank:].any()
            a, b = a[: got.rank], b[:, : got.rank]
        torch.testing.assert_close(got.a, a, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got.b, b, rtol=1e-6, atol=1e-7)
        # What PEFT adds to the base weight, with its own scaling of the new adapter.
        torch.testing.assert_close(got.scale * got.b @ got.a, layer.get_delta_weight(MERGED), rtol=1e-6, atol=1e-6)
        assert merged.config.scale(module) == got.scale
    return merged


@pytest.mark.parametrize(
    "names, weights, strategy, density, sign_method",
    [
        (("first", "second"), (1.0, 0.5), "linear", 1.0, "total"),
        (("second", "first", "third"), (0.6, -1.2, 0.9), "linear", 1.0, "total"),
        (("first", "second", "third"), (1.0, 0.7, 0.4), "ties", 0.5, "total"),
        (("first", "third"), (0.8, -0.5), "ties", 0.3, "frequency"),
        (("third", "second", "first"), (1.0, 1.0, 1.0), "ties", 1.0, "total"),
        (("first", "second"), (1.0, 0.5), "dare_linear", 0.5, "total"),
        (("third", "second", "first"), (0.9, -0.4, 1.1), "dare_linear", 0.8, "total"),
        (("first", "second", "third"), (1.0, 0.7, 0.4), "dare_ties", 0.5, "total"),
        (("second", "third"), (0.5, 1.5), "dare_ties", 0.7, "frequency"),
        (("second",), (0.5,), "dare_ties", 0.5, "total"),  # one adapter: PEFT merges it linearly
        (("second", "first", "third"), (0.6, -1.2, 0.9), "cat", 1.0, "total"),
        (("first", "third"), (1.0, 0.5), "magnitude_prune", 0.4, "total"),
        (("second", "first", "third"), (0.7, 0.3, -0.8), "magnitude_prune", 1.0, "total"),
    ],
)
def test_matches_peft(base, names, weights, strategy, density, sign_method):
    assert_merges_like_peft(base, MAIN, names, weights, strategy, density, sign_method, seed=7)


@pytest.mark.parametrize("names", [("second", "first"), ("first", "second")])
def test_result_has_scale_one_whatever_the_first_adapters_rslora(base, names):
    """PEFT >= 0.22: the sources' scales are folded into the factors, so the result is not scaled again
    (before, a first adapter with rsLoRA made every merged delta sqrt(r) times too large)."""
    merged = assert_merges_like_peft(base, MAIN, names, (1.0, 1.0), "linear")
    config = merged.config
    assert (config.r, config.lora_alpha, config.use_rslora) == (4, 4.0, False)
    assert set(config.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "lm_head"}
    assert {w.scale for w in merged.modules.values()} == {1.0}


def test_cat_takes_mixed_ranks_and_adds_them_up(base):
    configs = {
        "rs8": peft.LoraConfig(r=8, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
        "r4": peft.LoraConfig(r=4, lora_alpha=16, rank_pattern={"v_proj": 2}, target_modules=["v_proj", "o_proj"],
                              init_lora_weights=False),
    }
    merged = assert_merges_like_peft(base, configs, ("rs8", "r4"), (0.5, -1.5), "cat")
    assert (merged.config.r, merged.config.lora_alpha, merged.config.use_rslora) == (12, 12.0, False)
    ranks = {module.rsplit(".", 1)[-1]: w.rank for module, w in merged.modules.items()}
    assert ranks == {"q_proj": 8, "v_proj": 10, "o_proj": 4}  # v_proj: 8 + its rank pattern's 2
    with pytest.raises(AdapterInvalid, match="equal rank"):
        assert_merges_like_peft(base, configs, ("rs8", "r4"), (0.5, -1.5), "linear")


@pytest.mark.parametrize(
    "names, strategy",
    [(("rs_patterned", "patterned"), "dare_ties"), (("patterned", "rs_patterned"), "ties"), (("patterned",), "linear")],
)
def test_matches_peft_with_rank_pattern(base, names, strategy):
    merged = assert_merges_like_peft(base, RANK_PATTERN, names, (0.7,) * len(names), strategy, density=0.6, seed=3)
    # The result has r = alpha = 8 and no patterns: q_proj keeps its rank-4 tensors, every scale is 1.
    q_proj = merged.modules["model.layers.0.self_attn.q_proj"]
    assert q_proj.rank == 4
    assert {w.scale for w in merged.modules.values()} == {1.0}


def test_first_adapters_layers_to_transform_limits_the_result(base):
    configs = {
        "layer0": peft.LoraConfig(r=4, target_modules=["q_proj"], layers_to_transform=[0], init_lora_weights=False),
        "everywhere": peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    }
    merged = assert_merges_like_peft(base, configs, ("layer0", "everywhere"), (1.0, 1.0), "ties", density=0.5)
    assert sorted(merged.modules) == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]


def test_regex_targets_are_joined(base):
    configs = {
        "q0": peft.LoraConfig(r=4, target_modules=r"model\.layers\.0\.self_attn\.q_proj", init_lora_weights=False),
        "mlp": peft.LoraConfig(r=4, target_modules=r".*\.mlp\.(up|down)_proj", init_lora_weights=False),
    }
    merged = assert_merges_like_peft(base, configs, ("q0", "mlp"), (0.5, 2.0), "dare_linear", density=0.4, seed=11)
    assert len(merged.modules) == 5


def test_merged_adapter_gives_peft_logits(base):
    names, weights = ("rs_patterned", "patterned"), (0.8, -0.6)
    model, ours = with_adapters(base, RANK_PATTERN)
    merged = merge_adapters(
        MERGED, [ours[n] for n in names], weights, "dare_ties", density=0.7, generator=torch.Generator().manual_seed(5)
    )
    peft_merge(model, names, weights, "dare_ties", 0.7, "total", seed=5)
    model.set_adapter(MERGED)

    patched = copy.deepcopy(base)
    with torch.no_grad():
        for module, lora in merged.modules.items():
            patched.get_submodule(module).weight += lora.scale * lora.b @ lora.a
        ids = torch.randint(0, TINY["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
        expected = model(input_ids=ids).logits
        got = patched(input_ids=ids).logits
        unmerged = base(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (got - unmerged).abs().max() > 0.1  # the merged adapter does change the output


def test_default_generator_is_seeded_zero(base):
    _, ours = with_adapters(base, MAIN)
    adapters, weights = [ours["first"], ours["third"]], (1.0, 0.5)

    def merge(generator):
        merged = merge_adapters(MERGED, adapters, weights, "dare_linear", density=0.5, generator=generator)
        return torch.cat([torch.cat([w.a.flatten(), w.b.flatten()]) for w in merged.modules.values()])

    default = merge(None)
    torch.testing.assert_close(merge(None), default, rtol=0, atol=0)
    torch.testing.assert_close(merge(torch.Generator().manual_seed(0)), default, rtol=0, atol=0)
    assert not torch.equal(merge(torch.Generator().manual_seed(1)), default)


def test_module_order_key_follows_named_modules():
    # 12 layers, so that sorting layer indexes as text (10 before 2) would show.
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**{**TINY, "num_hidden_layers": 12}))
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    assert sorted(reversed(linears), key=module_order_key) == linears


# ---- refusals --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def main_adapters(base) -> dict[str, LoraAdapter]:
    return with_adapters(base, MAIN)[1]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(strategy="svd"), "unknown merge strategy 'svd'; expected one of linear, cat, ties, dare_linear, dare_ties, "
                               "magnitude_prune"),
        (dict(names=()), "the list of adapters is empty"),
        (dict(weights=(1.0,)), "got 1 weights for 2 adapters"),
        (dict(weights=(1.0, math.nan)), "the weight of adapter 'third' is nan"),
        (dict(strategy="ties", density=0.0), "density must be in (0, 1] for strategy 'ties'; got 0.0"),
        (dict(strategy="dare_linear", density=1.5), "density must be in (0, 1] for strategy 'dare_linear'; got 1.5"),
        (dict(strategy="dare_ties", density=-0.2), "density must be in (0, 1] for strategy 'dare_ties'"),
        (dict(strategy="magnitude_prune", density=0.0), "density must be in (0, 1] for strategy 'magnitude_prune'"),
        (dict(strategy="ties", majority_sign_method="mean"), "unknown majority_sign_method 'mean'"),
    ],
)
def test_refuses_bad_arguments(main_adapters, change, message):
    arguments = dict(names=("first", "third"), weights=(1.0, 0.5), strategy="linear", density=1.0)
    arguments.update(change)
    names = arguments.pop("names")
    with pytest.raises(AdapterInvalid) as refusal:
        merge_adapters(MERGED, [main_adapters[n] for n in names], **arguments)
    assert message in str(refusal.value)


def test_linear_ignores_density(main_adapters):
    merged = merge_adapters(MERGED, [main_adapters["first"]], [1.0], "linear", density=0.0)
    assert merged.modules


def test_refuses_unequal_ranks_as_peft_does(base):
    configs = {
        "r4": peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False),
        "r8": peft.LoraConfig(r=8, target_modules=["v_proj"], init_lora_weights=False),
    }
    model, ours = with_adapters(base, configs)
    with pytest.raises(ValueError, match="same r value"):
        model.base_model.add_weighted_adapter(["r4", "r8"], [1.0, 1.0], MERGED, combination_type="linear")
    with pytest.raises(AdapterInvalid) as refusal:
        merge_adapters(MERGED, [ours["r4"], ours["r8"]], [1.0, 1.0], "linear")
    assert str(refusal.value) == "merge strategy 'linear' needs adapters of equal rank; 'r4' has rank 4, 'r8' has rank 8"


def test_refuses_unequal_ranks_on_a_module(base):
    # Both have overall rank 8, so PEFT's check passes, and then it fails stacking q_proj's A matrices.
    configs = {"patterned": RANK_PATTERN["patterned"], "plain": peft.LoraConfig(r=8, target_modules=["q_proj"])}
    model, ours = with_adapters(base, configs)
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        model.base_model.add_weighted_adapter(["patterned", "plain"], [1.0, 1.0], MERGED, combination_type="ties", density=0.5)
    with pytest.raises(AdapterInvalid) as refusal:
        merge_adapters(MERGED, [ours["patterned"], ours["plain"]], [1.0, 1.0], "ties", density=0.5)
    assert str(refusal.value) == (
        "cannot merge module model.layers.0.self_attn.q_proj: its LoRA ranks differ ('patterned' has rank 4, 'plain' has rank 8)"
    )


def test_refuses_regex_with_list_targets(base):
    configs = {
        "regex": peft.LoraConfig(r=4, target_modules=r".*\.q_proj", init_lora_weights=False),
        "list": peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False),
    }
    model, ours = with_adapters(base, configs)
    with pytest.raises(ValueError, match="mix of list/set and string"):
        model.base_model.add_weighted_adapter(["regex", "list"], [1.0, 1.0], MERGED, combination_type="linear")
    with pytest.raises(AdapterInvalid, match="target_modules mix a regex and a list"):
        merge_adapters(MERGED, [ours["regex"], ours["list"]], [1.0, 1.0])
