"""The command line: parse, call the library, print. No decisions live here.

Each subcommand's module has ``register(subparsers)`` (its options, ``func`` set to its handler);
the library modules under ``ddpfab/`` never import this package.

LAZY: every module imports at its top, except here, in the command line, where a handler imports
the library modules that reach nodes (ssh, runner, launch, probe, check, execute, jobs, recover,
replay, sync, fetch, perfcheck: large, and they load Fabric/paramiko when they connect),
``ddpfab.launch.runs`` (importlib.metadata) and ``ddpfab.lab`` inside itself: building the parser for
``ddpfab --help``, ``--version`` or ``completion`` must not pay for them (their cost: docs/design.md,
"Start-up costs"). tests/unit/test_export.py keeps ``import ddpfab.cli`` free of them.
For the same reason ddpfab.remote.target (which emit and provision import, and so the parser) imports
paramiko only where it reads an ssh_config, and ddpfab.remote.ssh imports Fabric (ddpfab.remote.sshopen)
only where it opens a connection: a command over ``ddpfab hold``'s connections loads neither.
"""

from __future__ import annotations

import argparse
import os
import sys

from ddpfab.version import __version__
from ddpfab.cli import (check, completion, config, execute, export, fetch, hold, jobs, lab, provision, replay, run,
                        sync)
from ddpfab.cli.common import fill_missing_help
from ddpfab.cli.errors import Parser, closed_stdout_ends_quietly, die, refuse
from ddpfab.launch.interrupt import run_interruptible
from ddpfab.optionnames import spelled_by

#: The subcommands, in the order ``ddpfab --help`` lists them.
COMMANDS = (run, lab, provision, jobs, export, check, sync, fetch, execute, hold, replay)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="ddpfab", description=(
        "Start and debug multi-node PyTorch training on bare-metal GPU boxes over plain SSH."))
    parser.add_argument("--version", action="version", version=f"ddpfab {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.register(sub)  # sets `func` on its subcommand(s)
        if module is provision:  # `completion` has always been listed after `provision`
            comp = sub.add_parser("completion", help="print a bash or zsh completion script",
                                  description="Print a completion script: eval \"$(ddpfab completion bash)\" in "
                                              "~/.bashrc; zsh: the script into a file named _ddpfab in a directory on "
                                              "$fpath (before compinit), or eval \"$(ddpfab completion zsh)\" after "
                                              "compinit.")
            comp.add_argument("shell", choices=("bash", "zsh"), help="the shell")
            comp.set_defaults(func=cmd_completion)
    fill_missing_help(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse and run one command; SIGINT/SIGTERM at any stage end it with one line (130/143), a
    closed stdout quietly (141)."""
    return run_interruptible(lambda: closed_stdout_ends_quietly(lambda: unguarded_main(argv)))


def unguarded_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for i, word in enumerate(argv, 1):
        try:
            word.encode("utf-8")
        except UnicodeEncodeError:  # bytes the locale could not decode (surrogates): no file, node or record takes them
            return die(f"argument {i} ({repr(os.fsencode(word))[2:-1]}) is not UTF-8 text: ddpfab passes arguments, "
                       "environment values and commands to the nodes as UTF-8; nothing was started")
    args = build_parser().parse_args(run.spell_pdb(argv))
    args.argv = argv
    try:
        config.apply(args)  # flags > environment > project config
    except config.ConfigError as exc:
        return refuse(args, exc, "config")
    if getattr(args, "_inventory_required", False) and not args.inventory:
        return refuse(args, config.MISSING_INVENTORY, "inventory")
    if args.command in ("run", "replay") and args.json and not args.dry_run:
        # --json prints the plan: it never turns a dry run into a real one (sync --json reports a real sync)
        return die("--json prints the plan and needs --dry-run (or use `ddpfab plan --json`); nothing was started")
    with spelled_by(run.speller(args)):  # the library's messages name its options as this command line's flags
        return args.func(args)


def cmd_completion(args: argparse.Namespace) -> int:
    print(completion.script(build_parser(), args.shell), end="")
    return 0
