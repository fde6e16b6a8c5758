"""Command-line options that several subcommands share, defined once: same names, same help."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager

from ddpfab.optionnames import option
from ddpfab.api import Cluster, runs_dir_default
from ddpfab.cli import config
from ddpfab.cli.errors import warn
from ddpfab.hosts import inventory
from ddpfab.planning.plan import PlanError, check_run_id, parse_nproc

INVENTORY_HELP = ("the nodes: an Ansible inventory (YAML or INI), a host list ending in a comma "
                  "(node1,node2, or node1,; [user@]host[:port] entries, [v6]:port), Ansible or pdsh ranges "
                  "(node[01:04], node[1:10:3], node[a:c], node[01-04]), or a DeepSpeed/MPI hostfile "
                  "(`host slots=N`: N processes on that host). Repeatable: merged in order, as Ansible does. "
                  "Default: $DDPFAB_INVENTORY, else `inventory:` in ./ddpfab.yml")


def add_cluster_args(p: argparse.ArgumentParser, *, inventory_required: bool = True,
                     inventory_help: str = INVENTORY_HELP, ssh: bool = True) -> None:
    """Which nodes (inventory, group, limit, extra vars) and, with *ssh*, how to reach them (the
    host-key policy). Unset values are filled by :func:`ddpfab.cli.config.apply` (flags > env > config)."""
    p.set_defaults(_cluster_args=True, _inventory_required=inventory_required)
    p.add_argument("-i", "--inventory", action="append", default=None, help=inventory_help)
    p.add_argument("--group", default=None,
                   help="inventory group whose hosts are the nodes (default: $DDPFAB_GROUP, the config's, or all)")
    add_selection_args(p)
    if not ssh:
        return
    p.add_argument("--accept-new-host-keys", action="store_true",
                   help="trust and record host keys not yet in known_hosts (a changed key is always refused)")
    p.add_argument("--known-hosts", help="known_hosts file (default: $DDPFAB_KNOWN_HOSTS, the config's, the "
                                         "inventory's UserKnownHostsFile, else ~/.ssh/known_hosts)")
    p.add_argument("--ssh-config", help="an ssh_config file to read (default: $DDPFAB_SSH_CONFIG, the config's, "
                                        "else ~/.ssh/config)")


def add_selection_args(p: argparse.ArgumentParser, recorded: bool = False) -> None:
    """-l/--limit and -e/--extra-vars, one meaning in every command; *recorded*: a command given a
    run id, which starts from the run's own (recorded) limit and variables."""
    p.add_argument("-l", "--limit", metavar="PATTERN",
                   help="only the hosts of the group that match this Ansible pattern (node1:node3 is those "
                        "two, ':' joins patterns; a range: '~node[1-3]$' or 'all[0:2]'; 'gpu*', "
                        "'all:!node2', 'rack1:&gpus', or @FILE: one pattern a line); node ranks follow the "
                        "remaining hosts' order" + ("; default: the run's, as recorded" if recorded else ""))
    p.add_argument("-e", "--extra-vars", action="append", default=[], metavar="VARS",
                   help="inventory variables over every host's, as Ansible's -e: KEY=VALUE, JSON/YAML, or "
                        "@file (e.g. -e ddpfab_python=/opt/venv/bin/python); repeatable, later wins"
                        + ("; over the run's own, as recorded" if recorded else ""))


def add_script_args(p: argparse.ArgumentParser, script_help: str, args_help: str) -> None:
    """SCRIPT and its arguments, the rest of the line unchanged. (argparse marks a REMAINDER
    positional required, so a missing script read "required: script, args"; the args are not.)"""
    p.add_argument("script", help=script_help)
    p.add_argument("args", nargs=argparse.REMAINDER, help=args_help).required = False


def add_env_args(p: argparse.ArgumentParser) -> None:
    """The ranks' environment: --env, --env-file, and the forwarding of this shell's variables."""
    p.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="environment for every rank (wins over the inventory's ddpfab_env); a bare KEY "
                        "takes its value from this shell (keeps a secret out of ddpfab's own command line)")
    p.add_argument("--env-file", action="append", default=[], metavar="FILE",
                   help="KEY=VALUE lines for every rank (--env wins over it)")
    p.add_argument("--no-forward-env", action="store_true",
                   help="do not forward this shell's NCCL_*, TORCH_*, GLOO_*, PYTORCH_* variables")


def nproc_type(text: str) -> int | str:
    """argparse's type for ``--nproc-per-node``: a number >= 1 or gpu|cpu|auto (torchrun's words,
    :func:`ddpfab.planning.plan.parse_nproc`); one meaning in every command that takes it."""
    try:
        return parse_nproc(text)
    except PlanError as exc:
        # argparse names the flag itself: the message without its own naming of the option
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{option('nproc_per_node')} ")) from None


def nonempty_path(text: str) -> str:
    """argparse's type for a path option that must name something (``--emit ''`` was ignored)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: name a directory")
    return text


def positive_seconds(text: str) -> float:
    """argparse's type for a timeout in seconds: a number above 0 (``--timeout -1`` timed every
    node out at once)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:  # (nan too)
        raise argparse.ArgumentTypeError(f"{text} is not above 0: give the seconds to wait")
    return value


def runs_dir_type(text: str) -> str:
    """argparse's type for ``--runs-dir`` (and ``$DDPFAB_RUNS_DIR``): ``~`` is this user's home in
    every command (a quoted ``'~/x'`` made a ``./~`` dir and printed ``~/x``); empty is refused
    (run dirs went straight into the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: name a directory for the run records (default ./runs)")
    return os.path.expanduser(text)


def add_runs_dir_arg(p: argparse.ArgumentParser, what: str = "where run records go") -> None:
    """``--runs-dir``, one meaning in run, plan, replay, check --perf and the job commands."""
    p.add_argument("--runs-dir", type=runs_dir_type, default=runs_dir_default(),
                   help=f"{what} (default: ./runs, or $DDPFAB_RUNS_DIR)")


def add_include_keys_arg(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """``--include-keys``, one meaning in sync and run (whose sync comes first)."""
    p.add_argument("--include-keys", action="store_true",
                   help=f"{prefix}send private keys (id_*, *.pem/*.key and files with a private key header) and "
                        ".ssh/ dirs too; left out by default, and named (a `!PATH` line in .ddpfabignore sends one)")


def run_id_type(text: str) -> str:
    """argparse's type for a RUN_ID argument (stop, attach, logs, doctor, replay): a run id as
    ``--run-id`` takes it, or exit 2: it names a directory here and on the nodes (``../..`` would
    read and write outside the runs directories)."""
    try:
        return check_run_id(text, "run id")
    except PlanError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@contextmanager
def origin_named(args: argparse.Namespace) -> Iterator[None]:
    """An inventory that does not exist, named by ``$DDPFAB_INVENTORY`` or the project config
    rather than ``-i``, is refused with where that name came from."""
    try:
        yield
    except inventory.InventoryMissing as exc:
        came_from = config.origin(args, "inventory")
        if came_from is None:
            raise
        raise inventory.InventoryMissing(f"{exc} ({came_from})") from None


def load_cluster(args: argparse.Namespace):
    """The cluster the parsed cluster options name: inventory, group, --limit and -e applied; what
    in it has no effect (a mistyped variable) is shown as a warning."""
    with origin_named(args):
        cluster = inventory.load(args.inventory, args.group or "all", limit=getattr(args, "limit", None),
                                 extra_vars=getattr(args, "extra_vars", None) or ())
    for line in cluster.warnings:
        warn(line)
    return cluster


def api_cluster(args: argparse.Namespace) -> Cluster:
    """The API's cluster for the parsed cluster options (inventory, group, limit, -e, ssh)."""
    return Cluster(load_cluster(args), inventory=args.inventory, ssh_config=args.ssh_config,
                   known_hosts=args.known_hosts, accept_new_host_keys=args.accept_new_host_keys,
                   limit=getattr(args, "limit", None), extra_vars=getattr(args, "extra_vars", None) or ())


#: Help for options some subcommands define without any, by destination: one wording everywhere.
COMMON_HELP = {
    "runs_dir": "where run records are (default: ./runs, or $DDPFAB_RUNS_DIR)",
    "known_hosts": "known_hosts file (default: the inventory's UserKnownHostsFile, else ~/.ssh/known_hosts)",
    "ssh_config": "an ssh_config file to read (default: ~/.ssh/config)",
    "accept_new_host_keys": "trust and record host keys not yet in known_hosts (a changed key is always refused)",
    "json": "print the result as JSON",
    "run_id": "the run's id (as `ddpfab ps` lists it)",
    "no_color": "no colours in the output",
    "nproc_per_node": "processes per node (default: inventory, GPU list, GPUs, or 1)",
    "runtime_kind": "the kind of the Trainer runtime the TrainJob refers to",
}


def fill_missing_help(parser: argparse.ArgumentParser) -> list[str]:
    """Give every option of *parser* and its subcommands a help text (:data:`COMMON_HELP`); return
    the ones still without (a test keeps that list empty)."""
    missing = []
    for action in parser._actions:  # argparse has no public walk; _actions is stable since 3.2
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                missing += fill_missing_help(sub)
        elif action.help is None and action.dest not in ("help", "version", "command"):
            action.help = COMMON_HELP.get(action.dest)
            if action.help is None and action.option_strings:
                missing.append(f"{parser.prog} {action.option_strings[0]}")
    return missing


def add_floors_arg(p: argparse.ArgumentParser) -> None:
    """``--resource-floors``, the same option on check and run (read by ddpfab.health.resourcecheck)."""
    p.add_argument("--resource-floors", metavar="shm=SIZE,disk=SIZE,mem=SIZE,nofile=N",
                   help="what each node must have: free /dev/shm (default: 256 MiB per process, at least 512 MiB), "
                        "free space in the workdir and runs dir (1 GiB), available memory (1 GiB), open-files "
                        "limit (1024); any subset")
