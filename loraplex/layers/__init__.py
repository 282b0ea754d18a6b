"""Model building blocks (attention, norms, rotary embeddings, projections, experts; `kernels/` for Triton).

Of these, attention (attention.py, encoder_attention.py) and the rotary embeddings (rotary.py: each row's sequence
length, for dynamic NTK / LongRoPE) read the per-step forward context (forward_context.py); the fused kernels'
choice (kernels/) reads only its graph warm-up flag. The LoRA layers live beside this package, in loraplex/lora/
(layers.py, experts.py), and read the step's LoRA plan from the same context (`current_lora`)."""
