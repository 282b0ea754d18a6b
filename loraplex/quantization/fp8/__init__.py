"""`--quantize fp8` and published FP8 checkpoints: e4m3 weights, dynamic activation scales."""
