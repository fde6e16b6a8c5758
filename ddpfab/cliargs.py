"""Command-line options that several subcommands share, defined once: same names, same help."""

from __future__ import annotations

import argparse

INVENTORY_HELP = "Ansible inventory (YAML or INI) of the nodes"


def add_cluster_args(p: argparse.ArgumentParser, *, inventory_required: bool = True,
                     inventory_help: str = INVENTORY_HELP, ssh: bool = True) -> None:
    """Which nodes (inventory, group) and, with *ssh*, how to reach them (the host-key policy)."""
    p.add_argument("-i", "--inventory", required=inventory_required, help=inventory_help)
    p.add_argument("--group", default="all", help="inventory group whose hosts are the nodes (default: all)")
    if not ssh:
        return
    p.add_argument("--accept-new-host-keys", action="store_true",
                   help="trust and record host keys not yet in known_hosts (a changed key is always refused)")
    p.add_argument("--known-hosts", help="known_hosts file (default: the inventory's UserKnownHostsFile, "
                                         "else ~/.ssh/known_hosts)")
    p.add_argument("--ssh-config", help="an ssh_config file to read (default: ~/.ssh/config)")


def add_env_args(p: argparse.ArgumentParser) -> None:
    """The ranks' environment: --env, --env-file, and the forwarding of this shell's variables."""
    p.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="environment for every rank; a bare KEY takes its value from this shell "
                        "(keeps a secret out of ddpfab's own command line)")
    p.add_argument("--env-file", action="append", default=[], metavar="FILE",
                   help="KEY=VALUE lines for every rank (--env wins over it)")
    p.add_argument("--no-forward-env", action="store_true",
                   help="do not forward this shell's NCCL_*, TORCH_*, GLOO_*, PYTORCH_* variables")
