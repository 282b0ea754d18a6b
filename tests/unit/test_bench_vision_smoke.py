"""`loraplex bench --workload vision` runs end to end on both example VLMs (a tiny run: figures are not checked,
only that both systems produced every token and, for Mllama, the image-state memory is what its layout says)."""

from __future__ import annotations

import pytest

from benchmarks.vision import bench_vision, format_vision


@pytest.mark.parametrize("family", ["llava", "mllama"])
def test_vision_bench_runs(family):
    result = bench_vision(requests=2, new_tokens=2, repeats=1, family=family)
    assert result["requests"] == 4 and result["loraplex_tokens_per_s"] > 0 and result["transformers_tokens_per_s"] > 0
    text = format_vision(result)
    assert "ratio" in text
    if family == "mllama":  # 65 states per real tile (8 x 8 patches + CLS), 1 or 2 tiles per picture
        assert result["states_per_image"] in (65, 97.5, 130)
        assert result["reserved_bytes_per_image"] >= result["state_bytes_per_image"] > 0
        assert "image states" in text
