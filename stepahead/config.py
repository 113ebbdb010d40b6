"""Frozen config dataclasses built from CLI flags and STEPAHEAD_* environment variables.

Each daemon declares one frozen dataclass; every field becomes a flag `--field-name`
whose default comes from `STEPAHEAD_FIELD_NAME` when set, else the dataclass default.
Booleans get `--x/--no-x`. Precedence: flag > environment > default.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import math
import os
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
ENV_PREFIX = "STEPAHEAD_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigError(ValueError):
    """A flag or environment variable holds a value of the wrong kind."""


class NotBuiltYet(ConfigError):
    """A built-in model or a .gguf file asked for without building (the gateway) that is built
    or converted on first use and has not been yet."""


class Range:
    """The values a numeric flag accepts: its argparse `type=`, so that a value out of range
    is refused at parse time with argparse's own one-line error (exit 2), before a daemon
    loads a model or dials a peer only to fail on it later."""

    def __init__(self, kind: type, lo: float | None = None, hi: float | None = None, *,
                 lo_open: bool = False, hi_open: bool = False, allow_inf: bool = False) -> None:
        self.kind, self.lo, self.hi, self.lo_open, self.hi_open = kind, lo, hi, lo_open, hi_open
        self.allow_inf = allow_inf
        self.__name__ = kind.__name__  # argparse names the type in "invalid int value"

    def describe(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo}"
        return f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"

    def __call__(self, raw: str) -> Any:
        value = self.kind(raw)  # ValueError: argparse reports "invalid <kind> value"
        if isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and not self.allow_inf)):
            raise argparse.ArgumentTypeError(f"must be a finite number {self.describe()}, got {raw}")
        low_ok = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        high_ok = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        if not (low_ok and high_ok):
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {raw}")
        return value


class NonEmpty:
    """A text flag that must hold something: an empty one is a typo or an unset variable."""

    kind = str
    __name__ = "str"

    def describe(self) -> str:
        return "non-empty"

    def __call__(self, raw: str) -> str:
        if not raw.strip():
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {raw!r}")
        return raw


_PORT = Range(int, 0, 65535)
_POSITIVE = Range(int, 1)
_SECONDS = Range(float, 0, lo_open=True)
_FRACTION = Range(float, 0, 1)
# The accepted range of every numeric flag (and the text flags that must not be empty), by field
# name: one definition whichever daemon (or `serve`) declares the field.
RANGES: dict[str, Range | NonEmpty] = {
    # ports (0: pick a free one, or off where the help says so)
    "port": _PORT, "http_port": _PORT, "scheduler_port": _PORT, "metrics_port": _PORT, "health_port": _PORT,
    "kv_transfer_port": _PORT,
    # step geometry
    "block_size": Range(int, 1, 1024), "max_num_seqs": _POSITIVE, "max_num_batched_tokens": _POSITIVE,
    "max_model_len": Range(int, 2), "num_gpu_blocks_override": _POSITIVE, "kv_cache_memory_bytes": _POSITIVE,
    "gpu_memory_utilization": Range(float, 0, 1, lo_open=True), "swap_space": Range(float, 0),
    "kv_offloading_size": Range(float, 0),
    "long_prefill_token_threshold": Range(int, 0), "max_concurrent_batches": _POSITIVE,
    "max_queued_requests": _POSITIVE, "max_logprobs": Range(int, 0), "preemption_min_progress": Range(int, 0),
    # processes and threads
    "num_threads": _POSITIVE, "data_parallel_size": _POSITIVE,
    "prefill_replicas": Range(int, 0), "decode_replicas": Range(int, 0),
    "tensor_parallel_size": Range(int, 1, 1024), "sim_num_devices": _POSITIVE, "max_restarts": Range(int, 0),
    "structured_outputs_cache_size": _POSITIVE, "flight_recorder_steps": Range(int, 0),
    # timeouts and intervals (seconds)
    "startup_timeout_s": _SECONDS, "drain_timeout": Range(float, 0), "distributed_timeout": _SECONDS,
    "reconnect_max_backoff_s": _SECONDS, "worker_step_timeout": _SECONDS, "worker_wait_timeout": _SECONDS,
    "failover_timeout": _SECONDS, "gc_warning_threshold_secs": Range(float, 0),
    "max_wait_time": Range(float, 0, lo_open=True, allow_inf=True), "score_ttft_target": Range(float, 0),
    "max_expected_wait": _SECONDS, "kv_transfer_timeout": _SECONDS,
    # gateway
    "max_request_bytes": _POSITIVE, "max_concurrent_streams": _POSITIVE, "stream_interval": _POSITIVE,
    # scheduling weights and probabilities
    "balance_abs_threshold": Range(int, 0), "balance_rel_threshold": Range(float, 0, lo_open=True),
    "sim_eos_probability": _FRACTION, "sim_acceptance_rate": _FRACTION,
    # names
    "served_model_name": NonEmpty(),
}


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
            return _enum_value(tp)(raw)
        return tp(raw)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise ConfigError(f"{source}={raw!r}: {exc}") from None


def _enum_value(tp: type[enum.Enum]) -> Callable[[str], enum.Enum]:
    """The member of `tp` a flag or variable names; an error lists the values."""
    def parse(raw: str) -> enum.Enum:
        try:
            return tp(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{raw!r} is not one of {', '.join(m.value for m in tp)}") from None

    return parse


def add_arguments(parser: argparse.ArgumentParser, cls: type, exclude: tuple[str, ...] = ()) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        tp = _base_type(hints[f.name])
        if f.name in RANGES and RANGES[f.name].kind is tp:
            tp = RANGES[f.name]
        help_text = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        if env_name(f.name) in os.environ:
            default = _parse(tp, os.environ[env_name(f.name)], env_name(f.name))
        shown = default.value if isinstance(default, enum.Enum) else default  # 'fcfs', not <SchedulingPolicy.FCFS: 'fcfs'>
        help_text = f"{help_text} [env {env_name(f.name)}; default {shown!r}]"
        if _is_list(tp):
            parser.add_argument(flag_name(f.name), dest=f.name, action=_ListAction, default=tuple(default or ()),
                                help=help_text)
        elif tp is bool:
            parser.add_argument(flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
        elif isinstance(tp, type) and issubclass(tp, enum.Enum):
            parser.add_argument(flag_name(f.name), dest=f.name, type=_enum_value(tp), default=default,
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
