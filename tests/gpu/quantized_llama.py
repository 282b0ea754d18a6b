"""What the quantized-model GPU tests share (test_gpu_quantization, test_gpu_w4a16, test_gpu_fp8): a small Llama
(4 layers, hidden 512, GQA), its prompt, the sampling, and bfloat16's tolerance. No CUDA needed to import."""

import torch

from loraplex.params import SamplingParams

DEVICE, DTYPE = "cuda", torch.bfloat16
SHAPE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2)
PROMPT = [1, 17, 203, 45, 9, 88, 130, 7, 251, 64, 3, 99, 180, 42, 5, 77, 211, 8, 150, 33, 120, 2048, 4000, 3071]
NEW = 12
PARAMS = SamplingParams(max_new_tokens=NEW, ignore_eos=True)


def tolerance(expected: torch.Tensor) -> float:
    return 6e-2 * max(1.0, expected.abs().max().item())  # bfloat16, as tests/gpu/test_gpu_parity.py
