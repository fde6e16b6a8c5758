"""How ddpfab reaches a host: one connection target per node, rendered for every consumer.

A node's inventory vars (``ansible_host``/``_port``/``_user``/``_ssh_private_key_file``, the ``-o``
options of ``ansible_ssh_common_args``) and the user's ssh_config (``--ssh-config``, the
inventory's ``-F``, else ~/.ssh/config and /etc/ssh/ssh_config) are decided ONCE, here, into an
immutable :class:`Target`: address, port, user, identity files, known_hosts files, host-key policy,
the chain of jump hosts (each a Target itself, checked against known_hosts like any host) or a
ProxyCommand, and the few OpenSSH-only tuning options. Then it is rendered:

- :func:`openssh_options` / :func:`ssh_argv`: OpenSSH argv for rsync ``-e``, emitted scripts and
  dry-run lines. ``-F /dev/null`` so ssh applies exactly what was decided here, and jump hosts as
  an explicit ``ProxyCommand`` (not ``-J``: OpenSSH hands a ``-J`` hop none of the ``-o`` options,
  so the jump host's key would be checked against another known_hosts, or not in batch mode);
- :func:`ansible_vars`: the same as Ansible connection vars (``ddpfab provision``);
- ``ddpfab.remote.ssh.connect``: Fabric connections, jump hosts as a chain of ``gateway=Connection``,
  each with the strict host-key policy.

Precedence is OpenSSH's: the inventory's values (its command line) before the ssh_config's.
Every option is in :data:`OPTIONS`; one ddpfab cannot honour in every path is an error naming
the option, the host and the fix (:class:`TargetError`), never silently dropped.
"""

from __future__ import annotations

import functools
import getpass
import glob
import os
import re
import shlex
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpfab.hosts.inventory import SSH_ARG_VARS, Node, is_address
from ddpfab.hosts.suggest import did_you_mean
from ddpfab.problems import DdpfabError, Problem

if TYPE_CHECKING:
    import paramiko

DEFAULT_CONNECT_TIMEOUT = 10
#: OpenSSH's keepalives on the long-lived connections sync and fetch hold (paramiko's is set in
#: ddpfab.remote.sshopen), so a dead peer is noticed.
_KEEPALIVE = (("ServerAliveInterval", "5"), ("ServerAliveCountMax", "6"))

#: Every ssh option ddpfab knows (lower-case, as ssh_config and ``-o`` spell them, any case).
#: "target": decided into the Target and rendered for every path. "tuning": changes neither where
#: nor whom ssh trusts; passed to OpenSSH and Ansible, paramiko has its own equivalent or needs
#: none. "own": ddpfab (or Ansible) sets it itself in every path, the user's value is not used (a
#: value that would change what the user expects is refused: :data:`_OWN_REFUSED`).
#: Anything else is refused with :class:`TargetError`.
OPTIONS: dict[str, str] = {
    **dict.fromkeys((
        "hostname", "port", "user", "identityfile", "identitiesonly", "userknownhostsfile",
        "globalknownhostsfile", "stricthostkeychecking", "connecttimeout", "proxyjump", "proxycommand",
        "configfile"), "target"),
    **dict.fromkeys(("serveraliveinterval", "serveralivecountmax", "compression", "tcpkeepalive",
                     "loglevel", "connectionattempts"), "tuning"),
    **dict.fromkeys((
        "batchmode", "controlmaster", "controlpath", "controlpersist", "forwardagent", "requesttty",
        "hashknownhosts", "addkeystoagent", "visualhostkey", "updatehostkeys", "forwardx11",
        "forwardx11trusted", "sendenv", "gssapiauthentication", "gssapidelegatecredentials",
        "pubkeyauthentication", "passwordauthentication", "kbdinteractiveauthentication",
        "challengeresponseauthentication", "preferredauthentications", "checkhostip", "usekeychain",
        "canonicalizehostname"), "own"),
}
#: "own" options whose value would be silently overridden in a way the user would notice:
#: (is this value refused, why). The others' values change nothing a run depends on.
_OWN_REFUSED = {
    "forwardagent": (lambda v: v != "no", "ddpfab never forwards your agent to the nodes (a node's root could use "
                                          "it); sync forwards a key of its own only where it needs one"),
    "preferredauthentications": (lambda v: "publickey" not in v.split(","),
                                 "ddpfab authenticates with keys only (publickey), never a password prompt"),
    "forwardx11": (lambda v: v != "no", "ddpfab opens no X11 forwarding"),
}
#: Why an option is refused, where a reason is more useful than "not supported".
_REFUSED_WHY = {
    "hostkeyalias": "paramiko (the runner) cannot check a key under another name",
    "knownhostscommand": "paramiko (the runner) cannot run it",
    "proxyusefdpass": "paramiko (the runner) cannot take a passed descriptor",
    "localforward": "ddpfab opens no forwards", "remoteforward": "ddpfab opens no forwards",
    "dynamicforward": "ddpfab opens no forwards",
    "certificatefile": "paramiko (the runner) does not present certificates this way",
    "identityagent": "paramiko (the runner) reads only $SSH_AUTH_SOCK",
    "pkcs11provider": "paramiko (the runner) has no PKCS#11",
    "ciphers": "paramiko (the runner) has other algorithm names",
    "kexalgorithms": "paramiko (the runner) has other algorithm names",
    "macs": "paramiko (the runner) has other algorithm names",
    "hostkeyalgorithms": "paramiko (the runner) has other algorithm names",
}


class TargetError(DdpfabError):
    """An ssh option or value ddpfab cannot honour; the message names it, the host and the fix.
    *node*: the host it is about ("" for none: an ssh_config that cannot be read)."""

    check = "ssh_option"

    def __init__(self, node: str, message: str):
        super().__init__([Problem(node or None, self.check, text=message)])
        self.node = node


@dataclass(frozen=True)
class HostKeyPolicy:
    """How host keys are checked, on every host and every jump host.

    Args:
        known_hosts: the known_hosts file to trust (``--known-hosts``); None = the inventory's
            UserKnownHostsFile, else the ssh_config's, else ~/.ssh/known_hosts.
        accept_new: add keys of hosts not in known_hosts (StrictHostKeyChecking=accept-new).
            A key that differs from the recorded one is refused regardless.
    """

    known_hosts: str | None = None
    accept_new: bool = False


@dataclass(frozen=True)
class Target:
    """Where and how to connect to one host, decided once (see the module doc).

    Args:
        name: the inventory name (a jump host: its spec, e.g. ``root@bastion``).
        host: the address TCP connects to (ssh_config's HostName applied).
        port: the SSH port.
        user: the login user; None = the local user.
        identity_files: private keys to offer, in order.
        identities_only: offer only those (no agent keys).
        known_hosts: the known_hosts files; the first is where an accepted new key is written.
        global_known_hosts: the GlobalKnownHostsFile files (read only); () = none (/dev/null).
        accept_new: StrictHostKeyChecking=accept-new (else yes; a changed key is always refused).
        connect_timeout: seconds to wait for the TCP connect and the handshake.
        jump: the jump host this host is reached through (itself a Target, with its own jump).
        proxy_command: a ProxyCommand (exclusive with *jump*), its %-tokens expanded.
        tuning: OpenSSH-only options (name, value) that change neither route nor trust.
        jump_of: for a jump host: the inventory name of the node it serves (for messages).
        ssh_config: the ssh_config file it was resolved with (None: OpenSSH's own two); a host
            name that does not resolve is matched against its ``Host`` names.
    """

    name: str
    host: str
    port: int = 22
    user: str | None = None
    identity_files: tuple[str, ...] = ()
    identities_only: bool = False
    known_hosts: tuple[str, ...] = ("~/.ssh/known_hosts",)
    global_known_hosts: tuple[str, ...] = ()
    accept_new: bool = False
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    jump: Target | None = None
    proxy_command: str | None = None
    tuning: tuple[tuple[str, str], ...] = field(default=())
    jump_of: str | None = None
    ssh_config: str | None = None

    def __post_init__(self):
        # a Target built from records (emit's fallback) gets the same guard as a resolved one:
        # its host and port become ssh arguments
        if not is_address(self.host) or not 0 < self.port < 65536:
            raise TargetError(self.jump_of or self.name, f"{self.label}: {self.host!r} port {self.port!r} is not an "
                                                         "IP address or host name and a port 1-65535; fix it")

    @property
    def where(self) -> str:
        return f"{bracket(self.host)}:{self.port}"

    @property
    def label(self) -> str:
        """How messages name this host: ``host N`` or ``host N: jump host J``."""
        return f"host {self.jump_of}: jump host {self.name}" if self.jump_of else f"host {self.name}"

    @property
    def known_hosts_file(self) -> Path:
        """The known_hosts file new keys go to (and that messages name)."""
        return Path(os.path.expanduser(self.known_hosts[0]))

    def chain(self) -> list[Target]:
        """This host and its jump hosts, the host first."""
        hops: list[Target] = []
        t: Target | None = self
        while t is not None:
            hops.append(t)
            t = t.jump
        return hops


# -- resolving ----------------------------------------------------------------------------------
#: ``Keyword value`` or ``Keyword=value``, as OpenSSH reads an ssh_config line.
_CONFIG_LINE = re.compile(r"^\s*(\w+)(?:\s*=\s*|\s+)(.*?)\s*$")
#: ProxyCommand's ``%`` and ``~`` while paramiko reads the file: paramiko expands its tokens at
#: lookup with the file's port (22 when the inventory says 2222); :func:`_proxy_command` expands
#: them from the final host, port and user, the same for a ProxyCommand from the inventory.
_RAW = {"%": "\ue000", "~": "\ue001"}


def _keyword(line: str) -> tuple[str, str]:
    m = _CONFIG_LINE.match(line)
    return (m[1].lower(), m[2]) if m else ("", "")


def _config_text(path: str, depth: int = 0, block: str | None = None, read: list[tuple] | None = None) -> str:
    """An ssh_config file's text with its ``Include`` lines replaced by the files they name
    (paramiko does not follow them); relative names are under ~/.ssh, or /etc/ssh for the
    system file, as OpenSSH reads them. *block*: the Host/Match line the Include is under.

    OpenSSH reads an included file's Host/Match blocks only within the including block and
    goes back to that block after it; flat text cannot say "this block within that one", so such
    an Include inside a block is an error, and after a top-level one the top level (``Host *``)
    is restored for the lines that follow. *read* collects what was read: each file with its
    bytes, each Include pattern with the files it named (:func:`_config` reuses a parse while all
    of it reads the same)."""
    if depth > 8:
        raise TargetError("", f"ssh_config {path}: Include nested more than 8 deep (an Include loop?); "
                              "fix its Include lines")
    data = Path(path).read_bytes()
    if read is not None:
        read.append((path, data))
    text = data.decode("utf-8", errors="replace")
    base = "/etc/ssh" if os.path.abspath(path).startswith("/etc/ssh/") else os.path.expanduser("~/.ssh")
    out = []
    for line in text.splitlines():
        key, value = _keyword(line)
        if key in ("host", "match"):
            block = line.strip()
        elif key == "proxycommand":
            for char, mark in _RAW.items():
                line = line.replace(char, mark)
        if key != "include":
            out.append(line)
            continue
        for pattern in shlex.split(value):
            pattern = os.path.expanduser(pattern)
            pattern = pattern if os.path.isabs(pattern) else os.path.join(base, pattern)
            names = sorted(glob.glob(pattern))
            if read is not None:
                read.append((pattern, names))
            for name in names:
                included = _config_text(name, depth + 1, block, read)
                if not any(_keyword(ln)[0] in ("host", "match") for ln in included.splitlines()):
                    out.append(included)
                elif block is not None:
                    raise TargetError("", (
                        f"ssh_config {path}: 'Include {name}' under '{block}' reads a file with Host/Match blocks "
                        "of its own, which ddpfab cannot apply only within that block; put the Include before "
                        "the first Host/Match line, or its options inline"))
                else:
                    out += [included, "Host *"]
    return "\n".join(out)


#: Parsed ssh_configs, by the files asked for: (what was read for the parse, the parse). Every
#: node's resolve parsed the whole file again: with a Host block per node, 128 nodes took 1.2 s
#: of a sync's CPU, and each connect resolves again. A parse is reused while what it read reads
#: the same (every file's bytes, the files each Include pattern names: no time stamps, whose
#: granularity can hide a change). One thread parses at a time: connections resolve on many
#: threads at once.
_PARSED: dict[tuple[str, ...], tuple[list[tuple], paramiko.SSHConfig]] = {}  # (files, home, user) -> ...
_PARSING = threading.Lock()


def _reads_the_same(read: list[tuple]) -> bool:
    """Whether everything in *read* (:func:`_config_text`'s) reads the same now."""
    try:
        return all(Path(what).read_bytes() == got if isinstance(got, bytes) else sorted(glob.glob(what)) == got
                   for what, got in read)
    except OSError:
        return False


def _config(path: str | None) -> tuple[paramiko.SSHConfig, str]:
    """The ssh_config to read and how messages name it: *path*, else OpenSSH's own two files."""
    # here, not at the top: emit and provision import this module while the command line builds its
    # parser, which must not pay for paramiko (see LAZY in ddpfab/cli/__init__.py)
    import paramiko

    paths = [os.path.expanduser(path)] if path else [
        p for p in (os.path.expanduser("~/.ssh/config"), "/etc/ssh/ssh_config") if os.path.isfile(p)]
    where = path or "~/.ssh/config or /etc/ssh/ssh_config"
    paths = [os.path.abspath(p) for p in paths]
    # what else a parse and its lookups depend on: the home (~, Include's base), the local user
    key = (*paths, os.path.expanduser("~"), getpass.getuser())
    with _PARSING:
        known = _PARSED.get(key)
        if known is not None and _reads_the_same(known[0]):
            return known[1], where
        read: list[tuple] = []
        try:
            text = "\n".join(_config_text(p, read=read) for p in paths)
        except OSError as exc:
            raise TargetError("", f"ssh_config {path} cannot be read: {exc}; fix --ssh-config or -F") from None
        try:
            config = paramiko.SSHConfig.from_text(text)
        except paramiko.SSHException as exc:  # ConfigParseError: a line that is not `Keyword value`
            raise TargetError("", f"ssh_config {where} cannot be parsed: {exc}; fix it, or --ssh-config / -F") from None
        if not any((k == "match" and _MATCH_EXEC.search(v)) or k == "canonicalizehostname"
                   for k, v in map(_keyword, text.splitlines())):
            # a host's options are the same while the files are: a run or a sync resolves every node
            # before it connects, and each connect resolves its node again (paramiko's lookup reads
            # every block: 2.4 ms a node with 128 blocks). Not with a Match exec, whose command may
            # answer otherwise each time, nor where a lookup asks DNS (CanonicalizeHostname).
            config.lookup = functools.lru_cache(maxsize=None)(config.lookup)
        _PARSED[key] = (read, config)
        return config, where


_MATCH_EXEC = re.compile(r"(?:^|\s)!?exec\b", re.IGNORECASE)


def _lookup(config: paramiko.SSHConfig, where: str, host: str, label: str) -> dict[str, Any]:
    import paramiko  # loaded by _config already

    try:
        found = config.lookup(host)
    except (paramiko.SSHException, ValueError) as exc:  # e.g. a Match exec paramiko refuses
        raise TargetError(label, f"{label}: ssh_config {where} cannot be applied to {host}: {exc}") from None
    # (lists copied: a lookup's result is kept for the next lookup of the host, see _config)
    out = {k: (list(v) if k == "identityfile" else " ".join(v)) if isinstance(v, list) else v for k, v in found.items()}
    proxy = out.get("proxycommand")
    if isinstance(proxy, str) and proxy:
        for char, mark in _RAW.items():
            proxy = proxy.replace(mark, char)
        out["proxycommand"] = proxy
    return out


def _check(label: str, options: dict, source: str) -> None:
    for key, value in options.items():
        kind = OPTIONS.get(key)
        if kind is None:
            why = _REFUSED_WHY.get(key, "ddpfab does not support it in every path (Fabric, OpenSSH, Ansible)")
            raise TargetError(label, (
                f"{label}: ssh option {key}={value} (from {source}) cannot be honoured: {why}. "
                f"Remove it there (supported: {', '.join(sorted(k for k, v in OPTIONS.items() if v != 'own'))})"))
        refused = _OWN_REFUSED.get(key)
        if refused and refused[0](str(value).lower()):
            raise TargetError(label, (
                f"{label}: ssh option {key}={value} (from {source}) cannot be honoured: {refused[1]}. "
                "Remove it there"))
    strict = str(options.get("stricthostkeychecking", "yes")).lower()
    if strict not in ("yes", "ask", "accept-new", "true"):
        raise TargetError(label, (
            f"{label}: StrictHostKeyChecking={strict} (from {source}) is refused: ddpfab always checks host "
            "keys. Remove it there; to trust hosts on first use pass --accept-new-host-keys"))


_JUMP = re.compile(r"^(?:ssh://)?(?:(?P<user>[^@]+)@)?(?P<host>\[[^\]]+\]|[^:@\[\]]+)(?::(?P<port>\d+))?$")


def _address(label: str, key: str, value: str, source: str) -> str:
    """*value* if it is an IP address or a host name: it becomes an ssh argument, and a word
    like ``-oProxyCommand=...`` there would be read as an option (and run)."""
    if not is_address(value):
        raise TargetError(label, f"{label}: {key} {value!r} (from {source}) is neither an IP address nor a host "
                                 "name; fix it there")
    return value


def _int(label: str, key: str, value, source: str, high: int | None = None) -> int:
    """*value* as a whole number from 1 (to *high*): plain digits only (``int()`` would take
    ``2_2`` as 22), and in range (a port past 65535 would wrap around in the socket call)."""
    text = str(value).strip()
    if not (text.isascii() and text.isdigit()):
        raise TargetError(label, f"{label}: {key} {value!r} (from {source}) is not a whole number; fix it there")
    if not 1 <= int(text) <= (high or int(text)):
        want = f"1-{high}" if high else "at least 1"
        raise TargetError(label, f"{label}: {key} {value!r} (from {source}) must be {want}; fix it there")
    return int(text)


def resolve(node: Node, policy: HostKeyPolicy | None = None, ssh_config: str | None = None) -> Target:
    """The :class:`Target` for *node*: its inventory vars over the ssh_config (*ssh_config*, else
    the inventory's ``-F``, else ~/.ssh/config and /etc/ssh/ssh_config), under *policy*.

    Raises:
        TargetError: an option that cannot be honoured, or a value that is not valid.
    """
    policy = policy or HostKeyPolicy()
    label = f"host {node.name}"
    inv = dict(node.ssh_options)
    src_inv = f"host {node.name}'s ssh args ({', '.join(SSH_ARG_VARS)})"
    _check(label, inv, src_inv)
    cfg_path = ssh_config or inv.get("configfile")
    try:
        config, where = _config(cfg_path)
    except TargetError as exc:
        raise TargetError(node.name, f"{label}: {exc}") from None
    from_cfg = _lookup(config, where, node.host, label)
    _check(label, from_cfg, f"ssh_config {where}")
    if len(_ROUTE & inv.keys()) > 1:
        raise TargetError(node.name, f"{label}: both ProxyJump and ProxyCommand are set (in {src_inv}); keep one")
    if _ROUTE & inv.keys():  # one route: the inventory's (even 'none') before any of the ssh_config's
        from_cfg = {k: v for k, v in from_cfg.items() if k not in _ROUTE}
    # OpenSSH takes the first value it sees: the command line's (inventory) before the file's
    merged = {**_first_route(from_cfg), **{k: v for k, v in inv.items() if k != "configfile"}}
    origin = {k: src_inv if k in inv else f"ssh_config {where}" for k in merged}
    if node.port:
        merged["port"], origin["port"] = str(node.port), f"host {node.name}'s ansible_port"
    if node.user:
        merged["user"] = node.user
    # every IdentityFile is offered, in order: ansible_ssh_private_key_file (Ansible's -o comes
    # first), the ssh args', then the ssh_config's, as OpenSSH collects them
    inv_keys = inv.get("identityfile") or []
    keys = list(dict.fromkeys([*([node.key_file] if node.key_file else []),
                               *([inv_keys] if isinstance(inv_keys, str) else inv_keys),
                               *(from_cfg.get("identityfile") or [])]))
    target = replace(_target(node.name, node.host, merged, keys, policy, None, label, origin), ssh_config=cfg_path)
    spec = merged.get("proxyjump")
    if spec and spec.lower() != "none":
        target = replace(target, jump=_jumps(spec, config, where, target, node.name, policy, (node.host,)))
    return target


#: ProxyJump and ProxyCommand: one setting to OpenSSH, the first of either wins.
_ROUTE = {"proxyjump", "proxycommand"}


def _first_route(opts: dict) -> dict:
    """*opts* (an ssh_config lookup, keys in the order they first appear) with only the first of
    ProxyJump/ProxyCommand, as OpenSSH keeps it (a later block's other one does not apply)."""
    first = next((k for k in opts if k in _ROUTE), None)
    return {k: v for k, v in opts.items() if k not in _ROUTE or k == first}


def _known_hosts(label: str, files: tuple[str, ...], source: str) -> tuple[str, ...]:
    """*files*, ~ expanded, if each is (or can become) a regular file: /dev/null or a directory
    would record no key, so every host would be "new" to accept-new, or never known."""
    out = tuple(os.path.expanduser(f) for f in files)
    for path in out:
        if os.path.exists(path) and not os.path.isfile(path):
            raise TargetError(label, (
                f"{label}: UserKnownHostsFile {path} (from {source}) is not a regular file, so no host key "
                "would be checked against it; name a known_hosts file there (ddpfab never skips host-key checks)"))
    return out


def _writable(label: str, path: str, source: str) -> None:
    """With accept-new, a new key must be recorded where the next connection checks it: OpenSSH
    only warns when it cannot write it, and would then accept any key again next time."""
    parent = os.path.dirname(path) or "."
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)  # a missing directory is made where its parent allows it
    if not os.access(path if os.path.exists(path) else parent, os.W_OK):
        raise TargetError(label, (
            f"{label}: accept-new needs to record new host keys in {path} (UserKnownHostsFile, from {source}), "
            "which is not writable; make it writable or name a known_hosts file you can write"))


def _proxy_command(label: str, command: str, source: str, tokens: dict[str, str]) -> str:
    """*command* with OpenSSH's ProxyCommand tokens (%h %n %p %r %%) expanded from the final
    host, port and user, once, for every path; a token OpenSSH would refuse there is refused."""
    def one(m: re.Match) -> str:
        if m[1] not in tokens:
            raise TargetError(label, f"{label}: ProxyCommand {command!r} (from {source}) has %{m[1]}; ProxyCommand "
                                     "takes only %h, %n, %p, %r and %% (fix it there)")
        return tokens[m[1]]
    return re.sub(r"%(.?)", one, command)


def _target(name: str, host: str, opts: dict, keys: list[str], policy: HostKeyPolicy, inherit: Target | None,
            label: str, origin: dict[str, str] | str) -> Target:
    """A Target from merged options; a jump host takes what its own options do not say (keys,
    known_hosts, timeout) from the node it serves: one policy for the whole route. *origin*: where
    each option came from (for messages), or one source for all of them."""
    def source(key: str) -> str:
        if key == "userknownhostsfile" and policy.known_hosts:
            return "--known-hosts"
        return origin if isinstance(origin, str) else origin.get(key, "the inventory")

    known = policy.known_hosts or opts.get("userknownhostsfile")
    known_files = (_known_hosts(label, tuple(shlex.split(known)), source("userknownhostsfile")) if known
                   else inherit.known_hosts if inherit else ("~/.ssh/known_hosts",))
    timeout = opts.get("connecttimeout")
    tuning = tuple((k, str(v)) for k, v in opts.items() if OPTIONS.get(k) == "tuning")
    accept_new = policy.accept_new or str(opts.get("stricthostkeychecking", "")).lower() == "accept-new"
    if accept_new:
        _writable(label, os.path.expanduser(known_files[0]), source("userknownhostsfile") if known else "the default")
    address = _address(label, "HostName", str(opts.get("hostname") or host), source("hostname"))
    port = _int(label, "Port", opts["port"], source("port"), 65535) if opts.get("port") else 22
    user = opts.get("user") or None
    proxy = opts.get("proxycommand")
    if proxy and proxy.lower() != "none":
        proxy = _proxy_command(label, proxy, source("proxycommand"), {
            "%": "%", "h": address, "n": host, "p": str(port), "r": user or getpass.getuser()})
    else:
        proxy = None
    return Target(
        name=name,
        host=address,
        port=port,
        user=user,
        identity_files=tuple(os.path.expanduser(k) for k in keys) or (inherit.identity_files if inherit else ()),
        identities_only=(str(opts["identitiesonly"]).lower() == "yes" if "identitiesonly" in opts
                         else bool(inherit and inherit.identities_only)),
        known_hosts=tuple(os.path.expanduser(k) for k in known_files),
        global_known_hosts=(tuple(os.path.expanduser(f) for f in shlex.split(opts["globalknownhostsfile"]))
                            if opts.get("globalknownhostsfile") else inherit.global_known_hosts if inherit else ()),
        accept_new=accept_new,
        connect_timeout=(float(_int(label, "ConnectTimeout", timeout, source("connecttimeout"))) if timeout
                         else inherit.connect_timeout if inherit else DEFAULT_CONNECT_TIMEOUT),
        proxy_command=proxy,
        tuning=tuning,
        jump_of=inherit.name if inherit else None,
        ssh_config=inherit.ssh_config if inherit else None,
    )


def host_names(ssh_config: str | None) -> list[str]:
    """The names this machine knows hosts by: the literal ``Host`` names of *ssh_config* (None:
    OpenSSH's own two files; patterns left out) and the names in /etc/hosts. What a host name that
    does not resolve is compared with (:func:`unresolved`)."""
    try:
        names = {h for h in _config(ssh_config)[0].get_hostnames() if not any(c in h for c in "*?!")}
    except TargetError:
        names = set()
    try:
        lines = Path("/etc/hosts").read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    for line in lines:
        names.update(line.split("#", 1)[0].split()[1:])
    return sorted(names)


def unresolved(t: Target, why: str) -> str:
    """What to say when *t*'s host name resolves to no address (*why*: the resolver's words):
    the closest names this machine knows hosts by, and where a name gets its address."""
    where = t.ssh_config or "~/.ssh/config"
    others = [n for n in host_names(t.ssh_config) if n.lower() != t.host.lower()]  # (a Host entry without a HostName)
    return (f"the name {t.host} does not resolve ({why}){did_you_mean(t.host, others)}; fix "
            f"the host's name or its ansible_host in the inventory, or give it a Host entry with a HostName in {where}")


def _jumps(spec: str, config: paramiko.SSHConfig, where: str, node: Target, node_name: str,
           policy: HostKeyPolicy, path: tuple[str, ...]) -> Target:
    """The jump chain of ``ProxyJump a,b``: b reached through a (a's own ssh_config ProxyJump is
    what OpenSSH would use for a; b's is replaced by the list, as ``ssh -J a b`` does). *path*:
    the hosts whose ProxyJump led here; reaching one of them again is a loop."""
    jump: Target | None = None
    hops = [h.strip() for h in spec.split(",") if h.strip()]
    for i, hop in enumerate(hops):
        m = _JUMP.match(hop)
        label = f"host {node_name}: jump host {hop}"
        if not m:
            raise TargetError(node_name, f"{label}: ProxyJump entry {hop!r} is not [user@]host[:port]; fix it")
        host = _address(label, "ProxyJump host", m["host"].strip("[]"), f"ProxyJump {spec!r}")
        # the first hop's route is its own (the first of its ssh_config's); a later hop's is the list
        opts = _lookup(config, where, host, label)
        _check(label, opts, f"ssh_config {where}")
        opts = _first_route(opts) if i == 0 else {k: v for k, v in opts.items() if k not in _ROUTE}
        if m["user"]:
            opts["user"] = m["user"]
        if m["port"]:
            opts["port"] = m["port"]
        t = _target(hop, host, opts, list(opts.get("identityfile") or []),
                    HostKeyPolicy(policy.known_hosts, node.accept_new), node, label,
                    {**dict.fromkeys(opts, f"ssh_config {where}"),
                     **({"port": f"ProxyJump {spec!r}"} if m["port"] else {})})
        t = replace(t, jump_of=node_name)
        own = opts.get("proxyjump")
        if i == 0 and own and own.lower() != "none":
            if host in path:
                raise TargetError(node_name, (
                    f"{label}: ProxyJump loop {' -> '.join([*path, host])} (ssh_config {where}); "
                    f"give {host} its own route there (e.g. 'ProxyJump none' in a Host {host} block above)"))
            t = replace(t, jump=_jumps(own, config, where, node, node_name, policy, (*path, host)))
        elif jump is not None:
            t = replace(t, jump=jump)
        jump = t
    if jump is None:
        raise TargetError(node_name, f"host {node_name}: ProxyJump {spec!r} names no host; fix it")
    return jump


def resolve_all(nodes, policy: HostKeyPolicy | None = None, ssh_config: str | None = None) -> dict[str, Target]:
    """:func:`resolve` for every node, by name."""
    return {n.name: resolve(n, policy, ssh_config) for n in nodes}


# -- OpenSSH ------------------------------------------------------------------------------------
def _files_value(files: tuple[str, ...]) -> str:
    """Several files as one ssh option value, each quoted on its own where it needs it (OpenSSH
    splits the value into words itself: '"/a/my kh" /a/kh2' is two files, '"/a/my kh /a/kh2"' one)."""
    def word(f: str) -> str:
        if not any(c.isspace() or c in "\"'\\" for c in f):
            return f
        return '"' + f.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return " ".join(word(f) for f in files)


def bracket(host: str) -> str:
    """*host* as the host part of rsync's or scp's ``HOST:PATH`` (an IPv6 address bracketed)."""
    return f"[{host}]" if ":" in host else host


def destination(t: Target) -> str:
    """The host word of an ssh command line for *t*: the bare address (ssh reads ``[::1]`` as a
    name it cannot resolve; brackets belong only in ``HOST:PATH``, see :func:`host_path`)."""
    return t.host


def host_path(t: Target, path: str) -> str:
    """``HOST:PATH`` for rsync and scp (an IPv6 address bracketed, so its colons are not the path's)."""
    return f"{bracket(t.host)}:{path}"


def openssh_options(t: Target, keepalive: bool = False) -> list[str]:
    """The ssh options (no destination) that make OpenSSH connect exactly as decided in *t*: no
    ssh_config of its own (``-F /dev/null``), batch mode, the known_hosts files and host-key
    policy, port, user, keys, and the jump chain as a ProxyCommand running this same rendering
    of the jump host, so its key is checked the same way."""
    out = ["-F", "/dev/null", "-o", "BatchMode=yes",
           "-o", "UserKnownHostsFile=" + _files_value(t.known_hosts),
           "-o", "GlobalKnownHostsFile=" + (_files_value(t.global_known_hosts) or "/dev/null"),
           "-o", "StrictHostKeyChecking=" + ("accept-new" if t.accept_new else "yes"),
           "-o", f"ConnectTimeout={t.connect_timeout:g}", "-p", str(t.port)]
    if t.user:
        out += ["-l", t.user]
    for key in t.identity_files:
        out += ["-i", key]
    if t.identities_only:
        out += ["-o", "IdentitiesOnly=yes"]
    if t.jump is not None:
        inner = [w.replace("%", "%%") for w in ["ssh", *openssh_options(t.jump), destination(t.jump)]]
        out += ["-o", "ProxyCommand=" + shlex.join(inner) + " -W [%h]:%p"]
    elif t.proxy_command:  # expanded already (_proxy_command): ssh must not expand it again
        out += ["-o", "ProxyCommand=" + t.proxy_command.replace("%", "%%")]
    tuning = {k.lower(): v for k, v in t.tuning}
    if keepalive:  # the user's own value, if any, wins (keys in any case: ssh_config's are lower-case)
        tuning = {**{k.lower(): v for k, v in _KEEPALIVE}, **tuning}
    for key, value in tuning.items():
        out += ["-o", f"{key}={value}"]
    return out


def proxy_argv(t: Target) -> list[str]:
    """How a ProxyCommand runs, in every path: as OpenSSH runs it, ``$SHELL -c 'exec COMMAND'``
    (/bin/sh without $SHELL), so shell syntax means the same for Fabric (paramiko would split
    the line into words and run the first) as for ssh, rsync and Ansible."""
    assert t.proxy_command is not None
    return [os.environ.get("SHELL") or "/bin/sh", "-c", "exec " + t.proxy_command]


def ssh_argv(t: Target, *command: str, tty: bool = False) -> list[str]:
    """``ssh OPTIONS HOST [COMMAND...]`` for *t* (with *tty*: ``-t``, a terminal there)."""
    return ["ssh", *(["-t"] if tty else []), *openssh_options(t), "--", destination(t), *command]


def scp_argv(t: Target, *files: str) -> list[str]:
    """``scp OPTIONS FILES... [USER@]HOST:`` for *t* (scp spells the port -P, and -l is not a user)."""
    opts, out, i = openssh_options(t), [], 0
    while i < len(opts):
        if opts[i] == "-p":
            out += ["-P", opts[i + 1]]
        elif opts[i] == "-l":
            out += ["-o", f"User={opts[i + 1]}"]
        else:
            out += opts[i:i + 2]
        i += 2
    return ["scp", *out, "--", *files, host_path(t, "")]


#: Host aliases an ssh_config written by :func:`ssh_config_text` may use as they are
_ALIAS = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def ssh_config_text(targets: dict[str, Target]) -> str:
    """An ssh_config (``ssh -F FILE NAME``) with a ``Host NAME`` block per node that makes OpenSSH
    connect exactly as :func:`openssh_options` does, every option on a line of its own (an
    ``-o K=V`` and a config line ``K=V`` are read by the same parser), so that a command line needs
    only ``-F FILE NAME``. Nodes whose name is not a plain word are left out (:func:`config_alias`)."""
    blocks = []
    for name, t in targets.items():
        if config_alias(name) is None:
            continue
        # ssh expands %-tokens in HostName (a scoped IPv6 address's "%eth0" is not one)
        lines, opts = [f"Host {name}", f"  HostName {t.host.replace('%', '%%')}"], openssh_options(t)
        for flag, value in zip(opts[::2], opts[1::2], strict=True):
            if flag == "-o":
                lines.append(f"  {value}")
            elif flag in ("-p", "-l", "-i"):
                key = {"-p": "Port", "-l": "User", "-i": "IdentityFile"}[flag]
                lines.append(f"  {key} {_files_value((value,))}")
            # "-F /dev/null": this file is the only config read (ssh -F FILE)
        blocks.append("\n".join(lines))
    return "".join(f"{b}\n\n" for b in blocks)


def config_ssh_argv(config: str, name: str, *command: str, tty: bool = False) -> list[str]:
    """``ssh [-t] -F CONFIG NAME [COMMAND...]``: through the block :func:`ssh_config_text` wrote for *name*."""
    return ["ssh", *(["-t"] if tty else []), "-F", config, name, *command]


def config_scp_argv(config: str, name: str, *files: str) -> list[str]:
    """``scp -F CONFIG FILES... NAME:`` (to the home dir there), as :func:`config_ssh_argv`."""
    return ["scp", "-F", config, "--", *files, f"{name}:"]


def config_alias(name: str) -> str | None:
    """*name* as a ``Host`` alias of :func:`ssh_config_text`'s file, or None when it is not a plain
    word (a pattern character or a space would make the block match other names)."""
    return name if _ALIAS.fullmatch(name) else None


def ssh_line(t: Target) -> str:
    """:func:`ssh_argv` as one shell-quoted line (emitted scripts, dry-run output)."""
    return shlex.join(ssh_argv(t))


# -- Ansible ------------------------------------------------------------------------------------
def ansible_vars(t: Target, control_path: str) -> dict[str, str]:
    """Ansible connection vars that make its ssh connect exactly as decided in *t*.

    Every option goes in ``ansible_ssh_args``, which Ansible puts FIRST on ssh's command line,
    before what it adds itself (``StrictHostKeyChecking=no`` when host_key_checking is off, its
    Port, User, ConnectTimeout) and before ``ansible_ssh_common_args``: OpenSSH takes the first
    value, so nothing an ansible.cfg, ``ANSIBLE_*`` or an inventory var says re-decides the route
    or the host-key policy. ``-F /dev/null`` keeps any ssh_config out; ControlMaster with this
    run's own *control_path* (a master another run left was verified then, and must not carry
    this run past a host key that changed since)."""
    argv = [*openssh_options(t), "-o", "ControlMaster=auto", "-o", "ControlPersist=30s",
            "-o", "ControlPath=" + control_path]
    # Ansible decides become from the user it believes it logs in as: a login user that only the
    # ssh_config names (``User root``) must be Ansible's too, or it wraps every task in sudo (a
    # root login on a box without sudo fails) or, the other way round, skips sudo for a non-root
    # login. The local user (no user decided) is what both ssh and Ansible use by themselves.
    return {"ansible_host": t.host, "ansible_user": t.user or getpass.getuser(), "ansible_ssh_args": shlex.join(argv),
            "ansible_ssh_common_args": "", "ansible_ssh_extra_args": ""}


# -- OpenSSH's failures, in ddpfab's words ------------------------------------------------------
#: OpenSSH's words for a name no resolver knows (a temporary failure is worded as unreachable).
_UNRESOLVED = re.compile(r"Could not resolve hostname (\S+): (Name or service not known|No address associated with "
                         r"hostname|nodename nor servname provided, or not known)")
_KEY_CHANGED = re.compile(r"Host key for (\S+) has changed|REMOTE HOST IDENTIFICATION HAS CHANGED")
_KEY_UNKNOWN = re.compile(r"No (?:ED25519|RSA|ECDSA|DSA)?\s*host key is known for (\S+)|Host key verification failed")


def _hop_of(t: Target, stderr: str) -> Target:
    """The hop of *t*'s chain an OpenSSH message is about: the one whose address it names."""
    # OpenSSH names a host as ADDRESS, or [ADDRESS]:PORT off port 22 (an IPv6 address has colons)
    m = re.search(r"(?:Host key for|host key is known for|for host|key for) (?:\[([^\]\s]+)\]|(\S+))", stderr)
    if m:
        for hop in t.chain():
            if hop.host == (m.group(1) or m.group(2)):
                return hop
    # the ProxyCommand's ssh failed before the target's ssh got a banner: a jump host's fault
    if t.jump is not None and ("kex_exchange_identification" in stderr or "Connection closed by UNKNOWN" in stderr):
        return t.jump
    return t


def ssh_problem(t: Target, rc: int, stderr: str) -> str:
    """One clear line for a failed OpenSSH (exit 255) to *t*, naming the hop that failed."""
    text = " ".join(stderr.split())
    hop = _hop_of(t, text)
    head = f"{hop.label} ({hop.where})"
    known = hop.known_hosts_file
    if _KEY_CHANGED.search(text):
        return (f"{head}: host key CHANGED: it does not match {known}. This can be an attack. If the host was "
                f"reinstalled, remove the old key (ssh-keygen -R {hop.host} -f {known}) and verify the new one")
    if _KEY_UNKNOWN.search(text):
        return (f"{head}: host key not in {known}; verify it and add it (ssh-keyscan), "
                "or pass --accept-new-host-keys to trust it on first use")
    if "Permission denied" in text or "Too many authentication failures" in text:
        return (f"{head}: authentication failed ({text[-160:]}); check ansible_user and "
                "ansible_ssh_private_key_file (a jump host: its User/IdentityFile in the ssh_config)")
    resolve_fail = _UNRESOLVED.search(text)
    # (OpenSSH prints at most 100 characters of the name, and as given: compared so)
    wanted = resolve_fail[1].lower() if resolve_fail else None
    named = next((h for h in t.chain() if h.host.lower()[:100] == wanted), None) if wanted else None
    if named and resolve_fail:  # (the hop whose name it is: through two jump hosts the message comes from the inner one)
        return f"{named.label} ({named.where}): {unresolved(named, resolve_fail[2])}"
    for marker in ("timed out", "No route to host", "Connection refused", "Could not resolve",
                   "Network is unreachable", "Connection closed", "Connection reset"):
        if marker in text:
            return (f"{head}: unreachable: {text[-200:]}; check ansible_host/ansible_port "
                    "and that sshd runs there")
    return f"{head}: ssh failed (exit {rc}): {text[-300:] or 'no message'}"
