"""Benchmarks: throughput figures measured as ratios against peers run on the same machine, in the same run."""
