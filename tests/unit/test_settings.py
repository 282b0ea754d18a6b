"""Each engine and server setting declared once (issue 55, item 2): the EngineConfig / ServerConfig field carries
its flag, environment variable, help and parser, and the command line is built from it (loraplex/settings.py)."""

from __future__ import annotations

import argparse
import ast
import pathlib

import pytest

import loraplex
from loraplex.cli import build_parser
from loraplex.config import EngineConfig, ServerConfig
from loraplex.quantization import QUANTIZE_CHOICES
from loraplex.settings import dest_of, env_of, flag_of, from_namespace, settings

ROOT = pathlib.Path(loraplex.__file__).parent
SETTINGS = [(cls, field, how) for cls in (EngineConfig, ServerConfig) for field, how in settings(cls)]
IDS = [field.name for _, field, _ in SETTINGS]


@pytest.fixture
def clean_env(monkeypatch):
    """No setting's environment variable set (the CI's environment must not decide the defaults)."""
    for _, field, how in SETTINGS:
        monkeypatch.delenv(env_of(field, how), raising=False)
    return monkeypatch


def env_sample(field, how) -> tuple[str, object]:
    """A value for the setting's environment variable other than its default, and the field's value it gives."""
    if how.action == "store_true":
        return "1", True
    if how.action == "negatable":
        return ("0", False) if field.default is True else ("1", True)
    if how.action == "append" or how.nargs:
        return "a,b", ("a", "b")
    choices = QUANTIZE_CHOICES if field.name == "quantize" else how.choices
    if choices:
        value = next(c for c in choices if c != field.default)
        return value, value
    parse = how.type or str
    for text in ("3", "0.5", "x"):
        try:
            value = parse(text)
        except (ValueError, argparse.ArgumentTypeError):
            continue
        if value != field.default:
            return text, value
    raise AssertionError(f"no sample value for {field.name}")


def test_the_config_classes_declare_their_settings():
    names = set(IDS)
    assert {"model_id", "max_total_tokens", "quantize", "warm_up", "cuda_memory_fraction"} <= names
    assert {"adapter_source", "adapter_roots", "api_keys", "max_queued_tokens", "validation_workers"} <= names
    assert not names & {"block_size", "max_num_seqs", "kv_cache_memory_fraction", "default_max_new_tokens", "media"}


@pytest.mark.parametrize("cls, field, how", SETTINGS, ids=IDS)
def test_a_setting_defaults_to_its_field_and_reads_its_environment_variable(clean_env, cls, field, how):
    args = build_parser().parse_args(["serve"])
    assert getattr(args, dest_of(field, how)) == (None if field.default == () else field.default)
    assert getattr(from_namespace(cls, args), field.name) == field.default

    text, expected = env_sample(field, how)
    clean_env.setenv(env_of(field, how), text)
    assert getattr(from_namespace(cls, build_parser().parse_args(["serve"])), field.name) == expected


@pytest.mark.parametrize("cls, field, how", SETTINGS, ids=IDS)
def test_a_setting_is_a_flag_of_serve_with_its_help_and_environment_variable(clean_env, cls, field, how):
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    (action,) = [a for a in serve._actions if flag_of(field, how) in a.option_strings]
    assert action.dest == dest_of(field, how)
    assert f"env {env_of(field, how)}" in action.help
    assert how.help is None or action.help.startswith(how.help)


def test_generate_takes_the_engine_settings_and_the_adapter_ones(clean_env):
    args = build_parser().parse_args(["generate", "hi", "--max-lora-rank", "8", "--adapter-source", "local",
                                      "--adapter-root", "/a"])
    assert from_namespace(EngineConfig, args).max_lora_rank == 8
    server = from_namespace(ServerConfig, args)
    assert (server.adapter_source, server.adapter_roots) == ("local", ("/a",))
    assert server.max_concurrent_requests == ServerConfig().max_concurrent_requests  # serve's flag, not generate's


def test_cli_declares_no_setting_again():
    """Each setting's flag, environment variable and default are written once, in config.py: cli.py adds no
    argument of a setting's flag and reads no setting's environment variable itself."""
    flags = {flag_of(field, how) for _, field, how in SETTINGS}
    envs = {env_of(field, how) for _, field, how in SETTINGS}
    repeated = []
    for node in ast.walk(ast.parse((ROOT / "cli.py").read_text())):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            if (name == "add_argument" and node.args[0].value in flags) or (name == "_env" and node.args[0].value in envs):
                repeated.append(f"line {node.lineno}: {name}({node.args[0].value!r})")
    assert not repeated


def test_settings_module_stays_below_config():
    """config.py imports settings.py: it must import nothing of the project's (and so nothing above config)."""
    tree = ast.parse((ROOT / "settings.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m.split(".")[0] == "loraplex"}
