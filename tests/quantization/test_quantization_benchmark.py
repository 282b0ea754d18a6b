"""benchmarks/quantization.py on a tiny shape on the CPU: a row per setting, every workload measured, the quantized
weights smaller than the float ones."""

import json


def test_benchmark_smoke(tmp_path, capsys):
    from benchmarks.quantization import main

    out = tmp_path / "q.json"
    assert main(["--device", "cpu", "--layers", "2", "--hidden", "128", "--heads", "4", "--kv-heads", "2",
                 "--intermediate", "256", "--vocab", "512", "--prompt-len", "16", "--new-tokens", "4",
                 "--workloads", "1x0,3x2", "--settings", "bf16,nf4,fp8,fp8-kv8,w4a16", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    results = {r["setting"]: r for r in json.loads(out.read_text())["results"]}
    assert all(f"| {name} |" in table for name in results) and len(results) == 5
    assert all(w["decode_tokens_per_s"] > 0 for r in results.values() for w in r["workloads"])
    assert results["w4a16"]["weight_bytes"] < results["fp8"]["weight_bytes"] < results["bf16"]["weight_bytes"]
    assert results["nf4"]["weight_bytes"] < results["bf16"]["weight_bytes"]
    assert results["fp8-kv8"]["kv_capacity_tokens"] >= 2 * results["fp8"]["kv_capacity_tokens"] - 64
