"""`serve --help` by topic (issue 60): each flag in one argument group of config.HELP_GROUPS, the groups in the
issue's order, no flag lost, every setting named by a group; `loraplex --help` says what each command does."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from loraplex.cli import build_parser
from loraplex.config import HELP_GROUPS, EngineConfig, ServerConfig
from loraplex.settings import add_arguments, add_groups, flag_of, setting, settings

TOPICS = ["model", "adapters", "scheduling and memory", "server", "limits", "observability"]
SETTINGS = [(field, how) for cls in (EngineConfig, ServerConfig) for field, how in settings(cls)]
# The flags cli.py declares itself (no setting), by the group each belongs in.
CLI_FLAGS = {
    "model": {"--huggingface-hub-cache", "--trust-remote-code"},
    "server": {"--hostname", "--port", "--shutdown-timeout-s"},
    "observability": {"--otlp-endpoint"},
    "limits": {"--allowed-local-media-path", "--allowed-media-domains", "--allow-private-media-addresses",
               "--max-images-per-request", "--max-image-bytes", "--max-image-pixels", "--media-fetch-timeout-s",
               "--max-decoded-image-bytes", "--max-decoded-image-bytes-total"},
}


def flags_of_setting(field, how) -> set[str]:
    flag = flag_of(field, how)
    return {flag, "--no-" + flag.removeprefix("--")} if how.action == "negatable" else {flag}


def subparser(name: str) -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices[name]


def groups_of(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    """Each argument group's title and the option strings of its flags."""
    return {g.title: {o for a in g._group_actions for o in a.option_strings} for g in parser._action_groups}


def test_every_setting_is_named_by_exactly_one_group():
    named = [name for _, names in HELP_GROUPS.values() for name in names]
    assert len(named) == len(set(named)), "a setting named by two groups"
    assert set(named) == {field.name for field, _ in SETTINGS}


def test_the_groups_are_the_issues_topics_in_its_order():
    assert list(HELP_GROUPS) == TOPICS
    text = subparser("serve").format_help()
    positions = [text.index(f"\n{title}:\n") for title in TOPICS]
    assert positions == sorted(positions)
    assert text.index("\noptions:\n") < positions[0]


def test_every_serve_flag_is_in_its_named_group():
    groups = groups_of(subparser("serve"))
    assert groups["options"] == {"-h", "--help"} and not groups.get("positional arguments")
    for title, (_, names) in HELP_GROUPS.items():
        expected = set().union(*(flags_of_setting(f, h) for f, h in SETTINGS if f.name in names))
        assert groups[title] == expected | CLI_FLAGS.get(title, set()), title


def test_no_serve_flag_is_lost():
    """The option strings are those of the settings and cli.py's own flags, each once."""
    serve = subparser("serve")
    strings = [o for a in serve._actions for o in a.option_strings]
    expected = set().union(*(flags_of_setting(f, h) for f, h in SETTINGS), *CLI_FLAGS.values()) | {"-h", "--help"}
    assert len(strings) == len(set(strings)) and set(strings) == expected


def test_generate_groups_its_engine_flags_and_keeps_its_own_apart():
    groups = groups_of(subparser("generate"))
    assert groups["options"] == {"-h", "--help", "--chat", "--max-new-tokens", "--temperature", "--top-p", "--top-k",
                                 "--seed"}
    assert "--adapter-id" in groups["adapters"] and "--model-id" in groups["model"]
    assert not {"server", "observability"} & set(groups)  # no empty group in its --help
    text = subparser("generate").format_help()
    positions = [text.index(f"\n{title}:\n") for title in TOPICS if title in groups]
    assert positions == sorted(positions)


def test_a_setting_in_no_group_fails_the_parser():
    @dataclasses.dataclass(frozen=True)
    class Config:
        max_widgets: int = setting(3, type=int, help="widgets")

    parser = argparse.ArgumentParser()
    add_groups(parser, HELP_GROUPS)
    with pytest.raises(LookupError, match="Config.max_widgets is in no --help group"):
        add_arguments(parser, Config, lambda name, default, parse: default, groups=HELP_GROUPS)


def test_top_level_help_says_what_each_command_does():
    text = " ".join(build_parser().format_help().split())
    for expected in ("serve load a model and serve it", "generate load a model, generate text",
                     "bench offline throughput benchmark", "loraplex serve --help"):
        assert expected in text, expected
