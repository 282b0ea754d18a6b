"""GPU kernels (Triton), each beside the torch reference it must match (`layers/attention.py` for attention)."""
