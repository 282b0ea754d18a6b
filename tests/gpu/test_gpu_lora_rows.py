"""The per-row LoRA Triton kernels (lora/step/kernels/bgmv.py) against the torch reference, with mixed ranks, empty
slots, base rows and a corrupted adapter (CUDA only: `python -m pytest tests/gpu`)."""

import pytest
import torch

from loraplex.lora.adapter import LoraWeights
from loraplex.lora.device.upload import laid_out
from loraplex.lora.step.kernels import PointerTable, add_lora_rows_reference

if not torch.cuda.is_available():
    pytest.fail("tests/gpu needs a CUDA device", pytrace=False)

from loraplex.lora.step.kernels.bgmv import add_lora_rows, add_lora_rows_siblings  # noqa: E402  (Triton: CUDA only)

DEVICE = torch.device("cuda")
RANKS = [8, 16, 64, 1, None, 32]  # None: the slot's adapter does not target the layer


def slot_weights(in_features, out_features, dtype, seed, ranks=RANKS):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    weights = []
    for k, rank in enumerate(ranks):
        if rank is None:
            weights.append(None)
            continue
        a = torch.randn(rank, in_features, generator=g, device=DEVICE) / in_features**0.5
        b = torch.randn(out_features, rank, generator=g, device=DEVICE)
        weights.append(laid_out(LoraWeights(a.to(dtype), b.to(dtype), 0.5 + k)))
    return weights


def tables_for(weights, name="layer"):
    tables = PointerTable([name], len(weights), DEVICE)
    for slot, w in enumerate(weights):
        tables.set_slot(slot, {name: w})
    return tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(4096, 1024), (576, 1536), (14336, 4096), (100, 37)])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_kernel_matches_the_reference(dtype, shape, rows):
    in_features, out_features = shape
    weights = slot_weights(in_features, out_features, dtype, seed=rows)
    tables = tables_for(weights)
    g = torch.Generator().manual_seed(rows)
    row_slots = torch.randint(-1, len(weights), (rows,), generator=g).tolist()
    x = torch.randn(rows, in_features, device=DEVICE).to(dtype)
    base = torch.randn(rows, out_features, device=DEVICE).to(dtype)
    # The reference in float32 from the same (rounded) weights: the kernel keeps the shrink in float32.
    expected = add_lora_rows_reference(base.float().clone(), x.float(), row_slots,
                                       [None if w is None else w.to(DEVICE, torch.float32) for w in weights])
    got = add_lora_rows(base.clone(), x, torch.tensor(row_slots, device=DEVICE), tables, "layer", max_rank=64)
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), expected, **tolerance)
    untouched = [i for i, s in enumerate(row_slots) if s < 0 or weights[s] is None]
    assert torch.equal(got[untouched], base[untouched]), "rows without an adapter on this layer must not change"
    touched = [i for i in range(rows) if i not in untouched]
    assert not touched or not torch.equal(got[touched], base[touched]), "the adapters must change their rows"


def test_a_corrupted_adapter_reaches_only_its_rows():
    weights = slot_weights(256, 128, torch.float32, seed=3, ranks=[8, 16])
    weights[1].a[0, 0] = float("nan")
    weights[1].b[5, 2] = float("inf")
    tables = tables_for(weights)
    row_slots = [0, 1, -1, 0, 1, -1]
    x = torch.randn(len(row_slots), 256, device=DEVICE)
    base = torch.randn(len(row_slots), 128, device=DEVICE)
    got = add_lora_rows(base.clone(), x, torch.tensor(row_slots, device=DEVICE), tables, "layer", max_rank=16)
    clean = [i for i, s in enumerate(row_slots) if s != 1]
    assert torch.isfinite(got[clean]).all()
    assert not torch.isfinite(got[[1, 4]]).all()
    expected = add_lora_rows_reference(base.clone(), x, row_slots, [weights[0], None])
    torch.testing.assert_close(got[clean], expected[clean], atol=1e-4, rtol=1e-4)


def test_reinstalling_a_slot_changes_what_the_next_call_reads():
    weights = slot_weights(512, 256, torch.float32, seed=5, ranks=[4, 16])
    tables = tables_for(weights)
    x, base = torch.randn(2, 512, device=DEVICE), torch.randn(2, 256, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    replacement = slot_weights(512, 256, torch.float32, seed=6, ranks=[32])[0]
    tables.set_slot(0, {"layer": replacement})
    got = add_lora_rows(base.clone(), x, slots, tables, "layer", max_rank=32)
    expected = add_lora_rows_reference(base.clone(), x, [0, 1], [replacement, weights[1]])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def sibling_tables(dtype):
    """q/k/v-like siblings over 4 slots of mixed ranks, some slots' adapters targeting only some of them: the input
    features, the widths, the names, each one's weights per slot and the tables."""
    in_features, widths, names = 512, [256, 64, 64], ["q", "k", "v"]
    ranks = {"q": [8, 16, 64, 4], "k": [8, None, 64, 4], "v": [8, 16, None, None]}
    weights = {n: slot_weights(in_features, w, dtype, seed=i, ranks=ranks[n])
               for i, (n, w) in enumerate(zip(names, widths))}
    tables = PointerTable(names, 4, DEVICE)
    for slot in range(4):
        tables.set_slot(slot, {n: weights[n][slot] for n in names})
    return in_features, widths, names, weights, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 9, 64])
def test_siblings_in_one_launch_equal_one_launch_each(dtype, rows):
    """q/k/v-like siblings (one input, outputs side by side in one product): the same values, bit for bit, as a
    launch per layer, with mixed ranks and slots whose adapter targets only some of them."""
    in_features, widths, names, weights, tables = sibling_tables(dtype)
    row_slots = torch.tensor([(3 * i + 1) % 5 - 1 for i in range(rows)], device=DEVICE)  # -1 and every slot
    x = torch.randn(rows, in_features, device=DEVICE).to(dtype)
    start = torch.randn(rows, sum(widths), device=DEVICE).to(dtype)
    one_each, fused = start.clone(), start.clone()
    for name, out in zip(names, one_each.split(widths, dim=-1)):
        add_lora_rows(out, x, row_slots, tables, name, max_rank=64)
    add_lora_rows_siblings(fused.split(widths, dim=-1), x, row_slots, tables, names, max_rank=64)
    assert torch.equal(fused, one_each)
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    for name, got, before in zip(names, fused.split(widths, dim=-1), start.split(widths, dim=-1)):
        expected = add_lora_rows_reference(before.float().clone(), x.float(), row_slots.tolist(),
                                           [None if w is None else w.to(DEVICE, torch.float32) for w in weights[name]])
        torch.testing.assert_close(got.float(), expected, **tolerance)
    adapted = row_slots >= 0  # every slot's adapter targets q
    assert adapted.any() and not torch.equal(fused[adapted, :256], start[adapted, :256])
    assert torch.equal(fused[~adapted], start[~adapted])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_shrink_beside_the_product_in_a_graph_equals_the_deltas_after_it(dtype):
    """lora/step/beside.py: in a captured graph the shrink runs on a second stream while the product runs, and the
    expand adds to the product after the join: bit for bit what the deltas added after the product give, at every
    replay, with the inputs changed between replays (so the join, not luck, orders the reads)."""
    from loraplex.lora.step.beside import shrink_beside

    in_features, widths, names, weights, tables = sibling_tables(dtype)
    rows = 64
    row_slots = torch.tensor([(3 * i + 1) % 5 - 1 for i in range(rows)], device=DEVICE)
    weight = torch.randn(sum(widths), in_features, device=DEVICE).to(dtype) / in_features**0.5
    x = torch.randn(rows, in_features, device=DEVICE).to(dtype)
    offsets = [sum(widths[:i]) for i in range(len(widths))]

    def beside():
        early = shrink_beside(offsets, widths, x, row_slots, tables, names, 64)
        product = x @ weight.t()
        early.expand(product.split(widths, dim=-1))
        return product

    beside()  # compiles, and makes the side stream, before the capture
    torch.cuda.synchronize()
    graph, plain_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = beside()
    with torch.cuda.graph(plain_graph):  # the product alone, as the graph computes it
        plain = x @ weight.t()
    for seed in range(3):
        x.copy_(torch.randn(rows, in_features, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(seed)))
        graph.replay()
        plain_graph.replay()
        expected = plain.clone()
        add_lora_rows_siblings(expected.split(widths, dim=-1), x, row_slots, tables, names, max_rank=64)
        assert torch.equal(captured, expected)
        assert not torch.equal(captured, plain), "the adapters must change the product"
