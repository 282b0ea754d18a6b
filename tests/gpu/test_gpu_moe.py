"""The experts' grouped-GEMM kernel (layers/kernels/moe_gemm.py) against the torch reference, the per-expert matmul
loop of `grouped_product(..., fused=False)`, at Mixtral-8x7B's and Qwen1.5-MoE's shapes; under CUDA graph capture
(captured once, replayed over other routings); and tiny Mixtral / Qwen2-MoE models through the engine on CUDA, their
greedy tokens those of the CPU's torch path (CUDA only: `python -m pytest tests/gpu/test_gpu_moe.py`)."""

import pytest
import torch

from loraplex.layers import moe
from loraplex.layers.kernels.moe_gemm import grouped_gemm
from loraplex.layers.moe import ExpertDispatch, grouped_product, route
from loraplex.params import SamplingParams
from tests.helpers import engine_for, ours_from_hf
from tests.models.test_moe_parity import NEW_TOKENS, PROMPTS
from tests.moe_fixtures import tiny_moe

if not torch.cuda.is_available():
    pytest.fail("tests/gpu needs a CUDA device", pytrace=False)

DEVICE = "cuda"
# Both sides multiply bf16 inputs exactly and add in float32 (in other orders), then round once to bf16: one
# rounding step apart at most (outputs are of order 1; bf16 steps are 2^-8 to 2^-7 of a value). float32: exact
# products, sums in other orders.
TOLERANCE = {torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2), torch.float16: dict(atol=1e-2, rtol=4e-3),
             torch.float32: dict(atol=1e-4, rtol=1e-4)}
# (experts, top_k, hidden, intermediate)
SHAPES = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen1.5-moe": (60, 4, 2048, 1408)}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def experts(request):
    """One layer's stacked expert weights at a real model's shape, bf16: gate_up [E, 2I, H], down [E, H, I]."""
    e, top_k, hidden, inter = SHAPES[request.param]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    gate_up = (torch.randn(e, 2 * inter, hidden, generator=g, device=DEVICE) / hidden ** 0.5).to(torch.bfloat16)
    down = (torch.randn(e, hidden, inter, generator=g, device=DEVICE) / inter ** 0.5).to(torch.bfloat16)
    return request.param, top_k, {"gate_up": gate_up, "down": down}


def routed(rows: int, experts: int, top_k: int, seed: int = 0) -> ExpertDispatch:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    weights, chosen = route(torch.randn(rows, experts, generator=g, device=DEVICE), top_k, True)
    return ExpertDispatch.of(chosen, weights, experts)


def inputs(dispatch: ExpertDispatch, width: int, dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(dispatch.rows.numel(), width, generator=g, device=DEVICE).to(dtype)


def check(x, weight, dispatch):
    """The kernel against the torch loop in x's dtype, and both against float32 products of the same values: the
    kernel's error may not be much above the loop's."""
    got = grouped_product(x, weight, dispatch)  # CUDA with Triton: the kernel
    want = grouped_product(x, weight, dispatch, fused=False)
    torch.testing.assert_close(got, want, **TOLERANCE[x.dtype])
    if x.dtype != torch.float32 and x.shape[0]:
        exact = grouped_product(x.float(), weight.float(), dispatch, fused=False)
        ours, theirs = ((t.float() - exact).abs().max().item() for t in (got, want))
        assert ours <= 1.5 * theirs + 1e-3, (ours, theirs)
    return got


@pytest.mark.parametrize("rows", [1, 8, 64, 512, 2048], ids=lambda r: f"rows{r}")
def test_real_shapes_in_bf16(experts, rows):
    """Decode (1-64 rows x top_k pairs: BLOCK_M 16, narrow column tiles) and prefill (large tiles, grouped
    M-blocks) for both products."""
    name, top_k, weights = experts
    dispatch = routed(rows, weights["gate_up"].shape[0], top_k, seed=rows)
    x = inputs(dispatch, weights["gate_up"].shape[2], torch.bfloat16)
    hidden = torch.nn.functional.silu(check(x, weights["gate_up"], dispatch).chunk(2, dim=-1)[0])
    check(hidden.contiguous(), weights["down"], dispatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("counts", [[0, 0, 0, 0], [0, 1, 0, 0], [0, 5, 0, 0, 17, 0, 33, 0], [0, 0, 300],
                                    [700, 0, 0, 290, 1], [3] * 60],
                         ids=["P=0", "one-pair", "empty-experts", "one-expert", "uneven-prefill", "60-experts"])
@pytest.mark.parametrize("out_in", [(1000, 1000), (64, 4096), (2816, 2048), (17, 40)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_edges(dtype, counts, out_in):
    """P = 0, experts without pairs, every pair in one expert; widths not multiples of any block."""
    n, k = out_in
    num = len(counts)
    chosen = torch.repeat_interleave(torch.arange(num, device=DEVICE), torch.tensor(counts, device=DEVICE))
    dispatch = ExpertDispatch(torch.arange(chosen.numel(), device=DEVICE), chosen,
                              torch.ones(chosen.numel(), device=DEVICE), torch.tensor(counts, device=DEVICE))
    g = torch.Generator(device=DEVICE).manual_seed(2)
    weight = (torch.randn(num, n, k, generator=g, device=DEVICE) / k ** 0.5).to(dtype)
    got = check(inputs(dispatch, k, dtype), weight, dispatch)
    assert got.shape == (sum(counts), n)


def test_strided_inputs_and_weight_views():
    """x with a row stride wider than its width, and the weight a view of a larger stack (gate rows of gate_up)."""
    counts = [5, 0, 40, 3]
    chosen = torch.repeat_interleave(torch.arange(4, device=DEVICE), torch.tensor(counts, device=DEVICE))
    dispatch = ExpertDispatch(torch.arange(48, device=DEVICE), chosen, torch.ones(48, device=DEVICE),
                              torch.tensor(counts, device=DEVICE))
    x = torch.randn(48, 600, device=DEVICE, dtype=torch.bfloat16)[:, 50:562]
    weight = (torch.randn(4, 2 * 384, 512, device=DEVICE) / 512 ** 0.5).to(torch.bfloat16)[:, :384]
    assert not x.is_contiguous() and not weight.is_contiguous()
    check(x, weight, dispatch)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("rows", [1, 16, 64], ids=lambda r: f"rows{r}")
def test_captured_once_replays_any_routing(shape, rows):
    """A CUDA graph of both products captured over one routing, replayed over others (every pair in one expert,
    experts left empty, random): each replay equals the eager kernel bit for bit and the torch loop within the
    tolerance. The capture itself proves no host sync: reading the device from the host fails while capturing."""
    e, top_k, hidden, inter = SHAPES[shape]
    g = torch.Generator(device=DEVICE).manual_seed(3)
    inter = min(inter, 2048)  # the routing is what varies; smaller experts keep the test quick
    gate_up = (torch.randn(e, 2 * inter, hidden, generator=g, device=DEVICE) / hidden ** 0.5).to(torch.bfloat16)
    down = (torch.randn(e, hidden, inter, generator=g, device=DEVICE) / inter ** 0.5).to(torch.bfloat16)
    pairs = rows * top_k
    # The graph's static inputs: the pairs' inputs (sorted by expert) and the per-expert counts.
    static_x = torch.zeros(pairs, hidden, device=DEVICE, dtype=torch.bfloat16)
    static = ExpertDispatch(torch.zeros(pairs, dtype=torch.long, device=DEVICE),
                            torch.zeros(pairs, dtype=torch.long, device=DEVICE), torch.zeros(pairs, device=DEVICE),
                            torch.zeros(e, dtype=torch.long, device=DEVICE))

    def products(x, dispatch):
        up = grouped_product(x, gate_up, dispatch)
        return grouped_product(torch.nn.functional.silu(up[:, :inter]) * up[:, inter:], down, dispatch)

    def load(dispatch, seed):
        x = inputs(dispatch, hidden, torch.bfloat16, seed)
        static_x.copy_(x)
        static.counts.copy_(dispatch.counts)
        return x

    first = routed(rows, e, top_k, seed=10)
    load(first, 0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        products(static_x, static)  # compiles the kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = products(static_x, static)

    lopsided = torch.zeros(pairs, e, device=DEVICE)
    lopsided[:, 0] = 1.0  # every row's top choice is expert 0; the others by a routing of their own
    lopsided[:, 1:] = torch.rand(pairs, e - 1, generator=torch.Generator(device=DEVICE).manual_seed(4), device=DEVICE)
    one_expert = [torch.zeros(rows * top_k, 1, dtype=torch.long, device=DEVICE), e]  # top-1 of expert 0 alone
    dispatches = [first, routed(rows, e, top_k, seed=11), routed(rows, e, top_k, seed=12),
                  ExpertDispatch.of(one_expert[0], torch.ones(pairs, 1, device=DEVICE), e),
                  ExpertDispatch.of(torch.topk(lopsided[:rows], top_k, -1).indices,
                                    torch.full((rows, top_k), 1.0 / top_k, device=DEVICE), e)]
    for seed, dispatch in enumerate(dispatches):
        assert dispatch.rows.numel() == pairs
        x = load(dispatch, seed)
        graph.replay()
        torch.testing.assert_close(captured, products(x, dispatch), atol=0, rtol=0)
        up = grouped_product(x, gate_up, dispatch, fused=False)
        want = grouped_product(torch.nn.functional.silu(up[:, :inter]) * up[:, inter:], down, dispatch, fused=False)
        torch.testing.assert_close(captured, want, **TOLERANCE[torch.bfloat16])
    assert dispatches[3].host_counts[0] == pairs and sum(c == 0 for c in dispatches[3].host_counts) == e - 1


def _greedy(engine) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))]


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_tiny_model_on_cuda_greedy_equals_the_cpu(kind):
    """float32 through the engine: CUDA (the kernel, decode steps in CUDA graphs) against the CPU (the torch loop)."""
    hf = tiny_moe(kind)
    cpu = _greedy(engine_for(*ours_from_hf(hf)))
    ours, config = ours_from_hf(hf, device=DEVICE)
    engine = engine_for(ours, config, device=DEVICE)
    assert _greedy(engine) == cpu


def test_tiny_mixtral_decode_steps_replay_cuda_graphs():
    """Nothing in a sparse layer's decode step reads the device from the host: its bucket captures. (The
    dispatch's per-expert counts must come from a capturable op: torch.bincount on CUDA reads its input's max on
    the host; `zeros(E).scatter_add_(0, experts, ones)` captures.)"""
    ours, config = ours_from_hf(tiny_moe("mixtral"), device=DEVICE)
    engine = engine_for(ours, config, device=DEVICE)
    _greedy(engine)
    assert engine.runner.decode_graphs is not None and engine.runner.decode_graphs.num_captured >= 1


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_tiny_model_bf16_kernel_against_the_torch_loop(kind, monkeypatch):
    """bf16 on CUDA, the kernel against the torch loop (eager steps): the first tokens agree (near-ties may flip
    later ones, as bf16 products of other kernels do elsewhere in tests/gpu)."""
    ours, config = ours_from_hf(tiny_moe(kind), device=DEVICE, dtype=torch.bfloat16)
    fused = _greedy(engine_for(ours, config, device=DEVICE, dtype=torch.bfloat16))
    monkeypatch.setattr(moe, "triton_available", lambda device: False)  # grouped_product's gate only
    loop = _greedy(engine_for(ours, config, device=DEVICE, dtype=torch.bfloat16, cuda_graphs=False))
    for got, want in zip(fused, loop):
        assert got[:4] == want[:4], (got, want)


def test_kernel_is_called_directly():
    """The direct launcher keeps the compiled kernel after its first call (eager steps pay no Triton launch path)."""
    from loraplex.layers.kernels import moe_gemm

    dispatch = routed(4, 8, 2)
    weight = torch.randn(8, 256, 128, device=DEVICE, dtype=torch.bfloat16)
    x = inputs(dispatch, 128, torch.bfloat16)
    first = grouped_gemm(x, weight, dispatch.counts)
    assert not moe_gemm._grouped.direct or moe_gemm._grouped._compiled
    torch.testing.assert_close(grouped_gemm(x, weight, dispatch.counts), first, atol=0, rtol=0)
