"""``ddpfab shell``: an interactive shell on a node that is what ddpfab starts there, or a rank.

The shell starts in the node's workdir, after the node's setup lines (``ddpfab_setup``,
``ddpfab_conda_env``), with the node's python first on PATH; for a rank of a recorded run
(``--run-id RUN --rank R``) with that rank's whole environment too: the run's env and what
torchrun gives each worker (MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK,
...), so ``python train.py`` there is that rank. Its prompt names the node (and the rank).

Nothing of it is in a command line: the shell's start file (setup lines, exports, prompt) goes
over a first channel's stdin into a 0600 file in the user's ``~/.ddpfab/shell`` (0700), which the
shell reads and removes as it starts; the terminal's channel (a pty) runs only ``bash --rcfile
FILE -i`` (``sh`` with ``ENV=FILE`` where there is no bash). Input that is not a terminal (``printf
'cmd\n' | ddpfab shell node1``) is a script: read to its end here, it runs as ``exec``'s commands
do (:func:`ddpfab.remote.command.guarded`: on stdin, after the setup, in the same environment, no
pty, stdout and stderr apart, and ended with the connection), and its exit status is the shell's.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import shlex
import signal
import sys
import termios
import tty
from collections.abc import Iterable, Mapping
from typing import BinaryIO

from ddpfab.hosts import nodeenv
from ddpfab.masking import was_masked
from ddpfab.planning.plan import Plan
from ddpfab.remote.streams import write_all

#: The node's dir of start files (0700), under the user's home.
SHELL_DIR = "~/.ddpfab/shell"
#: The most a piped shell input (a script) may hold: it travels on the command's stdin, which
#: the node's shell reads a byte at a time (:data:`ddpfab.hosts.nodeenv.BOOTSTRAP`).
MAX_SCRIPT_BYTES = 1 << 20


def rank_env(plan: Plan, rank: int, given: Mapping[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """(rank *rank*'s environment as its process had it, the keys left out because the record masks
    their values): the run's env on its node, then torchrun's per-worker variables, then *given*
    (values for the masked keys, or any other), which wins."""
    node, local = plan.node_of_rank(rank)
    env: dict[str, str] = {}
    masked = []
    for key, value in dict(node.env).items():
        if was_masked(key, value, plan.secret_env):
            masked.append(key)
        else:
            env[key] = value
    if node.nproc > 1:  # torchrun's default for its workers when more than one shares the node
        env.setdefault("OMP_NUM_THREADS", "1")
    env.update({
        "MASTER_ADDR": plan.master_addr, "MASTER_PORT": str(plan.master_port), "RANK": str(rank),
        "LOCAL_RANK": str(local), "WORLD_SIZE": str(plan.world_size), "LOCAL_WORLD_SIZE": str(node.nproc),
        "GROUP_RANK": str(node.node_rank), "GROUP_WORLD_SIZE": str(plan.nnodes), "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(plan.world_size), "ROLE_NAME": "default", "TORCHELASTIC_RUN_ID": plan.run_id,
        "DDPFAB_RUN_ID": plan.run_id})
    env.update(given or {})
    return env, [k for k in masked if k not in (given or {})]


def start_file(node, workdir: str, env: Mapping[str, str], prompt: str, path: str) -> str:
    """The shell's start file: it removes itself, then the node's setup and python (as every
    command ddpfab starts there: :func:`ddpfab.hosts.nodeenv.prefix`), the workdir, the exports,
    the prompt. *node*: a Node or a NodePlan."""
    lines = [f"rm -f {home_word(path)}", '[ -f "$HOME/.bashrc" ] && [ -n "$BASH_VERSION" ] && . "$HOME/.bashrc"']
    lines.append(nodeenv.prefix(node, export_python=True).rstrip("\n"))
    lines += _enter(workdir, env, or_else="")  # a terminal stays open where the workdir is missing
    lines.append(f"PS1={shlex.quote(prompt)}")
    return "\n".join(line for line in lines if line) + "\n"


def _enter(workdir: str, env: Mapping[str, str], or_else: str) -> list[str]:
    """The lines that put a shell in *workdir* with *env* exported; a missing workdir is said,
    then *or_else* runs (nothing, or ``exit 1``)."""
    missing = f"printf 'ddpfab: the workdir %s is not there\\n' {shlex.quote(workdir)} >&2"
    lines = [f"cd {_path_word(workdir)} || " + (f"{{ {missing}; {or_else}; }}" if or_else else missing)]
    return lines + [f"export {key}={shlex.quote(value)}" for key, value in env.items()]


def _path_word(path: str) -> str:
    """*path* as a shell word, ``~/`` left to the shell."""
    return "~/" + shlex.quote(path[2:]) if path.startswith("~/") else shlex.quote(path)


def home_word(path: str) -> str:
    """A ``~/`` path of :func:`new_start_path` as a double-quoted shell word (no spaces in it)."""
    return '"$HOME/' + path.removeprefix("~/") + '"'


def new_start_path() -> str:
    return f"{SHELL_DIR}/rc-{secrets.token_hex(8)}"


def write_command(path: str) -> str:
    """The command of the first channel: its stdin into *path*, private."""
    folder = home_word(SHELL_DIR)
    return f"umask 077 && mkdir -p {folder} && chmod 700 {folder} && cat > {home_word(path)}"


def shell_command(path: str) -> str:
    """The terminal channel's command: an interactive shell that starts with the file at *path*."""
    home = home_word(path)
    return f"if command -v bash >/dev/null 2>&1; then exec bash --rcfile {home} -i; else ENV={home} exec sh -i; fi"


def script_body(workdir: str, env: Mapping[str, str], script: str) -> str:
    """What a shell whose input is not a terminal runs (after the node's setup, which
    :func:`ddpfab.remote.command.stdin_for` puts first): the workdir, the exports, the *script*."""
    return "\n".join(_enter(workdir, env, or_else="exit 1")) + "\n" + script


class _Streams:
    """A printer (:class:`ddpfab.remote.output.Printer`) that writes a node's lines as they are:
    stdout's to stdout, stderr's to stderr."""

    closed = False

    def line(self, name: str, text: str, stderr: bool = False) -> None:
        stream = sys.stderr if stderr else sys.stdout
        stream.write(text + "\n")
        stream.flush()

    def ended(self, result) -> None:
        """(The shell's exit status is its own.)"""


def run_script(conn, node, workdir: str, env: Mapping[str, str], script: str) -> int:
    """*script* (the input of a shell that is not a terminal) on *conn*'s node, as the shell would
    run it; its exit status. ConnectionError when it did not run to an exit status."""
    from ddpfab.remote.command import run_in  # (the SSH stack: only this path needs it)

    result = run_in(conn.transport.open_session(timeout=30), node, script_body(workdir, env, script), _Streams())
    if result.exit_code is None:
        raise ConnectionError(f"{node.name}: {result.error or 'no exit status'}")
    return result.exit_code


class _WindowSize:
    """This terminal's size changes (SIGWINCH), passed on to *chan*'s pty by the loop that reads
    :meth:`fileno`. A signal handler runs in the main thread wherever it is, which may be inside
    paramiko with the channel's lock held: resizing there would wait for that lock for ever. So
    the handler only writes a byte to a pipe."""

    def __init__(self, chan, fd: int):
        self.chan, self.fd = chan, fd
        self.r, self.w = os.pipe()
        try:
            os.set_blocking(self.w, False)
            self.old = signal.signal(signal.SIGWINCH, self.signalled)
        except BaseException:  # not the main thread (ValueError): no pipe left open
            os.close(self.r)
            os.close(self.w)
            raise

    def signalled(self, *_) -> None:
        with contextlib.suppress(OSError):  # the pipe is full: a resize is pending already
            os.write(self.w, b"w")

    def fileno(self) -> int:
        return self.r

    def apply(self) -> None:
        os.read(self.r, 512)
        try:
            cols, rows = os.get_terminal_size(self.fd)
            self.chan.resize_pty(width=cols, height=rows)
        except Exception:  # noqa: BLE001 - a terminal hung up, a channel closing: the loop sees its end next
            pass

    def close(self) -> None:
        try:  # (None: a handler not set from Python; the default then)
            signal.signal(signal.SIGWINCH, self.old if self.old is not None else signal.SIG_DFL)
        finally:
            os.close(self.r)
            os.close(self.w)


def interact(chan, stdin_fd: int = 0, stdout_fd: int = 1) -> int:
    """This terminal in raw mode to *chan* (a pty channel) until it closes; its exit status. The
    terminal's size follows this one's (SIGWINCH)."""
    is_tty = os.isatty(stdin_fd)
    saved = termios.tcgetattr(stdin_fd) if is_tty else None
    size = None
    try:
        if is_tty:
            size = _WindowSize(chan, stdin_fd)
            tty.setraw(stdin_fd)
        reading = True
        while True:
            fds = [chan] + ([stdin_fd] if reading else []) + ([size] if size else [])
            ready, _, _ = select.select(fds, [], [], 0.5)
            if size is not None and size in ready:
                size.apply()
            if chan in ready:
                data = chan.recv(65536)
                if not data:
                    break
                write_all(stdout_fd, data)
            if stdin_fd in ready:
                data = os.read(stdin_fd, 4096)
                if data:
                    chan.sendall(data)
                else:  # end of input: the shell gets EOF and exits
                    chan.shutdown_write()
                    reading = False
            if chan.exit_status_ready() and not chan.recv_ready():
                break
        return chan.recv_exit_status()
    finally:
        if saved is not None:
            termios.tcsetattr(stdin_fd, termios.TCSADRAIN, saved)
        if size is not None:
            size.close()


def terminal_size(fd: int = 0) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return 80, 24
    return size.columns or 80, size.lines or 24  # a pty nobody sized says 0 x 0


def masked_note(keys: Iterable[str]) -> str | None:
    keys = list(keys)
    if not keys:
        return None
    return (f"not set (masked in the run's record): {', '.join(keys)}; give "
            f"{'them' if len(keys) > 1 else 'it'} with --env KEY=VALUE (or --env KEY for this shell's value)")


def term_name() -> str:
    return os.environ.get("TERM") or "xterm"


def piped_script(stream: BinaryIO | None = None) -> str | None:
    """The script on this process's stdin when that is not a terminal (a pipe, a file,
    /dev/null: a pty would never pass its end on), else None. Its bytes are kept as they are
    (undecodable ones travel unchanged: ``surrogateescape``). ValueError when it is over
    :data:`MAX_SCRIPT_BYTES`."""
    if stream is None:
        if os.isatty(0):
            return None
        stream = sys.stdin.buffer
    data = stream.read(MAX_SCRIPT_BYTES + 1)
    if len(data) > MAX_SCRIPT_BYTES:
        raise ValueError(f"the shell's input is over {MAX_SCRIPT_BYTES >> 20} MiB: a script that long goes "
                         "to the node as a file (in the synced workdir) and runs from there")
    return data.decode("utf-8", "surrogateescape")


def run_shell(conn, node, workdir: str, env: Mapping[str, str], prompt: str, script: str | None = None) -> int:
    """An interactive shell on *conn*'s node (see the module), this terminal driving it; its exit
    status. With *script* (:func:`piped_script`), that runs instead (:func:`run_script`)."""
    if script is not None:
        return run_script(conn, node, workdir, env, script)
    path = new_start_path()
    first = conn.transport.open_session(timeout=30)
    try:
        first.exec_command(write_command(path))
        first.sendall(start_file(node, workdir, env, prompt, path).encode())
        first.shutdown_write()
        code = first.recv_exit_status()
    finally:
        first.close()
    if code != 0:
        raise ConnectionError(f"could not write the shell's start file on {node.name} (exit {code})")
    chan, started = None, False
    try:
        chan = conn.transport.open_session(timeout=30)
        cols, rows = terminal_size()
        chan.get_pty(term=term_name(), width=cols, height=rows)
        chan.exec_command(shell_command(path))
        started = True  # (the shell removes its start file as it starts)
        return interact(chan)
    finally:
        if chan is not None:
            chan.close()
        if not started:  # the start file holds the rank's env (its secrets too): it must not stay there
            _remove_start_file(conn, path)
        sys.stdout.flush()


def _remove_start_file(conn, path: str) -> None:
    """Remove the start file at *path* of a shell that did not start; as far as the link allows."""
    with contextlib.suppress(Exception):  # (a link that failed: nothing more can be done over it)
        chan = conn.transport.open_session(timeout=10)
        try:
            chan.exec_command(f"rm -f {home_word(path)}")
            chan.recv_exit_status()
        finally:
            chan.close()
