"""Start-up settings (issue 58): --max-input-length and --max-total-tokens derived as TGI derives them, a
--max-total-tokens past the model's context refused at start-up, and timeouts and sizes of 0 or less refused as one
line with exit status 2 before the model loads (0 stays where it means something and says so)."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from loraplex.cli import build_parser
from loraplex.config import EngineConfig
from loraplex.engine import engine as engine_module
from loraplex.engine.engine import Engine
from tests.helpers import live_server

CONTEXT = 8192  # the embedded SmolLM2-135M-Instruct's max_position_embeddings


def loraplex(*args: str, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loraplex.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def one_error_line(run: subprocess.CompletedProcess) -> str:
    """The run exited 2 with one error line, its last, and no traceback; that line."""
    errors = [line for line in run.stderr.splitlines() if "error" in line.lower()]
    assert run.returncode == 2 and "Traceback" not in run.stderr and run.stdout == "", run.stderr[-3000:]
    assert errors == [run.stderr.strip().splitlines()[-1]], run.stderr[-3000:]
    return errors[0]


# ---- lengths -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("given, served", [
    ({}, (4095, 4096)),  # TGI's defaults where the context allows them
    ({"max_total_tokens": 2048}, (2047, 2048)),
    ({"max_total_tokens": CONTEXT}, (CONTEXT - 1, CONTEXT)),
    ({"max_input_length": 100}, (100, 4096)),
    ({"max_input_length": 6000}, (6000, 6001)),
    ({"max_input_length": 1000, "max_total_tokens": 1500}, (1000, 1500)),
])
def test_lengths_not_given_are_derived_from_those_given_and_the_context(given, served):
    config = engine_module.resolve_lengths(EngineConfig(**given), CONTEXT)
    assert (config.max_input_length, config.max_total_tokens) == served


def test_a_small_context_is_the_default_total():
    config = engine_module.resolve_lengths(EngineConfig(), 512)
    assert (config.max_input_length, config.max_total_tokens) == (511, 512)


@pytest.mark.parametrize("given, words", [
    ({"max_total_tokens": 100000}, ("--max-total-tokens (100000) is more than", f"context of {CONTEXT} tokens")),
    ({"max_input_length": CONTEXT}, (f"--max-input-length ({CONTEXT}) must be <", f"context of {CONTEXT} tokens")),
    ({"max_input_length": 2048, "max_total_tokens": 2048}, ("--max-input-length (2048) must be < --max-total-tokens (2048)",)),
])
def test_lengths_the_model_cannot_serve_are_refused(given, words):
    with pytest.raises(engine_module.LengthsError) as refused:
        engine_module.resolve_lengths(EngineConfig(**given), CONTEXT)
    assert all(word in str(refused.value) for word in words), str(refused.value)


def test_a_kv_cache_of_a_set_size_bounds_derived_lengths_and_refuses_given_ones(embedded):
    engine = Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=512))
    served = engine.describe()
    assert (engine.max_total_tokens, engine.config.max_input_length) == (512, 511) == (
        served.max_total_tokens, served.max_input_length)
    assert engine.kv_capacity_tokens == 512
    with pytest.raises(engine_module.LengthsError, match=r"--max-total-tokens \(1024\) is more than the KV cache's 512 tokens"):
        Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=512, max_total_tokens=1024))
    with pytest.raises(engine_module.LengthsError, match=r"--max-input-length \(600\) must be < the KV cache's 512 tokens"):
        Engine(embedded, EngineConfig(device="cpu", max_batch_total_tokens=512, max_input_length=600))


def test_serve_with_only_max_total_tokens_derives_the_input_limit():
    with live_server("--max-total-tokens", "2048") as url:
        info = httpx.get(f"{url}/info", timeout=30).json()
        assert (info["max_input_length"], info["max_total_tokens"]) == (2047, 2048)
        assert info["max_batch_total_tokens"] >= 2048
        too_long = httpx.post(f"{url}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2048}},
                              timeout=60)
        assert too_long.status_code == 422 and "2048" in too_long.text, too_long.text
        fits = httpx.post(f"{url}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}}, timeout=60)
        assert fits.status_code == 200, fits.text


def test_serve_refuses_a_total_past_the_model_context_in_one_line():
    line = one_error_line(loraplex("serve", "--port", "0", "--max-total-tokens", "100000"))
    assert line.startswith("loraplex: error: --max-total-tokens (100000)") and str(CONTEXT) in line, line


# ---- timeouts and sizes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, message", [
    (["--request-timeout-s", "0"], "argument --request-timeout-s: must be > 0, got 0"),
    (["--request-timeout-s", "-1"], "argument --request-timeout-s: must be > 0, got -1"),
    (["--max-request-bytes", "0"], "argument --max-request-bytes: must be >= 1, got 0"),
    (["--max-request-bytes", "-5"], "argument --max-request-bytes: must be >= 1, got -5"),
])
def test_serve_refuses_zero_or_negative_timeouts_and_sizes_in_one_line(flags, message):
    run = loraplex("serve", "--model-id", "/no/such/model", *flags)  # refused before the model is looked for
    assert run.returncode == 2 and run.stdout == "" and "Traceback" not in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and message in run.stderr, run.stderr


def test_an_environment_variable_of_zero_is_refused_in_one_line():
    run = loraplex("serve", "--model-id", "/no/such/model", env={"REQUEST_TIMEOUT_S": "0"})
    assert run.returncode == 2 and run.stdout == "" and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip() == "loraplex: error: environment variable REQUEST_TIMEOUT_S='0': must be > 0, got 0"


@pytest.mark.parametrize("flag", [
    "--request-timeout-s", "--max-request-bytes", "--grammar-compile-timeout-s", "--max-grammar-bytes",
    "--media-fetch-timeout-s", "--max-image-bytes", "--max-image-pixels", "--max-images-per-request",
    "--shutdown-timeout-s", "--max-best-of", "--max-total-tokens", "--max-input-length",
])
def test_each_timeout_and_size_refuses_zero_and_negative_values(flag, capsys):
    for value in ("0", "-1"):
        with pytest.raises(SystemExit) as exited:
            build_parser().parse_args(["serve", flag, value])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and len(err.strip().splitlines()) == 1 and f"argument {flag}: must be" in err


@pytest.mark.parametrize("flag, dest", [
    ("--adapter-access-ttl-s", "adapter_access_ttl_s"),  # 0: every request asks the hub
    ("--adapter-cycle-time-s", "adapter_cycle_time_s"),  # 0: a slot is yielded as soon as other adapters wait
    ("--max-cpu-adapters", "max_cpu_adapters"),  # 0: no cache beyond the preloaded adapters
    ("--max-stop-sequences", "max_stop_sequences"),  # 0: stop sequences refused
    ("--max-waiting-tokens", "max_waiting_tokens"),  # 0: joins at every step
])
def test_zero_is_kept_where_it_means_something_and_negatives_are_refused(flag, dest, capsys):
    assert getattr(build_parser().parse_args(["serve", flag, "0"]), dest) == 0
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", flag, "-1"])
    assert exited.value.code == 2 and f"argument {flag}: must be >= 0" in capsys.readouterr().err


def test_the_decoded_image_budgets_are_flags():
    from loraplex.cli import _media_config, build_parser

    args = build_parser().parse_args(["serve", "--max-decoded-image-bytes", "1000", "--max-decoded-image-bytes-total", "5000"])
    config = _media_config(args)
    assert (config.max_decoded_bytes_per_request, config.max_decoded_bytes_total) == (1000, 5000)
