"""The ``xirang-ds`` command line: validate, estimate, report, bench, tune.

Bad input (an invalid config, a missing file, a bad model spec, a trace that is not one) prints one
clear message and exits with status 2; nothing from deep inside DeepSpeed reaches the user.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Callable, Optional

USAGE_ERROR = 2


class UsageError(Exception):
    """A user error the CLI reports in one message with exit status 2."""


def _cmd_validate(args: argparse.Namespace) -> int:
    from xirang_ds.config import BLOCK_KEY, read_ds_config, to_dict
    from xirang_ds.config.fit import fit_block

    ds_config = read_ds_config(args.config)
    if BLOCK_KEY not in ds_config:
        print(f"{args.config}: no \"xirang\" block; the run is plain DeepSpeed")
        return 0
    choice = None
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's import-time log lines stay off stdout (JSON)
        if args.model is not None:
            from xirang_ds.config.auto import choose_for_spec

            if args.world_size < 1:
                raise UsageError(f"--world-size must be >= 1; got {args.world_size}")
            ds_config, choice = choose_for_spec(ds_config, args.model, args.world_size)
        fitted = fit_block(ds_config[BLOCK_KEY], ds_config)
    config = fitted.config
    enabled = ", ".join(config.enabled_sections()) or "none"
    print(f"{args.config}: valid; preset {config.preset or 'none'}; enabled sections: {enabled}")
    if choice:
        print(f"  {choice}")
    for line in fitted.lines():
        print(f"  {line}")
    if args.show_resolved:
        print(json.dumps({"xirang": to_dict(config)}, indent=2))
    return 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}
"""Subcommand name → (help, add_arguments(parser), run(args) -> exit status)."""


def register_command(name: str, help_text: str, setup: Callable[[argparse.ArgumentParser], None],
                     run: Callable[[argparse.Namespace], int]) -> None:
    """Add a subcommand; modules in `_load_commands` call this at import."""
    COMMANDS[name] = (help_text, setup, run)


def _setup_validate(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="ds_config file (JSON or YAML) with a \"xirang\" block")
    p.add_argument("--show-resolved", action="store_true",
                   help="print the block with its preset expanded and every default filled in")
    p.add_argument("--model", default=None,
                   help="resolve \"preset\": \"auto\" for this model (gpt-small | gpt:layers=..,hidden=.. | "
                        "package.module:factory; built on the meta device)")
    p.add_argument("--world-size", type=int, default=1, help="ranks, for --model (default 1)")


register_command("validate", "check a ds_config's \"xirang\" block", _setup_validate, _cmd_validate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xirang-ds", description="xirang_ds: less device memory for "
                                     "DeepSpeed and Megatron-core training.")
    from xirang_ds import __version__

    parser.add_argument("--version", action="version", version=f"xirang_ds {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _load_commands()
    for name, (help_text, setup, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        setup(p)
        p.set_defaults(run=run)
    return parser


def _load_commands() -> None:
    """Import the modules that register the other subcommands (they import torch lazily)."""
    import importlib

    for module in ("xirang_ds.commands",):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise


def main(argv: Optional[list[str]] = None) -> int:
    from xirang_ds.config.validate import XirangConfigError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (XirangConfigError, UsageError) as e:
        print(f"xirang-ds {args.command}: {e}", file=sys.stderr)
        return USAGE_ERROR
    except (FileNotFoundError, ValueError) as e:  # ModelSpecError, TraceError, a bad data file
        print(f"xirang-ds {args.command}: {e}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
