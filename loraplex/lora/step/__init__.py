"""The per-step LoRA plan, the wrapped linears that ask it for their deltas, and the kernels that compute them."""
