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
import getpass
import logging
import os
import resource
import shlex
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import paramiko
from fabric import Config, Connection

from ddpfab.hosts.inventory import Node
from ddpfab.problems import NodeError

# HostKeyPolicy is ddpfab.remote.ssh.HostKeyPolicy to callers too
from ddpfab.remote.target import HostKeyPolicy, Target, TargetError, proxy_argv, resolve, unresolved
from ddpfab.results import GroupResult

T = TypeVar("T")


class Named(Protocol):
    """What :func:`parallel` needs of a node: its name (an inventory's Node, a plan's NodePlan)."""

    @property
    def name(self) -> str: ...


N = TypeVar("N", bound=Named)
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

# paramiko's transport thread logs each failed handshake (e.g. a server that never sends its banner)
# at ERROR with a traceback; with no handler of its own, Python's last-resort handler prints that on
# stderr (~60 lines a try). The failure reaches the caller as an exception, which becomes one
# SSHError naming the host; paramiko's record of it stays available to any handler an embedding
# program configures, but is not printed by default.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


class SSHError(NodeError):
    """Connecting to or running on one host failed; the message names the host and what to do."""

    def __init__(self, node: str, message: str, kind: str = "ssh", found: str | None = None):
        super().__init__(node, message, kind, found)


def _hop_error(node: str, t: Target, what: str, kind: str = "ssh", at: str | None = "") -> SSHError:
    """An SSHError about hop *t* of *node*'s route: ``host N (AT): WHAT``, or through a jump host
    ``host N: jump host J (AT): WHAT`` (*at*: the address, default the hop's; None: none). Its
    ``found`` leaves out the node (``WHAT``, or ``jump host J (AT): WHAT``)."""
    at = f" ({at or t.where})" if at is not None else ""
    hop = f"jump host {t.name}{at}: " if t.jump_of else ""
    return SSHError(node, f"{t.label}{at}: {what}", kind, found=hop + what)


class _UnknownKey(paramiko.MissingHostKeyPolicy):
    """Refuse hosts whose key is not on record, or record them when the user opted in."""

    def __init__(self, node: str, target: Target):
        self.node, self.target = node, target

    _lock = threading.Lock()

    def missing_host_key(self, client, hostname, key):
        fingerprint = f"{key.get_name()} {key.fingerprint}"
        t, path = self.target, self.target.known_hosts_file
        if not t.accept_new:
            raise _hop_error(self.node, t, (
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
                    raise _hop_error(node, t, f"cannot read {what} {path}: {exc}", at=None) from None
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
#: hold so. A list, not a current one: commands of several clusters may run at once (threads).
_warm: list[Callable[[Node, HostKeyPolicy, str | None], Any]] = []
_warm_lock = threading.Lock()


@contextmanager
def warm_through(factory: Callable[[Node, HostKeyPolicy, str | None], Any]) -> Iterator[None]:
    """Within: :func:`connect` gives *factory*'s connection where it gives one (over ``ddpfab
    hold``'s connections: :func:`ddpfab.remote.heldconn.factory`, which gives one only for the
    nodes, policy and ssh_config its holder was made with). Process-wide: the per-node threads
    connect too."""
    with _warm_lock:
        _warm.append(factory)
    try:
        yield
    finally:
        with _warm_lock:
            _warm.remove(factory)


def connect(node: Node, policy: HostKeyPolicy, ssh_config: str | None = None,
            timeout: float | None = None, warm: bool = True) -> Connection:
    """An open, host-key-verified Fabric connection to *node* (through its jump hosts, each
    verified the same way), or an SSHError that says which hop failed and why. Under
    :func:`warm_through` (and *warm*), one over the holder's connection where it holds the node."""
    if warm:
        with _warm_lock:
            factories = list(reversed(_warm))
        for factory in factories:
            held = factory(node, policy, ssh_config)
            if held is not None:
                return held
    try:
        target = resolve(node, policy, ssh_config)
    except TargetError as exc:
        # a TargetError is its sentence only; the node's own name leads it when it is about the node
        raise SSHError(node.name, str(exc), kind="ssh-option",
                       found=str(exc).removeprefix(f"host {node.name}: ")) from None
    if timeout is not None:
        target = _with_timeout(target, timeout)
    conn = _connection(node.name, target)
    conn.target = target  # how it was reached (probe reads the node's address from it)
    _open_hop(node.name, conn, target)
    conn.transport.set_keepalive(KEEPALIVE_S)
    return conn


def _with_timeout(t: Target, timeout: float) -> Target:
    return replace(t, connect_timeout=timeout, jump=_with_timeout(t.jump, timeout) if t.jump else None)


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
        raise _hop_error(node, t, (
            f"host key CHANGED: {known} has {exc.expected_key.get_name()} "
            f"{exc.expected_key.fingerprint}, the host offered {exc.key.get_name()} {exc.key.fingerprint}. "
            f"This can be an attack. If the host was reinstalled, remove the old key "
            f"(ssh-keygen -R {t.host} -f {known}) and verify the new one"), "changed-host-key") from None
    except paramiko.AuthenticationException as exc:
        keys = f" ({', '.join(t.identity_files)})" if t.identity_files else ""
        raise _hop_error(node, t, (
            f"authentication as {conn.user} failed ({exc}); check ansible_user and "
            f"ansible_ssh_private_key_file{keys}"), "auth") from None
    except TimeoutError as exc:
        raise _hop_error(node, t, (
            f"unreachable, no answer within {timeout:g} s in {CONNECT_ATTEMPTS} tries "
            f"({exc or 'timed out'}); "
            "check ansible_host and that the host is up"), "unreachable") from None
    except socket.gaierror as exc:
        if exc.errno not in _NO_SUCH_NAME:
            raise _hop_error(node, t, f"unreachable: its name {t.host} cannot be resolved now ({exc.strerror}); "
                             "check this machine's DNS", "unreachable") from None
        raise _hop_error(node, t, unresolved(t, exc.strerror or str(exc)), "unreachable") from None
    except (OSError, paramiko.SSHException, EOFError) as exc:
        if _no_banner(conn):
            raise _hop_error(node, t, (
                f"no SSH banner within {timeout:g} s in {CONNECT_ATTEMPTS} tries: something accepts TCP "
                f"connections on port {t.port} but does not answer as an SSH server (another service, or an "
                "sshd too busy to greet); check ansible_port and the sshd there"), "no-banner") from None
        raise _hop_error(node, t, (
            f"unreachable: {exc}; check ansible_host/ansible_port and that "
            "sshd runs there"), "unreachable") from None


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


def parallel(nodes: Sequence[N], fn: Callable[[N], T], window: int | None = None) -> GroupResult[T]:
    """``fn(node)`` for every node, *window* (default WINDOW) at a time; per node (in *nodes*'
    order) its result or the exception it raised."""
    results: GroupResult[T] = GroupResult()
    if not nodes:
        return results
    _fit_open_files(len(nodes))
    pool = ThreadPoolExecutor(max_workers=min(window or WINDOW, len(nodes)))
    try:
        futures = {n.name: pool.submit(fn, n) for n in nodes}
        for name, fut in futures.items():
            try:
                results[name] = _result(fut)
            except Exception as exc:  # noqa: BLE001 - a failure on one host is data
                results[name] = exc
    finally:
        # SIGINT/SIGTERM (Interrupted, a KeyboardInterrupt) reach the caller at once, never as a
        # node's result: the caller closes the connections, which ends what still runs here
        pool.shutdown(wait=False, cancel_futures=True)
    return results


def on_each(nodes: list[Node] | tuple[Node, ...], policy: HostKeyPolicy, ssh_config: str | None,
            fn: Callable[[Connection, Node], T]) -> GroupResult[T]:
    """``fn(connection, node)`` on every node at once, each over a connection of its own, closed
    after; per node its result or the exception it raised (a node that cannot be reached is one
    failure among the results)."""
    def connected(node: Node) -> T:
        conn = connect(node, policy, ssh_config)
        try:
            return fn(conn, node)
        finally:
            conn.close()
    return parallel(nodes, connected)


#: How long the main thread waits for a node's thread at a time (see :func:`_result`).
SIGNAL_CHECK_S = 0.2


def _result(fut: Future[T]) -> T:
    """*fut*'s result, waited for in slices of :data:`SIGNAL_CHECK_S`: a SIGINT taken on another
    thread, or just before a wait began, runs its handler only when the main thread next runs,
    and a wait on a lock is not woken by it; a Ctrl-C of ``exec -- sleep 60`` went unanswered
    until the command ended. Between slices the main thread runs, and the signal's
    :class:`~ddpfab.launch.interrupt.Interrupted` is raised."""
    while not fut.done():
        wait_for([fut], timeout=SIGNAL_CHECK_S)
    return fut.result()


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
            try:
                chan.sendall(stdin)
            except OSError:
                if not (chan.closed or chan.exit_status_ready()):
                    raise
                # the command ended before reading its input (a setup line failed): its exit says why
        if not chan.closed:
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
    except TimeoutError:
        found = f"`{command[:60]}` did not finish within {timeout:g} s"
        raise SSHError(node, f"host {node}: {found}", found=found) from None
    finally:
        chan.close()
    return CommandResult(node, code, out.decode(errors="replace"), err.decode(errors="replace"))
