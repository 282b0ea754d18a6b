"""Each engine and server setting declared once: the config dataclass's field carries its flag, help text,
environment variable and parser (`setting`), and the command line is built from the fields (`add_arguments`,
`from_namespace`). Only the standard library: config.py imports this."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable

_KEY = "loraplex.setting"  # the field metadata key that marks a field as a command-line setting


def _truthy(value: str) -> bool:
    return value.lower() in ("1", "true", "yes", "on")


def _positive(value: str) -> int:
    """Sizes and limits that 0 would make useless (a prefill budget of 0 would never start a request)."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def _non_negative(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {number}")
    return number


def _positive_float(value: str) -> float:
    number = float(value)
    if not number > 0.0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return number


def _non_negative_float(value: str) -> float:
    """Durations where 0 means "at once" or "never kept" (documented as such where the setting is declared)."""
    number = float(value)
    if not number >= 0.0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return number


def _fraction(value: str) -> float:
    number = float(value)
    if not 0.0 < number <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return number


def _comma_list(value: str) -> list[str]:
    return value.split(",")


@dataclasses.dataclass(frozen=True)
class Setting:
    """How one field is set from the command line. `action`: None (a value), "store_true", "negatable"
    (--x / --no-x) or "append" (repeatable); `nargs`: argparse's. `env` and `flag` default to the name's."""

    help: str | None = None
    type: Callable[[str], Any] | None = None
    choices: tuple | None = None
    env: str | None = None
    flag: str | None = None
    action: str | None = None
    nargs: str | None = None

    def env_parser(self) -> Callable[[str], Any]:
        """The environment variable's value is parsed as the flag's is; switches take 1/true/yes/on, lists commas."""
        if self.action in ("store_true", "negatable"):
            return _truthy
        if self.action == "append" or self.nargs:
            return _comma_list
        return self.type or str


def setting(default: Any = None, help: str | None = None, **how: Any) -> Any:
    """A dataclass field with its default, settable by a flag and an environment variable (see Setting)."""
    return dataclasses.field(default=default, metadata={_KEY: Setting(help=help, **how)})


def settings(cls, start: str | None = None, stop: str | None = None) -> list[tuple[dataclasses.Field, Setting]]:
    """cls's command-line fields in declaration order, from field `start` up to (not including) field `stop`."""
    names = [f.name for f in dataclasses.fields(cls)]
    chosen = dataclasses.fields(cls)[names.index(start) if start else 0: names.index(stop) if stop else None]
    return [(f, f.metadata[_KEY]) for f in chosen if _KEY in f.metadata]


def flag_of(field: dataclasses.Field, how: Setting) -> str:
    return how.flag or "--" + field.name.replace("_", "-")


def dest_of(field: dataclasses.Field, how: Setting) -> str:
    """The namespace attribute argparse gives the flag (--api-key: api_key, for the field api_keys)."""
    return flag_of(field, how).removeprefix("--").replace("-", "_")


def env_of(field: dataclasses.Field, how: Setting) -> str:
    return how.env or dest_of(field, how).upper()


Groups = dict[str, tuple[str, tuple[str, ...]]]  # --help's topics: title -> (what it holds, the settings it lists)


def add_groups(parser: argparse.ArgumentParser, groups: Groups, only: tuple[str, ...] | None = None) -> None:
    """--help's topics (config.HELP_GROUPS) as the parser's argument groups, in the mapping's order; `only`: those
    titles alone (argparse prints an empty group's title and description)."""
    for title, (description, _) in groups.items():
        if only is None or title in only:
            parser.add_argument_group(title, description)


def group_of(parser: argparse.ArgumentParser, title: str):
    """The parser's argument group `title` (made by add_groups)."""
    for group in parser._action_groups:
        if group.title == title:
            return group
    raise LookupError(f"{parser.prog} has no argument group {title!r} (settings.add_groups)")


def add_arguments(parser: argparse.ArgumentParser, cls, read_env: Callable, start: str | None = None,
                  stop: str | None = None, choices: dict[str, tuple] | None = None,
                  groups: Groups | None = None) -> None:
    """A flag for each of cls's settings (see `settings` for start/stop). `read_env(name, default, parse)` gives
    the default the environment sets; `choices` supplies those config.py cannot import (--quantize's). `groups`:
    each flag goes into the parser's group (add_groups) that names its setting; a setting none names is an error."""
    topic = {name: title for title, (_, names) in (groups or {}).items() for name in names}
    for field, how in settings(cls, start, stop):
        if groups is not None and field.name not in topic:
            raise LookupError(f"{cls.__name__}.{field.name} is in no --help group: name it in config.HELP_GROUPS")
        target = group_of(parser, topic[field.name]) if groups is not None else parser
        # An empty tuple default is argparse's None: append needs a list, and --help shows no default.
        default = None if field.default == () else field.default
        kwargs: dict[str, Any] = {"default": read_env(env_of(field, how), default, how.env_parser()), "help": how.help}
        if how.action == "negatable":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif how.action:
            kwargs["action"] = how.action
        if how.action in (None, "append"):
            kwargs.update(type=how.type, nargs=how.nargs, choices=(choices or {}).get(field.name, how.choices))
        kwargs = {k: v for k, v in kwargs.items() if v is not None or k == "default"}
        action = target.add_argument(flag_of(field, how), **kwargs)
        action.env = env_of(field, how)  # for --help's note (cli.py)


def from_namespace(cls, args: argparse.Namespace, **others: Any):
    """cls with each setting the namespace holds (lists as tuples); `others` sets fields that are no flags."""
    values = {}
    for field, how in settings(cls):
        dest = dest_of(field, how)
        if hasattr(args, dest):
            value = getattr(args, dest)
            values[field.name] = tuple(value or ()) if isinstance(field.default, tuple) else value
    return cls(**values, **others)
