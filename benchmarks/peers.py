"""Hugging Face transformers peers: the same prompts through `model.generate`, greedy, EOS ignored.

A peer (like loraplex's own runner in `offline.py`) has a `name` and `run(workload) -> generated ids per request`.
"""

from __future__ import annotations

import os

import torch

from benchmarks.workload import Workload


def load_hf_model(path: str | os.PathLike, attn_implementation: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)
    except ValueError:  # families transformers runs only eagerly (MPT)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()



def left_padded(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) for transformers' generate: prompts right-aligned, padding on the left."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    return input_ids, attention_mask

class HFBatched:
    """All requests as one left-padded batch. `generate` cannot stop rows early when EOS is ignored, so every
    row gets max(max_new_tokens); each request keeps only its own first max_new_tokens (the useful ones)."""

    name = "transformers batched"

    def __init__(self, model, pad_token_id: int = 0) -> None:
        self.model, self.pad_token_id = model, pad_token_id

    def run(self, workload: Workload) -> list[list[int]]:
        input_ids, attention_mask = left_padded(workload.prompts, self.pad_token_id)
        steps = max(workload.max_new_tokens)
        out = self.model.generate(
            input_ids=input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=steps,
            min_new_tokens=steps, pad_token_id=self.pad_token_id, temperature=None, top_p=None, top_k=None,
        )
        return [row[:n].tolist() for row, n in zip(out[:, input_ids.shape[1]:], workload.max_new_tokens)]


class HFOneAtATime:
    """One request at a time, each a batch of one with its own max_new_tokens (no padding)."""

    name = "transformers one-at-a-time"

    def __init__(self, model, pad_token_id: int = 0) -> None:
        self.single = HFBatched(model, pad_token_id)

    def run(self, workload: Workload) -> list[list[int]]:
        return [self.single.run(workload.select([i]))[0] for i in range(workload.num_requests)]
