"""``ddpfab provision [...] [-- ANSIBLE-PLAYBOOK ARGS]``: the ddpfab.cluster roles over Ansible."""

from __future__ import annotations

import argparse
import json

from ddpfab.cli.common import INVENTORY_HELP
from ddpfab.cli.config import ConfigError, default_inventory
from ddpfab.cli.errors import die
from ddpfab.remote.provision import PLAYBOOKS, AnsibleOptions, ProvisionError, run_playbook
from ddpfab.remote.target import HostKeyPolicy


def register(sub) -> None:
    prov = sub.add_parser("provision", help="provision the nodes with the ddpfab.cluster Ansible roles",
                          description="Run the ddpfab.cluster collection's provision playbook (or --playbook) with "
                                      "ansible-playbook over your own Ansible configuration: ansible-playbook options "
                                      "> your ANSIBLE_* environment > your ansible.cfg > ddpfab's ansible.cfg.")
    add_arguments(prov)
    # the defaults of every inventory command ($DDPFAB_INVENTORY, ddpfab.yml's inventory, limit, extra_vars,
    # ssh_config, known_hosts: cli/config.py), filled before the command runs
    prov.set_defaults(func=cmd_provision, _cluster_args=True, _inventory_required=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``ddpfab provision``: ddpfab's own, then the ansible-playbook options passed
    through with their usual names."""
    parser.add_argument("-i", "--inventory", action="append", default=None, help=INVENTORY_HELP)
    parser.add_argument("--playbook", default="provision",
                        help=f"{' | '.join(PLAYBOOKS)} or a path to a playbook (default: provision)")
    parser.add_argument("-t", "--tags", action="append", default=[],
                        help="only these roles: base,timesync,firewall,gpu,python (comma-separated, repeatable)")
    parser.add_argument("--skip-tags", action="append", default=[], help="skip these roles/tags (as -t)")
    parser.add_argument("-C", "--check", action="store_true",
                        help="dry run: show what would change (with --diff), change nothing")
    parser.add_argument("-D", "--diff", action="store_true", help="show the changes made to files and templates")
    parser.add_argument("-l", "--limit", help="an Ansible host pattern to restrict the run to")
    parser.add_argument("-e", "--extra-vars", action="append", default=[], metavar="VARS",
                        help="Ansible extra vars (KEY=VALUE, JSON/YAML, or @file), repeatable; the highest precedence")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="ansible-playbook's verbosity (-v .. -vvvv)")
    parser.add_argument("-u", "--user", help="connect as this user (over the inventory's ansible_user)")
    parser.add_argument("-K", "--ask-become-pass", action="store_true",
                        help="ask for the become (sudo) password on the terminal")
    parser.add_argument("--vault-id", action="append", default=[], metavar="ID",
                        help="a vault identity (label@source), repeatable")
    parser.add_argument("-J", "--ask-vault-pass", action="store_true", help="ask for the vault password")
    parser.add_argument("--vault-password-file", action="append", default=[], metavar="FILE",
                        help="a vault password file, repeatable")
    parser.add_argument("--known-hosts", help="known_hosts file (default: the inventory's UserKnownHostsFile, "
                                              "the ssh_config's, else ~/.ssh/known_hosts), as for `ddpfab run`")
    parser.add_argument("--accept-new-host-keys", action="store_true",
                        help="trust and record host keys not yet in known_hosts (a changed key is always refused)")
    parser.add_argument("--ssh-config", help="an ssh_config file to read (default: the inventory's -F, else "
                                             "~/.ssh/config), as for `ddpfab run`")
    parser.add_argument("ansible_args", nargs="*", metavar="-- ANSIBLE-PLAYBOOK ARGS",
                        help="after --: any other ansible-playbook arguments, passed unchanged")


def options_from_args(args: argparse.Namespace) -> AnsibleOptions:
    """The :class:`AnsibleOptions` of parsed ``ddpfab provision`` arguments."""
    return AnsibleOptions(
        verbosity=args.verbose, ask_become_pass=args.ask_become_pass, user=args.user,
        vault_ids=tuple(args.vault_id), ask_vault_pass=args.ask_vault_pass,
        vault_password_files=tuple(args.vault_password_file), check=args.check, diff=args.diff,
        limit=args.limit, tags=tuple(args.tags), skip_tags=tuple(args.skip_tags),
        # the project config's extra_vars are a mapping: one JSON -e, before the command line's
        extra_vars=tuple(ev if isinstance(ev, str) else json.dumps(ev) for ev in args.extra_vars))


def policy_from_args(args: argparse.Namespace) -> HostKeyPolicy:
    """The host-key policy of parsed ``ddpfab provision`` arguments."""
    return HostKeyPolicy(known_hosts=args.known_hosts, accept_new=args.accept_new_host_keys)


def cmd_provision(args: argparse.Namespace) -> int:
    try:
        inventory = default_inventory(args.inventory)
        # ansible-playbook's own exit code (it uses 2 for a failed host, 4 for an unreachable one)
        return run_playbook(inventory, playbook=args.playbook, extra_args=args.ansible_args,
                            options=options_from_args(args), policy=policy_from_args(args),
                            ssh_config=args.ssh_config)
    except (ProvisionError, ConfigError) as exc:  # ansible-playbook was not started
        return die(str(exc))
