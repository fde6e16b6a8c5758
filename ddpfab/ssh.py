"""The one SSH layer: every command ddpfab sends to a host goes through here.

It reads the inventory's connection vars (and an optional ssh_config), enforces the host-key
policy, opens connections in parallel and returns per-host results in which a failure on one host
is data, not an exception that loses the others (Fabric's GroupResult model).

Why not Fabric's defaults: Fabric accepts any host key (paramiko's AutoAddPolicy, no known_hosts
loaded). ddpfab loads known_hosts and refuses unknown and changed keys unless the user explicitly
opts in to accepting *new* ones; a changed key is always refused.
"""

from __future__ import annotations

import errno
import os
import resource
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import paramiko
from fabric import Config, Connection

from .inventory import Node

T = TypeVar("T")
DEFAULT_CONNECT_TIMEOUT = 10
#: Seconds between SSH keepalives on long-lived connections, so a dead peer is noticed.
KEEPALIVE_S = 2
#: The fan-out window (like pdsh's -f): at most this many hosts are worked on at once by
#: :func:`parallel`. Each target host sees one connection from ddpfab, so its sshd's MaxStartups
#: (default 10:30:100) is never reached; the window bounds the controller's threads instead.
WINDOW = 64
#: Handshakes at once through one jump host: all of them land on the jump host's sshd, whose
#: default MaxStartups starts refusing 30% of new connections beyond 10 unauthenticated ones.
JUMP_WINDOW = 8
_jump_slots: dict[str, threading.BoundedSemaphore] = {}
_jump_lock = threading.Lock()


class SSHError(Exception):
    """Connecting to or running on one host failed; the message names the host and what to do."""

    def __init__(self, node: str, message: str, kind: str = "ssh"):
        super().__init__(message)
        self.node = node
        self.kind = kind


@dataclass(frozen=True)
class HostKeyPolicy:
    """How host keys are checked.

    Args:
        known_hosts: the known_hosts file to trust; None = from the node's ssh options, else
            ~/.ssh/known_hosts.
        accept_new: add keys of hosts not in known_hosts (like StrictHostKeyChecking=accept-new).
            A key that differs from the recorded one is refused regardless.
    """

    known_hosts: str | None = None
    accept_new: bool = False

    def file_for(self, node: Node, ssh_config: str | None = None) -> Path:
        """--known-hosts, else the inventory's UserKnownHostsFile, else the ssh_config's for this
        host (*ssh_config*, or ~/.ssh/config), else ~/.ssh/known_hosts: the file OpenSSH would use."""
        chosen = (self.known_hosts or node.ssh_options.get("userknownhostsfile")
                  or _ssh_config_value(ssh_config or node.ssh_options.get("configfile"), node.host,
                                       "userknownhostsfile")
                  or "~/.ssh/known_hosts")
        return Path(os.path.expanduser(chosen.split()[0]))


def _ssh_config_value(path: str | None, host: str, key: str) -> str | None:
    """*key* for *host* in the ssh_config *path* (default ~/.ssh/config); None when not set there."""
    path = os.path.expanduser(path or "~/.ssh/config")
    try:
        value = paramiko.SSHConfig.from_path(path).lookup(host).get(key)
    except (OSError, paramiko.SSHException):
        return None
    if isinstance(value, list):  # paramiko lists UserKnownHostsFile's several files
        value = value[0] if value else None
    return value


class _UnknownKey(paramiko.MissingHostKeyPolicy):
    """Refuse hosts whose key is not on record, or record them when the user opted in."""

    def __init__(self, node: Node, path: Path, accept_new: bool):
        self.node, self.path, self.accept_new = node, path, accept_new

    _lock = threading.Lock()

    def missing_host_key(self, client, hostname, key):
        fingerprint = f"{key.get_name()} {key.fingerprint}"
        if not self.accept_new:
            raise SSHError(self.node.name, (
                f"host {self.node.name} ({hostname}): host key not in {self.path} (it offered "
                f"{fingerprint}); verify it and add it (ssh-keyscan {hostname} >> {self.path}), "
                f"or pass --accept-new-host-keys to trust it on first use"), kind="unknown-host-key")
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            entry = hostname if self.node.port in (None, 22) else f"[{hostname}]:{self.node.port}"
            with self.path.open("a") as fh:
                fh.write(f"{entry} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


def connect(node: Node, policy: HostKeyPolicy, ssh_config: str | None = None,
            timeout: float | None = None) -> Connection:
    """An open, host-key-verified Fabric connection to *node*, or an SSHError that says why not."""
    config = Config(runtime_ssh_path=ssh_config) if ssh_config else Config()
    if not ssh_config and "configfile" in node.ssh_options:
        config = Config(runtime_ssh_path=os.path.expanduser(node.ssh_options["configfile"]))
    opts = node.ssh_options
    if timeout is None:
        timeout = float(opts.get("connecttimeout") or DEFAULT_CONNECT_TIMEOUT)
    key_file = node.key_file or opts.get("identityfile")
    connect_kwargs = {"look_for_keys": key_file is None, "banner_timeout": timeout, "auth_timeout": timeout}
    if key_file:
        connect_kwargs["key_filename"] = [os.path.expanduser(key_file)]
    port = node.port or (int(opts["port"]) if "port" in opts else None)
    conn = Connection(node.host, user=node.user, port=port, config=config,
                      connect_timeout=int(timeout), connect_kwargs=connect_kwargs)
    known = policy.file_for(node, ssh_config)
    client = conn.client
    if known.exists():
        try:
            client.load_host_keys(str(known))
        except (OSError, paramiko.SSHException) as exc:
            raise SSHError(node.name, f"host {node.name}: cannot read known_hosts {known}: {exc}") from None
    client.set_missing_host_key_policy(_UnknownKey(node, known, policy.accept_new))
    where = f"{node.host}:{port or 22}"
    try:
        _open(conn, timeout)
    except SSHError:
        raise
    except paramiko.BadHostKeyException as exc:
        raise SSHError(node.name, (
            f"host {node.name} ({where}): host key CHANGED: {known} has {exc.expected_key.get_name()} "
            f"{exc.expected_key.fingerprint}, the host offered {exc.key.get_name()} {exc.key.fingerprint}. "
            f"This can be an attack. If the host was reinstalled, remove the old key "
            f"(ssh-keygen -R {node.host} -f {known}) and verify the new one"), kind="changed-host-key") from None
    except paramiko.AuthenticationException as exc:
        who = conn.user
        raise SSHError(node.name, (
            f"host {node.name} ({where}): authentication as {who} failed ({exc}); check ansible_user and "
            f"ansible_ssh_private_key_file{' (' + key_file + ')' if key_file else ''}"), kind="auth") from None
    except (socket.timeout, TimeoutError) as exc:
        raise SSHError(node.name, (
            f"host {node.name} ({where}): unreachable, no answer within {timeout:g} s in {CONNECT_ATTEMPTS} tries "
            f"({exc or 'timed out'}); "
            "check ansible_host and that the host is up"), kind="unreachable") from None
    except (OSError, paramiko.SSHException, EOFError) as exc:
        raise SSHError(node.name, (
            f"host {node.name} ({where}): unreachable: {exc}; check ansible_host/ansible_port and that "
            "sshd runs there"), kind="unreachable") from None
    conn.transport.set_keepalive(KEEPALIVE_S)
    return conn


#: Tries to open a connection when the failure may be load, not a fault (a timeout, a handshake the
#: server dropped); a refused or unroutable connect, a bad key or failed auth end at once.
CONNECT_ATTEMPTS = 3
_FINAL_ERRNOS = (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH)


def _open(conn: Connection, timeout: float) -> None:
    for attempt in range(CONNECT_ATTEMPTS):
        try:
            if conn.gateway is None:  # (a ProxyJump/ProxyCommand brings its own socket)
                conn.connect_kwargs["sock"] = _socket(conn.host, conn.port, timeout)
                conn.open()
            else:
                with _jump_slot(conn.gateway):
                    conn.open()
            return
        except (SSHError, paramiko.BadHostKeyException):
            raise
        except (OSError, paramiko.SSHException, EOFError) as exc:
            # paramiko reports a server too busy to finish auth in time as an auth failure
            busy_auth = isinstance(exc, paramiko.AuthenticationException) and "timeout" in str(exc).lower()
            final = (isinstance(exc, OSError) and exc.errno in _FINAL_ERRNOS
                     or isinstance(exc, paramiko.AuthenticationException) and not busy_auth)
            if attempt == CONNECT_ATTEMPTS - 1 or final:
                raise
            conn.close()
            time.sleep(0.5 * 2 ** attempt)


def _jump_slot(gateway) -> threading.BoundedSemaphore:
    """The semaphore that keeps handshakes through one jump host under JUMP_WINDOW."""
    key = str(getattr(gateway, "host", gateway))
    with _jump_lock:
        return _jump_slots.setdefault(key, threading.BoundedSemaphore(JUMP_WINDOW))


def _fit_open_files(hosts: int) -> None:
    """Raise this process's soft open-file limit (towards the hard one) when *hosts* connections
    (a socket each, plus what paramiko and the windowed threads hold) might not fit under it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * hosts + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if new > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


def _socket(host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection with Nagle off, which paramiko does not do: with it on, each request that
    follows an unacknowledged small write waits for the peer's delayed ACK (40 ms on Linux), so
    every SSH round trip (handshake steps, a session open, an exec) cost 40 ms instead of < 1 ms."""
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def parallel(nodes: list[Node] | tuple[Node, ...], fn: Callable[[Node], T],
             window: int | None = None) -> dict[str, T | BaseException]:
    """``fn(node)`` for every node, *window* (default WINDOW) at a time; per node its result or the
    exception it raised."""
    results: dict[str, T | BaseException] = {}
    if not nodes:
        return results
    _fit_open_files(len(nodes))
    pool = ThreadPoolExecutor(max_workers=min(window or WINDOW, len(nodes)))
    try:
        futures = {n.name: pool.submit(fn, n) for n in nodes}
        for name, fut in futures.items():
            try:
                results[name] = fut.result()
            except Exception as exc:  # noqa: BLE001 - a failure on one host is data
                results[name] = exc
    finally:
        # SIGINT/SIGTERM (Interrupted, a KeyboardInterrupt) reach the caller at once, never as a
        # node's result: the caller closes the connections, which ends what still runs here
        pool.shutdown(wait=False, cancel_futures=True)
    return results


@dataclass
class CommandResult:
    node: str
    exit_code: int
    stdout: str
    stderr: str


def run(conn: Connection, node: str, command: str, timeout: float | None = 60,
        stdin: bytes | None = None) -> CommandResult:
    """Run *command* on an open connection and collect its output (for short probes, not jobs)."""
    chan = conn.transport.open_session(timeout=timeout)
    try:
        if timeout:
            chan.settimeout(timeout)
        chan.exec_command(command)
        if stdin is not None:
            chan.sendall(stdin)
        chan.shutdown_write()
        out, err = bytearray(), bytearray()
        while True:
            data = chan.recv(65536)
            if not data:
                break
            out += data
        while True:
            data = chan.recv_stderr(65536)
            if not data:
                break
            err += data
        code = chan.recv_exit_status()
    except socket.timeout:
        raise SSHError(node, f"host {node}: `{command[:60]}` did not finish within {timeout:g} s") from None
    finally:
        chan.close()
    return CommandResult(node, code, out.decode(errors="replace"), err.decode(errors="replace"))
