"""``ddpfab provision``: run ddpfab's Ansible playbooks against the inventory ``ddpfab run`` uses.

Ansible does what Ansible is for (idempotent host state: packages, venv, firewall, time sync); this
module only finds ``ansible-playbook`` and the playbooks shipped inside the package (the
``ddpfab.cluster`` collection, see :func:`collection_dir`), runs them over the user's own Ansible
configuration with ddpfab's settings layered beneath it (:func:`ansible_env`), streams Ansible's
output, and names the hosts that failed, one line each.

    run_playbook("lab/inventory.yml")                          # the collection's provision playbook
    run_playbook("inv.yml", "firewall", limit="node3")         # only the firewall
    run_playbook("inv.yml", tags=["python"], check=True)       # dry run of one role

Precedence of Ansible settings, highest first: ansible-playbook's command-line options (``-u``,
``-K``, ``-e``, ``-v``...), ``ANSIBLE_*`` variables in your environment, your ansible.cfg (the one
Ansible itself would pick: ``$ANSIBLE_CONFIG``, ``./ansible.cfg``, ``~/.ansible.cfg``,
``/etc/ansible/ansible.cfg``), ddpfab's ``ansible.cfg`` (each of its settings that neither your
environment nor your config names is passed as its ``ANSIBLE_*`` variable), Ansible's defaults.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TextIO

from ddpfab.hosts import inventory as invmod
from ddpfab.hosts.suggest import did_you_mean
from ddpfab.problems import DdpfabError
from ddpfab.remote import waits
from ddpfab.remote.target import HostKeyPolicy, Target, TargetError, ansible_vars, resolve_all, ssh_argv, ssh_problem

#: Playbooks ``ddpfab provision --playbook NAME`` knows by name (``<name>.yml`` in :func:`ansible_dir`).
PLAYBOOKS = ("provision", "firewall")
#: The collection the playbooks and roles live in (``ansible-galaxy collection build`` takes its dir).
COLLECTION = ("ddpfab", "cluster")

#: ddpfab's ansible.cfg settings and the ``ANSIBLE_*`` variable that carries each one. A setting of
#: that name in the user's config (any section: Ansible reads some in several) or environment wins.
#: collections_path is not layered: ``ddpfab provision`` finds the collection beside its playbooks.
SETTING_ENV = {
    "interpreter_python": "ANSIBLE_PYTHON_INTERPRETER",
    "host_key_checking": "ANSIBLE_HOST_KEY_CHECKING",
    "forks": "ANSIBLE_FORKS",
    "timeout": "ANSIBLE_TIMEOUT",
    "retry_files_enabled": "ANSIBLE_RETRY_FILES_ENABLED",
    "nocows": "ANSIBLE_NOCOWS",
    "stdout_callback": "ANSIBLE_STDOUT_CALLBACK",
    "callback_result_format": "ANSIBLE_CALLBACK_RESULT_FORMAT",
    "show_task_path_on_failure": "ANSIBLE_SHOW_TASK_PATH_ON_FAILURE",
    "display_skipped_hosts": "ANSIBLE_DISPLAY_SKIPPED_HOSTS",
    "check_mode_markers": "ANSIBLE_CHECK_MODE_MARKERS",
    "become_method": "ANSIBLE_BECOME_METHOD",
    "pipelining": "ANSIBLE_PIPELINING",
    "control_path_dir": "ANSIBLE_SSH_CONTROL_PATH_DIR",
    "ssh_args": "ANSIBLE_SSH_ARGS",
}
NOT_LAYERED = ("collections_path",)

#: The connection vars :func:`ssh_vars_file` decides for every inventory host.
ANSIBLE_SSH_VARS = ("ansible_host", "ansible_user", "ansible_ssh_args", "ansible_ssh_common_args", "ansible_ssh_extra_args")

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_RECAP_LINE = re.compile(r"^(?P<host>\S+)\s*:\s*(?P<counts>(?:\w+=\d+\s*)+)$")


class ProvisionError(DdpfabError):
    """Provisioning could not start: ansible-playbook, a playbook or the inventory is missing."""

    check = "provision"


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


def ansible_dir() -> Path:
    """The dir holding ddpfab's ``ansible.cfg``, the playbooks ``provision`` runs, the example
    inventory and (under ``collections/``) the ``ddpfab.cluster`` collection: package data, the same
    in a checkout and in an installed wheel. ``$DDPFAB_ANSIBLE_DIR`` replaces it (a patched copy).
    """
    override = os.environ.get("DDPFAB_ANSIBLE_DIR")
    cand = Path(override) if override else Path(str(resources.files("ddpfab") / "ansible"))
    if (cand / "ansible.cfg").is_file() and (cand / "provision.yml").is_file():
        return cand
    raise ProvisionError(
        f"ddpfab's Ansible files (ansible.cfg, provision.yml) are not in {cand}: "
        + ("point DDPFAB_ANSIBLE_DIR at a copy of ddpfab/ansible" if override
           else "the package is incomplete; reinstall ddpfab (pip install --force-reinstall ddpfab)"))


def collection_dir() -> Path:
    """The ``ddpfab.cluster`` collection (galaxy.yml, roles/, playbooks/) inside :func:`ansible_dir`."""
    return ansible_dir() / "collections" / "ansible_collections" / COLLECTION[0] / COLLECTION[1]


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
        return ansible_dir() / f"{playbook}.yml"
    path = Path(playbook)
    if path.is_file():
        return path.resolve()

    raise ProvisionError(f"unknown playbook {playbook!r}{did_you_mean(playbook, PLAYBOOKS)}: use one of "
                         f"{', '.join(PLAYBOOKS)} or a path to a playbook")


@dataclass(frozen=True)
class AnsibleOptions:
    """ansible-playbook options ``ddpfab provision`` passes through unchanged.

    Args:
        verbosity: ``-v`` count (0-4).
        ask_become_pass: ``-K``: Ansible prompts for the become (sudo) password on the terminal.
        user: ``-u``: the SSH user, over the inventory's and your config's.
        vault_ids: ``--vault-id`` values (``label@source``), in order.
        ask_vault_pass: ``--ask-vault-pass``.
        vault_password_files: ``--vault-password-file`` values.
        check: ``--check``: change nothing.
        diff: ``--diff``: show what changes (``--check`` alone implies it, as ddpfab always did).
        limit: ``-l``: an Ansible host pattern.
        tags: ``-t``: only these tags (comma-separated entries are split).
        skip_tags: ``--skip-tags``.
        extra_vars: ``-e`` values (KEY=VALUE, JSON/YAML, or @file), in order.
    """

    verbosity: int = 0
    ask_become_pass: bool = False
    user: str | None = None
    vault_ids: tuple[str, ...] = ()
    ask_vault_pass: bool = False
    vault_password_files: tuple[str, ...] = ()
    check: bool = False
    diff: bool = False
    limit: str | None = None
    tags: tuple[str, ...] = ()
    skip_tags: tuple[str, ...] = ()
    extra_vars: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        out: list[str] = []
        if self.verbosity:
            out.append("-" + "v" * min(self.verbosity, 6))
        if self.user:
            out += ["-u", self.user]
        if self.ask_become_pass:
            out.append("--ask-become-pass")
        for v in self.vault_ids:
            out += ["--vault-id", v]
        if self.ask_vault_pass:
            out.append("--ask-vault-pass")
        for v in self.vault_password_files:
            out += ["--vault-password-file", v]
        for flag, values in (("--tags", self.tags), ("--skip-tags", self.skip_tags)):
            split = [t.strip() for tag in values for t in tag.split(",") if t.strip()]
            if split:
                out += [flag, ",".join(split)]
        if self.check:
            out.append("--check")
        if self.check or self.diff:
            out.append("--diff")
        if self.limit:
            out += ["--limit", self.limit]
        for ev in self.extra_vars:
            out += ["-e", ev]
        return out

    @property
    def prompts(self) -> bool:
        """Ansible will ask something on the terminal: its stdin must be ours."""
        return self.ask_become_pass or self.ask_vault_pass


def build_command(inventory: str | os.PathLike | list, playbook: str = "provision", tags: list[str] | None = None,
                  check: bool = False, limit: str | None = None,
                  extra_args: list[str] | None = None, options: AnsibleOptions | None = None) -> list[str]:
    """The ansible-playbook argv for these options (no side effects beyond looking files up).

    *inventory* is anything ``-i`` takes (see :func:`ddpfab.hosts.inventory.ansible_source`): a file, a
    host list ``a,b,``, a DeepSpeed hostfile or ranges; or a list of them (one ``-i`` each, in order).
    """
    try:
        sources = [invmod.ansible_source(s) for s in invmod.sources_of(inventory)]
    except invmod.InventoryError as exc:
        raise ProvisionError(exc.problems) from None
    opts = options or AnsibleOptions()
    if tags or check or limit:
        opts = AnsibleOptions(**{**opts.__dict__, "tags": opts.tags + tuple(tags or ()),
                                 "check": opts.check or check, "limit": limit or opts.limit})
    argv = [find_ansible_playbook(), *(w for s in sources for w in ("-i", s)), str(playbook_path(playbook))]
    return argv + opts.argv() + list(extra_args or [])


def user_config(environ: Mapping[str, str] | None = None, cwd: str | None = None) -> Path | None:
    """The ansible.cfg Ansible itself would read, in its order (``$ANSIBLE_CONFIG``, ``./ansible.cfg``
    unless the dir is world-writable, ``~/.ansible.cfg``, ``/etc/ansible/ansible.cfg``), or None."""
    environ = os.environ if environ is None else environ
    cwd = cwd or os.getcwd()
    cands: list[Path] = []
    if environ.get("ANSIBLE_CONFIG"):
        p = Path(os.path.expanduser(environ["ANSIBLE_CONFIG"]))
        cands.append(p / "ansible.cfg" if p.is_dir() else p)
    try:
        if not os.stat(cwd).st_mode & 0o002:
            cands.append(Path(cwd) / "ansible.cfg")
    except OSError:
        pass
    cands += [Path(os.path.expanduser("~/.ansible.cfg")), Path("/etc/ansible/ansible.cfg")]
    return next((c for c in cands if c.is_file()), None)


def _cfg_settings(path: Path) -> dict[str, str]:
    """key -> value of every setting in an ansible.cfg (sections flattened; keys lower-cased)."""
    parser = configparser.ConfigParser(interpolation=None, inline_comment_prefixes=(";",))
    try:
        parser.read(path, encoding="utf-8")
    except (configparser.Error, UnicodeDecodeError) as exc:
        raise ProvisionError(f"ansible config {path} cannot be read: {exc}") from None
    return {k.lower(): v for s in parser.sections() for k, v in parser.items(s, raw=True)}


def layered_settings(environ: Mapping[str, str] | None = None, cwd: str | None = None) -> dict[str, str]:
    """The ``ANSIBLE_*`` variables ddpfab adds: its ansible.cfg's settings that neither *environ* nor
    the user's config (:func:`user_config`) sets."""
    environ = os.environ if environ is None else environ
    user = user_config(environ, cwd)
    theirs = _cfg_settings(user) if user else {}
    ours = _cfg_settings(ansible_dir() / "ansible.cfg")
    out = {}
    for key, value in ours.items():
        if key in NOT_LAYERED:
            continue
        env = SETTING_ENV.get(key)
        if env is None:
            raise ProvisionError(f"{ansible_dir() / 'ansible.cfg'}: setting {key} has no ANSIBLE_* variable in "
                                 "ddpfab.remote.provision.SETTING_ENV; add it there")
        if env in environ or key in theirs:
            continue
        # relative paths in ddpfab's config mean its own dir, as they would in the file
        out[env] = os.path.expanduser(value)
    return out


def ansible_env(color: bool = False) -> dict[str, str]:
    """The environment for ansible-playbook: the user's own, ddpfab's settings layered beneath it
    (:func:`layered_settings`), unbuffered output, and this venv's bin first on PATH."""
    env = dict(os.environ)
    env.update(layered_settings(env))
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
    recap: list[HostRecap] = []
    for line in lines[start:]:
        m = _RECAP_LINE.match(line.strip())
        if not m:
            if recap:
                break
            continue
        counts = {k: int(v) for k, v in (kv.split("=") for kv in m.group("counts").split())}
        recap.append(HostRecap(m.group("host"), counts))
    return recap


def summarize(recap: list[HostRecap], rc: int, why: dict[str, str] | None = None) -> list[str]:
    """One line per host that failed or was unreachable (with *why*, what ddpfab found on its SSH
    route); a general line if none but rc != 0."""
    lines = []
    for h in recap:
        if h.unreachable:
            lines.append(f"ddpfab provision: {h.host}: UNREACHABLE ("
                         f"{(why or {}).get(h.host) or 'check SSH: address, key, known_hosts'})")
        elif h.failed:
            lines.append(f"ddpfab provision: {h.host}: FAILED ({h.counts.get('failed')} task(s); "
                         f"see the task marked fatal for {h.host} above)")
    if rc != 0 and not lines:
        lines.append(f"ddpfab provision: ansible-playbook exited with status {rc} before any host ran "
                     f"(see its message above)")
    return lines


def targets_of(inventory: str | Path | list, policy: HostKeyPolicy | None = None,
               ssh_config: str | None = None) -> dict[str, Target]:
    """How ddpfab reaches every host of *inventory* (:func:`ddpfab.remote.target.resolve`)."""
    try:
        return resolve_all(invmod.load(inventory, group="all").nodes, policy, ssh_config)
    except (invmod.InventoryError, TargetError) as exc:
        raise ProvisionError(exc.problems) from None


def ssh_vars_file(targets: dict[str, Target], directory: str) -> str:
    """An extra-vars file (``-e @FILE``, the highest precedence) that makes Ansible reach every
    host exactly as the runner and sync do (:func:`ddpfab.remote.target.ansible_vars`: the same address,
    key, known_hosts and host-key policy, and jump hosts as a ProxyCommand that checks the jump
    host's key too), whatever ansible.cfg, ``ANSIBLE_*`` or inventory vars say. Hosts outside the
    inventory (localhost) keep Ansible's own address and args."""
    per_host = {name: ansible_vars(t, f"{directory}/cp-%C") for name, t in targets.items()}
    data: dict = {"ddpfab_ssh_vars": per_host,
                  # host key checking off would add StrictHostKeyChecking=no; ddpfab's own comes first
                  # and wins anyway, but no setting may even ask for it (both names: the last wins)
                  "ansible_host_key_checking": True, "ansible_ssh_host_key_checking": True}
    for var in ANSIBLE_SSH_VARS:
        fallback = "inventory_hostname" if var == "ansible_host" else "''"
        if var == "ansible_user":  # Ansible's own choice (remote_user, else the local user)
            fallback = "lookup('config', 'DEFAULT_REMOTE_USER') or lookup('env', 'USER')"
        if var == "ansible_ssh_args":  # Ansible's default, for hosts ddpfab does not reach (localhost)
            fallback = "'-C -o ControlMaster=auto -o ControlPersist=60s'"
        data[var] = f"{{{{ (ddpfab_ssh_vars[inventory_hostname] | default({{}})).{var} | default({fallback}) }}}}"
    path = os.path.join(directory, "ssh_vars.json")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w", encoding="utf-8") as fh:
        json.dump(data, fh)
    return path


def why_unreachable(targets: list[Target]) -> dict[str, str]:
    """For hosts Ansible could not reach: what OpenSSH says on the same route, in ddpfab's words
    (which hop failed: the host or a jump host, and why); Ansible shows only the outer ssh's last
    line ("Connection closed by UNKNOWN port 65535") when a jump host refused."""
    def one(t: Target) -> str | None:
        wait = t.connect_timeout * len(t.chain()) + 10
        try:
            proc = subprocess.run(ssh_argv(t, "true"), capture_output=True, text=True, timeout=wait,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return f"{t.label} ({t.where}): no SSH connection within {wait:g} s"
        return ssh_problem(t, proc.returncode, proc.stderr) if proc.returncode == 255 else None

    with waits.pool(max(1, min(16, len(targets)))) as pool:
        found = dict(zip([t.name for t in targets], waits.mapped(pool, one, targets), strict=True))
    return {name: why for name, why in found.items() if why}


def run_playbook(inventory: str | Path | list, playbook: str = "provision", tags: list[str] | None = None,
                 check: bool = False, limit: str | None = None, extra_args: list[str] | None = None,
                 out: TextIO | None = None, options: AnsibleOptions | None = None,
                 policy: HostKeyPolicy | None = None, ssh_config: str | None = None) -> int:
    """Run *playbook* against *inventory*, streaming Ansible's output to *out*; return its exit code.

    Args:
        inventory: the inventory ``ddpfab run`` uses (a file, a host list, a hostfile, pdsh ranges).
        playbook: ``provision`` (everything), ``firewall``, or a path to a playbook.
        tags: run only these roles/tags (base, timesync, firewall, gpu, python).
        check: dry run (``--check --diff``): report what would change, change nothing.
        limit: an Ansible host pattern to restrict the run to.
        extra_args: more ansible-playbook arguments, e.g. ``["-e", "ddpfab_group=train"]``.
        out: where to write Ansible's output and the failed-host lines (default stdout).
        options: the pass-through ansible-playbook options (:class:`AnsibleOptions`).
        policy: the host-key policy (known_hosts, accept-new), as for ``ddpfab run``.
        ssh_config: an ssh_config file, as for ``ddpfab run`` (see :func:`ssh_vars_file`).

    Raises:
        ProvisionError: ansible-playbook, the playbook or the inventory is missing.
    """
    out = out or sys.stdout
    options = options or AnsibleOptions()
    targets = targets_of(inventory, policy, ssh_config)
    with tempfile.TemporaryDirectory(prefix="ddpfab-provision-") as tmp:
        argv = build_command(inventory, playbook, tags=tags, check=check, limit=limit, extra_args=extra_args,
                             options=options)
        # ddpfab's route first: the user's own -e (later on the line) still wins, as with Ansible
        argv[3:3] = ["-e", "@" + ssh_vars_file(targets, tmp)]
        rc, output = _run_streaming(argv, out, options)
    recap = parse_recap(output)
    why = why_unreachable([targets[h.host] for h in recap if h.unreachable and h.host in targets])
    for line in summarize(recap, rc, why):
        out.write(line + "\n")
    out.flush()
    return rc


def _run_streaming(argv: list[str], out: TextIO, options: AnsibleOptions) -> tuple[int, str]:
    """Run ansible-playbook *argv*, streaming its output to *out*; its exit code and output."""
    color = bool(getattr(out, "isatty", lambda: False)()) and "NO_COLOR" not in os.environ
    captured: list[bytes] = []
    try:
        # a prompt (-K, --ask-vault-pass) reads the terminal: stdin stays ours then
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=None if options.prompts else subprocess.DEVNULL, env=ansible_env(color))
    except OSError as exc:
        raise ProvisionError(f"cannot run {argv[0]}: {exc}") from None
    try:
        assert proc.stdout is not None
        # chunks, not lines: a password prompt has no newline and must show before the answer
        while chunk := os.read(proc.stdout.fileno(), 65536):
            out.write(chunk.decode("utf-8", "replace"))
            out.flush()
            captured.append(chunk)
        rc = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    return rc, b"".join(captured).decode("utf-8", "replace")
