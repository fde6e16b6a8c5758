"""Read the cluster from a standard Ansible inventory, with Ansible's own inventory API.

Why Ansible's API and not a YAML parser: users already keep their hosts in Ansible inventories
(YAML or INI, groups, ``node[1:4]`` ranges, group_vars/host_vars, templated vars), and the
provisioning playbooks read the same file. One reader means one meaning.

The result is a :class:`Cluster`: plain data, no Ansible objects, so the plan stays pure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import ipaddress
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: ddpfab's own inventory variables; each is documented in inventory/example.yml.
VAR_NPROC = "ddpfab_nproc_per_node"
VAR_GPUS = "ddpfab_gpus"
VAR_DATA_ADDR = "ddpfab_data_addr"
VAR_WORKDIR = "ddpfab_workdir"
VAR_PYTHON = "ddpfab_python"
VAR_MASTER = "ddpfab_master"
VAR_SHARED_DIR = "ddpfab_shared_dir"
VAR_SPARES = "ddpfab_spares_group"

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+$")


class InventoryError(Exception):
    """The inventory cannot be used; the message names the file or host and what to fix."""


@dataclass(frozen=True)
class Node:
    """One host of the cluster, as the inventory describes it.

    Args:
        name: the inventory hostname.
        host: where SSH connects (``ansible_host``, else the name).
        port: SSH port (``ansible_port``), None for the default.
        user: SSH user (``ansible_user``), None for the current user / ssh_config.
        key_file: private key (``ansible_ssh_private_key_file``).
        ssh_options: ``-o Key=Value`` options from ``ansible_ssh_common_args``, keys lower-cased.
        nproc: processes per node (``ddpfab_nproc_per_node``), None to decide later (GPUs or 1).
        gpus: GPUs the host is expected to have (``ddpfab_gpus``), None if not stated.
        data_addr: the address peers use for training traffic (``ddpfab_data_addr``, else ``host``).
        workdir: remote working dir (``ddpfab_workdir``), None for the controller's cwd.
        python: the node's python with torch (``ddpfab_python``).
        master: this node hosts the rendezvous (``ddpfab_master``).
        shared_dir: a directory every node sees with the same content (NFS and the like;
            ``ddpfab_shared_dir``), used for the file:// init method; None if not set.
        spares_group: the inventory group whose hosts stand by to replace a lost node
            (``ddpfab_spares_group``; ``ddpfab run --spares`` wins); None if not set.
    """

    name: str
    host: str
    port: int | None = None
    user: str | None = None
    key_file: str | None = None
    ssh_options: dict[str, str] = field(default_factory=dict)
    nproc: int | None = None
    gpus: int | None = None
    data_addr: str = ""
    workdir: str | None = None
    python: str = "python3"
    master: bool = False
    shared_dir: str | None = None
    spares_group: str | None = None

    def __hash__(self) -> int:
        return hash(self.name)


@dataclass(frozen=True)
class Cluster:
    """The ordered nodes of one group: node_rank follows this order."""

    source: str
    group: str
    nodes: tuple[Node, ...]

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


def parse_ssh_args(args: str) -> dict[str, str]:
    """The ``-o Key=Value`` (and ``-F``, ``-i``, ``-p``) options of an ssh command-line fragment.

    ddpfab honours the ones that matter for connecting and verifying the host
    (UserKnownHostsFile, StrictHostKeyChecking, ConnectTimeout, ...), so an inventory that works
    for Ansible works for ddpfab with the same host-key policy.
    """
    out: dict[str, str] = {}
    try:
        words = shlex.split(args or "")
    except ValueError as exc:
        raise InventoryError(f"cannot parse ansible_ssh_common_args {args!r}: {exc}") from None
    flags = {"-F": "configfile", "-i": "identityfile", "-p": "port"}
    i = 0
    while i < len(words):
        w = words[i]
        if w == "-o" and i + 1 < len(words):
            opt = words[i + 1]
            i += 2
        elif w.startswith("-o") and len(w) > 2:
            opt = w[2:]
            i += 1
        elif w in flags and i + 1 < len(words):
            out[flags[w]] = words[i + 1]
            i += 2
            continue
        else:
            i += 1
            continue
        key, sep, value = opt.partition("=")
        if not sep:
            key, _, value = opt.partition(" ")
        out[key.strip().lower()] = value.strip()
    return out


def _int_var(host: str, var: str, value: Any, minimum: int) -> int | None:
    if value is None or value == "":
        return None
    try:
        if isinstance(value, bool):
            raise ValueError
        number = int(str(value).strip())
    except ValueError:
        raise InventoryError(f"host {host}: {var} must be an integer, got {value!r}") from None
    if number < minimum:
        raise InventoryError(f"host {host}: {var} must be >= {minimum}, got {number}")
    return number


def _bool_var(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _ansible_env() -> None:
    """Make Ansible fail loudly on an inventory it cannot parse, instead of warning and going on
    with an implicit localhost (which would launch a "cluster" of one on the controller)."""
    os.environ.setdefault("ANSIBLE_INVENTORY_UNPARSED_FAILED", "true")
    os.environ.setdefault("ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED", "true")
    os.environ.setdefault("ANSIBLE_INVENTORY_ENABLED", "host_list,yaml,ini,toml,auto")
    os.environ.setdefault("ANSIBLE_LOCALHOST_WARNING", "false")
    os.environ.setdefault("ANSIBLE_DUPLICATE_YAML_DICT_KEY", "error")  # a host listed twice is an error


def load(source: str | os.PathLike, group: str = "all") -> Cluster:
    """Load the hosts of *group* from the inventory *source*, in inventory order.

    Ansible parses it; its result is kept in a cache (:mod:`ddpfab.invcache`) and reused while
    every file it read (and the Ansible settings) are unchanged: loading Ansible costs about 0.3 s
    on every command, more than the rest of a ``ddpfab exec`` on a few hosts.
    """
    from . import invcache

    path = Path(source)
    if not path.exists():
        raise InventoryError(f"inventory {path}: no such file or directory")
    _ansible_env()  # first: its settings are part of the cache key
    key = invcache.key(path, group)
    cached = invcache.get(key)
    if cached is not None:
        cluster = Cluster(source=str(path), group=group, nodes=tuple(Node(**n) for n in cached))
    else:
        cluster = _load_with_ansible(path, group)
        invcache.put(key, [dataclasses.asdict(n) for n in cluster.nodes])
    _check_ini_repeats(path)  # (on a cached load too: the cache may predate these checks)
    _check_duplicates(path, list(cluster.nodes))
    return cluster


def _load_with_ansible(path: Path, group: str) -> Cluster:
    """Ansible's InventoryManager on *path* (its settings made strict by :func:`load` first)."""
    from ansible.errors import AnsibleError
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar
    from ansible.vars.manager import VariableManager

    loader = DataLoader()
    chatter = io.StringIO()
    try:
        with contextlib.redirect_stderr(chatter), contextlib.redirect_stdout(chatter), _strict_parsing():
            inv = InventoryManager(loader=loader, sources=[str(path)])
    except AnsibleError as exc:
        detail = " ".join(str(exc).split())
        reason = _inner_reason(chatter.getvalue()) or detail
        raise InventoryError(f"inventory {path}: cannot be parsed: {reason}") from None
    if group not in inv.groups:
        known = ", ".join(sorted(inv.groups)) or "none"
        raise InventoryError(f"inventory {path}: no group {group!r} (groups: {known}); pick one with --group")
    hosts = inv.groups[group].get_hosts()
    if not hosts:
        raise InventoryError(f"inventory {path}: group {group!r} has no hosts; add hosts or pick another --group")
    vm = VariableManager(loader=loader, inventory=inv)
    nodes = []
    for h in hosts:
        raw = vm.get_vars(host=h, include_hostvars=False)
        templar = Templar(loader=loader, variables=raw)

        def var(name: str, default: Any = None, _raw: dict = raw, _t: Templar = templar) -> Any:
            if name not in _raw:
                return default
            try:
                value = _t.template(_raw[name])
            except AnsibleError as exc:
                raise InventoryError(f"host {h.name}: variable {name} cannot be templated: {exc}") from None
            return _plain(value)

        nodes.append(_make_node(h.name, var))
    masters = [n.name for n in nodes if n.master]
    if len(masters) > 1:
        raise InventoryError(f"inventory {path}: {VAR_MASTER} is set on several hosts ({', '.join(masters)}); "
                             "set it on one")
    return Cluster(source=str(path), group=group, nodes=tuple(nodes))


def _check_duplicates(path: Path, nodes: list[Node]) -> None:
    """One machine, one node: two entries that reach the same sshd would run two node ranks
    there in the same run dir (and a YAML key given twice is refused by the parser itself)."""
    seen: dict[tuple, str] = {}
    for n in nodes:
        where = (n.host, n.port or 22, n.user)
        if where in seen:
            raise InventoryError(f"inventory {path}: host {n.name} is listed twice: it reaches the same "
                                 f"{n.user + '@' if n.user else ''}{n.host}:{n.port or 22} as {seen[where]}; "
                                 "list each machine once")
        seen[where] = n.name


def _check_ini_repeats(path: Path) -> None:
    """Ansible merges a host written twice in one INI section into one (the last line's vars
    win): an error here, naming it. (YAML repeats are refused by the parser.)"""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return
    first = next((ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith(("#", ";"))), "")
    if not first.startswith("["):
        return  # not INI
    section, seen = None, set()
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith(("#", ";")):
            continue
        if text.startswith("["):
            section, seen = text, set()
            continue
        if section is None or section.endswith((":vars]", ":children]")):
            continue
        host = text.split()[0]
        if host in seen:
            raise InventoryError(f"inventory {path}, line {number}: host {host} is listed twice in {section}; "
                                 "list each host once (Ansible would merge the two silently)")
        seen.add(host)


@contextlib.contextmanager
def _strict_parsing():
    """The same settings as :func:`_ansible_env`, on Ansible's constants themselves: when ansible
    was imported before (a playbook run, a plugin, a test) the environment is read already."""
    from ansible import constants as C

    wanted = {"INVENTORY_UNPARSED_IS_FAILED": True, "INVENTORY_ANY_UNPARSED_IS_FAILED": True,
              "DUPLICATE_YAML_DICT_KEY": "error",
              "INVENTORY_ENABLED": ["host_list", "yaml", "ini", "toml", "auto"]}
    saved = {k: getattr(C, k) for k in wanted if hasattr(C, k)}
    for k, v in wanted.items():
        setattr(C, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(C, k, v)


def _inner_reason(chatter: str) -> str:
    lines = [ln.strip() for ln in chatter.splitlines() if ln.strip()]
    for ln in lines:
        if "Failed to parse" in ln or "not in the expected format" in ln or "Invalid" in ln:
            return ln.removeprefix("[WARNING]:").strip()
    return ""


def _plain(value: Any) -> Any:
    """Ansible's tagged values as plain Python types (for JSON and equality)."""
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _make_node(name: str, var) -> Node:
    if not _SAFE_NAME.fullmatch(name):
        raise InventoryError(f"host {name!r}: the name has characters a host name cannot have; "
                             "use letters, digits, '.', '-' or '_' and put the address in ansible_host")
    host = str(var("ansible_host", None) or var("ansible_ssh_host", None) or name)
    port = _int_var(name, "ansible_port", var("ansible_port", var("ansible_ssh_port")), 1)
    if port is not None and port > 65535:
        raise InventoryError(f"host {name}: ansible_port must be 1-65535, got {port}")
    user = var("ansible_user", var("ansible_ssh_user"))
    key_file = var("ansible_ssh_private_key_file", var("ansible_private_key_file"))
    ssh_options: dict[str, str] = {}
    for ssh_var in ("ansible_ssh_common_args", "ansible_ssh_extra_args"):
        value = var(ssh_var, "") or ""
        if not isinstance(value, str):
            raise InventoryError(f"host {name}: {ssh_var} must be a string of ssh options, got {value!r}")
        ssh_options.update(parse_ssh_args(value))
    data_addr = str(var(VAR_DATA_ADDR, None) or host)
    _check_address(name, VAR_DATA_ADDR, data_addr)
    _check_address(name, "ansible_host", host)
    workdir = var(VAR_WORKDIR, None)
    if workdir is not None and not str(workdir).startswith(("/", "~")):
        raise InventoryError(f"host {name}: {VAR_WORKDIR} must be an absolute path, got {workdir!r}")
    shared_dir = var(VAR_SHARED_DIR, None)
    if shared_dir is not None and not str(shared_dir).startswith("/"):
        raise InventoryError(f"host {name}: {VAR_SHARED_DIR} must be an absolute path, got {shared_dir!r}")
    return Node(
        name=name,
        host=host,
        port=port,
        user=str(user) if user else None,
        key_file=os.path.expanduser(str(key_file)) if key_file else None,
        ssh_options=ssh_options,
        nproc=_int_var(name, VAR_NPROC, var(VAR_NPROC), 1),
        gpus=_int_var(name, VAR_GPUS, var(VAR_GPUS), 0),
        data_addr=data_addr,
        workdir=str(workdir) if workdir else None,
        python=str(var(VAR_PYTHON, None) or "python3"),
        master=_bool_var(var(VAR_MASTER, False)),
        shared_dir=str(shared_dir) if shared_dir else None,
        spares_group=str(var(VAR_SPARES, None) or "") or None,
    )


def _check_address(host: str, var: str, value: str) -> None:
    """An address is an IP literal or a DNS name; anything else would end up in a shell or argv."""
    try:
        ipaddress.ip_address(value)
        return
    except ValueError:
        pass
    if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9\-_.]*[A-Za-z0-9])?", value):
        raise InventoryError(f"host {host}: {var} {value!r} is neither an IP address nor a host name")
