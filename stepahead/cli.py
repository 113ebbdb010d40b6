"""The `stepahead` command: one sub-command per tool or daemon."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

# Each entry: (name, help, module exposing add_arguments(parser) and run(args) -> int).
# Modules are imported lazily so `stepahead generate` never imports torch.
_COMMANDS: list[tuple[str, str, str]] = [
    ("make-model", "build a built-in Hugging Face checkpoint offline", "stepahead.builtin_models"),
]


def _load(module_name: str):
    import importlib

    return importlib.import_module(module_name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stepahead", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text, module_name in _COMMANDS:
        p = sub.add_parser(name, help=help_text)
        module = _load(module_name)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args._run
    return int(run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
