"""Model building blocks. Only attention (and, later, LoRA) layers read the per-step forward context."""
