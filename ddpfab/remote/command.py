"""``ddpfab exec``: one ad-hoc command on every node at once, output prefixed per host, exit codes summed up.

    ddpfab exec -i inv.yml -- nvidia-smi -L
    ddpfab exec -i inv.yml --nodes gpu01,gpu03 -- 'ss -tlnp | grep 295'

Quoting rule: several words after ``--`` are one command, each word quoted for the remote shell
(``shlex.join``): ``-- ls "my dir"`` lists the directory ``my dir``. A single word is passed to the
remote shell as it is, so pipes, redirections, ``$VARS`` and ``&&`` work: ``-- 'ls | wc -l'``.

Each node connects and runs on its own thread through the same SSH layer as ``ddpfab run`` (host
keys verified; an unreachable node is reported, the others still run). stdout lines go to stdout,
stderr lines to stderr, each prefixed ``<host> |`` as they arrive. The exit status is 0 when every
node exited 0, else the first failing node's exit code (255 for a node ddpfab could not reach).
The command runs after the node's ``ddpfab_setup`` lines (a failing one: exit 96, the line named
on stderr), with the node's python (:mod:`ddpfab.hosts.nodeenv`) in ``$DDPFAB_PYTHON`` and its
directory first on PATH, so ``python`` there is the python a run would use.
The remote command gets no terminal and reads /dev/null; its process group (the SSH session's)
ends (TERM, then KILL after 2 s) when the connection closes, so a Ctrl-C here (exit 130) leaves
nothing running on any node, unlike plain ``ssh host cmd``.
"""

from __future__ import annotations

import shlex
import threading
import time

from ddpfab.hosts import nodeenv
from ddpfab.remote import ssh, streams
from ddpfab.remote.output import HostResult, Printer, tell_ended


#: The fallback watcher's TERM to the command's process group ``$p``, once more after 0.2 s when the
#: group is not there yet (a connection that closes at once can beat the ``setsid`` child to making it).
TERM_GROUP = 'kill -s TERM -- "-$p" || { sleep 0.2; kill -s TERM -- "-$p"; }'


#: The watcher's 2 s between its TERM and its KILL, in short sleeps: a watcher that the guard ends
#: because the command ended meanwhile leaves at most a 0.1 s ``sleep`` behind, not a 2 s one. (A
#: ``sleep`` that takes whole seconds only refuses 0.1: then one 2 s sleep, as before.)
PAUSE = "i=0; while [ $i -lt 20 ]; do sleep 0.1 || { sleep 2; break; }; i=$((i+1)); done"


#: The guard shell's variable that holds the command (set from stdin by :func:`stdin_for`).
COMMAND_VAR = "__ddpfab_cmd"
#: Run the command, which then no longer sees it in that variable.
_EVAL = f'eval "unset -v {COMMAND_VAR}; ${COMMAND_VAR}"'


def guarded() -> str:
    """The command (in :data:`COMMAND_VAR`, read from stdin before this: :func:`stdin_for`) run
    so that it ends with the connection: stdin from /dev/null, while a watcher reads this SSH
    session's stdin, which ddpfab keeps open; when it closes (ddpfab exits, is interrupted or
    killed, or the connection drops) the watcher ends the command's whole process group, TERM
    then KILL. Without it a quiet remote command would outlive a Ctrl-C (no terminal, so no
    SIGHUP). The command's text is in no process's argv on the node: another user's ``ps`` does
    not show it (a token typed into it), and ``pgrep -f`` in it finds only what it looks for.

    OpenSSH starts a session's shell as the leader of a new session (``setsid`` in sshd), so the
    shell's own group can be the command's: the command runs in a subshell (a fork, no new
    program) and the watcher is a shell loop. Two program starts per node fewer than a ``setsid``
    shell and a ``cat``: a third of the CPU a short command costs a node. The guard shell catches
    TERM and the watcher ignores it, so a command that signals its own group (``kill 0``, a
    ``trap 'kill 0' EXIT``) ends itself only: its exit code is reported and the watcher still
    guards what survives. The command sees none of the guard's variables (``g``, ``w``, ``_``, the
    command's), as in a plain ``ssh host cmd``. Where the shell does not lead its group (another
    SSH server: read from ``/proc``), the command gets a session of its own from ``setsid`` (its
    text then in that shell's argv) and a ``cat`` watches."""
    return ("exec 3<&0; "
            'if read -r _ _ _ _ g _ 2>/dev/null </proc/$$/stat && [ "$g" = "$$" ]; then '
            "trap '' TERM; "
            f"( while read -r _; do :; done <&3; kill -s TERM 0; {PAUSE}; kill -s KILL 0 ) >/dev/null 2>&1 & w=$!; "
            f"trap : TERM; ( unset -v g w _; {_EVAL} ) </dev/null 3<&- & p=$!; exec 3<&-; "
            # a TERM to the group interrupts the wait: wait again until the command has ended
            'while wait "$p"; c=$?; kill -0 "$p" 2>/dev/null; do :; done; kill -s KILL "$w"; exit "$c"; '
            "fi; "
            f'setsid "${{SHELL:-sh}}" -c "${COMMAND_VAR}" </dev/null 3<&- & p=$!; '
            f'( cat <&3 >/dev/null; {TERM_GROUP}; {PAUSE}; kill -s KILL -- "-$p" ) >/dev/null 2>&1 & w=$!; '
            'exec 3<&-; wait "$p"; c=$?; kill "$w" 2>/dev/null; exit "$c"')


def stdin_for(node, command: str) -> tuple[str, bytes]:
    """(the shell that goes first, what goes first on stdin) for *command* on *node*: the node's
    setup, with its python first on PATH, then the command into :data:`COMMAND_VAR`, both read
    from stdin (:data:`ddpfab.hosts.nodeenv.BOOTSTRAP`). The command is one line there whatever
    its newlines (each a ``$__nl`` between its quoted parts): the bootstrap joins lines one by one,
    which a shell does in time that grows with the square of their number."""
    quoted = shlex.quote(command)
    if "\n" not in quoted:
        return nodeenv.setup_stdin(node, export_python=True, then=f"{COMMAND_VAR}={quoted}")
    # (a newline is always inside a single-quoted part of shlex.quote's output)
    joined = quoted.replace("\n", "'\"$__nl\"'")
    return nodeenv.setup_stdin(node, export_python=True, then=f"__nl=$(printf '\\n.'); __nl=${{__nl%.}}; "
                                                             f"{COMMAND_VAR}={joined}; unset -v __nl")


def _pump(chan, read, name: str, printer: Printer, stderr: bool, node=None) -> None:
    for line in streams.lines(read):
        if node is not None and line.startswith(nodeenv.SETUP_MARK):  # the bootstrap's own, said as ddpfab says it
            line = "ddpfab: " + (nodeenv.node_setup_failure(node, nodeenv.SETUP_FAILED, line) or line)
        printer.line(name, line, stderr)
        if printer.closed:  # nobody reads on: closing the channel ends the command (see guarded)
            chan.close()
            return


def _pump_stderr(chan, node, printer: Printer) -> None:
    """stderr's pump, on a thread of its own: its failures (the --timeout's TimeoutError, a closed
    channel) end it quietly; the stdout side reports them as the node's result. A setup line's
    failure is said as the line it is (exit status :data:`ddpfab.hosts.nodeenv.SETUP_FAILED`)."""
    try:
        _pump(chan, chan.recv_stderr, node.name, printer, True, node)
    except OSError:
        return


def host_error(exc: BaseException) -> str:
    """How a failure to reach or run on a node reads in its result: an SSHError is its own
    sentence (it names the hop and the fix); anything else its type and message."""
    return str(exc) if isinstance(exc, ssh.SSHError) else f"{type(exc).__name__}: {exc}"


def run_on(node, command: str, policy, ssh_config: str | None, printer: Printer,
           timeout: float | None = None) -> HostResult:
    """Connect to *node*, run *command*, stream its output; never raises."""
    start = time.monotonic()
    conn = None
    try:
        conn = ssh.connect(node, policy, ssh_config)
        return run_in(conn.transport.open_session(timeout=30), node, command, printer, timeout, start=start)
    except Exception as exc:  # noqa: BLE001 - a failure on one host is data
        return HostResult(node.name, error=host_error(exc), seconds=time.monotonic() - start)
    finally:
        if conn is not None:
            conn.close()


def run_in(chan, node, command: str, printer: Printer, timeout: float | None = None,
           channels: list | None = None, start: float | None = None) -> HostResult:
    """Run *command* on *node* in the open session *chan*, streaming its output to *printer*;
    never raises. The channel is added to *channels* (when given: closing it ends the command), and
    closed here unless the command exited (a --timeout, a closed printer): it ends there too."""
    result = HostResult(node.name)
    start = time.monotonic() if start is None else start
    try:
        if channels is not None:
            channels.append(chan)
        if printer.closed:  # the reader went away before this node started: never start it
            return result
        if timeout:
            chan.settimeout(timeout)
        # after the node's setup, with its python first on PATH; our end of stdin stays open:
        # closing it ends the command
        bootstrap, head = stdin_for(node, command)  # the setup and the command, read before the guard
        chan.exec_command(bootstrap + guarded())
        chan.sendall(head)
        err_thread = threading.Thread(target=_pump_stderr, args=(chan, node, printer), daemon=True)
        err_thread.start()
        _pump(chan, chan.recv, node.name, printer, False)
        if printer.closed:  # ended by us: no exit status will come
            return result
        err_thread.join(timeout=timeout)
        code = chan.recv_exit_status()
        if code == -1:
            result.error, result.end = "the SSH session ended without an exit status", "no exit status"
        else:
            result.exit_code = code
    except TimeoutError:
        result.error, result.end = f"no output and no exit within {timeout:g} s (--timeout)", "timeout"
    except Exception as exc:  # noqa: BLE001 - a failure on one host is data
        result.error = host_error(exc)
    finally:
        if result.exit_code is None:
            chan.close()
        result.seconds = time.monotonic() - start
    return result


def exec_all(nodes, command: str, policy, ssh_config: str | None, printer: Printer,
             timeout: float | None = None) -> dict[str, HostResult]:
    def one(node) -> HostResult:
        result = run_on(node, command, policy, ssh_config, printer, timeout)
        tell_ended(printer, result)
        return result

    results = ssh.parallel(list(nodes), one)
    return {k: (v if isinstance(v, HostResult) else HostResult(k, error=repr(v))) for k, v in results.items()}
