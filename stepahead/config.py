"""Frozen config dataclasses built from CLI flags and STEPAHEAD_* environment variables.

Each daemon declares one frozen dataclass; every field becomes a flag `--field-name`
whose default comes from `STEPAHEAD_FIELD_NAME` when set, else the dataclass default.
Booleans get `--x/--no-x`. Precedence: flag > environment > default.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")
ENV_PREFIX = "STEPAHEAD_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigError(ValueError):
    """A flag or environment variable holds a value of the wrong kind."""


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _base_type(tp: Any) -> Any:
    """`int | None` → int; other types unchanged."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        assert len(args) == 1, f"unsupported union {tp}"
        return args[0]
    return tp


def _is_list(tp: Any) -> bool:
    return typing.get_origin(tp) is tuple


class _ListAction(argparse.Action):
    """A `tuple[str, ...]` field: the flag may repeat and each value may be a comma list;
    the first use replaces the default."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        seen = f"_{self.dest}_given"
        items = list(getattr(namespace, self.dest)) if getattr(namespace, seen, False) else []
        setattr(namespace, seen, True)
        setattr(namespace, self.dest, tuple(items + _split(values)))


def _split(raw: str) -> list[str]:
    return [item.strip() for item in raw.split(",") if item.strip()]


def _parse(tp: Any, raw: str, source: str) -> Any:
    if _is_list(tp):
        return tuple(_split(raw))
    try:
        if tp is bool:
            low = raw.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError(f"expected one of {sorted(_TRUE | _FALSE)}")
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            return tp(raw)
        return tp(raw)
    except ValueError as exc:
        raise ConfigError(f"{source}={raw!r}: {exc}") from None


def add_arguments(parser: argparse.ArgumentParser, cls: type, exclude: tuple[str, ...] = ()) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        tp = _base_type(hints[f.name])
        help_text = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        if env_name(f.name) in os.environ:
            default = _parse(tp, os.environ[env_name(f.name)], env_name(f.name))
        help_text = f"{help_text} [env {env_name(f.name)}; default {default!r}]"
        if _is_list(tp):
            parser.add_argument(flag_name(f.name), dest=f.name, action=_ListAction, default=tuple(default or ()),
                                help=help_text)
        elif tp is bool:
            parser.add_argument(flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
        elif isinstance(tp, type) and issubclass(tp, enum.Enum):
            parser.add_argument(flag_name(f.name), dest=f.name, type=tp, default=default,
                                choices=list(tp), metavar="{" + ",".join(m.value for m in tp) + "}",
                                help=help_text)
        else:
            parser.add_argument(flag_name(f.name), dest=f.name, type=tp, default=default, help=help_text)


def from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)


def to_flags(config: Any, names: typing.Iterable[str] | None = None) -> list[str]:
    """Render (some) fields of a config back into flags, for spawning a daemon."""
    out: list[str] = []
    wanted = set(names) if names is not None else None
    for f in dataclasses.fields(config):
        if wanted is not None and f.name not in wanted:
            continue
        value = getattr(config, f.name)
        if value is None:
            continue
        if isinstance(value, tuple):
            out += [flag_name(f.name), ",".join(map(str, value))]
        elif isinstance(value, bool):
            out.append(flag_name(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, enum.Enum):
            out += [flag_name(f.name), str(value.value)]
        else:
            out += [flag_name(f.name), str(value)]
    return out


def field(default: Any, help: str) -> Any:  # noqa: A002 - mirrors argparse
    return dataclasses.field(default=default, metadata={"help": help})
