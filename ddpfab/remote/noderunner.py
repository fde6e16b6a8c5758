"""One runner per node: everything ddpfab does on a node, over ONE SSH connection to it.

A :class:`NodeRunner` is built from a node's open, host-key-verified paramiko connection
(:func:`ddpfab.remote.ssh.connect`, which renders its :class:`~ddpfab.remote.target.Target`), the
way Fabric's ``Connection`` and SkyPilot's ``command_runner`` wrap a host. It offers the node
program's calls and sessions (:mod:`ddpfab.node`), a command with its output, and rsync over that
same connection: rsync's remote shell is :mod:`ddpfab.remote.rsh`, a tiny relay that asks the
runner (through a unix socket in a private 0700 directory the runner owns) to run rsync's remote
side on a new channel of the open transport. So a node sees one TCP connection from the controller
for a whole run, sync included, and no ssh option is written twice. What the runner starts (relay
sockets, rsync processes, channels) it ends in :meth:`NodeRunner.close` and :meth:`cancel`; a
:class:`~ddpfab.remote.reaper.Reaper` given to it ends its rsync processes should ddpfab be killed.

The only other ssh/rsync/ssh-agent command lines ddpfab builds are here too: the node-to-node
hop of sync's tree fan-out (ssh on the forwarding node, :func:`hop_rsh`) and that fan-out's
dedicated, key-constrained ssh-agent (:class:`Agent`). Provision (ansible-playbook) keeps OpenSSH
with the options :mod:`ddpfab.remote.target` renders.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.hosts.inventory import Node
from ddpfab.remote import relay
from ddpfab.remote import rsh as _rsh
from ddpfab.remote.reaper import Reaper
from ddpfab.remote.target import HostKeyPolicy, Target
from ddpfab.results import GroupResult

#: The relay program rsync runs as its remote shell (by path: stdlib only, no ddpfab import).
RSH_PATH = os.path.abspath(_rsh.__file__)
#: How long the fan-out's agent keeps the key at most, should ddpfab die without cleaning up.
AGENT_KEY_LIFETIME_S = 3600


@dataclass
class Finished:
    """A command's end: exit status and output (bytes)."""

    code: int
    stdout: bytes
    stderr: bytes


class NodeRunner:
    """One node's connection and what runs over it. *owned*: :meth:`close` closes the
    connection too (else it is the caller's, e.g. a run's, and stays open)."""

    def __init__(self, node: Node, conn, *, owned: bool = False, sock_dir: str | None = None,
                 reaper: Reaper | None = None):
        self.node, self.name, self.conn, self.owned = node, node.name, conn, owned
        self.reaper = reaper
        self._sock_dir, self._base_dir = None, sock_dir
        self._listener: socket.socket | None = None
        self._procs: set[subprocess.Popen] = set()
        self._chans: set = set()
        self._lock = threading.Lock()
        self.cancelled = False

    @property
    def target(self) -> Target | None:
        """How the node is reached: its connection's, read when needed (a held connection reads
        the ssh_config then; one that cannot be read now is an SSHError naming the option)."""
        return getattr(self.conn, "target", None)

    @classmethod
    def open(cls, node: Node, policy: HostKeyPolicy, ssh_config: str | None = None, **kwargs) -> NodeRunner:
        """A runner over a new connection to *node* (it owns it); an SSHError names the hop that failed."""
        from ddpfab.remote import ssh  # (paramiko, ~0.2 s: not for importers that only select or hash)

        return cls(node, ssh.connect(node, policy, ssh_config), owned=True, **kwargs)

    # -- the node program ---------------------------------------------------------------------
    def session(self, words: tuple[str, ...] = ("ddpfab-node",), fallback: str | None = None) -> nodeprog.Session:
        """The node program kept open on a new channel (its python: the node's, else *fallback*)."""
        return nodeprog.start(self.conn, self.node, words=words, fallback=fallback)

    def ask(self, session: nodeprog.Session, *requests: dict, timeout: float = 600) -> list[nodeprog.Reply]:
        """Send *requests* in *session* and wait for their replies (in order); a NodeProgramError
        naming the node when the program ended or did not answer in time."""
        got = nodeprog.exchange({self.name: session}, {self.name: list(requests)}, timeout)[self.name]
        if isinstance(got, Exception):
            raise got
        return got

    def call(self, *requests: dict, timeout: float = 600, fallback: str | None = None) -> list[nodeprog.Reply]:
        """One exchange in a session of its own (closed after it)."""
        s = self.session(fallback=fallback)
        try:
            return self.ask(s, *requests, timeout=timeout)
        finally:
            s.close()

    def run(self, command: str, timeout: float | None = 60, stdin: bytes | None = None):
        """*command* on the node, its output collected (short commands): a ``ssh.CommandResult``."""
        from ddpfab.remote import ssh

        return ssh.run(self.conn, self.name, command, timeout=timeout, stdin=stdin)

    # -- rsync over the connection -------------------------------------------------------------
    def rsh(self) -> str:
        """rsync's ``-e``: the relay to this runner's connection (its socket served from now on)."""
        with self._lock:
            if self._listener is None:
                self._sock_dir = tempfile.mkdtemp(prefix="ddpfab-rsh-", dir=self._base_dir)  # 0700: ours only
                path = os.path.join(self._sock_dir, "s")
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                listener.bind(path)
                listener.listen(16)
                self._listener = listener
                threading.Thread(target=self._serve, args=(listener,), daemon=True).start()
        return shlex.join([sys.executable, "-I", "-S", RSH_PATH, os.path.join(self._sock_dir, "s")])

    @staticmethod
    def remote(path: str) -> str:
        """An rsync destination (or source) on this runner's node (the host word is the relay's, unused)."""
        return "node:" + path

    def rsync(self, argv: list[str], stdout=subprocess.PIPE) -> Finished:
        """Run rsync (*argv* from :func:`rsync_argv` with :meth:`rsh`) to its end; :meth:`cancel`
        ends it early. It runs in its own session (a terminal's Ctrl-C reaches ddpfab, which ends
        it) and the reaper, when given, ends it should ddpfab be killed."""
        if self.cancelled:
            return Finished(130, b"", b"cancelled")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=subprocess.PIPE,
                                start_new_session=True)
        if self.reaper:
            self.reaper.watch(proc.pid)
        with self._lock:
            self._procs.add(proc)
        try:
            out, err = proc.communicate()
        finally:
            with self._lock:
                self._procs.discard(proc)
            if self.reaper:
                self.reaper.forget(proc.pid)
        return Finished(proc.returncode, out or b"", err or b"")

    def _serve(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed: the runner is closing
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        """One rsh: its command on a new channel, stdin from the socket, stdout/stderr/status back as frames."""
        send = relay.frame_sender(client)
        chan = None
        try:
            header = relay.read_header(client)
            if header is None:
                return
            command = json.loads(header)["command"]
            try:
                chan = self.conn.transport.open_session(timeout=30)
                chan.exec_command(command)
            except Exception as exc:  # noqa: BLE001 - told to rsync, which reports it for this node
                send(b"e", f"ddpfab: host {self.name}: cannot run rsync's remote side: {exc}\n".encode())
                send(b"x", b"255")
                return
            with self._lock:
                self._chans.add(chan)
            relay.relay(client, chan, send)
        except (OSError, EOFError, ValueError, KeyError):
            pass  # the relay or the channel went away: rsync sees the end and reports it
        finally:
            if chan is not None:
                chan.close()
                with self._lock:
                    self._chans.discard(chan)
            client.close()

    # -- node-to-node hops (sync's tree fan-out) ---------------------------------------------------
    def run_forwarding(self, command: str, agent_sock: str) -> Finished:
        """*command* on the node with *agent_sock* (the fan-out's own agent) forwarded to it, on
        this one channel only; :meth:`cancel` ends it."""
        if self.cancelled:
            return Finished(130, b"", b"cancelled")
        chan = self.conn.transport.open_session(timeout=30)
        with self._lock:
            self._chans.add(chan)
        try:
            chan.request_forward_agent(lambda agent_chan: _agent_relay(agent_chan, agent_sock))
            chan.exec_command(command)
            chan.shutdown_write()
            out, err = bytearray(), bytearray()
            while data := chan.recv(65536):
                out += data
            while data := chan.recv_stderr(65536):
                err += data
            code = chan.recv_exit_status()
        except (OSError, EOFError) as exc:
            return Finished(255, b"", str(exc).encode())
        finally:
            chan.close()
            with self._lock:
                self._chans.discard(chan)
        return Finished(code if not self.cancelled else 130, bytes(out), bytes(err))

    # -- the end -----------------------------------------------------------------------------
    def cancel(self) -> None:
        """End what runs now (rsync, hop commands) and refuse new ones (Ctrl-C, an error in ddpfab)."""
        self.cancelled = True
        with self._lock:
            procs, chans = list(self._procs), list(self._chans)
        for proc in procs:
            try:
                os.killpg(proc.pid, 15)
            except OSError:
                pass
        for chan in chans:
            chan.close()

    def close(self) -> None:
        """Stop serving rsync, remove the socket's directory, close the connection when owned."""
        with self._lock:
            listener, self._listener = self._listener, None
            chans = list(self._chans)
        if listener is not None:
            with contextlib.suppress(OSError):  # wakes the serving thread's accept(): close() alone does not
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
            shutil.rmtree(self._sock_dir, ignore_errors=True)
        for chan in chans:
            chan.close()
        if self.owned:
            self.conn.close()


def _agent_relay(chan, agent_sock: str) -> None:
    """Relay one forwarded-agent channel to *agent_sock* (paramiko calls this for each)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(agent_sock)
    except OSError:
        chan.close()
        return

    def pump(read, write, done) -> None:
        try:
            while data := read(65536):
                write(data)
        except (OSError, EOFError):
            pass
        finally:
            done()

    threading.Thread(target=pump, args=(chan.recv, sock.sendall, sock.close), daemon=True).start()
    threading.Thread(target=pump, args=(sock.recv, chan.sendall, chan.close), daemon=True).start()


def open_group(nodes: list[Node], policy: HostKeyPolicy, ssh_config: str | None = None,
               **kwargs) -> GroupResult[NodeRunner]:
    """A runner (its own connection) per node, opened in parallel; a node that failed has its SSHError."""
    from ddpfab.remote import ssh

    return ssh.parallel(nodes, lambda n: NodeRunner.open(n, policy, ssh_config, **kwargs))


def close_group(runners: dict[str, NodeRunner] | GroupResult) -> None:
    for r in list(runners.values()):
        if isinstance(r, NodeRunner):
            r.close()


# -- command lines (the only ones ddpfab builds for rsync, ssh on a node, and the agent) ------------
def rsync_argv(flags: tuple[str, ...] | list[str], files_from: str | None, rsh_e: str, src: str, dest: str, *,
               compress: bool = False, checksum: bool = False, dry_run: bool = False,
               trailing: bool = True) -> list[str]:
    """An rsync command line: *flags*, the options asked for, the file list, the remote shell."""
    argv = ["rsync", *flags]
    if compress:
        argv.append("--compress")
    if checksum:
        argv.append("--checksum")
    if dry_run:
        argv.append("--dry-run")
    if files_from is not None:
        argv.append(f"--files-from={files_from}")
    if trailing:
        src, dest = src.rstrip("/") + "/", dest.rstrip("/") + "/"
    return [*argv, "-e", rsh_e, src, dest]


def hop_rsh(stage: str, port: str | int, user: str) -> str:
    """The ``rsync -e`` a forwarding node uses to reach the next one: OpenSSH there, no config of
    its own, the next node's host key from the lines the controller staged, the forwarded agent."""
    return shlex.join([
        "ssh", "-F", "/dev/null", "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={stage}/known_hosts",
        "-o", "GlobalKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=yes",
        "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=6",
        "-p", str(port), "-l", user])


class Agent:
    """A dedicated ssh-agent for one sync: its socket in the sync's private temp dir, its keys
    destination-constrained and time-limited, the whole agent ended when the sync ends."""

    def __init__(self, ctl_dir: str, reaper: Reaper | None = None):
        self.sock = os.path.join(ctl_dir, "agent.sock")
        self.proc: subprocess.Popen | None = None
        self.reaper = reaper

    def start(self) -> str | None:
        if not (shutil.which("ssh-agent") and shutil.which("ssh-add")):
            return "ssh-agent/ssh-add not found on the controller"
        self.proc = subprocess.Popen(["ssh-agent", "-D", "-a", self.sock], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        if self.reaper:
            self.reaper.watch(self.proc.pid)
        deadline = time.monotonic() + 5
        while not os.path.exists(self.sock):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return "could not start ssh-agent: " + (self.proc.stderr.read().decode(errors="replace").strip()
                                                        if self.proc.poll() is not None else "timeout")
            time.sleep(0.01)
        return None

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("SSH_AGENT_PID", "DISPLAY", "SSH_ASKPASS")}
        env.update(SSH_AUTH_SOCK=self.sock, SSH_ASKPASS_REQUIRE="never")
        return env

    def add(self, keys: list[str], labels_file: str, constraints: list[str]) -> str | None:
        argv = ["ssh-add", "-q", "-t", str(AGENT_KEY_LIFETIME_S), "-H", labels_file]
        for c in constraints:
            argv += ["-h", c]
        proc = subprocess.run(argv + keys, env=self.env(), stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=30)
        if proc.returncode != 0:
            msg = " ".join((proc.stderr or proc.stdout).split())
            return f"ssh-add refused the key with destination constraints ({msg[-200:]}; needs OpenSSH >= 8.9 and " \
                   "a key without passphrase)"
        return None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.reaper:
            self.reaper.forget(self.proc.pid)
