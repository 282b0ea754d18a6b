"""`--quantize bitsandbytes*`: int8 (LLM.int8) and NF4/FP4 linears through bitsandbytes."""
