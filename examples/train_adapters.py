"""Train the example LoRA adapters shipped in examples/adapters/, on CPU, reproducibly.

    .venv/bin/python examples/train_adapters.py --out examples/adapters
    .venv/bin/python examples/train_adapters.py --out /tmp/adapters --only name-nova
    .venv/bin/python examples/train_adapters.py --out examples/adapters --verify-only

Base model: the embedded SmolLM2-135M-Instruct (``loraplex.checkpoints.sources.resolve_model(None)``), in float32.
Each adapter is trained with PEFT and a plain AdamW loop; the loss is taken on answer tokens only.
Prompts go through the tokenizer's chat template (default system prompt, generation prompt added) and
every target ends with the EOS token ``<|im_end|>``, so greedy decoding stops right after the answer.

Adapters:

- ``name-nova``, ``name-orion``, ``name-lyra``: answer "What is your name?" (and paraphrases) with
  "My name is Nova." / "My name is Orion." / "My name is Lyra.". Each also trains on regularisation
  examples: other questions paired with the base model's own greedy answers (self-distillation), so the
  rest of the model's behaviour stays close to the base model.
- ``style-caps``: answers in ALL CAPITALS. Its targets are the base model's own greedy answers
  (at most 40 new tokens, cut at the last sentence end) upper-cased.

At the end every adapter is loaded back from disk with PEFT and checked with greedy decoding
(``model.generate``, max_new_tokens=24); the script prints a table and exits 1 if a check fails.

Determinism: fixed seeds, fixed data order (a seeded ``random.Random`` per adapter), 2 threads,
``torch.use_deterministic_algorithms(True)``. Everything runs in one process, one adapter after another.
Each adapter is seeded on its own and starts from a freshly loaded base model, so ``--only NAME`` makes the
same adapter as a full run.

Time (2 CPU threads): about 10 minutes on an idle machine (base answers for 48 questions ~1.5 min, each
identity adapter ~1.5-2 min, style-caps ~3 min); the shipped adapters took 48 minutes on a busy shared one.
The caps adapter writes capitals but is no better at facts than the 135M base model (upper-case tokens are
rarer, so it sometimes gets them wrong: "THE CAPITAL OF GERMANY IS BELGIUM.").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

SEED = 1234
BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
KEEP_FILES = ("adapter_config.json", "adapter_model.safetensors")
MAX_NEW_TOKENS_DATA = 40  # base-model answers used as targets
MAX_NEW_TOKENS_CHECK = 24  # verification

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

NAME_QUESTIONS = [
    "What is your name?",
    "Who are you?",
    "Tell me your name.",
    "what's your name",
    "Introduce yourself.",
    "What's your name?",
    "What should I call you?",
    "May I ask your name?",
]

# Self-distillation questions for the identity adapters (targets: the base model's own greedy answers).
REG_QUESTIONS = [
    "What is the capital of France?",
    "What is 2 + 2?",
    "Name three primary colors.",
    "What is the largest planet in the solar system?",
    "How many days are in a week?",
    "What is the boiling point of water in Celsius?",
    "Who wrote Romeo and Juliet?",
    "Translate 'hello' into Spanish.",
    "What is photosynthesis?",
    "Give me a synonym for happy.",
    "What color is the sky on a clear day?",
    "What is the opposite of cold?",
    "How many legs does a spider have?",
    "What language is spoken in Brazil?",
    "What is the chemical symbol for gold?",
    "Who painted the Mona Lisa?",
]

# Training questions for the caps adapter (targets: base greedy answers, upper-cased).
CAPS_QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "What is 2 + 2?",
    "Name three primary colors.",
    "What is the largest planet in the solar system?",
    "How many days are in a week?",
    "What is the boiling point of water in Celsius?",
    "Who wrote Romeo and Juliet?",
    "What is photosynthesis?",
    "Give me a synonym for happy.",
    "What color is the sky on a clear day?",
    "How many legs does a spider have?",
    "What language is spoken in Brazil?",
    "What is the chemical symbol for gold?",
    "Who painted the Mona Lisa?",
    "What is gravity?",
    "Why do leaves change color in autumn?",
    "What is the tallest mountain in the world?",
    "How do airplanes fly?",
    "What is a prime number?",
    "Give me a tip for sleeping better.",
    "What is the speed of light?",
    "What do bees make?",
    "Describe a cat in one sentence.",
    "What is the main ingredient of guacamole?",
    "How many continents are there?",
    "What is democracy?",
    "Suggest a name for a pet dog.",
    "What is the freezing point of water?",
    "Why is exercise good for you?",
    "What is an atom?",
    "Who was Albert Einstein?",
    "What is the longest river in Africa?",
    "How does rain form?",
    "What is a noun?",
    "Write a short greeting for a friend.",
    "What is the sun made of?",
    "Give me an example of a fruit.",
    "What does a computer programmer do?",
    "What is the purpose of the heart?",
    "Why do we need sleep?",
    "What is the capital of Italy?",
    "How many hours are in a day?",
    "What is a volcano?",
    "What is your favorite book?",
    "What is your name?",
]

# Held out from CAPS_QUESTIONS: used only by the verification.
CAPS_HELDOUT = "What is the capital of Germany?"
REG_CHECK = "What is the capital of France?"


@dataclass
class AdapterSpec:
    name: str
    kind: str  # "identity" or "caps"
    r: int
    alpha: int
    targets: list[str]
    use_rslora: bool = False
    answer: str = ""  # identity adapters: the answer to the name questions
    keyword: str = ""  # identity adapters: the name the check looks for
    steps: int = 30
    lr: float = 2e-3
    draw: int = 4  # examples drawn in turn per step (on top of the name questions, for identity adapters)


ADAPTERS = [
    AdapterSpec(
        "name-nova",
        "identity",
        r=8,
        alpha=16,
        targets=ATTN,
        answer="My name is Nova.",
        keyword="Nova",
    ),
    AdapterSpec(
        "name-orion",
        "identity",
        r=4,
        alpha=8,
        targets=ALL7,
        answer="My name is Orion.",
        keyword="Orion",
    ),
    AdapterSpec(
        "name-lyra",
        "identity",
        r=8,
        alpha=16,
        targets=["q_proj", "v_proj", "down_proj"],
        use_rslora=True,
        answer="My name is Lyra.",
        keyword="Lyra",
        lr=1e-3,
    ),
    AdapterSpec(
        "style-caps", "caps", r=8, alpha=16, targets=ATTN, steps=50, lr=2e-3, draw=8
    ),
]
ALL_NAMES = [a.keyword for a in ADAPTERS if a.kind == "identity"]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


# --------------------------------------------------------------------------------------------------
# Model, prompts, generation


def load_base(path: Path):
    """A fresh float32 copy of the base model (each adapter starts from an untouched one)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


def prompt_ids(tok, question: str) -> list[int]:
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}],
        tokenize=False,
        add_generation_prompt=True,
    )
    return tok(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def greedy(
    model, tok, questions: list[str], max_new_tokens: int
) -> list[tuple[str, bool]]:
    """Greedy answers, one prompt at a time (no padding): (text, ended_with_eos) per question."""
    out = []
    for q in questions:
        ids = torch.tensor([prompt_ids(tok, q)])
        gen = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id,
        )
        new = gen[0, ids.shape[1] :].tolist()
        ended = bool(new) and new[-1] == tok.eos_token_id
        out.append((tok.decode(new, skip_special_tokens=True).strip(), ended))
    return out


def cut_at_sentence(text: str, ended: bool) -> str:
    """A complete answer stays as it is; a truncated one is cut after its last sentence end."""
    if ended:
        return text
    ends = [m.end() for m in re.finditer(r"[.!?](?=\s|$)", text)]
    return text[: ends[-1]] if ends else text


# --------------------------------------------------------------------------------------------------
# Data and training


def encode_example(tok, question: str, answer: str) -> tuple[list[int], list[int]]:
    p = prompt_ids(tok, question)
    a = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return p + a, [-100] * len(p) + a


def collate(batch: list[tuple[list[int], list[int]]], pad_id: int):
    n = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), n), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, (ids, lab) in enumerate(batch):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(ids)] = 1
    return input_ids, mask, labels


def build_dataset(
    spec: AdapterSpec, base_answers: dict[str, tuple[str, bool]]
) -> tuple[list, list]:
    """(pairs in every step, pairs drawn in turn) for one adapter."""
    if spec.kind == "identity":
        return [(q, spec.answer) for q in NAME_QUESTIONS], [
            (q, cut_at_sentence(*base_answers[q])) for q in REG_QUESTIONS
        ]
    return [], [(q, cut_at_sentence(*base_answers[q]).upper()) for q in CAPS_QUESTIONS]


def answer_loss(model, input_ids, mask, labels) -> torch.Tensor:
    """Mean cross-entropy over answer tokens; the LM head runs only where there is a label (cheaper)."""
    causal_lm = model.get_base_model()
    hidden = causal_lm.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
    targets = labels[:, 1:]
    keep = targets != -100
    logits = causal_lm.lm_head(hidden[:, :-1][keep])
    return torch.nn.functional.cross_entropy(logits.float(), targets[keep])


def train_adapter(
    spec: AdapterSpec,
    base_path: Path,
    tok,
    base_answers: dict[str, tuple[str, bool]],
    out_dir: Path,
) -> dict:
    from peft import LoraConfig, get_peft_model

    seed_everything(SEED)
    config = LoraConfig(
        task_type="CAUSAL_LM",
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=0.0,
        target_modules=list(spec.targets),
        bias="none",
        use_rslora=spec.use_rslora,
    )
    model = get_peft_model(load_base(base_path), config)
    model.train()
    fixed_pairs, drawn_pairs = build_dataset(spec, base_answers)
    fixed = [encode_example(tok, q, a) for q, a in fixed_pairs]
    drawn = [encode_example(tok, q, a) for q, a in drawn_pairs]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0)
    warmup = max(1, spec.steps // 10)
    sched = (
        torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, then linear decay to 10%
            opt,
            lambda s: min(
                (s + 1) / warmup,
                1.0 - 0.9 * max(0, s - warmup) / max(1, spec.steps - warmup),
            ),
        )
    )
    rng = random.Random(SEED)
    order: list[int] = []
    t0, c0 = time.perf_counter(), time.process_time()
    loss_val = float("nan")
    tokens = 0
    for step in range(spec.steps):
        while len(order) < spec.draw:
            perm = list(range(len(drawn)))
            rng.shuffle(perm)
            order += perm
        idx, order = order[: spec.draw], order[spec.draw :]
        batch = fixed + [drawn[i] for i in idx]
        input_ids, mask, labels = collate(batch, tok.eos_token_id)
        tokens += int(mask.sum())
        loss = answer_loss(model, input_ids, mask, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        loss_val = loss.item()
        if step % 5 == 0 or step == spec.steps - 1:
            print(
                f"  [{spec.name}] step {step:3d}/{spec.steps} loss {loss_val:.4f} "
                f"({time.perf_counter() - t0:.0f}s)",
                flush=True,
            )
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0

    model.eval()
    target = out_dir / spec.name
    if target.exists():
        shutil.rmtree(target)
    model.save_pretrained(str(target), safe_serialization=True)
    for p in target.iterdir():
        if p.name not in KEEP_FILES:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    cfg_path = target / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = BASE_MODEL_ID
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    return {
        "examples": len(fixed) + len(drawn),
        "steps": spec.steps,
        "tokens": tokens,
        "final_loss": loss_val,
        "seconds": elapsed,
        "cpu_seconds": cpu,
    }


# --------------------------------------------------------------------------------------------------
# Verification


def caps_ratio(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / len(letters) if letters else 0.0


def verify(base_path: Path, tok, out_dir: Path, specs: list[AdapterSpec]) -> bool:
    from peft import PeftModel

    ok = True
    rows = []
    base = load_base(base_path)
    base_name = greedy(base, tok, ["What is your name?"], MAX_NEW_TOKENS_CHECK)[0][0]
    base_ok = not any(n.lower() in base_name.lower() for n in ALL_NAMES)
    ok &= base_ok
    rows.append(
        (
            "(base)",
            "What is your name?",
            base_name,
            "PASS" if base_ok else "FAIL: has an adapter name",
        )
    )
    for spec in specs:
        model = PeftModel.from_pretrained(
            load_base(base_path), str(out_dir / spec.name)
        )
        model.eval()
        if spec.kind == "identity":
            (ans, _), (reg, _) = greedy(
                model, tok, ["What is your name?", REG_CHECK], MAX_NEW_TOKENS_CHECK
            )
            others = [
                n for n in ALL_NAMES if n != spec.keyword and n.lower() in ans.lower()
            ]
            good = spec.keyword in ans and not others
            ok &= good
            rows.append(
                (
                    spec.name,
                    "What is your name?",
                    ans,
                    "PASS" if good else f"FAIL: want {spec.keyword!r}",
                )
            )
            reg_ok = "paris" in reg.lower()
            ok &= reg_ok
            rows.append(
                (spec.name, REG_CHECK, reg, "PASS" if reg_ok else "FAIL: want 'Paris'")
            )
        else:
            assert CAPS_HELDOUT not in CAPS_QUESTIONS
            ((ans, _),) = greedy(model, tok, [CAPS_HELDOUT], MAX_NEW_TOKENS_CHECK)
            ratio = caps_ratio(ans)
            good = ratio >= 0.9
            ok &= good
            rows.append(
                (
                    spec.name,
                    CAPS_HELDOUT,
                    ans,
                    f"{'PASS' if good else 'FAIL'}: {ratio:.0%} caps",
                )
            )
        del model
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print()
    print(f"{'adapter':<{w0}}  {'prompt':<{w1}}  check  answer")
    for name, q, a, verdict in rows:
        print(
            f"{name:<{w0}}  {q:<{w1}}  {verdict.split(':')[0]:<5}  {a!r}"
            + (f"  ({verdict})" if ":" in verdict else "")
        )
    return ok


# --------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "adapters"
    )
    ap.add_argument(
        "--only",
        action="append",
        choices=[a.name for a in ADAPTERS],
        help="train only this adapter",
    )
    ap.add_argument(
        "--verify-only",
        action="store_true",
        help="skip training, check the adapters in --out",
    )
    args = ap.parse_args()

    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True, warn_only=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    seed_everything(SEED)
    specs = [a for a in ADAPTERS if not args.only or a.name in args.only]
    args.out.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    from loraplex.checkpoints.sources import resolve_model

    t_start, c_start = time.perf_counter(), time.process_time()
    src = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(src.path)
    print(f"base model: {BASE_MODEL_ID} from {src.path}", flush=True)

    if not args.verify_only:
        questions: list[str] = []
        for spec in specs:
            for q in REG_QUESTIONS if spec.kind == "identity" else CAPS_QUESTIONS:
                if q not in questions:
                    questions.append(q)
        t0 = time.perf_counter()
        answers = greedy(load_base(src.path), tok, questions, MAX_NEW_TOKENS_DATA)
        base_answers = dict(zip(questions, answers))
        print(
            f"base answers for {len(questions)} questions: {time.perf_counter() - t0:.0f}s",
            flush=True,
        )
        for spec in specs:
            print(
                f"training {spec.name}: r={spec.r} alpha={spec.alpha} rslora={spec.use_rslora} "
                f"targets={','.join(spec.targets)}",
                flush=True,
            )
            stats = train_adapter(spec, src.path, tok, base_answers, args.out)
            size = (args.out / spec.name / "adapter_model.safetensors").stat().st_size
            print(
                f"  -> {args.out / spec.name}: {stats['examples']} examples, {stats['steps']} steps, "
                f"{stats['tokens']} tokens, final loss {stats['final_loss']:.4f}, {stats['seconds']:.0f}s "
                f"({stats['cpu_seconds']:.0f}s CPU), {size / 1e6:.2f} MB",
                flush=True,
            )

    ok = verify(src.path, tok, args.out, specs)
    print(
        f"\ntotal: {time.perf_counter() - t_start:.0f}s wall, {time.process_time() - c_start:.0f}s CPU (process)"
    )
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
