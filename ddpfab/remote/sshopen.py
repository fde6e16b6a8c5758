"""Opening one SSH connection with Fabric and paramiko, host keys checked strictly: what
:func:`ddpfab.remote.ssh.connect` does for a node no ``ddpfab hold`` holds.

Why not Fabric's defaults: Fabric accepts any host key (paramiko's AutoAddPolicy, no known_hosts
loaded). ddpfab loads known_hosts and refuses unknown and changed keys unless the user explicitly
opts in to accepting *new* ones; a changed key is always refused.

Its own module because Fabric and paramiko take 0.1 s to import: :mod:`ddpfab.remote.ssh` imports
this one only when it opens a connection, so a command whose every node is held never loads them.
"""

from __future__ import annotations

import errno
import getpass
import logging
import os
import shlex
import socket
import threading
import time
from pathlib import Path
from typing import Any

import paramiko
from fabric import Config, Connection

from ddpfab.remote.ssherror import SSHError, hop_error
from ddpfab.remote.target import Target, proxy_argv, unresolved

#: Seconds between SSH keepalives on long-lived connections, so a dead peer is noticed.
KEEPALIVE_S = 2
#: Handshakes at once through one jump host: all of them land on the jump host's sshd, whose
#: default MaxStartups starts refusing 30% of new connections beyond 10 unauthenticated ones.
JUMP_WINDOW = 8
_jump_slots: dict[str, threading.BoundedSemaphore] = {}
_jump_lock = threading.Lock()

# paramiko's transport thread logs each failed handshake (e.g. a server that never sends its banner)
# at ERROR with a traceback; with no handler of its own, Python's last-resort handler prints that on
# stderr (~60 lines a try). The failure reaches the caller as an exception, which becomes one
# SSHError naming the host; paramiko's record of it stays available to any handler an embedding
# program configures, but is not printed by default.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


def open_connection(node: str, target: Target) -> Connection:
    """An open connection to *node* rendering *target* (through its jump hosts, each verified the
    same way), keepalives on, or an SSHError that says which hop failed and why."""
    conn = _connection(node, target)
    conn.target = target  # how it was reached (probe reads the node's address from it)
    _open_hop(node, conn, target)
    conn.transport.set_keepalive(KEEPALIVE_S)
    return conn


class _UnknownKey(paramiko.MissingHostKeyPolicy):
    """Refuse hosts whose key is not on record, or record them when the user opted in."""

    def __init__(self, node: str, target: Target):
        self.node, self.target = node, target

    _lock = threading.Lock()

    def missing_host_key(self, client, hostname, key):
        fingerprint = f"{key.get_name()} {key.fingerprint}"
        t, path = self.target, self.target.known_hosts_file
        if not t.accept_new:
            raise hop_error(self.node, t, (
                f"host key not in {path} (it offered "
                f"{fingerprint}); verify it and add it (ssh-keyscan {hostname} >> {path}), "
                f"or pass --accept-new-host-keys to trust it on first use"), "unknown-host-key", at=hostname)
        with self._lock:
            path.parent.mkdir(parents=True, exist_ok=True)
            entry = hostname if t.port == 22 else f"[{hostname}]:{t.port}"
            with path.open("a") as fh:
                fh.write(f"{entry} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


class _Connection(Connection):
    """A Connection that closes its jump host's connection with its own (Fabric's leaves it open)."""

    def close(self):
        super().close()
        if isinstance(self.gateway, Connection):
            self.gateway.close()


def _connection(node: str, t: Target) -> Connection:
    """A Fabric Connection (not yet open) rendering *t*: no ssh_config of Fabric's own (the target
    has applied it), its known_hosts loaded and the strict policy set, and its jump host as a
    ``gateway`` Connection built the same way, so every hop's key is checked."""
    gateway: Connection | str | bool = False
    if t.jump is not None:
        gateway = _connection(node, t.jump)
    elif t.proxy_command:  # paramiko splits this back into proxy_argv's words
        gateway = shlex.join(proxy_argv(t))
    connect_kwargs: dict[str, Any] = {"look_for_keys": not t.identity_files, "banner_timeout": t.connect_timeout,
                      "auth_timeout": t.connect_timeout}
    if t.identity_files:
        connect_kwargs["key_filename"] = list(t.identity_files)
    if t.identities_only:
        connect_kwargs["allow_agent"] = False
    conn = _Connection(t.host, user=t.user or getpass.getuser(), port=t.port,
                      config=Config(ssh_config=paramiko.SSHConfig()), gateway=gateway,
                      connect_timeout=max(1, int(t.connect_timeout)), connect_kwargs=connect_kwargs)
    client = conn.client
    # GlobalKnownHostsFile is read only, as OpenSSH reads it (paramiko's "system" keys)
    for files, keys, what in ((t.known_hosts, client.get_host_keys(), "known_hosts"),
                              (t.global_known_hosts, client._system_host_keys, "GlobalKnownHostsFile")):
        for known in files:
            path = Path(os.path.expanduser(known))
            if path.exists():
                try:
                    entries = _known_entries(path)
                except (OSError, paramiko.SSHException) as exc:
                    raise hop_error(node, t, f"cannot read {what} {path}: {exc}", at=None) from None
                # copies: a key this connection records (accept-new) stays its own until the file changes
                keys._entries.extend(paramiko.hostkeys.HostKeyEntry(list(e.hostnames), e.key) for e in entries)
    client.set_missing_host_key_policy(_UnknownKey(node, t))
    return conn


_known_cache: dict[str, tuple[tuple[int, int, int], list]] = {}
_known_lock = threading.Lock()


def _known_entries(path: Path) -> list:
    """*path*'s host keys, parsed once per version of the file (its inode, size and mtime). paramiko's
    ``load_host_keys`` parses every line into a key object and compares it with every earlier
    line, per connection: on N hosts sharing one known_hosts that is N x N key parses (at 128 hosts
    the largest part of `exec`'s CPU time)."""
    with _known_lock:
        st = path.stat()
        version = (st.st_ino, st.st_size, st.st_mtime_ns)
        cached = _known_cache.get(str(path))
        if cached is None or cached[0] != version:
            keys = paramiko.HostKeys()
            keys.load(str(path))
            cached = _known_cache[str(path)] = (version, keys._entries)
        return cached[1]


#: The factories of the commands running now whose cluster has a holder (:func:`warm_through`):
#: node, policy, ssh_config -> a connection over the holder's, or None for a node it does not

def _open_hop(node: str, conn: Connection, t: Target) -> None:
    """Open *conn*'s gateway chain from the outermost hop in, then *conn*: a failure names its hop."""
    if isinstance(conn.gateway, Connection) and t.jump is not None:
        _open_hop(node, conn.gateway, t.jump)
    known, timeout = t.known_hosts_file, t.connect_timeout
    try:
        _open(conn, timeout)
    except SSHError:
        raise
    except paramiko.BadHostKeyException as exc:
        raise hop_error(node, t, (
            f"host key CHANGED: {known} has {exc.expected_key.get_name()} "
            f"{exc.expected_key.fingerprint}, the host offered {exc.key.get_name()} {exc.key.fingerprint}. "
            f"This can be an attack. If the host was reinstalled, remove the old key "
            f"(ssh-keygen -R {t.host} -f {known}) and verify the new one"), "changed-host-key") from None
    except paramiko.AuthenticationException as exc:
        keys = f" ({', '.join(t.identity_files)})" if t.identity_files else ""
        raise hop_error(node, t, (
            f"authentication as {conn.user} failed ({exc}); check ansible_user and "
            f"ansible_ssh_private_key_file{keys}"), "auth") from None
    except TimeoutError as exc:
        raise hop_error(node, t, (
            f"unreachable, no answer within {timeout:g} s in {CONNECT_ATTEMPTS} tries "
            f"({exc or 'timed out'}); "
            "check ansible_host and that the host is up"), "unreachable") from None
    except socket.gaierror as exc:
        if exc.errno not in _NO_SUCH_NAME:
            raise hop_error(node, t, f"unreachable: its name {t.host} cannot be resolved now ({exc.strerror}); "
                             "check this machine's DNS", "unreachable") from None
        raise hop_error(node, t, unresolved(t, exc.strerror or str(exc)), "unreachable") from None
    except (OSError, paramiko.SSHException, EOFError) as exc:
        if isinstance(exc, OSError) and _key_file(exc, t.identity_files):  # a key file here, not the network
            raise hop_error(node, t, (
                f"cannot read {exc.filename} here ({exc.strerror}); check ansible_ssh_private_key_file (or "
                "the ssh config's IdentityFile)"), "key-file") from None
        if _no_banner(conn):
            raise hop_error(node, t, (
                f"no SSH banner within {timeout:g} s in {CONNECT_ATTEMPTS} tries: something accepts TCP "
                f"connections on port {t.port} but does not answer as an SSH server (another service, or an "
                "sshd too busy to greet); check ansible_port and the sshd there"), "no-banner") from None
        raise hop_error(node, t, (
            f"unreachable: {exc}; check ansible_host/ansible_port and that "
            "sshd runs there"), "unreachable") from None


def _key_file(exc: BaseException, files) -> bool:
    """*exc* is a failure to read one of the key *files* here (its ``filename``, not its text)."""
    if not isinstance(exc, OSError) or exc.filename is None:
        return False
    names = [files] if isinstance(files, str) else list(files)
    return any(os.path.expanduser(str(f)) == os.path.expanduser(str(exc.filename)) for f in names)


def _no_banner(conn: Connection) -> bool:
    """The last try got a transport (so a connection was made) that never read the server's
    ``SSH-...`` greeting: paramiko sets ``remote_version`` only once it has."""
    transport = conn.client.get_transport()
    return transport is not None and not transport.remote_version


#: Tries to open a connection when the failure may be load, not a fault (a timeout, a handshake the
#: server dropped); a refused or unroutable connect, a bad key or failed auth end at once.
CONNECT_ATTEMPTS = 3
_FINAL_ERRNOS = (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH)
#: The resolver's answers that a name has no address (not a failure to ask: EAI_AGAIN is retried).
_NO_SUCH_NAME = tuple(getattr(socket, n) for n in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, n))


def _open(conn: Connection, timeout: float) -> None:
    for attempt in range(CONNECT_ATTEMPTS):
        began = time.monotonic()
        try:
            if not conn.gateway:  # (a jump host or ProxyCommand brings its own socket)
                conn.connect_kwargs["sock"] = _socket(conn.host, conn.port, timeout)
                conn.open()
            else:
                with _jump_slot(conn.gateway):
                    conn.open()
            return
        except (SSHError, paramiko.BadHostKeyException):
            raise
        except (OSError, paramiko.SSHException, EOFError) as exc:
            # paramiko reports a server too busy to finish auth in time as an auth failure: its own
            # auth deadline having passed says which (its message is not read)
            auth_timeout = conn.connect_kwargs.get("auth_timeout") or timeout
            busy_auth = (isinstance(exc, paramiko.AuthenticationException)
                         and time.monotonic() - began >= auth_timeout)
            final = (isinstance(exc, socket.gaierror) and exc.errno in _NO_SUCH_NAME
                     or isinstance(exc, OSError) and not isinstance(exc, socket.gaierror) and exc.errno in _FINAL_ERRNOS
                     or isinstance(exc, paramiko.AuthenticationException) and not busy_auth
                     or _key_file(exc, conn.connect_kwargs.get("key_filename") or ()))  # no retry helps
            if attempt == CONNECT_ATTEMPTS - 1 or final:
                raise
            conn.close()
            time.sleep(0.5 * 2 ** attempt)


def _jump_slot(gateway) -> threading.BoundedSemaphore:
    """The semaphore that keeps handshakes through one jump host under JUMP_WINDOW."""
    key = str(getattr(gateway, "host", gateway))
    with _jump_lock:
        return _jump_slots.setdefault(key, threading.BoundedSemaphore(JUMP_WINDOW))


def _socket(host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection with Nagle off, which paramiko does not do: with it on, each request that
    follows an unacknowledged small write waits for the peer's delayed ACK (40 ms on Linux), so
    every SSH round trip (handshake steps, a session open, an exec) cost 40 ms instead of < 1 ms."""
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


