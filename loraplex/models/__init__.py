"""Model code: one file per family; no batching, no adapters, no HTTP."""
