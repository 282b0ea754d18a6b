"""W4A16 (4-bit weights, 16-bit activations): GPTQ/AWQ/compressed-tensors checkpoints and their kernels."""
