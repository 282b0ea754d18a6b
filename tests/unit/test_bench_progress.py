"""Every `python -m benchmarks.*` says what it does within seconds (issue "A user's first hour"): stamped progress
lines on stderr (benchmarks/progress.py), and a benchmark that needs CUDA says so and exits 2 at once elsewhere."""

from __future__ import annotations

import importlib
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
STAMPED = re.compile(r"^\[\s*\d+s\] \S")

# Benchmarks with a `__main__` that do not use benchmarks/progress.py, and why.
ALLOWED = {
    "offline": "its own `progress` (the same `[  12s] what` lines), from which benchmarks/progress.py was copied",
    "embeddings": "its own stamped `log` lines and its own CUDA check (another change's file)",
    "cold_adapters": "drives a server over HTTP; left to its own change",
    "scheduler_cost": "pure Python, finishes in about a second",
}

# Those that need a CUDA device, with the smallest arguments their main takes.
NEEDS_CUDA = {
    "decode_graphs": ["--layers", "1", "--new-tokens", "2"],
    "fp8_kernels": ["--shapes", "qkv", "--rows", "1"],
    "kv_fp8": ["--calls", "1"],
    "lora_host_costs": [],
    "lora_rows": [],
    "lora_step": [],
    "mllama_shape": ["--image-requests", "1", "--text-requests", "1"],
    "moe": ["--rows", "1"],
    "paged_decode": ["--rows", "1", "--op-only"],
    "quantized_rows": ["--rows", "1"],
    "step_shares": ["--new-tokens", "2"],
    "w4a16_kernels": ["--rows", "1", "--no-sweep"],
}

# CPU-capable ones, with their smallest options: a stamped line must come within 15 s of the start.
ON_CPU = {
    "speculative": ["--requests", "1", "--new-tokens", "4", "--speculative-tokens", "0"],
    "prefix_caching": ["--requests", "2", "--system-tokens", "16", "--new-tokens", "2", "--adapters", "0",
                       "--repeats", "1"],
}


def mains() -> list[str]:
    return sorted(p.stem for p in BENCHMARKS.glob("*.py") if 'if __name__ == "__main__"' in p.read_text())


def test_every_benchmark_with_a_main_uses_the_progress_helper_or_says_why_not():
    missing = [name for name in mains() if name not in ALLOWED
               and "from benchmarks.progress import" not in (BENCHMARKS / f"{name}.py").read_text()]
    assert not missing, f"print progress with benchmarks/progress.py, or allow-list with the reason: {missing}"
    assert not set(ALLOWED) - set(mains()), "allow-listed modules that no longer have a __main__"
    assert set(NEEDS_CUDA) | set(ON_CPU) <= set(mains())


def test_progress_stamps_seconds_on_stderr(capsys):
    from benchmarks.progress import progress

    progress(time.perf_counter() - 12)("loading")
    out, err = capsys.readouterr()
    assert out == "" and err == "[   12s] loading\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
@pytest.mark.parametrize("name", sorted(NEEDS_CUDA))
def test_a_cuda_benchmark_exits_2_at_once_without_cuda(name, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # lora_host_costs runs on CPU under Triton's interpreter
    module = importlib.import_module(f"benchmarks.{name}")
    started = time.perf_counter()
    code = module.main(NEEDS_CUDA[name])
    took = time.perf_counter() - started
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "CUDA" in err, err
    assert took < 5, f"{name} took {took:.1f}s to give up"


def first_stamped_line(args: list[str], within: float) -> tuple[str | None, list[str]]:
    """The first stamped stderr line of `python -m ...args` within `within` seconds of its start (None if none
    came), and every stderr line read; the process is killed either way."""
    lines: queue.Queue[str | None] = queue.Queue()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)

    def pump():
        for line in proc.stderr:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + within
    seen: list[str] = []
    try:
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:  # the process ended
                break
            seen.append(line)
            if STAMPED.match(line):
                return line, seen
        return None, seen
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.parametrize("name", sorted(ON_CPU))
def test_a_cpu_benchmark_says_what_it_runs_within_seconds(name):
    line, seen = first_stamped_line([f"benchmarks.{name}", "--device", "cpu", *ON_CPU[name]], within=15)
    assert line is not None, f"no stamped progress line on stderr within 15 s; stderr: {seen}"
    assert "cpu" in line, line
