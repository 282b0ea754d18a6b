"""The command line (issue 14): --version, --help's defaults and environment variables, LoRAX's launcher flags,
user errors as one line with exit status 2, --json-output's lines, and `loraplex bench` taking its options."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from loraplex import __version__
from loraplex.cli import build_parser
from tests.helpers import free_port


def loraplex(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loraplex.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def test_version():
    run = loraplex("--version")
    assert run.returncode == 0 and run.stdout.strip() == f"loraplex {__version__}"


def test_help_shows_defaults_and_environment_variables():
    text = " ".join(loraplex("serve", "--help").stdout.split())
    for expected in ("env MAX_INPUT_LENGTH", "env MODEL_ID", "default: 8080; env PORT",
                     "env HOSTNAME_BIND", "--trust-remote-code", "--cuda-memory-fraction", "--max-waiting-tokens",
                     "env MAX_QUEUED_TOKENS"):
        assert expected in text, expected


def test_lorax_launcher_flags_are_accepted():
    args = build_parser().parse_args([
        "serve", "--revision", "v2", "--huggingface-hub-cache", "/tmp/hub", "--max-waiting-tokens", "5",
        "--waiting-served-ratio", "0.5", "--validation-workers", "4", "--cuda-memory-fraction", "0.9",
        "--adapter-memory-fraction", "0.2",
    ])
    assert (args.revision, args.huggingface_hub_cache, args.max_waiting_tokens) == ("v2", "/tmp/hub", 5)
    assert (args.cuda_memory_fraction, args.adapter_memory_fraction) == (0.9, 0.2)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--cuda-memory-fraction", "1.5"])


def test_max_queued_tokens_is_off_by_default_and_comes_from_flag_or_environment(monkeypatch):
    assert build_parser().parse_args(["serve"]).max_queued_tokens is None
    assert build_parser().parse_args(["serve", "--max-queued-tokens", "5000"]).max_queued_tokens == 5000
    monkeypatch.setenv("MAX_QUEUED_TOKENS", "7000")
    assert build_parser().parse_args(["serve"]).max_queued_tokens == 7000
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-queued-tokens", "0"])


def test_generation_config_defaults_are_on_unless_ignored(monkeypatch):
    assert build_parser().parse_args(["serve"]).generation_config == "auto"
    assert build_parser().parse_args(["serve", "--generation-config", "ignore"]).generation_config == "ignore"
    monkeypatch.setenv("GENERATION_CONFIG", "ignore")
    assert build_parser().parse_args(["serve"]).generation_config == "ignore"


def test_default_max_tokens_is_off_by_default_and_comes_from_flag_or_environment(monkeypatch):
    assert build_parser().parse_args(["serve"]).default_max_tokens is None
    assert build_parser().parse_args(["serve", "--default-max-tokens", "256"]).default_max_tokens == 256
    monkeypatch.setenv("DEFAULT_MAX_TOKENS", "64")
    assert build_parser().parse_args(["serve"]).default_max_tokens == 64
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--default-max-tokens", "0"])


def test_make_serve_caps_openai_requests_without_max_tokens():
    from pathlib import Path

    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    serve = makefile.split("\nserve:", 1)[1].split("\n\n", 1)[0]
    assert "--default-max-tokens 256" in serve


@pytest.mark.parametrize("flags, message", [
    (["--model-id", "/no/such/model"], "no such file or directory"),
    (["--device", "cuda"], "no CUDA device"),
    (["--trust-remote-code"], "--trust-remote-code is not supported"),
], ids=["missing-model", "no-cuda", "remote-code"])
def test_user_errors_are_one_line_and_exit_2(flags, message):
    run = loraplex("generate", "hi", *flags)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and lines == [lines[0]] and lines[0].startswith("loraplex: error:"), run.stderr
    assert message in lines[0] and "Traceback" not in run.stderr


def test_json_output_makes_every_line_json():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraplex.cli", "serve", "--json-output", "--port", str(port),
         "--max-batch-total-tokens", "2048"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines = []
    try:
        for line in proc.stdout:  # until the ready line
            lines.append(line)
            if "loraplex ready" in line:
                break
        assert proc.poll() is None, "".join(lines)
        body = json.dumps({"inputs": "hi", "parameters": {"max_new_tokens": 2}}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/generate", body, {"content-type": "application/json"})
        assert urllib.request.urlopen(request, timeout=60).status == 200
        deadline = time.monotonic() + 30
        while not any('"loraplex.requests"' in line for line in lines) and time.monotonic() < deadline:
            lines.append(proc.stdout.readline())  # the request's log line follows its response
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    records = [json.loads(line) for line in lines if line.strip()]  # fails on any line that is not JSON
    assert any(r.get("target") == "loraplex.requests" and r.get("status") == 200 for r in records)
    assert any("loading" in r.get("message", "") for r in records)  # progress is JSON too


def test_bench_takes_its_options():
    run = loraplex("bench", "--workload", "equal", "--requests", "2", "--one-at-a-time-requests", "1",
                   "--prompt-tokens", "16", "--new-tokens", "4", timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "equal" in run.stdout and "tok/s" in run.stdout
    rejected = loraplex("bench", "--workload", "nonsense")
    assert rejected.returncode == 2 and "invalid choice" in rejected.stderr


LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 100}


def unloadable_model(tmp_path, kind: str) -> str:
    """A model directory `serve` cannot load (or a path that is none)."""
    if kind == "missing":
        return str(tmp_path / "no-such-model")
    (tmp_path / "config.json").write_text({
        "broken-config": "{not json", "config-without-fields": json.dumps({"model_type": "llama"}),
    }.get(kind, json.dumps(LLAMA_CONFIG)))
    if kind in ("config-without-fields", "corrupt-safetensors"):
        (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    return str(tmp_path)


@pytest.mark.parametrize("kind, message", [
    ("missing", "no such file or directory"),
    ("broken-config", "cannot read"),
    ("config-without-fields", "config.json lacks 'num_attention_heads'"),
    ("no-safetensors", "no *.safetensors weights"),
    ("corrupt-safetensors", "is not a valid safetensors file"),
])
def test_serve_with_an_unloadable_model_exits_with_one_line(tmp_path, kind, message):
    run = loraplex("serve", "--port", "0", "--model-id", unloadable_model(tmp_path, kind))
    errors = [line for line in run.stderr.splitlines() if "error" in line.lower()]
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert errors == [run.stderr.strip().splitlines()[-1]] and errors[0].startswith("loraplex: error:"), run.stderr
    assert message in errors[0]


@pytest.mark.parametrize("flags, message", [
    (["--port", "abc"], "argument --port: invalid int value: 'abc'"),
    (["--max-batch-prefill-tokens", "0"], "argument --max-batch-prefill-tokens: must be >= 1, got 0"),
    (["--max-total-tokens", "-5"], "must be >= 1"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_serve_with_bad_flags_exits_with_one_line(flags, message):
    run = loraplex("serve", *flags)
    assert run.returncode == 2 and run.stdout == "", run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and message in run.stderr and "--help" in run.stderr, run.stderr


@pytest.mark.parametrize("env, message", [
    ({"MAX_TOTAL_TOKENS": "abc"}, "environment variable MAX_TOTAL_TOKENS='abc'"),
    ({"MAX_QUEUED_TOKENS": "0"}, "environment variable MAX_QUEUED_TOKENS='0': must be >= 1"),
])
def test_serve_with_a_bad_environment_variable_exits_with_one_line(env, message):
    run = loraplex("serve", env=env)
    assert run.returncode == 2 and run.stdout == "" and "Traceback" not in run.stderr, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"loraplex: error: {message}"), run.stderr


def test_serve_checks_what_it_can_before_loading_a_weight(tmp_path):
    """Each start-up mistake is one line and exit 2, before the model loads: the model named here does not exist,
    so an error about it would mean the check came too late."""
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = str(taken.getsockname()[1])
    unreadable = tmp_path / "locked"
    unreadable.mkdir(mode=0o000)
    cases = [
        (["--port", port], f"cannot listen on 127.0.0.1:{port}: the port is in use"),
        (["--adapter-root", str(tmp_path / "nonexistent")], "nonexistent: no such directory"),
        (["--adapter-root", str(tmp_path / "file.txt")], "file.txt: not a directory"),
        (["--max-input-length", "5000", "--max-total-tokens", "4096"],
         "--max-input-length (5000) must be < --max-total-tokens (4096)"),
    ]
    (tmp_path / "file.txt").write_text("x")
    if os.geteuid() != 0:  # root reads any directory
        cases.append((["--adapter-root", str(unreadable)], "not readable by this process"))
    try:
        for flags, message in cases:
            run = loraplex("serve", "--hostname", "127.0.0.1", "--model-id", str(tmp_path / "no-model"), *flags)
            lines = [line for line in run.stderr.splitlines() if line.strip()]
            assert run.returncode == 2 and len(lines) == 1 and "Traceback" not in run.stderr, (flags, run.stderr)
            assert lines[0].startswith("loraplex: error:") and message in lines[0], (flags, lines[0])
    finally:
        taken.close()
        unreadable.chmod(0o700)
