"""Read the cluster from a standard Ansible inventory, with Ansible's own inventory API.

Why Ansible's API and not a YAML parser: users already keep their hosts in Ansible inventories
(YAML or INI, groups, ``node[1:4]`` ranges, group_vars/host_vars, templated vars), and the
provisioning playbooks read the same file. One reader means one meaning.

The result is a :class:`Cluster`: plain data, no Ansible objects, so the plan stays pure.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import invcache, nodeenv
from .invcache import cache_dir
from .suggest import did_you_mean

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
VAR_SETUP = "ddpfab_setup"
VAR_CONDA_ENV = "ddpfab_conda_env"

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: a DeepSpeed / MPI hostfile line: ``host slots=N`` (``max_slots=M`` allowed and ignored)
_HOSTFILE_LINE = re.compile(r"^(?P<host>[A-Za-z0-9][A-Za-z0-9_.\-]*)(?:\s+slots\s*=\s*(?P<slots>\d+))?"
                            r"(?:\s+max_slots\s*=\s*\d+)?\s*$")
_RANGE = re.compile(r"\[([^\[\]]*)\]")
_HOST_WORD = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
#: generated inventories (from host lists and hostfiles) are kept at most this many
_MAX_GENERATED = 64


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
        ssh_options: the ssh options of ``ansible_ssh_args``/``_common_args``/``_extra_args``, keys
            lower-cased, the first value of each (OpenSSH's rule); ``identityfile`` a list of all.
        nproc: processes per node (``ddpfab_nproc_per_node``), None to decide later (GPUs or 1).
        gpus: GPUs the host is expected to have (``ddpfab_gpus``), None if not stated.
        data_addr: the address peers use for training traffic (``ddpfab_data_addr``, else ``host``).
        workdir: remote working dir (``ddpfab_workdir``), None for the controller's cwd.
        python: the node's python with torch (``ddpfab_python``); without it the node chooses
            (:mod:`ddpfab.nodeenv`: an env the setup activated, the provisioned venv, python3).
        python_from: where *python* came from (:data:`ddpfab.nodeenv.SOURCES`): "inventory" for
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
                                 "use -o Option=value (see ddpfab/target.py OPTIONS), -F, -i, -p, -l or -J")
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


def expand_ranges(word: str) -> list[str]:
    """pdsh-style ranges in a host name: ``node[01-04]`` -> node01..node04 (zero padding kept),
    ``n[1-2,5]`` -> n1 n2 n5, several brackets multiply; Ansible's ``node[01:04]`` works too."""
    m = _RANGE.search(word)
    if not m:
        return [word]
    items: list[str] = []
    for part in m.group(1).split(","):
        lo, sep, hi = part.strip().replace(":", "-").partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise InventoryError(f"host range {word!r}: expected digits like [01-04] or [1,3,5], found [{m.group(1)}]")
        if not sep:
            items.append(lo)
            continue
        if int(hi) < int(lo):
            raise InventoryError(f"host range {word!r}: {lo}-{hi} counts down; write [{hi}-{lo}]")
        width = len(lo) if lo.startswith("0") else 0
        items += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    head, tail = word[:m.start()], word[m.end():]
    return [name for item in items for name in expand_ranges(head + item + tail)]


def parse_hostfile(text: str) -> list[tuple[str, int | None]] | None:
    """The (host, slots) of a DeepSpeed/MPI hostfile, or None when *text* is not one.

    A hostfile has one ``host [slots=N]`` per line (``#`` comments), at least one ``slots=``; an
    INI inventory would read ``slots=4`` as a variable nobody uses, which is why it is told apart.
    """
    hosts: list[tuple[str, int | None]] = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = _HOSTFILE_LINE.match(line)
        if not m:
            return None
        hosts.append((m.group("host"), int(m.group("slots")) if m.group("slots") else None))
    if not hosts or all(slots is None for _, slots in hosts):
        return None
    return hosts


def _host_list(source: str) -> list[str] | None:
    """The names of an Ansible-style host list (``a,b,``, ``a,``, with pdsh ranges), or None."""
    if "," not in source and not _RANGE.search(source):
        return None
    # split on commas outside brackets (n[1,3],m)
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
    names = []
    for w in filter(None, words):
        for name in expand_ranges(w):
            if not _HOST_WORD.fullmatch(name):
                raise InventoryError(f"host list {source!r}: {name!r} is not a host name (letters, digits, "
                                     "'.', '-', '_'); put users, ports and addresses in an inventory file")
            names.append(name)
    if not names:
        raise InventoryError(f"host list {source!r} names no hosts")
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise InventoryError(f"host list {source!r} names {', '.join(dup)} more than once")
    return names


def _generated(kind: str, hosts: list[tuple[str, int | None]]) -> str:
    """A YAML inventory for *hosts* (name, nproc) in a private cache dir, named by its content."""
    body = {"all": {"hosts": {name: ({VAR_NPROC: slots} if slots else None) for name, slots in hosts}}}
    text = f"# generated by ddpfab from a {kind}\n" + json.dumps(body, indent=1) + "\n"
    d = cache_dir().parent / "generated"
    path = d / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.yml"
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
    DeepSpeed/MPI hostfile or a host list (with pdsh ranges) as a generated YAML inventory.

    Raises:
        InventoryError: *source* is none of these.
    """
    path = Path(os.path.expanduser(source))
    if path.is_file():
        try:
            head = path.read_text(encoding="utf-8", errors="replace")[:1 << 20]
        except OSError as exc:
            raise InventoryError(f"inventory {source}: {exc.strerror}") from None
        slots = parse_hostfile(head)
        return _generated(f"hostfile {path.resolve()}", slots) if slots else str(path)
    if path.exists():
        return str(path)
    names = _host_list(source)
    if names is not None:
        return _generated(f"host list {source}", [(n, None) for n in names])
    hint = f"; for a single host write {source},  (a host list ends with a comma)" \
        if _HOST_WORD.fullmatch(source) else ""
    raise InventoryError(f"inventory {source}: no such file or directory{hint}")


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
            value.pop("_raw_params", None)
            bad = [w for w in text.split() if "=" not in w]
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


def load(source: str | os.PathLike, group: str = "all", limit: str | None = None,
         extra_vars=()) -> Cluster:
    """Load the hosts of *group* from the inventory *source*, in inventory order.

    Args:
        source: an inventory file or dir, a host list (``a,b,``), pdsh ranges or a hostfile
            (:func:`ansible_source`).
        group: the group whose hosts are the nodes.
        limit: an Ansible host pattern; only the group's hosts it matches are kept (in order).
        extra_vars: ``-e`` values (:func:`parse_extra_vars`), over every host's variables.

    Ansible parses it; its result is kept in a cache (:mod:`ddpfab.invcache`) and reused while
    every file it read (and the Ansible settings) are unchanged: loading Ansible costs about 0.3 s
    on every command, more than the rest of a ``ddpfab exec`` on a few hosts.
    """
    group = group or "all"
    path = Path(ansible_source(str(source)))
    extra = parse_extra_vars(extra_vars) if extra_vars else {}
    _ansible_env()  # first: its settings are part of the cache key
    selection = json.dumps([group, limit, extra], sort_keys=True, default=str)
    key = invcache.key(path, selection if (limit or extra) else group)
    cached = invcache.get(key)
    if cached is not None:
        cluster = Cluster(source=str(source), group=group, nodes=tuple(_node_from_cache(n) for n in cached))
    else:
        cluster = _load_with_ansible(path, group, limit, extra, str(source))
        invcache.put(key, [dataclasses.asdict(n) for n in cluster.nodes])
        cluster = dataclasses.replace(cluster, source=str(source))
    _check_ini_repeats(path)  # (on a cached load too: the cache may predate these checks)
    _check_duplicates(path, list(cluster.nodes))
    return cluster


def _node_from_cache(data: dict) -> Node:
    if data.get("gpu_ids") is not None:
        data = {**data, "gpu_ids": tuple(data["gpu_ids"])}
    return Node(**{**data, "setup": tuple(data.get("setup") or ())})


def _load_with_ansible(path: Path, group: str, limit: str | None = None,
                       extra: dict[str, Any] | None = None, shown: str | None = None) -> Cluster:
    """Ansible's InventoryManager on *path* (its settings made strict by :func:`load` first);
    messages name *shown* (what the user gave: a host list, a hostfile) rather than *path*."""
    from ansible.errors import AnsibleError
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar
    from ansible.vars.manager import VariableManager

    where = shown or str(path)
    loader = DataLoader()
    chatter = io.StringIO()
    try:
        with contextlib.redirect_stderr(chatter), contextlib.redirect_stdout(chatter), _strict_parsing():
            inv = InventoryManager(loader=loader, sources=[str(path)])
    except AnsibleError as exc:
        detail = " ".join(str(exc).split())
        reason = _inner_reason(chatter.getvalue()) or detail
        raise InventoryError(f"inventory {where}: cannot be parsed: {reason}") from None
    if group not in inv.groups:
        known = ", ".join(sorted(inv.groups)) or "none"
        raise InventoryError(f"inventory {where}: no group {group!r}{did_you_mean(group, inv.groups)} "
                             f"(groups: {known}); pick one with --group")
    hosts = inv.groups[group].get_hosts()
    if not hosts:
        raise InventoryError(f"inventory {where}: group {group!r} has no hosts; add hosts or pick another --group")
    if limit:
        with contextlib.redirect_stderr(chatter), contextlib.redirect_stdout(chatter):
            try:
                matched = {h.name for h in inv.get_hosts(pattern=limit)}
            except AnsibleError as exc:
                raise InventoryError(f"--limit {limit!r}: {' '.join(str(exc).split())}") from None
        kept = [h for h in hosts if h.name in matched]
        if not kept:
            words = [w.lstrip("!&") for w in re.split(r"[:,]", limit) if w.strip("!&")]
            hints = "".join(did_you_mean(w, [*inv.hosts, *inv.groups]) for w in words
                            if w not in inv.hosts and w not in inv.groups)
            raise InventoryError(f"--limit {limit!r} matches no host of group {group!r} in {where}{hints}; "
                                 f"its hosts: {', '.join(h.name for h in hosts[:8])}"
                                 f"{' ...' if len(hosts) > 8 else ''}")
        hosts = kept
    vm = VariableManager(loader=loader, inventory=inv)
    nodes = []
    for h in hosts:
        raw = vm.get_vars(host=h, include_hostvars=False)
        if extra:
            raw = {**raw, **extra}
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
        raise InventoryError(f"inventory {where}: {VAR_MASTER} is set on several hosts ({', '.join(masters)}); "
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
    ssh_options: dict[str, Any] = {}
    # in the order Ansible puts them on ssh's command line: OpenSSH takes the first value it sees
    for ssh_var in SSH_ARG_VARS:
        value = var(ssh_var, "") or ""
        if not isinstance(value, str):
            raise InventoryError(f"host {name}: {ssh_var} must be a string of ssh options, got {value!r}")
        for key, opt in parse_ssh_args(value, ssh_var).items():
            _add_option(ssh_options, key, opt)
    for hkc_var in ("ansible_host_key_checking", "ansible_ssh_host_key_checking"):
        hkc = var(hkc_var, None)
        if hkc is not None and hkc != "" and not _bool_var(hkc):
            raise InventoryError(f"host {name}: {hkc_var}={hkc!r} cannot be honoured: ddpfab always checks host keys "
                                 "(every path, provision too). Remove it; to trust hosts on first use pass "
                                 "--accept-new-host-keys")
    data_addr = str(var(VAR_DATA_ADDR, None) or host)
    _check_address(name, VAR_DATA_ADDR, data_addr)
    _check_address(name, "ansible_host", host)
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
        raise InventoryError(str(exc)) from None
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
    )


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
