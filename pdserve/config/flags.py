"""Command-line flags and environment variables derived from the config dataclasses.

Each leaf field ``name`` of a (possibly nested) config dataclass becomes the flag ``--name``
(underscores as dashes) and the environment variable ``PDSERVE_NAME``. The flag wins over the
environment, which wins over the dataclass default. Tuples are comma-separated. A field marked
``env_only`` (a secret that must never appear on a command line) is read from its environment
variable alone: it has no flag and ``to_args`` leaves it out. A field's ``aliases`` (metadata) are
other flags of the same setting, such as vLLM's name for it (``--max-num-seqs``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import typing
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

T = TypeVar("T")
ENV_PREFIX = "PDSERVE_"


@dataclasses.dataclass(frozen=True)
class Option:
    """One leaf field: its path in the nested config, type, default and help."""

    path: tuple[str, ...]
    type: Any
    default: Any
    help: str
    secret: bool = False  # its value is never shown (``--help``)
    env_only: bool = False  # no flag: read from the environment only
    aliases: tuple[str, ...] = ()  # other flags of the same setting
    bare: str | None = None  # the value of the flag given without one (a bool's is true)

    @property
    def name(self) -> str:
        return self.path[-1]

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env_var(self) -> str:
        return ENV_PREFIX + self.name.upper()


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def options(cls: type, defaults: Any = None, prefix: tuple[str, ...] = ()) -> Iterator[Option]:
    """The leaf options of a config dataclass, depth first, in field order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        default = getattr(defaults, f.name) if defaults is not None else _field_default(f)
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from options(typing.cast(type, kind), default, (*prefix, f.name))
        else:
            help_text = str(f.metadata.get("help", ""))
            yield Option(
                (*prefix, f.name),
                kind,
                default,
                help_text,
                bool(f.metadata.get("secret")),
                bool(f.metadata.get("env_only")),
                tuple(f.metadata.get("aliases", ())),
                f.metadata.get("bare"),
            )


def env_names(cls: type) -> list[str]:
    """Every environment variable a config class reads."""
    return [o.env_var for o in options(cls)]


def _parse_flag(option: Option, text: str) -> Any:
    try:
        return _parse(option, text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parse(option: Option, text: str) -> Any:
    origin = typing.get_origin(option.type)
    if origin is tuple:
        return tuple(part.strip() for part in text.split(",") if part.strip())
    if option.type is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"{option.name} must be a boolean, got {text!r}")
    try:
        return option.type(text)
    except ValueError:
        raise ValueError(f"{option.name} must be {option.type.__name__}, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser, cls: type, env: Mapping[str, str] | None = None) -> None:
    """Adds one flag per leaf option; defaults come from the environment, then the dataclass."""
    env = os.environ if env is None else env
    for option in options(cls):
        default = option.default
        if option.env_var in env:
            default = _parse(option, env[option.env_var])
        if option.env_only:
            parser.set_defaults(**{option.name: default})
            continue
        shown = ",".join(default) if isinstance(default, tuple) else default
        if option.secret and shown:
            shown = "(set)"
        # A bare boolean flag means true; `--flag false` also works.
        parser.add_argument(
            option.flag,
            *option.aliases,
            dest=option.name,
            type=functools.partial(_parse_flag, option),
            default=default,
            help=f"{option.help} (env {option.env_var}; default: {shown!r})",
            nargs="?" if option.type is bool or option.bare is not None else None,
            const=True if option.type is bool else option.bare,
        )


def to_args(cls: type, config: Any, **overrides: Any) -> list[str]:
    """The flags that build ``config`` again (``overrides`` replace fields by name)."""
    args: list[str] = []
    for option in options(cls, config):
        if option.env_only:
            continue
        value = overrides.get(option.name, _leaf(config, option.path))
        if isinstance(value, tuple):
            value = ",".join(value)
        elif isinstance(value, bool):
            value = "true" if value else "false"
        args += [option.flag, str(value)]
    return args


def _leaf(config: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        config = getattr(config, name)
    return config


def build_or_report(cls: type[T], args: argparse.Namespace, command: str) -> T | None:
    """``build``, or None after telling the user on stderr why the flags are wrong (the command
    then exits 2, as argparse does)."""
    try:
        return build(cls, args)
    except ValueError as error:
        print(f"{command}: error: {error}", file=sys.stderr)
        return None


def build(cls: type[T], args: argparse.Namespace) -> T:
    """Builds the config from parsed flags (validation runs in each __post_init__)."""
    return _build(cls, vars(args))


def _build(cls: type[T], values: Mapping[str, Any]) -> T:
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(typing.cast(Any, cls)):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            kwargs[f.name] = _build(typing.cast(type, kind), values)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)
