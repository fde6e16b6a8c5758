"""Read the cluster from a standard Ansible inventory, with Ansible's own inventory API.

Why Ansible's API and not a YAML parser: users already keep their hosts in Ansible inventories
(YAML or INI, groups, ``node[1:4]`` ranges, group_vars/host_vars, templated vars), and the
provisioning playbooks read the same file. One reader means one meaning.

The result is a :class:`Inventory`: plain data, no Ansible objects, so the plan stays pure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import ipaddress
import json
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpfab.version import __version__
from ddpfab.hostlist import compact
from ddpfab.hosts import invcache, nodeenv
from ddpfab.hosts.invcache import cache_dir
from ddpfab.hosts.suggest import close_matches, did_you_mean, files_like
from ddpfab.optionnames import option
from ddpfab.problems import DdpfabError, Problem

#: ddpfab's own inventory variables; each is documented in inventory/example.yml.
VAR_NPROC = "ddpfab_nproc_per_node"
VAR_GPUS = "ddpfab_gpus"
VAR_DATA_ADDR = "ddpfab_data_addr"
VAR_WORKDIR = "ddpfab_workdir"
VAR_PYTHON = "ddpfab_python"
VAR_MASTER = "ddpfab_master"
VAR_SHARED_DIR = "ddpfab_shared_dir"
VAR_SPARES = "ddpfab_spares_group"
VAR_ENV = "ddpfab_env"
VAR_GPU_IDS = "ddpfab_gpu_ids"
VAR_REPLICATE = "ddpfab_replicate"
VAR_SECRET_ENV = "ddpfab_secret_env"
VAR_SETUP = "ddpfab_setup"
VAR_CONDA_ENV = "ddpfab_conda_env"
#: Every ``VAR_*`` above: what ddpfab itself reads from a host's variables.
OWN_VARS = frozenset({VAR_NPROC, VAR_GPUS, VAR_DATA_ADDR, VAR_WORKDIR, VAR_PYTHON, VAR_MASTER, VAR_SHARED_DIR,
                      VAR_SPARES, VAR_ENV, VAR_GPU_IDS, VAR_REPLICATE, VAR_SECRET_ENV, VAR_SETUP, VAR_CONDA_ENV})
#: The provisioning playbooks and roles: their variables share the ``ddpfab_`` prefix.
ANSIBLE_DIR = Path(__file__).resolve().parent.parent / "ansible"

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RANGE = re.compile(r"\[([^\[\]]*)\]")
_HOST_WORD = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
#: generated inventories (from host lists and hostfiles) are kept at most this many
_MAX_GENERATED = 64


class InventoryError(DdpfabError):
    """The inventory cannot be used; the message names the file or host and what to fix."""

    check = "inventory"


#: The endings of inventory files' names (no host name ends so): a missing ``lab.yml`` is no single host.
INVENTORY_SUFFIXES = (".yml", ".yaml", ".ini", ".json", ".cfg", ".txt", ".hosts")


class InventoryMissing(InventoryError):
    """The inventory named is no file, directory, hostfile or host list."""


@dataclass(frozen=True)
class Node:
    """One host of the cluster, as the inventory describes it.

    Args:
        name: the inventory hostname.
        host: where SSH connects (``ansible_host``, else the name).
        port: SSH port (``ansible_port``), None for the default.
        user: SSH user (``ansible_user``), None for the current user / ssh_config.
        key_file: private key (``ansible_ssh_private_key_file``).
        ssh_options: the ssh options of ``ansible_ssh_args``/``_common_args``/``_extra_args``, keys
            lower-cased, the first value of each (OpenSSH's rule); ``identityfile`` a list of all.
        nproc: processes per node (``ddpfab_nproc_per_node``), None to decide later (GPUs or 1).
        gpus: GPUs the host is expected to have (``ddpfab_gpus``), None if not stated.
        data_addr: the address peers use for training traffic (``ddpfab_data_addr``, else ``host``).
        workdir: remote working dir (``ddpfab_workdir``), None for the controller's cwd.
        python: the node's python with torch (``ddpfab_python``); without it the node chooses
            (:mod:`ddpfab.hosts.nodeenv`: an env the setup activated, the provisioned venv, python3).
        python_from: where *python* came from (:data:`ddpfab.hosts.nodeenv.SOURCES`): "inventory" for
            an explicit ``ddpfab_python``, after the probe the node's choice; "" while the node is
            to choose (an inventory without ``ddpfab_python``). A Node made in code without it
            runs *python* as given ("default").
        setup: shell lines run before anything ddpfab starts there (``ddpfab_setup``, then the
            activation of ``ddpfab_conda_env``).
        conda_env: the conda env (a name or a path) activated there (``ddpfab_conda_env``).
        master: this node hosts the rendezvous (``ddpfab_master``).
        shared_dir: a directory every node sees with the same content (NFS and the like;
            ``ddpfab_shared_dir``), used for the file:// init method; None if not set.
        spares_group: the inventory group whose hosts stand by to replace a lost node
            (``ddpfab_spares_group``; ``ddpfab run --spares`` wins); None if not set.
        env: environment for this node's ranks (``ddpfab_env``, a mapping; Ansible's precedence:
            the host's value replaces its group's whole). The command line's --env wins over it.
        gpu_ids: the GPUs this node's ranks may use (``ddpfab_gpu_ids``, a list of indexes or
            UUIDs): CUDA_VISIBLE_DEVICES, and nproc defaults to its length. None: all.
        replicate: files of the workdir that ``ddpfab run`` copies from rank 0's node to the other
            nodes before the launch (``ddpfab_replicate``, a list; ``--replicate`` adds to it).
        secret_env: env keys whose values are masked wherever shown or recorded, on top of
            :mod:`ddpfab.masking`'s rule (``ddpfab_secret_env``, a list of keys).
        unknown_vars: the host's ``ddpfab_*`` variables that neither ddpfab nor its playbooks and
            roles read: likely typos (:func:`unknown_var_warnings`), which have no effect.
    """

    name: str
    host: str
    port: int | None = None
    user: str | None = None
    key_file: str | None = None
    ssh_options: dict[str, Any] = field(default_factory=dict)
    nproc: int | None = None
    gpus: int | None = None
    data_addr: str = ""
    workdir: str | None = None
    python: str = "python3"
    python_from: str = "default"
    setup: tuple[str, ...] = ()
    conda_env: str | None = None
    master: bool = False
    shared_dir: str | None = None
    spares_group: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    gpu_ids: tuple[str, ...] | None = None
    replicate: tuple[str, ...] = ()
    secret_env: tuple[str, ...] = ()
    unknown_vars: tuple[str, ...] = ()

    def __hash__(self) -> int:
        return hash(self.name)


@dataclass(frozen=True)
class Inventory:
    """The ordered nodes of one group: node_rank follows this order.

    Args:
        source: the inventory as shown (several ``-i`` joined by `` + ``).
        group: the group whose hosts these are.
        nodes: in inventory order.
        sources: what was given to ``-i``, in order (:func:`load` takes it back); () when made by hand.
    """

    source: str
    group: str
    nodes: tuple[Node, ...]
    sources: tuple[str, ...] = ()

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)

    @property
    def warnings(self) -> list[str]:
        """What the inventory says that has no effect (:func:`unknown_var_warnings`): every
        command that loads it shows these, the run going ahead."""
        return unknown_var_warnings(self)


def known_vars() -> frozenset[str]:
    """The ``ddpfab_*`` names ddpfab reads (:data:`OWN_VARS`) or its playbooks, roles and their
    plugins mention (options in argument_specs, defaults, facts they set): a name outside these set
    on a host is read by nothing. Read once per process, and only when a host sets a name
    outside :data:`OWN_VARS`."""
    global _KNOWN_VARS
    if _KNOWN_VARS is None:
        found = set(OWN_VARS)
        for path in ANSIBLE_DIR.rglob("*"):
            if path.suffix in (".yml", ".yaml", ".py", ".j2", ".cfg") and path.is_file():
                found.update(re.findall(r"\bddpfab_[a-z0-9_]+", path.read_text(errors="replace")))
        _KNOWN_VARS = frozenset(found)
    return _KNOWN_VARS


_KNOWN_VARS: frozenset[str] | None = None


def unknown_vars(names) -> tuple[str, ...]:
    """Of a host's variable *names*, the ``ddpfab_*`` ones nothing reads (:func:`known_vars`)."""
    maybe = [n for n in names if isinstance(n, str) and n.startswith("ddpfab_") and n not in OWN_VARS]
    return tuple(sorted(n for n in maybe if n not in known_vars())) if maybe else ()


def unknown_var_warnings(cluster: Inventory) -> list[str]:
    """One line per unknown ``ddpfab_*`` variable of *cluster*'s nodes: which hosts set it, the
    variable it likely meant, that it has no effect. A warning, not a refusal: a user's own
    variables may share the prefix."""
    hosts: dict[str, list[str]] = {}
    for n in cluster.nodes:
        for var in n.unknown_vars:
            hosts.setdefault(var, []).append(n.name)
    lines = []
    for var, names in hosts.items():
        where = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        best = close_matches(var, known_vars(), n=1)  # the one it likely meant; three read as a menu
        lines.append(f"inventory {cluster.source}: {var} (set for {where}) is not a variable ddpfab or its "
                     f"roles read{f' (did you mean {best[0]}?)' if best else ''}; it has no effect")
    return lines


#: The inventory vars that carry ssh options, in the order Ansible's ssh connection puts them on
#: the command line (ansible.cfg's ssh_args first); all of them mean the same in every path.
SSH_ARG_VARS = ("ansible_ssh_args", "ansible_ssh_common_args", "ansible_ssh_extra_args")
#: ssh flags that change nothing about where or how ddpfab connects (quiet, no tty, no X11, no stdin).
_NO_OP_FLAGS = ("-q", "-T", "-x", "-n")


def parse_ssh_args(args: str, var: str = "ansible_ssh_common_args") -> dict[str, Any]:
    """The ``-o Key=Value`` (and ``-F``, ``-i``, ``-p``, ``-l``, ``-J``, ``-C``) options of an ssh command-line fragment.

    ddpfab honours the ones that matter for connecting and verifying the host
    (UserKnownHostsFile, StrictHostKeyChecking, ConnectTimeout, ...), so an inventory that works
    for Ansible works for ddpfab with the same host-key policy.
    """
    out: dict[str, str] = {}
    try:
        words = shlex.split(args or "")
    except ValueError as exc:
        raise InventoryError(f"cannot parse {var} {args!r}: {exc}") from None
    flags = {"-F": "configfile", "-i": "identityfile", "-p": "port", "-J": "proxyjump", "-l": "user"}
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
            _add_option(out, flags[w], words[i + 1])
            i += 2
            continue
        elif w[:2] in flags and len(w) > 2:  # -p2222, -Jbastion
            _add_option(out, flags[w[:2]], w[2:])
            i += 1
            continue
        elif w == "-C":
            _add_option(out, "compression", "yes")
            i += 1
            continue
        elif w in _NO_OP_FLAGS:
            i += 1
            continue
        else:
            # an ssh flag ddpfab would not apply the same way in every path: never dropped silently
            raise InventoryError(f"{var} {args!r}: ssh flag {w!r} is not supported by ddpfab; "
                                 "use -o Option=value (see ddpfab/remote/target.py OPTIONS), -F, -i, -p, -l or -J")
        key, sep, value = opt.partition("=")
        if not sep:
            key, _, value = opt.partition(" ")
        _add_option(out, key.strip().lower(), value.strip())
    return out


def _add_option(options: dict, key: str, value) -> None:
    """Add an ssh option as OpenSSH does: the first value wins, IdentityFile (a list) collects all."""
    if key == "identityfile":
        options.setdefault(key, []).extend(value if isinstance(value, list) else [value])
    else:
        options.setdefault(key, value)


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


#: at most this many hosts from one range entry (a typo like ``n[1:1000000]`` is not a cluster)
MAX_RANGE_HOSTS = 100_000
_USER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
#: ``[v6]`` or ``[v6]:port`` (ssh's and Ansible's way to give an IPv6 literal a port)
_BRACKETED_V6 = re.compile(r"^\[(?P<addr>[0-9A-Fa-f:.]+(?:%[A-Za-z0-9_.\-]+)?)\](?::(?P<port>\d+))?$")
#: a ``slots=``/``max_slots=`` word: what makes a file a DeepSpeed/MPI hostfile
_SLOTS_WORD = re.compile(r"(?:^|\s)(?:max_)?slots\s*=", re.MULTILINE)


def expand_ranges(word: str) -> list[str]:
    """The host names of one host pattern: Ansible's ranges as Ansible's own expander reads them
    (``node[01:04]``, ``node[1:10:3]``, ``node[a:c]``) and pdsh's (``node[01-04]``, ``n[1-2,5]``,
    zero padding kept); several brackets multiply."""
    m = _RANGE.search(word)
    if not m:
        return [word]
    head, inner, tail = word[:m.start()], m.group(1), word[m.end():]
    items = _ansible_range(word, inner) if ":" in inner else _pdsh_range(word, inner)
    return [name for item in items for name in expand_ranges(head + item + tail)]


def _ansible_range(word: str, inner: str) -> list[str]:
    """``[beg:end]`` / ``[beg:end:step]`` by Ansible's expander (imported only for these: 0.4 s)."""
    bounds = inner.split(":")
    numeric = [b.strip() for b in bounds]
    if len(bounds) in (2, 3) and all(b.isdigit() for b in numeric if b) and numeric[1]:
        step = int(numeric[2]) if len(bounds) == 3 and numeric[2] else 1
        if step < 1:
            raise InventoryError(f"host range {word!r}: step {numeric[2]} must be >= 1")
        if (int(numeric[1]) - int(numeric[0] or 0)) // step >= MAX_RANGE_HOSTS:
            raise InventoryError(f"host range {word!r} makes more than {MAX_RANGE_HOSTS} hosts; check the bounds")
    from ansible.errors import AnsibleError
    from ansible.plugins.inventory import expand_hostname_range

    try:
        items = list(expand_hostname_range(f"[{inner}]"))
    except (AnsibleError, ValueError) as exc:
        reason = str(exc) if isinstance(exc, AnsibleError) else "bounds must be numbers or single letters"
        raise InventoryError(f"host range {word!r}: {reason} (Ansible's [beg:end] or [beg:end:step], like "
                             "[01:04], [1:10:3] or [a:c]; pdsh's [01-04] or [1-2,5])") from None
    if not items:
        raise InventoryError(f"host range {word!r} makes no host: it counts down; write [end:beg] the other way round")
    return items


def _pdsh_range(word: str, inner: str) -> list[str]:
    items: list[str] = []
    for part in inner.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise InventoryError(f"host range {word!r}: expected digits like [01-04] or [1,3,5] (pdsh), or "
                                 f"Ansible's [01:04], [1:10:3], [a:c]; found [{inner}]")
        if not sep:
            items.append(lo)
            continue
        if int(hi) < int(lo):
            raise InventoryError(f"host range {word!r}: {lo}-{hi} counts down; write [{hi}-{lo}]")
        if int(hi) - int(lo) >= MAX_RANGE_HOSTS:
            raise InventoryError(f"host range {word!r} makes more than {MAX_RANGE_HOSTS} hosts; check the bounds")
        width = len(lo) if lo.startswith("0") else 0
        items += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    return items


def is_hostfile(text: str) -> bool:
    """Whether *text* is a DeepSpeed/MPI hostfile: some line has a ``slots=`` word, and nothing in
    it is INI (a ``[section]``) or YAML (``key:``). Any slots word decides, so a broken hostfile
    (``slots=four``) is refused as a hostfile, never read as an INI inventory of odd variables."""
    if not _SLOTS_WORD.search("\n".join(line.split("#", 1)[0] for line in text.splitlines())):
        return False
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if words and (words[0].startswith(("[", "-", "{")) or words[0].endswith(":")):
            return False
    return True


def parse_hostfile(text: str, source: str = "hostfile") -> list[tuple[str, int | None]] | None:
    """The (host, slots) of a DeepSpeed/MPI hostfile, or None when *text* is not one (:func:`is_hostfile`).

    One ``host [slots=N] [max_slots=M]`` per line (``#`` comments, blank lines); N >= 1; each host
    once. *source* names the file in errors, as ``source:line``.

    Raises:
        InventoryError: a hostfile with a line that is not one of these.
    """
    if not is_hostfile(text):
        return None
    hosts: list[tuple[str, int | None]] = []
    first_line: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = re.sub(r"\s*=\s*", "=", raw.split("#", 1)[0].strip())
        if not line:
            continue
        where = f"{source}:{number}"
        host, *words = line.split()
        if not _is_host_word(host):
            raise InventoryError(f"{where}: {host!r} is not a host name (letters, digits, '.', '-', '_') or an "
                                 "IP address; a hostfile line is `host slots=N`")
        if host in first_line:
            raise InventoryError(f"{where}: host {host} is listed again (first on line {first_line[host]}); "
                                 "list each host once, with all its slots")
        first_line[host] = number
        values: dict[str, int] = {}
        for w in words:
            key, sep, value = w.partition("=")
            if not sep or key not in ("slots", "max_slots"):
                raise InventoryError(f"{where}: {w!r} after host {host}: a hostfile line is `host slots=N` "
                                     "(max_slots=M allowed); put other settings in an Ansible inventory")
            if key in values:
                raise InventoryError(f"{where}: {key} given twice for host {host}")
            if not value.isdigit():
                raise InventoryError(f"{where}: {key}={value!r} for host {host} is not a whole number; "
                                     f"write {key}=N with N the processes on that host, e.g. {key}=4")
            if int(value) < 1:
                raise InventoryError(f"{where}: {key}={value} for host {host}: a host needs at least one slot; "
                                     "remove the line to leave the host out")
            values[key] = int(value)
        if "slots" in values and "max_slots" in values and values["slots"] > values["max_slots"]:
            raise InventoryError(f"{where}: slots={values['slots']} exceeds max_slots={values['max_slots']} "
                                 f"for host {host}")
        hosts.append((host, values.get("slots")))
    return hosts or None


def _split_list(source: str) -> list[str]:
    """The entries of a host list: split on commas outside brackets (``n[1,3],m``)."""
    words, depth, cur = [], 0, ""
    for ch in source:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            words.append(cur.strip())
            cur = ""
        else:
            cur += ch
    words.append(cur.strip())
    return [w for w in words if w]


def host_entry(entry: str, source: str = "") -> list[tuple[str, dict[str, Any]]]:
    """The hosts of one host-list entry with their connection vars: ``[user@]pattern[:port]``, where
    pattern is a name, an IP (IPv6 as ``[v6]:port``) or a range (:func:`expand_ranges`); the user
    and port become the hosts' ``ansible_user`` and ``ansible_port`` (pdsh's and ssh's habits)."""
    where = f"host list {source!r}: entry {entry!r}" if source else f"host entry {entry!r}"
    user, at, rest = entry.rpartition("@")
    host_vars: dict[str, Any] = {}
    if at:
        if not _USER.fullmatch(user):
            raise InventoryError(f"{where}: {user!r} is not a user name (letters, digits, '.', '-', '_')")
        host_vars["ansible_user"] = user
    port = None
    v6 = _BRACKETED_V6.fullmatch(rest)
    if v6 and _is_ip(v6.group("addr")):
        pattern, port = v6.group("addr"), v6.group("port")
    elif _is_ip(rest):
        pattern = rest  # an IPv6 literal without brackets has no port
    else:
        pattern, port = rest, None
        outside = _RANGE.sub("", rest)
        if ":" in outside:
            pattern, _, port = rest.rpartition(":")
            if ":" in _RANGE.sub("", pattern):
                raise InventoryError(f"{where}: an IPv6 address with a port is written [ADDR]:PORT")
    if port is not None:
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise InventoryError(f"{where}: port {port!r} must be a number in 1-65535")
        host_vars["ansible_port"] = int(port)
    names = [pattern] if _is_ip(pattern) else expand_ranges(pattern)
    for name in names:
        if not _is_host_word(name):
            raise InventoryError(f"{where}: {name!r} is not a host name (letters, digits, '.', '-', '_') or an "
                                 "IP address; write [user@]host[:port], and other settings in an inventory file")
    return [(name, dict(host_vars)) for name in names]


def _is_host_word(word: str) -> bool:
    """Whether *word* names one host in a host list or a hostfile: a host name or an IP literal."""
    return _is_ip(word) or bool(_HOST_WORD.fullmatch(word))


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def _is_host_list(source: str) -> bool:
    """Whether *source* (not a path) is a host list: a comma, or a range."""
    return "," in source or bool(_RANGE.search(source))


def _host_list(source: str) -> list[tuple[str, dict[str, Any]]]:
    """The (name, vars) of an Ansible-style host list (``a,b,``, ``a,``, with ranges, ``user@host``,
    ``host:port``)."""
    hosts = [h for entry in _split_list(source) for h in host_entry(entry, source)]
    if not hosts:
        raise InventoryError(f"host list {source!r} names no hosts")
    names = [name for name, _ in hosts]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise InventoryError(f"host list {source!r} names {', '.join(dup)} more than once; list each host once")
    return hosts


def _generated_dir() -> Path:
    return cache_dir().parent / "generated"


def _host_list_file(source: str) -> Path:
    """Where the generated inventory of host list *source* is kept: named by the list's text and
    what expands it (ddpfab's cache format and version, ansible-core's version), so a later
    command finds it without expanding again (Ansible's range expander costs a 0.4 s import)."""
    ident = json.dumps([invcache.FORMAT, __version__, invcache.ansible_version(), source])
    return _generated_dir() / f"list-{hashlib.sha256(ident.encode()).hexdigest()[:24]}.yml"


def _generated(kind: str, hosts: list[tuple[str, dict[str, Any]]], path: Path | None = None) -> str:
    """A YAML inventory for *hosts* (name, vars) in a private cache dir, at *path* or named by its content."""
    body = {"all": {"hosts": {name: (host_vars or None) for name, host_vars in hosts}}}
    text = f"# generated by ddpfab from a {kind}\n" + json.dumps(body, indent=1) + "\n"
    d = _generated_dir()
    path = path or d / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.yml"
    if not path.is_file():
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, path)
        for old in sorted(d.glob("*.yml"), key=lambda e: e.stat().st_mtime)[:-_MAX_GENERATED]:
            old.unlink(missing_ok=True)
    return str(path)


def ansible_source(source: str) -> str:
    """What Ansible's ``-i`` gets for ddpfab's *source*: an inventory file or dir as it is, a
    DeepSpeed/MPI hostfile or a host list (ranges, ``user@host:port``) as a generated YAML inventory.

    Raises:
        InventoryError: *source* is none of these, or a hostfile or host list with a mistake.
    """
    path = Path(os.path.expanduser(source))
    if path.is_file():
        try:
            # utf-8-sig: a BOM (Windows editors write one) is no part of the first host
            head = path.read_text(encoding="utf-8-sig", errors="replace")[:1 << 20]
        except OSError as exc:
            raise InventoryError(f"inventory {source}: {exc.strerror}") from None
        slots = parse_hostfile(head, source)
        if not slots:
            return str(path)
        return _generated(f"hostfile {path.resolve()}", [(h, {VAR_NPROC: n} if n else {}) for h, n in slots])
    if path.exists():
        return str(path)
    if _is_host_list(source):
        known = _host_list_file(source)
        if known.is_file():  # expanded and checked before
            return str(known)
        return _generated(f"host list {source}", _host_list(source), known)
    near = files_like(path.name, str(path.parent)) if "." in path.name or "/" in source else ""
    if near:  # a mistyped file name first: it is what a name with a dot or a slash usually is
        raise InventoryMissing(f"inventory {source}: no such file or directory{near}")
    hint = f"; for a single host write {source},  (a host list ends with a comma)" \
        if _is_host_entry(source) and path.suffix.lower() not in INVENTORY_SUFFIXES else ""
    raise InventoryMissing(f"inventory {source}: no such file or directory{hint}")


def _is_host_entry(word: str) -> bool:
    """Whether *word* would be a host-list entry (``node1``, ``root@node1:2222``) with a comma after it."""
    try:
        return bool(host_entry(word))
    except InventoryError:
        return False


def sources_of(source: str | os.PathLike | list | tuple) -> list[str]:
    """*source* as the list of ``-i`` values it stands for (a repeated ``-i`` gives several)."""
    items = [source] if isinstance(source, (str, os.PathLike)) else list(source or ())
    if not items:
        raise InventoryError("no inventory given")
    return [str(s) for s in items]


def limit_patterns(limit: str | None) -> list | None:
    """What *limit* selects, as data for the cache key: its comma-separated parts, each ``@FILE``
    (Ansible's ``--limit @retry_file``) replaced by the file's patterns, one a line (Ansible applies
    them; this reads them first to key on their content and to name a bad line)."""
    if not limit:
        return None
    out: list = []
    for part in limit.split(","):
        if not part.startswith("@"):
            out.append(part)
            continue
        name = part[1:]
        try:
            # utf-8-sig: a byte-order mark (an editor on Windows) is not part of the first pattern
            lines = Path(name).read_text(encoding="utf-8-sig").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or "not a text file"
            raise InventoryError(f"{option('limit', part)}: {reason}; {option('limit', '@FILE')} reads one host "
                                 "pattern a line") from None
        patterns = []
        for number, line in enumerate(lines, 1):
            text = line.strip()
            if text and (any(ch.isspace() for ch in text) or "," in text):
                raise InventoryError(f"{option('limit', part)}: {name}:{number}: {text!r} is not one host pattern; "
                                     "write one pattern a line")
            if text:
                patterns.append(text)
        if not patterns:
            raise InventoryError(f"{option('limit', part)}: {name} names no host pattern; write one pattern a line")
        out.append(patterns)
    return out


def parse_extra_vars(items) -> dict[str, Any]:
    """Ansible's ``-e`` values merged in order: ``KEY=VALUE ...``, a JSON/YAML mapping, ``@file``,
    or an already parsed mapping (from the project config)."""
    out: dict[str, Any] = {}
    for item in items or ():
        if isinstance(item, dict):
            out.update(item)
            continue
        text = str(item).strip()
        if text.startswith("@"):
            try:
                text = Path(os.path.expanduser(text[1:])).read_text(encoding="utf-8")
            except OSError as exc:
                raise InventoryError(f"-e {item}: {exc.strerror}") from None
            value = _yaml_mapping(text, item)
        elif text.startswith(("{", "[")):
            value = _yaml_mapping(text, item)
        else:
            from ansible.parsing.splitter import parse_kv

            try:
                value = parse_kv(text)
            except Exception as exc:  # noqa: BLE001 - Ansible's parser raises several kinds
                raise InventoryError(f"-e {item!r}: {exc}") from None
            # Ansible's own reading: quotes group (key='a b c' is one value); words without '=' are left over
            bad = str(value.pop("_raw_params", "")).split()
            if bad or not value:
                raise InventoryError(f"-e {item!r}: expected KEY=VALUE (or JSON, or @file), found {bad[0] if bad else text!r}")
        out.update(value)
    return out


def _yaml_mapping(text: str, item: Any) -> dict[str, Any]:
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InventoryError(f"-e {item}: not YAML/JSON: {' '.join(str(exc).split())}") from None
    if not isinstance(value, dict):
        raise InventoryError(f"-e {item}: expected a mapping of variables, found {type(value).__name__}")
    return value


def load(source: str | os.PathLike | list | tuple, group: str = "all", limit: str | None = None,
         extra_vars=()) -> Inventory:
    """Load the hosts of *group* from the inventory *source*, in inventory order.

    Args:
        source: an inventory file or dir, a host list (``a,b,``), ranges or a hostfile
            (:func:`ansible_source`); or a list of them (a repeated ``-i``), merged in order as
            Ansible merges its sources.
        group: the group whose hosts are the nodes.
        limit: an Ansible host pattern, or ``@FILE`` of patterns (:func:`limit_patterns`); only the
            group's hosts it matches are kept (in order).
        extra_vars: ``-e`` values (:func:`parse_extra_vars`), over every host's variables.

    Ansible parses it; its result is kept in a cache (:mod:`ddpfab.hosts.invcache`) and reused while
    every file it read (and the Ansible settings) are unchanged: loading Ansible costs about 0.3 s
    on every command, more than the rest of a ``ddpfab exec`` on a few hosts.
    """
    group = group or "all"
    sources = sources_of(source)
    paths = [Path(ansible_source(s)) for s in sources]
    shown = " + ".join(sources)
    limit_key = limit_patterns(limit)  # an @FILE's patterns are the key, not its name
    extra = parse_extra_vars(extra_vars) if extra_vars else {}
    _ansible_env()  # first: its settings are part of the cache key
    selection = json.dumps([group, limit_key, extra], sort_keys=True, default=str)
    key = invcache.key(paths, selection if (limit or extra) else group)
    cached = invcache.get(key)
    if cached is not None:
        nodes = tuple(_node_from_cache(n) for n in cached)
    else:
        nodes = _load_with_ansible(paths, group, limit, extra, shown, limit_key).nodes
        invcache.put(key, [dataclasses.asdict(n) for n in nodes])
    for path in paths:
        _check_ini_repeats(path)  # (on a cached load too: the cache may predate these checks)
    _check_duplicates(shown, list(nodes))
    return Inventory(source=shown, group=group, nodes=nodes, sources=tuple(sources))


def _node_from_cache(data: dict) -> Node:
    if data.get("gpu_ids") is not None:
        data = {**data, "gpu_ids": tuple(data["gpu_ids"])}
    data = {**data, "replicate": tuple(data.get("replicate") or ()), "setup": tuple(data.get("setup") or ()),
            "unknown_vars": tuple(data.get("unknown_vars") or ())}
    if data.get("secret_env") is not None:
        data = {**data, "secret_env": tuple(data["secret_env"])}
    return Node(**data)


def _load_with_ansible(paths: list[Path], group: str, limit: str | None = None,
                       extra: dict[str, Any] | None = None, shown: str | None = None,
                       limit_key: list | None = None) -> Inventory:
    """Ansible's InventoryManager on *paths*, merged in order (its settings made strict by
    :func:`load` first); messages name *shown* (what the user gave: host lists, hostfiles).
    *limit_key* (:func:`limit_patterns`) is what Ansible applies: an ``@FILE`` is read once, by
    ddpfab, and each of its patterns must match a host (a typo in a file is not dropped silently)."""
    from ansible.parsing.dataloader import DataLoader
    from ansible.vars.manager import VariableManager

    where = shown or " + ".join(map(str, paths))
    loader = DataLoader()
    chatter = io.StringIO()
    inv = _parse_sources(loader, paths, where, chatter)
    hosts = _group_hosts(inv, group, where)
    if limit:
        hosts = _limited_hosts(inv, hosts, group, limit, limit_key, where, chatter)
    vm = VariableManager(loader=loader, inventory=inv)
    nodes = [_host_node(loader, vm, h, extra) for h in hosts]
    masters = [n.name for n in nodes if n.master]
    if len(masters) > 1:
        raise InventoryError(f"inventory {where}: {VAR_MASTER} is set on several hosts ({', '.join(masters)}); "
                             "set it on one")
    return Inventory(source=where, group=group, nodes=tuple(nodes))


def _parse_sources(loader: Any, paths: list[Path], where: str, chatter: io.StringIO) -> Any:
    """Ansible's InventoryManager on *paths*, its messages kept in *chatter*: a parse failure is
    an InventoryError naming the file, line and column Ansible's own messages point at."""
    from ansible.errors import AnsibleError
    from ansible.inventory.manager import InventoryManager

    try:
        with contextlib.redirect_stderr(chatter), contextlib.redirect_stdout(chatter), _strict_parsing():
            return InventoryManager(loader=loader, sources=[str(p) for p in paths])
    except AnsibleError as exc:
        detail = " ".join(str(exc).split())
        reason = _inner_reason(chatter.getvalue()) or detail
        raise InventoryError(f"inventory {where}: cannot be parsed: {reason}") from None


def _group_hosts(inv: Any, group: str, where: str) -> list:
    """The hosts of *group* in inventory order; a group that is missing (with the close names)
    or empty is an InventoryError, since there would be nothing to run on."""
    if group not in inv.groups:
        known = ", ".join(sorted(inv.groups)) or "none"
        raise InventoryError(f"inventory {where}: no group {group!r}{did_you_mean(group, inv.groups)} "
                             f"(groups: {known}); pick one with {option('group')}")
    hosts = inv.groups[group].get_hosts()
    if not hosts:
        raise InventoryError(f"inventory {where}: group {group!r} has no hosts; add hosts or pick another "
                             f"{option('group')}")
    return hosts


def _limited_hosts(inv: Any, hosts: list, group: str, limit: str, limit_key: list | None, where: str,
                   chatter: io.StringIO) -> list:
    """The *hosts* that ``--limit`` keeps (in order), as Ansible's own subset matches them. An
    ``@FILE`` pattern that matches no host, or a limit that keeps none of the group, is an
    InventoryError with close names: a typo would otherwise run on fewer nodes or none."""
    from ansible.errors import AnsibleError

    with contextlib.redirect_stderr(chatter), contextlib.redirect_stdout(chatter):
        try:  # Ansible's --limit itself: patterns, and @FILE's patterns as read by limit_patterns
            for part in limit_key or [limit]:
                for pattern in part if isinstance(part, list) else ():
                    if pattern[0] not in "!&" and not inv.get_hosts(pattern=pattern):
                        raise InventoryError(
                            f"{option('limit', limit)}: the pattern {pattern!r} of that file matches no host in "
                            f"{where}{did_you_mean(pattern, [*inv.hosts, *inv.groups])}") from None
            inv.subset([p for part in (limit_key or [limit]) for p in (part if isinstance(part, list) else [part])])
            matched = {h.name for h in inv.get_hosts(pattern="all")}
        except AnsibleError as exc:
            raise InventoryError(f"{option('limit', limit)}: {' '.join(str(exc).split())}") from None
        finally:
            inv.subset(None)
    kept = [h for h in hosts if h.name in matched]
    if not kept:
        words = [w.lstrip("!&") for w in re.split(r"[:,]", limit) if w.strip("!&")]
        hints = "".join(did_you_mean(w, [*inv.hosts, *inv.groups]) for w in words
                        if w not in inv.hosts and w not in inv.groups)
        raise InventoryError(f"{option('limit', limit)} matches no host of group {group!r} in {where}{hints}; "
                             f"its hosts: {compact([h.name for h in hosts])}")
    return kept


def _host_node(loader: Any, vm: Any, host: Any, extra: dict[str, Any] | None) -> Node:
    """The Node of one Ansible host: its variables (``-e`` over them), each templated only when
    :func:`_make_node` reads it, so a broken template in a variable ddpfab ignores does no harm."""
    from ansible.errors import AnsibleError
    from ansible.template import Templar

    raw = vm.get_vars(host=host, include_hostvars=False)
    if extra:
        raw = {**raw, **extra}
    templar = Templar(loader=loader, variables=raw)

    def var(name: str, default: Any = None) -> Any:
        if name not in raw:
            return default
        try:
            value = templar.template(raw[name])
        except AnsibleError as exc:
            raise InventoryError(f"host {host.name}: variable {name} cannot be templated: {exc}") from None
        return _plain(value)

    return dataclasses.replace(_make_node(host.name, var), unknown_vars=unknown_vars(raw))


def _check_duplicates(path: Path | str, nodes: list[Node]) -> None:
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
    section: str | None = None
    seen: set[str] = set()
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


#: Where Ansible's parser stopped, as its messages say it: ``Origin: /path/inv.yml:4:1``.
_ORIGIN = re.compile(r"^Origin: (/.*?):(\d+)(?::(\d+))?$")


def _inner_reason(chatter: str) -> str:
    """The first parse failure in Ansible's messages, and the file, line and column it names (a
    directory inventory holds many files), for the user to read: nothing is decided by it."""
    lines = [ln.strip() for ln in chatter.splitlines() if ln.strip()]
    for i, ln in enumerate(lines):
        if "Failed to parse" in ln or "not in the expected format" in ln or "Invalid" in ln:
            # its own Origin comes after it (each plugin's failure has one); else the first one with a line
            at = next((m for later in (lines[i:], lines) for o in later if (m := _ORIGIN.match(o))), None)
            where = ""
            if at:
                where = f" (at {at.group(1)} line {at.group(2)}" + (f", column {at.group(3)}" if at.group(3) else "") + ")"
            return ln.removeprefix("[WARNING]:").strip() + where
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
    ssh_options = _ssh_options(name, var)
    _refuse_unchecked_host_keys(name, var)
    _check_address(name, "ansible_host", host)  # first: a data address defaults to it, and is then its fault
    data_addr = str(var(VAR_DATA_ADDR, None) or host)
    _check_address(name, VAR_DATA_ADDR, data_addr)
    workdir = var(VAR_WORKDIR, None)
    if workdir is not None and not str(workdir).startswith(("/", "~")):
        raise InventoryError(f"host {name}: {VAR_WORKDIR} must be an absolute path, got {workdir!r}")
    shared_dir = var(VAR_SHARED_DIR, None)
    if shared_dir is not None and not str(shared_dir).startswith("/"):
        raise InventoryError(f"host {name}: {VAR_SHARED_DIR} must be an absolute path, got {shared_dir!r}")
    try:
        conda_env = nodeenv.parse_conda_env(name, var(VAR_CONDA_ENV, None))
        setup = nodeenv.setup_lines(nodeenv.parse_setup(name, var(VAR_SETUP, None)), conda_env)
    except ValueError as exc:
        raise InventoryError(Problem(name, "inventory", text=str(exc))) from None
    python = var(VAR_PYTHON, None)
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
        python=str(python or "python3"),
        python_from="inventory" if python else "",
        setup=setup,
        conda_env=conda_env,
        master=_bool_var(var(VAR_MASTER, False)),
        shared_dir=str(shared_dir) if shared_dir else None,
        spares_group=str(var(VAR_SPARES, None) or "") or None,
        env=_env_var(name, var(VAR_ENV, None)),
        gpu_ids=_gpu_ids(name, var(VAR_GPU_IDS, None)),
        replicate=_replicate_var(name, var(VAR_REPLICATE, None)),
        secret_env=_secret_env_var(name, var(VAR_SECRET_ENV, None)),
    )


def _ssh_options(name: str, var: Callable[..., Any]) -> dict[str, Any]:
    """The host's ssh options from ``ansible_ssh_args``, ``_common_args`` and ``_extra_args``,
    keys lower-cased, as one mapping: what the connection and the ssh command lines use."""
    ssh_options: dict[str, Any] = {}
    # in the order Ansible puts them on ssh's command line: OpenSSH takes the first value it sees
    for ssh_var in SSH_ARG_VARS:
        value = var(ssh_var, "") or ""
        if not isinstance(value, str):
            raise InventoryError(f"host {name}: {ssh_var} must be a string of ssh options, got {value!r}")
        for key, opt in parse_ssh_args(value, ssh_var).items():
            _add_option(ssh_options, key, opt)
    return ssh_options


def _refuse_unchecked_host_keys(name: str, var: Callable[..., Any]) -> None:
    """An InventoryError when the host turns host key checking off: ddpfab checks host keys on
    every path, and silently checking anyway would surprise whoever wrote it."""
    for hkc_var in ("ansible_host_key_checking", "ansible_ssh_host_key_checking"):
        hkc = var(hkc_var, None)
        if hkc is not None and hkc != "" and not _bool_var(hkc):
            raise InventoryError(f"host {name}: {hkc_var}={hkc!r} cannot be honoured: ddpfab always checks host keys "
                                 "(every path, provision too). Remove it; to trust hosts on first use pass "
                                 f"{option('accept_new_host_keys', True)}")


def _replicate_var(host: str, value: Any) -> tuple[str, ...]:
    """``ddpfab_replicate``: a list of paths relative to the workdir (checked as paths by the run)."""
    if value is None or value == "":
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise InventoryError(f"host {host}: {VAR_REPLICATE} must be a list of paths relative to the workdir like "
                             f"[snapshot.pt], got {value!r}")
    return tuple(value)


def _secret_env_var(host: str, value: Any) -> tuple[str, ...]:
    """``ddpfab_secret_env``: a list of environment variable names (or one name)."""
    if value is None or value == "":
        return ()
    items = [value] if isinstance(value, str) else value if isinstance(value, list) else None
    bad = [k for k in items or [] if not isinstance(k, str) or not _ENV_KEY.fullmatch(k)]
    if items is None or bad:
        raise InventoryError(f"host {host}: {VAR_SECRET_ENV} must be a list of environment variable names like "
                             f"[DB_URL, MY_CREDS], got {value!r}")
    return tuple(items)


def _env_var(host: str, value: Any) -> dict[str, str]:
    """``ddpfab_env``: a mapping of variable names to scalar values."""
    if value is None or value == "":
        return {}
    if not isinstance(value, dict):
        raise InventoryError(f"host {host}: {VAR_ENV} must be a mapping like {{NCCL_IB_HCA: mlx5_0}}, got {value!r}")
    out = {}
    for k, v in value.items():
        if not _ENV_KEY.fullmatch(str(k)):
            raise InventoryError(f"host {host}: {VAR_ENV} key {k!r} is not an environment variable name "
                                 "(letters, digits, '_')")
        if isinstance(v, (dict, list)) or v is None:
            raise InventoryError(f"host {host}: {VAR_ENV}.{k} must be a string or number, got {v!r}")
        out[str(k)] = str(v).lower() if isinstance(v, bool) else str(v)
    return out


def _gpu_ids(host: str, value: Any) -> tuple[str, ...] | None:
    """``ddpfab_gpu_ids``: a list (or comma-separated string) of GPU indexes or UUIDs."""
    if value is None or value == "":
        return None
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else None
    if items is None or isinstance(value, bool):
        raise InventoryError(f"host {host}: {VAR_GPU_IDS} must be a list of GPU indexes or UUIDs like [0, 1], "
                             f"got {value!r}")
    ids = tuple(str(i).strip() for i in items)
    bad = [i for i in ids if not re.fullmatch(r"[A-Za-z0-9\-]+", i)]
    if bad or not ids:
        raise InventoryError(f"host {host}: {VAR_GPU_IDS} entry {bad[0] if bad else value!r} is not a GPU index "
                             "or UUID")
    if len(set(ids)) != len(ids):
        raise InventoryError(f"host {host}: {VAR_GPU_IDS} lists a GPU twice: {list(ids)}")
    return ids


def is_address(value: str) -> bool:
    """An IP literal or a DNS name: anything else (a leading '-', spaces) would end up in a shell or argv."""
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return bool(re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9\-_.]*[A-Za-z0-9])?", value))


def _check_address(host: str, var: str, value: str) -> None:
    if not is_address(value):
        raise InventoryError(f"host {host}: {var} {value!r} is neither an IP address nor a host name")
