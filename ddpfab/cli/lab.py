"""``ddpfab lab up|down|status``: a local multi-host lab in network namespaces."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from ddpfab.cli.errors import EXIT_FAILED, die


def register(sub) -> None:
    p = sub.add_parser("lab", help="a local multi-host lab in network namespaces (root)")
    lab_sub = p.add_subparsers(dest="lab_command", required=True)
    up = lab_sub.add_parser("up", help="bring up N hosts node1..nodeN with sshd")
    up.add_argument("--hosts", type=_count, default=2, help="how many hosts (default 2)")
    up.add_argument("--dir", required=True, help="where the lab keeps its state, keys and inventory")
    up.add_argument("--subnet", type=_network, default="10.213.0.0/24",
                    help="the lab's private /24 (default 10.213.0.0/24)")
    up.add_argument("--python", metavar="PATH",
                    help="the nodes' python, written as ddpfab_python in the lab inventory (default: this python "
                         "when it has torch, else the venv `ddpfab provision` makes, /opt/ddpfab/venv/bin/python)")
    up.add_argument("--share", action="append", default=[], metavar="DIR",
                    help="a dir under /tmp that hosts must see (each host has its own /tmp); the lab dir, "
                         "the python's venv and the current dir are always shared (repeatable)")
    up.add_argument("--gpus", type=int, default=0, metavar="N",
                    help="give each host a STAND-IN nvidia-smi reporting N GPUs (no GPU, no CUDA: for testing GPU "
                         "leases and GPU counts on CPU; jobs still run on gloo)")
    for name, text in (("down", "remove everything the lab made"), ("status", "show the lab's hosts")):
        q = lab_sub.add_parser(name, help=text)
        q.add_argument("--dir", required=True, help="the lab's dir (as given to lab up)")
    p.set_defaults(func=cmd_lab)


def _count(text: str) -> int:
    """--hosts: a whole number of at least 1 (argparse's error, exit 2, otherwise)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a number of hosts, 1 or more, got {text!r}")
    return int(text)


def _network(text: str) -> str:
    """--subnet: an IPv4 network such as 10.213.0.0/24."""
    try:
        net = ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an IPv4 network such as 10.213.0.0/24, got {text!r}") from None
    if net.version != 4:
        raise argparse.ArgumentTypeError(f"expected an IPv4 network such as 10.213.0.0/24, got {text!r}")
    return text


def cmd_lab(args: argparse.Namespace) -> int:
    # slow to import: see LAZY in ddpfab/cli/__init__.py
    from ddpfab import lab

    try:
        if args.lab_command == "up":
            python, why = lab.node_python(args.python)
            the_lab, already = lab.up(args.dir, hosts=args.hosts, subnet=args.subnet, python=python,
                                         share=args.share, gpus=args.gpus)
            state = "already up" if already else "up"
            if already:  # idempotent: a running lab is left as it is, but not silently when asked otherwise
                differs = [f"{what} {have}, not {asked}" for what, have, asked in (
                    ("hosts", len(the_lab.hosts), args.hosts), ("subnet", the_lab.subnet, args.subnet),
                    ("stand-in GPUs", the_lab.gpus, args.gpus)) if str(have) != str(asked)]
                if differs:
                    sys.stderr.write(f"ddpfab: warning: the lab in {the_lab.dir} has {'; '.join(differs)}: it is left "
                                     f"as it is (`ddpfab lab down --dir {args.dir}` first to change it)\n")
            first, last = the_lab.hosts[0], the_lab.hosts[-1]
            # every host of a small lab; a large one as a range (one short line at 128 hosts)
            names = (", ".join(f"{h.name}={h.address}" for h in the_lab.hosts) if len(the_lab.hosts) <= 8 else
                     f"{len(the_lab.hosts)} hosts {first.name}..{last.name} = {first.address}..{last.address}")
            print(f"lab {state}: {names}")
            print(f"inventory: {the_lab.inventory}")
            print(f"ssh:       ssh -F {the_lab.ssh_config} {the_lab.hosts[0].name}")
            print(f"python:    {python} ({why})")
            return 0
        if args.lab_command == "down":
            lab.check_prerequisites()
            print("lab down" if lab.down(args.dir) else f"no lab in {os.path.abspath(args.dir)}")
            return 0
        if lab.Lab.load(args.dir) is None:
            return die(f"no lab in {os.path.abspath(args.dir)} (bring one up with: ddpfab lab up --dir {args.dir})")
        print(lab.status(args.dir))
        return 0
    except lab.LabError as exc:
        return die(str(exc), EXIT_FAILED)
