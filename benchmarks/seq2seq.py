"""The encoder-decoder workload: loraplex serving T5 and BART against transformers (and PEFT), timed in one run.

    loraplex bench --workload seq2seq [--family t5|bart|both] [--requests 32] [--one-at-a-time-requests 8]
                   [--repeats 1] [--adapters 8] [--adapter-rank 16] [--seed 0] [--json PATH]

For each family a random model is built in-process from a transformers config with a fixed seed (T5 v1.1
style: gated-GELU, untied head; BART: post-norm, learned positions; both d_model 256, 4 encoder + 4 decoder
layers, 4 heads, feed-forward 1024, vocabulary 16384), its weights re-drawn wide enough that greedy outputs
vary with the input. It is saved with `save_pretrained` to a temporary directory and loaded with loraplex's
loader. The same transformers model is the peer.

The workload: `--requests` requests with encoder inputs of mixed lengths (uniform 8..256 tokens, ending with
the family's EOS, BART's starting with its BOS) and mixed new-token counts (uniform 8..64), greedy, EOS ignored.
Systems, taking turns `--repeats` times (each keeps its best time):

- loraplex: all requests submitted at once to one engine.
- transformers batched: one right-padded batch (attention_mask) through `generate`; every row generates the
  largest max_new_tokens (a batch cannot stop rows early when EOS is ignored), each request keeps its own
  first max_new_tokens (the useful ones: only those are counted).
- transformers one at a time: the first `--one-at-a-time-requests` requests, each alone.
- with `--adapters N` (default 8; 0 skips it): loraplex with N random LoRA adapters (rank `--adapter-rank`,
  alpha 2 x rank, on every attention and feed-forward projection), made with PEFT, saved with PEFT's
  `save_pretrained` and read with loraplex's adapter loader, spread round-robin over the requests; against
  PEFT's mixed-adapter batch (`adapter_names=` in `generate`) on a copy of the same transformers model.

EOS is ignored the same way on both sides: transformers gets `eos_token_id=None` (nothing stops a row and no
logit is masked, as loraplex's `ignore_eos`), so greedy tokens compare one for one. Forced BOS / EOS tokens
(BART's default `forced_eos_token_id`) are switched off in the random model: with mixed lengths a padded batch
would force EOS only at the longest request's end. Sanity: how many requests' greedy tokens loraplex matched
(the padded batch can flip a near-tie token through small numeric differences, so this is reported, not
asserted), and how many of the adapter requests match PEFT's and differ from the base model's.
"""

from __future__ import annotations

import copy
import json
import os
import random
import sys
import tempfile
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.systems import Loraplex, Measurement, measure
from benchmarks.workload import Workload, random_prompts, round_robin

FAMILIES = ("t5", "bart")
# loraplex's tokens/s as a multiple of each peer's (the targets).
TARGETS = {"batched": 1.5, "one_at_a_time": 5.0, "peft_mixed": 1.5}
TARGET_MODULES = {
    "t5": ("q", "k", "v", "o", "wi_0", "wi_1", "wo"),
    "bart": ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
}


@dataclass(frozen=True)
class ModelSize:
    d_model: int = 256
    layers: int = 4  # encoder and decoder each
    heads: int = 4
    d_ff: int = 1024
    vocab_size: int = 16384

    def describe(self) -> str:
        return (f"d_model {self.d_model}, {self.layers}+{self.layers} layers, {self.heads} heads, "
                f"d_ff {self.d_ff}, vocab {self.vocab_size}")


@dataclass(frozen=True)
class Tokens:
    """A family's special ids: what an encoder input is wrapped in, and what random ids avoid."""

    head: tuple[int, ...]  # before the random ids (BART's <s>)
    tail: tuple[int, ...]  # after them (</s>)
    special: tuple[int, ...]
    pad: int


FAMILY_TOKENS = {
    "t5": Tokens(head=(), tail=(1,), special=(0, 1, 2), pad=0),  # <pad>=0 </s>=1 <unk>=2
    "bart": Tokens(head=(0,), tail=(2,), special=(0, 1, 2, 3), pad=1),  # <s>=0 <pad>=1 </s>=2 <unk>=3
}


# ---- the models -------------------------------------------------------------------------------------


def build_hf_model(family: str, size: ModelSize = ModelSize(), seed: int = 0):
    """A random transformers T5 (v1.1 style) or BART of `size`, seeded, its weights re-drawn so that every one
    matters and greedy outputs vary (as the parity tests' tiny models do), forced tokens off."""
    import transformers

    torch.manual_seed(seed)
    if family == "t5":
        config = transformers.T5Config(
            vocab_size=size.vocab_size, d_model=size.d_model, d_kv=size.d_model // size.heads, d_ff=size.d_ff,
            num_layers=size.layers, num_decoder_layers=size.layers, num_heads=size.heads,
            feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0, pad_token_id=0,
            eos_token_id=1,
        )
        model = transformers.T5ForConditionalGeneration(config).eval()
        # As tests/helpers.py's tiny_t5, a little narrower: at 4+4 layers its 1.5 / 2.0 make the model so
        # sensitive that float32 logits are off float64's by up to 4% (greedy near-ties everywhere); 0.8 / 1.0
        # keep outputs varied with float32 errors near 1e-4.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
                elif "relative_attention_bias" in name:
                    p.normal_(0, 1.0)
                elif p.dim() == 2:
                    p.normal_(0, 0.8 / p.shape[1] ** 0.5)
    elif family == "bart":
        config = transformers.BartConfig(
            vocab_size=size.vocab_size, d_model=size.d_model, encoder_layers=size.layers,
            decoder_layers=size.layers, encoder_attention_heads=size.heads, decoder_attention_heads=size.heads,
            encoder_ffn_dim=size.d_ff, decoder_ffn_dim=size.d_ff, max_position_embeddings=512,
            forced_bos_token_id=None, forced_eos_token_id=None,
        )
        model = transformers.BartForConditionalGeneration(config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith("bias"):  # LayerNorms at 1/0 and zero biases: perturb
                    p.add_(torch.randn_like(p) * 0.1)
                elif "embed" in name or "shared" in name or "lm_head" in name:
                    p.normal_(0, 1.0)
                else:  # sharp attention and a strong feed-forward, small v/out: varied outputs
                    std = (3.0 if name.endswith(("q_proj.weight", "k_proj.weight", "fc1.weight", "fc2.weight"))
                           else 1.0 if "encoder_attn" in name else 0.3)
                    p.normal_(0, std / p.shape[1] ** 0.5)
            model.final_logits_bias.normal_(0, 0.05)
    else:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    model.generation_config.forced_bos_token_id = None
    model.generation_config.forced_eos_token_id = None
    return model


def load_loraplex(hf_model, directory: str | os.PathLike, model_id: str = "random-seq2seq"):
    """Save `hf_model` and load it back with loraplex's loader (resolve, config + generation config, weights):
    a LoadedModel on CPU, float32, without a tokenizer (the workload is token ids)."""
    from loraplex.checkpoints.sources import resolve_model
    from loraplex.checkpoints.weights import load_state_dict
    from loraplex.engine.loading import LoadedModel, build_model, with_generation_config
    from loraplex.models.registry import config_from_hf

    hf_model.save_pretrained(directory)
    source = resolve_model(str(directory))
    generation = source.path / "generation_config.json"
    config = with_generation_config(
        config_from_hf(source.hf_config), json.loads(generation.read_text()) if generation.exists() else {}
    )
    model = build_model(config, load_state_dict(source, device="cpu", dtype=torch.float32))
    return LoadedModel(model, config, None, torch.device("cpu"), torch.float32, model_id)


def make_engine(loaded, workload: Workload, adapters: int, rank: int, block_size: int = 16):
    """An engine whose KV cache holds every request of `workload` at once (decoder tokens and the encoder's
    cross-attention states), with a device slot for each adapter."""
    from loraplex.config import EngineConfig
    from loraplex.engine.engine import Engine

    def blocks(n: int) -> int:
        return -(-n // block_size)

    tokens = sum(blocks(len(p)) + blocks(n + 2) for p, n in zip(workload.prompts, workload.max_new_tokens))
    config = EngineConfig(block_size=block_size, max_batch_total_tokens=(tokens + 8) * block_size,
                          max_active_adapters=max(1, adapters), max_lora_rank=max(rank, 1))
    return Engine(loaded, config)


# ---- the workload -----------------------------------------------------------------------------------


def seq2seq_workload(
    num_requests: int, vocab_size: int, tokens: Tokens, input_lens: tuple[int, int] = (8, 256),
    new_tokens: tuple[int, int] = (8, 64), seed: int = 0, name: str = "seq2seq",
) -> Workload:
    """Encoder inputs of lengths drawn uniformly from `input_lens` (inclusive, the special tokens included):
    random non-special ids wrapped in the family's head / tail; new-token counts uniform in `new_tokens`."""
    rng = random.Random(seed)
    wrap = len(tokens.head) + len(tokens.tail)
    lengths = [max(rng.randint(*input_lens), wrap + 1) for _ in range(num_requests)]
    outputs = [rng.randint(*new_tokens) for _ in range(num_requests)]
    bodies = random_prompts([n - wrap for n in lengths], vocab_size, tokens.special, rng)
    prompts = [[*tokens.head, *body, *tokens.tail] for body in bodies]
    return Workload(name, prompts, outputs, seed)


def right_padded(inputs: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) for an encoder: inputs left-aligned (positions from 0, as BART's learned
    positions need), padding on the right."""
    width = max(len(p) for p in inputs)
    input_ids = torch.full((len(inputs), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(inputs):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
    return input_ids, attention_mask


# ---- peers ------------------------------------------------------------------------------------------


class HFSeq2SeqBatched:
    """All requests as one right-padded batch through `generate`. Every row gets max(max_new_tokens) (EOS
    ignored, rows cannot stop early); each request keeps its own first max_new_tokens (the useful ones).
    With `mixed_adapters` (a PEFT model), each row runs on its workload's adapter (`adapter_names`)."""

    def __init__(self, model, pad_token_id: int, name: str = "transformers batched", mixed_adapters: bool = False):
        self.model, self.pad_token_id, self.name, self.mixed_adapters = model, pad_token_id, name, mixed_adapters

    @torch.inference_mode()
    def run(self, workload: Workload) -> list[list[int]]:
        input_ids, attention_mask = right_padded(workload.prompts, self.pad_token_id)
        steps = max(workload.max_new_tokens)
        extra = {}
        if self.mixed_adapters:
            assert workload.adapter_ids is not None, f"{self.name} needs a workload with adapters"
            extra["adapter_names"] = list(workload.adapter_ids)
        out = self.model.generate(
            input_ids=input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=steps,
            eos_token_id=None, pad_token_id=self.pad_token_id, temperature=None, top_p=None, top_k=None, **extra,
        )
        # out[:, 0] is the decoder start token
        return [row[1 : 1 + n].tolist() for row, n in zip(out, workload.max_new_tokens)]


class HFSeq2SeqOneAtATime:
    """One request at a time, each a batch of one with its own max_new_tokens (no padding)."""

    name = "transformers one-at-a-time"

    def __init__(self, model, pad_token_id: int) -> None:
        self.single = HFSeq2SeqBatched(model, pad_token_id)

    def run(self, workload: Workload) -> list[list[int]]:
        return [self.single.run(workload.select([i]))[0] for i in range(workload.num_requests)]


def make_peft_adapters(hf_model, names: Sequence[str], targets: Iterable[str], rank: int, directory: Path,
                       base_shapes, seed: int = 0):
    """A PEFT seq2seq model over a deep copy of `hf_model` holding one random adapter per name (PEFT's
    `init_lora_weights=False`: A and B drawn as nn.Linear's default, seeded; alpha = 2 x rank), each saved
    with PEFT's `save_pretrained` and read back with loraplex's loader. Returns (peft model, {name: adapter})."""
    from peft import LoraConfig, TaskType, get_peft_model

    from loraplex.lora.adapter import load_adapter_dir

    def config() -> LoraConfig:
        return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), lora_dropout=0.0,
                          init_lora_weights=False, task_type=TaskType.SEQ_2_SEQ_LM)

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(copy.deepcopy(hf_model), config(), adapter_name=names[0])
        for name in names[1:]:
            peft_model.add_adapter(name, config())
    peft_model.eval()
    adapters = {}
    for name in names:
        peft_model.save_pretrained(str(directory), selected_adapters=[name])
        saved = directory if name == "default" else directory / name  # where PEFT puts a named adapter
        adapters[name] = load_adapter_dir(saved, name, base_shapes, rank)
    return peft_model, adapters


# ---- the benchmark ----------------------------------------------------------------------------------


@dataclass
class Seq2SeqResult:
    family: str
    model: str  # a description of the random model
    workload: Workload
    ours: Measurement
    batched: Measurement
    one_at_a_time: Measurement
    identical_batched: int  # of all requests, loraplex's greedy tokens equal to transformers batched
    identical_one: int  # of the one-at-a-time subset
    adapters: Measurement | None = None  # loraplex with adapters
    peft: Measurement | None = None
    identical_peft: int = 0
    differ_from_base: int = 0  # adapter requests whose tokens differ from loraplex's on the base model
    stats: dict = field(default_factory=dict)  # loraplex's engine statistics (steps, most requests in a step)
    repeats: int = 1
    load_average: float = 0.0  # os.getloadavg()[0] after the timed runs

    @property
    def ratios(self) -> dict[str, float]:
        rate = self.ours.tokens_per_s
        ratios = {"batched": rate / self.batched.tokens_per_s, "one_at_a_time": rate / self.one_at_a_time.tokens_per_s}
        if self.adapters is not None and self.peft is not None:
            ratios["peft_mixed"] = self.adapters.tokens_per_s / self.peft.tokens_per_s
            ratios["adapters_vs_base"] = self.adapters.tokens_per_s / rate
        return ratios

    def to_json(self) -> dict:
        w = self.workload
        systems = {"loraplex": self.ours, "batched": self.batched, "one_at_a_time": self.one_at_a_time,
                   "loraplex_adapters": self.adapters, "peft_mixed": self.peft}
        figures = {
            "model": self.model,
            "description": w.describe(),
            "seed": w.seed,
            "encoder_input_lengths": [len(p) for p in w.prompts],
            "max_new_tokens": w.max_new_tokens,
            **{key: vars(m) | {"tokens_per_s": m.tokens_per_s} for key, m in systems.items() if m is not None},
            "ratios": self.ratios,
            "targets": TARGETS,
            "identical_to_batched": [self.identical_batched, w.num_requests],
            "identical_to_one_at_a_time": [self.identical_one, self.one_at_a_time.requests],
            "loraplex_stats": self.stats,
            "repeats": self.repeats,
            "load_average": self.load_average,
        }
        if self.adapters is not None:
            figures["num_adapters"] = w.num_adapters if w.adapter_ids else None
            figures["identical_to_peft"] = [self.identical_peft, self.adapters.requests]
            figures["differ_from_base"] = [self.differ_from_base, self.adapters.requests]
        return figures


@dataclass
class Setup:
    """One family's systems, built, loaded and warmed up, and its workloads."""

    family: str
    model: str  # a description of the random model
    workload: Workload
    ours: Loraplex
    batched: HFSeq2SeqBatched
    one_at_a_time: HFSeq2SeqOneAtATime
    adapter_workload: Workload | None = None  # the workload, round-robin over the adapters
    ours_adapters: Loraplex | None = None
    peft: HFSeq2SeqBatched | None = None


def bench_seq2seq(setup: Setup, one_at_a_time_requests: int, repeats: int = 1, log=lambda line: None) -> Seq2SeqResult:
    """Time the systems (taking turns `repeats` times; each keeps its best run) and compare greedy tokens."""
    family, model, workload, ours = setup.family, setup.model, setup.workload, setup.ours
    adapter_workload = setup.adapter_workload
    runs = [(ours, workload), (setup.batched, workload), (setup.one_at_a_time, workload.head(one_at_a_time_requests))]
    if adapter_workload is not None:
        runs += [(setup.ours_adapters, adapter_workload), (setup.peft, adapter_workload)]
    rounds = []
    for i in range(repeats):
        row = []
        for system, w in runs:
            m, outputs = measure(system, w)
            row.append((m, outputs, dict(getattr(system, "stats", {}))))  # the engine's statistics of this run
            log(f"  [{family} round {i + 1}/{repeats}] {system.name}: {m.seconds:.2f}s, {m.tokens_per_s:.1f} tok/s, "
                f"load average {os.getloadavg()[0]:.2f}")
        rounds.append(row)
    best = [min(column, key=lambda r: r[0].seconds) for column in zip(*rounds)]
    (ours_m, ours_out, stats), (batched_m, batched_out, _), (one_m, one_out, _) = best[:3]
    result = Seq2SeqResult(
        family, model, workload, ours_m, batched_m, one_m,
        identical_batched=sum(a == b for a, b in zip(ours_out, batched_out)),
        identical_one=sum(a == b for a, b in zip(ours_out, one_out)),
        stats=stats, repeats=repeats,
    )
    if adapter_workload is not None:
        (adapters_m, adapters_out, _), (peft_m, peft_out, _) = best[3:]
        result.adapters, result.peft = adapters_m, peft_m
        result.identical_peft = sum(a == b for a, b in zip(adapters_out, peft_out))
        result.differ_from_base = sum(a != b for a, b in zip(adapters_out, ours_out))
    result.load_average = os.getloadavg()[0]
    return result


def format_seq2seq(result: Seq2SeqResult, setting: str) -> str:
    w, ratios = result.workload, result.ratios
    best_of = f", best of {result.repeats}" if result.repeats > 1 else ""

    def row(m: Measurement, key: str | None = None, label: str | None = None) -> str:
        line = f"  {label or m.system:<32}{m.tokens_per_s:>9.1f} tok/s"
        if key is None:
            return line
        ratio, target = ratios[key], TARGETS.get(key)
        verdict = "" if target is None else f" (target >= {target:.1f}x, {'met' if ratio >= target else 'NOT met'})"
        who = "loraplex with adapters" if key == "peft_mixed" else "loraplex"
        return f"{line}   {who} = {ratio:.2f}x{verdict}"

    description = w.describe().replace(" prompt /", " encoder input /")
    lines = [
        f"workload seq2seq ({result.family}: {result.model}): {description}, greedy, {setting}{best_of}",
        row(result.ours),
        row(result.batched, "batched"),
        row(result.one_at_a_time, "one_at_a_time"),
    ]
    if result.adapters is not None and result.peft is not None:
        lines += [
            row(result.adapters, label=f"loraplex, {result.adapters.system.split(', ')[-1]}")
            + f"   = {ratios['adapters_vs_base']:.2f}x loraplex on the base model",
            row(result.peft, "peft_mixed"),
        ]
    steps = max(w.max_new_tokens)
    if min(w.max_new_tokens) != steps:
        lines.append(f"  note: the padded batches generate {steps} tokens for all {w.num_requests} rows "
                     f"({steps * w.num_requests} tokens); their tok/s counts only the {w.new_tokens} requested ones")
    n = result.one_at_a_time.requests
    if n < w.num_requests:
        lines.append(f"  note: transformers one-at-a-time timed on the first {n} of {w.num_requests} requests; "
                     "its tok/s is from those (a ratio of rates)")
    s = result.stats
    lines.append(f"  loraplex: {s.get('steps', 0)} engine steps, at most {s.get('max_running', 0)} requests in a step")
    lines.append(f"  sanity: greedy tokens identical to transformers batched for {result.identical_batched}/"
                 f"{w.num_requests} requests, to transformers one-at-a-time for {result.identical_one}/{n}")
    if result.adapters is not None:
        k = result.adapters.requests
        lines.append(f"  sanity: with adapters, {result.identical_peft}/{k} requests identical to PEFT's; "
                     f"{result.differ_from_base}/{k} differ from the base model's (the adapters change the output)")
    lines.append(f"  load average {result.load_average:.2f} after the timed runs")
    return "\n".join(lines)


def setup_family(family: str, args, directory: Path, size: ModelSize = ModelSize()) -> Setup:
    """Build the random model, load it into loraplex (through `directory`), make the adapters and warm every
    system up. `args`: requests, adapters, adapter_rank, seed; optionally input_lens and new_tokens_range
    (inclusive ranges; default 8..256 and 8..64)."""
    tokens = FAMILY_TOKENS[family]
    hf = build_hf_model(family, size, seed=args.seed)
    input_lens = getattr(args, "input_lens", (8, 256))
    new_tokens = getattr(args, "new_tokens_range", (8, 64))
    workload = seq2seq_workload(args.requests, size.vocab_size, tokens, input_lens, new_tokens, seed=args.seed)
    warmup = seq2seq_workload(2, size.vocab_size, tokens, (8, 16), (2, 4), seed=args.seed + 1, name="warmup")
    loaded = load_loraplex(hf, directory / "model", model_id=f"random-{family}")
    engine = make_engine(loaded, workload, args.adapters, args.adapter_rank)
    params = sum(p.numel() for p in hf.parameters()) / 1e6
    model = f"random {'T5 v1.1 (gated-GELU)' if family == 't5' else 'BART'}, {size.describe()}, {params:.1f}M params"
    setup = Setup(family, model, workload, Loraplex(engine), HFSeq2SeqBatched(hf, tokens.pad),
                  HFSeq2SeqOneAtATime(hf, tokens.pad))
    for system in (setup.ours, setup.batched, setup.one_at_a_time):  # warm-up (excluded)
        system.run(warmup)
    if args.adapters > 0:
        names = [f"adapter-{i}" for i in range(args.adapters)]
        peft_model, adapters = make_peft_adapters(hf, names, TARGET_MODULES[family], args.adapter_rank,
                                                  directory / "adapters", engine.lora.base_shapes, seed=args.seed)
        setup.adapter_workload = round_robin(workload, names)
        setup.ours_adapters = Loraplex(engine, adapters, name=f"loraplex, {args.adapters} adapters")
        setup.peft = HFSeq2SeqBatched(peft_model, tokens.pad, name="PEFT mixed-adapter batch", mixed_adapters=True)
        # One short request per adapter: the timed runs serve resident adapters (as PEFT's are).
        adapter_warmup = round_robin(
            seq2seq_workload(args.adapters, size.vocab_size, tokens, (8, 16), (2, 4), seed=args.seed + 1), names)
        setup.ours_adapters.run(adapter_warmup)
        setup.peft.run(adapter_warmup)
    return setup


def run_family(family: str, args, size: ModelSize = ModelSize(),
               log=lambda line: print(line, file=sys.stderr, flush=True)) -> Seq2SeqResult:
    """Set one family up (in a temporary directory) and time it (`args` as setup_family's, and
    one_at_a_time_requests, repeats)."""
    with tempfile.TemporaryDirectory() as tmp:
        setup = setup_family(family, args, Path(tmp), size)
        return bench_seq2seq(setup, args.one_at_a_time_requests, args.repeats, log=log)


def main(args) -> int:
    """`loraplex bench --workload seq2seq ...` (parsed by benchmarks/offline.py, which calls this; the module has no
    `__main__` of its own: offline.py imports it, so it imports nothing of offline.py)."""
    families = FAMILIES if args.family == "both" else (args.family,)
    setting = f"cpu float32, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.2f} (the machine is shared: read the ratios)", flush=True)
    results = {}
    for family in families:
        results[family] = run_family(family, args)
        print(format_seq2seq(results[family], setting), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setting": setting, "torch_num_threads": torch.get_num_threads(),
                       "workloads": {f"seq2seq-{k}": r.to_json() for k, r in results.items()}}, f, indent=2)
    return 0

