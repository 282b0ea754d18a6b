"""The step profile's grouping (benchmarks/step_kernels.py): kernel names to kinds, and the lines it prints."""

from benchmarks.step_kernels import describe, kind_of


def test_kernels_are_grouped_by_what_they_read():
    assert kind_of("nvjet_tst_64x8_64x16_2x1_v_bz_splitK_TNT") == "matmuls"
    assert kind_of("void gemv2T_kernel_val<int, int, __nv_bfloat16>") == "matmuls"
    assert kind_of("cublasLt::splitKreduce_kernel<32, 16>") == "matmuls"
    assert kind_of("_paged_decode_kernel") == "attention" and kind_of("_merge_splits_kernel") == "attention"
    assert kind_of("_shrink_kernel") == "lora" and kind_of("_expand_kernel") == "lora"
    assert kind_of("_add_rms_norm_kernel") == "elementwise" and kind_of("_write_kv_kernel") == "elementwise"
    assert kind_of("Memcpy DtoD (Device -> Device)") == "other"


def test_each_kind_gets_its_time_share_and_rate_and_the_rest_is_gaps():
    lines = describe({"matmuls": 4.0, "attention": 2.0, "other": 0.5}, 8.0, {"matmuls": 16_000_000_000})
    assert lines[0].split() == ["matmuls", "4.00", "ms", "(50%),", "16.00", "GB", "at", "4,000", "GB/s"]
    assert lines[1].split() == ["attention", "2.00", "ms", "(25%)"]  # its bytes were not given: no rate
    assert lines[2].split()[:2] == ["other", "0.50"]
    assert lines[3].split() == ["gaps", "1.50", "ms", "(19%)"]
