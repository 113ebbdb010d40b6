"""The `stepahead` command: one sub-command per tool or daemon.

Only the chosen sub-command's module is imported, so `stepahead generate` never loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from pathlib import Path

from stepahead import config as cfg

# name -> (help, module exposing add_arguments(parser) and run(args) -> int)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("start gateway, scheduler and worker as one system", "cli.serve"),
    "generate": ("stream a completion from a running gateway", "cli.client"),
    "gateway": ("run the gateway daemon (public API)", "gateway.server"),
    "scheduler": ("run the scheduler daemon", "scheduler_service.server"),
    "worker": ("run a worker daemon", "worker_service.daemon"),
    "bench": ("benchmark a running gateway (flags follow vllm bench serve)", "cli.bench"),
    "simulate": ("replay a request trace offline on a virtual clock (sim cost model)", "cli.simulate"),
    "trace": ("write the flight recorder as a Perfetto trace and a PNG timeline", "cli.trace"),
    "make-model": ("build a built-in Hugging Face checkpoint offline", "model_zoo.builtin_models"),
}


class _Parser(argparse.ArgumentParser):
    """Errors in one line, without the usage: a daemon has dozens of flags, and the line that
    names the bad one must not drown in them (`--help` prints the usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _top_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="stepahead",
        description="stepahead: an LLM inference server that plans one step ahead.",
        epilog="commands:\n" + "\n".join(f"  {n:<11} {h}" for n, (h, _) in COMMANDS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    parser.add_argument("command", choices=sorted(COMMANDS), metavar="COMMAND")
    return parser


def version() -> str:
    """The installed distribution's version (pyproject.toml's), as `pip show stepahead` gives it."""
    from importlib import metadata

    try:
        return metadata.version("stepahead")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def output_file(path: str | Path, flag: str) -> Path:
    """A file a command writes its results to, made (with its directory) before the command's
    work: a place it cannot go is a ConfigError naming `flag` now, not a traceback after the run."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError as exc:
        raise cfg.ConfigError(f"{flag} {path}: {exc.strerror or exc}") from None
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        _top_parser().parse_args(argv[:1])  # prints usage / the error and exits
        return 2
    name = argv[0]
    help_text, module_name = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = _Parser(prog=f"stepahead {name}", description=help_text)
    try:
        module.add_arguments(parser)  # a STEPAHEAD_* variable out of range fails here
        args = parser.parse_args(argv[1:])
        return int(module.run(args) or 0)
    except cfg.ConfigError as exc:  # a bad environment variable, or a checkpoint refused before loading
        parser.error(str(exc))
        return 2
    except BrokenPipeError:  # `stepahead generate --json | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush goes nowhere
        return 128 + signal.SIGPIPE

