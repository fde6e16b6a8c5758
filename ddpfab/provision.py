"""``ddpfab provision``: run the project's Ansible playbooks against the inventory ``ddpfab run`` uses.

Ansible does what Ansible is for (idempotent host state: packages, venv, firewall, time sync); this
module only finds ``ansible-playbook`` and the project's playbooks, runs them with the project's
``ansible.cfg``, streams Ansible's own output, and names the hosts that failed, one line each.

    run_playbook("lab/inventory.yml")                          # playbooks/provision.yml
    run_playbook("inv.yml", "firewall", limit="node3")         # playbooks/firewall.yml
    run_playbook("inv.yml", tags=["python"], check=True)       # dry run of one role
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

#: Playbooks under ``playbooks/`` that ``ddpfab provision --playbook NAME`` knows by name.
PLAYBOOKS = ("provision", "firewall")

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_RECAP_LINE = re.compile(r"^(?P<host>\S+)\s*:\s*(?P<counts>(?:\w+=\d+\s*)+)$")


class ProvisionError(Exception):
    """Provisioning could not start: ansible-playbook, a playbook or the inventory is missing."""


@dataclass(frozen=True)
class HostRecap:
    """One host's line of Ansible's PLAY RECAP.

    Args:
        host: the inventory name.
        counts: ok, changed, unreachable, failed, skipped, rescued, ignored.
    """

    host: str
    counts: dict[str, int]

    @property
    def failed(self) -> bool:
        return self.counts.get("failed", 0) > 0

    @property
    def unreachable(self) -> bool:
        return self.counts.get("unreachable", 0) > 0

    @property
    def changed(self) -> int:
        return self.counts.get("changed", 0)


def project_dir() -> Path:
    """The dir holding ``ansible.cfg``, ``playbooks/`` and ``roles/``.

    ``$DDPFAB_ANSIBLE_DIR`` if set, else the checkout this package lives in (the package's parent
    dir), else an ``ansible/`` dir shipped inside the package.
    """
    here = Path(__file__).resolve().parent
    candidates = []
    if os.environ.get("DDPFAB_ANSIBLE_DIR"):
        candidates.append(Path(os.environ["DDPFAB_ANSIBLE_DIR"]))
    candidates += [here.parent, here / "ansible"]
    for cand in candidates:
        if (cand / "ansible.cfg").is_file() and (cand / "playbooks").is_dir():
            return cand
    raise ProvisionError(
        "ddpfab's ansible.cfg and playbooks/ were not found (looked in "
        + ", ".join(str(c) for c in candidates)
        + "): run ddpfab from its source checkout, or set DDPFAB_ANSIBLE_DIR to it")


def find_ansible_playbook() -> str:
    """``ansible-playbook`` beside the running python (its venv), else on PATH."""
    beside = Path(sys.executable).parent / "ansible-playbook"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("ansible-playbook")
    if found:
        return found
    raise ProvisionError(
        f"ansible-playbook not found (not in {beside.parent} nor on PATH): install ansible-core "
        f"where ddpfab runs, e.g. `{sys.executable} -m pip install ansible-core`")


def playbook_path(playbook: str) -> Path:
    """A playbook by name (``provision``, ``firewall``) or by path."""
    if playbook in PLAYBOOKS:
        return project_dir() / "playbooks" / f"{playbook}.yml"
    path = Path(playbook)
    if path.is_file():
        return path.resolve()
    raise ProvisionError(f"unknown playbook {playbook!r}: use one of {', '.join(PLAYBOOKS)} or a path to a playbook")


def build_command(inventory: str | os.PathLike, playbook: str = "provision", tags: list[str] | None = None,
                  check: bool = False, limit: str | None = None,
                  extra_args: list[str] | None = None) -> list[str]:
    """The ansible-playbook argv for these options (no side effects beyond looking files up)."""
    inv = Path(inventory)
    if not inv.exists():
        raise ProvisionError(f"inventory {inv} does not exist")
    argv = [find_ansible_playbook(), "-i", str(inv.resolve()), str(playbook_path(playbook))]
    tag_list = [t.strip() for tag in (tags or []) for t in tag.split(",") if t.strip()]
    if tag_list:
        argv += ["--tags", ",".join(tag_list)]
    if check:
        argv += ["--check", "--diff"]
    if limit:
        argv += ["--limit", limit]
    argv += list(extra_args or [])
    return argv


def ansible_env(color: bool = False) -> dict[str, str]:
    """The environment for ansible-playbook: the project's ansible.cfg, unbuffered output."""
    env = dict(os.environ)
    env["ANSIBLE_CONFIG"] = str(project_dir() / "ansible.cfg")
    env["PYTHONUNBUFFERED"] = "1"
    # helpers Ansible spawns (ansible-inventory plugins, the venv's python) come from the same venv
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    if color:
        env.setdefault("ANSIBLE_FORCE_COLOR", "1")
    else:
        env.pop("ANSIBLE_FORCE_COLOR", None)
        env["ANSIBLE_NOCOLOR"] = "1"
    return env


def parse_recap(output: str) -> list[HostRecap]:
    """The hosts of the last PLAY RECAP in Ansible's output, in order."""
    lines = [_ANSI.sub("", line).rstrip() for line in output.splitlines()]
    start = None
    for i, line in enumerate(lines):
        if line.startswith("PLAY RECAP"):
            start = i + 1
    if start is None:
        return []
    recap = []
    for line in lines[start:]:
        m = _RECAP_LINE.match(line.strip())
        if not m:
            if recap:
                break
            continue
        counts = {k: int(v) for k, v in (kv.split("=") for kv in m.group("counts").split())}
        recap.append(HostRecap(m.group("host"), counts))
    return recap


def summarize(recap: list[HostRecap], rc: int) -> list[str]:
    """One line per host that failed or was unreachable; a general line if none but rc != 0."""
    lines = []
    for h in recap:
        if h.unreachable:
            lines.append(f"ddpfab provision: {h.host}: UNREACHABLE (check SSH: address, key, known_hosts)")
        elif h.failed:
            lines.append(f"ddpfab provision: {h.host}: FAILED ({h.counts.get('failed')} task(s); "
                         f"see the task marked fatal for {h.host} above)")
    if rc != 0 and not lines:
        lines.append(f"ddpfab provision: ansible-playbook exited with status {rc} before any host ran "
                     f"(see its message above)")
    return lines


def run_playbook(inventory: str | Path, playbook: str = "provision", tags: list[str] | None = None,
                 check: bool = False, limit: str | None = None, extra_args: list[str] | None = None,
                 out: TextIO | None = None) -> int:
    """Run *playbook* against *inventory*, streaming Ansible's output to *out*; return its exit code.

    Args:
        inventory: the Ansible inventory ``ddpfab run`` uses.
        playbook: ``provision`` (everything), ``firewall``, or a path to a playbook.
        tags: run only these roles/tags (base, timesync, firewall, gpu, python).
        check: dry run (``--check --diff``): report what would change, change nothing.
        limit: an Ansible host pattern to restrict the run to.
        extra_args: more ansible-playbook arguments, e.g. ``["-e", "ddpfab_group=train"]``.
        out: where to write Ansible's output and the failed-host lines (default stdout).

    Raises:
        ProvisionError: ansible-playbook, the playbook or the inventory is missing.
    """
    out = out or sys.stdout
    argv = build_command(inventory, playbook, tags=tags, check=check, limit=limit, extra_args=extra_args)
    color = bool(getattr(out, "isatty", lambda: False)()) and "NO_COLOR" not in os.environ
    captured: list[str] = []
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=ansible_env(color), text=True, errors="replace", bufsize=1)
    except OSError as exc:
        raise ProvisionError(f"cannot run {argv[0]}: {exc}") from None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            out.flush()
            captured.append(line)
        rc = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    for line in summarize(parse_recap("".join(captured)), rc):
        out.write(line + "\n")
    out.flush()
    return rc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``ddpfab provision`` (for the CLI to reuse)."""
    parser.add_argument("-i", "--inventory", required=True, help="the Ansible inventory `ddpfab run` uses")
    parser.add_argument("--playbook", default="provision",
                        help=f"{' | '.join(PLAYBOOKS)} or a path to a playbook (default: provision)")
    parser.add_argument("-t", "--tags", action="append", default=[],
                        help="only these roles: base,timesync,firewall,gpu,python (comma-separated, repeatable)")
    parser.add_argument("--check", action="store_true", help="dry run: show what would change, change nothing")
    parser.add_argument("-l", "--limit", help="an Ansible host pattern to restrict the run to")
    parser.add_argument("-e", "--extra-vars", action="append", default=[],
                        help="Ansible extra vars (KEY=VALUE or @file), repeatable")


def main(argv: list[str] | None = None) -> int:
    """``python -m ddpfab.provision -i INVENTORY [...] [-- ANSIBLE-PLAYBOOK ARGS]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, passthrough = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(prog="ddpfab provision", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    extra = [a for ev in args.extra_vars for a in ("-e", ev)] + passthrough
    try:
        return run_playbook(args.inventory, args.playbook, tags=args.tags, check=args.check,
                            limit=args.limit, extra_args=extra)
    except ProvisionError as exc:
        print(f"ddpfab provision: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
