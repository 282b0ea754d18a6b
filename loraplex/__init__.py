"""loraplex: one base model, many LoRA adapters, batched together."""

__version__ = "0.1.0"
