"""``ddpfab run --tmux``: the plan's launches in a tmux session, one window per node.

Each window runs its node's launch (the command ``plan --emit`` writes, placed on the node over
the run's connection, so no secret is in any command line) through ``ssh -t``: a terminal there,
so Ctrl-C and the keyboard reach that node's torchrun and its ranks (a ``breakpoint()`` is
driven in its window). ddpfab watches the windows: the first launch that ends with a failure stops
the others (Ctrl-C in their windows, then their processes are ended over the connection); closing
the session, or Ctrl-C to ddpfab, ends every node's; ddpfab killed (SIGKILL) closes the session
(:func:`tie_session`), so the windows' ssh and the nodes' launches end. The run is recorded as any
run.

What it runs without: the node supervisor (its output relay and log, exit guard, GPU leases, hang
watch); the ranks' output is in the windows and in torchrun's per-rank logs on the nodes.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import queue
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ddpfab.hostlist import compact, fold_by
from ddpfab.launch.execute import STOP_GRACE_S, Printer
from ddpfab.launch.interrupt import Interrupted, signals_queued
from ddpfab.node.agent import TMUX_PID
from ddpfab.optionnames import option
from ddpfab.planning.emit import interactive_line, node_script
from ddpfab.planning.plan import NodePlan, Plan, PlanError
from ddpfab.problems import DdpfabError
from ddpfab.remote import nodeprogram as nodeprog
from ddpfab.remote import ssh
from ddpfab.remote.target import Target, config_alias, config_ssh_argv, ssh_argv, ssh_config_text

if TYPE_CHECKING:  # (slow to import: see ddpfab.remote.ssh.connect; api imports this module for refuse())
    from fabric import Connection

#: The launch, in the node's record of the run beside its session's pid (TMUX_PID); the launch is
#: removed at the end, the pid stays with the node's exit code: the node's record of the run
LAUNCH = "tmux-launch.sh"
#: The launch's first line: ``sh FILE`` reads on from the open file, so the file (which may hold
#: secret values) is gone from the node as soon as its window started it, whatever happens next.
SELF_REMOVE = 'rm -f -- "$0"\n'
#: The session's tie to this ddpfab: a FIFO this process holds open (so it is open exactly as
#: long as this process lives); the tmux server waits on it and closes the session when it ends
#: without the word :data:`KEEP` (ddpfab was killed: SIGKILL, OOM), so the windows' ssh go and
#: with them the nodes' launches.
ALIVE = "alive"
KEEP = b"keep\n"
#: The session option the tmux job sets once it holds the FIFO open: the windows start their
#: nodes only then, so no launch runs untied.
TIED = "@ddpfab_tied"
#: Seconds ddpfab, and each window, wait for the tie.
TIE_WAIT_S = 30
#: How often the windows' ends are looked for
POLL_S = 0.2
#: Seconds a node may take to store its launch.
PLACE_TIMEOUT_S = 30
INSTALL_HINT = "install it (Debian/Ubuntu: apt-get install tmux; macOS: brew install tmux)"


def refuse(tmux: bool, **others: object) -> None:
    """PlanError when ``--tmux`` cannot run here or with the *others* given (the run's option, by its
    :class:`ddpfab.api.Options` field name -> value)."""
    if not tmux:
        return
    if shutil.which("tmux") is None:
        raise PlanError(f"{option('tmux')}: tmux is not installed on this machine; {INSTALL_HINT}")
    given = [option(name) for name, value in others.items() if value]
    if given:
        raise PlanError(f"{option('tmux')} with {', '.join(given)}: each window runs the node's launch without "
                        f"ddpfab's node supervisor, which those need; run without {option('tmux')}")


def session_name(run_id: str) -> str:
    """The tmux session of run *run_id* (tmux reads ``.`` and ``:`` in a target as separators)."""
    return "ddpfab-" + run_id.replace(".", "-").replace(":", "-")


def server_socket(environ: dict[str, str] | None = None) -> str:
    """The socket of the tmux server that this process's ``tmux`` commands reach: inside tmux the
    one it runs in (``$TMUX``: socket,pid,session; ``tmux -L NAME`` too), else the default one
    (``${TMUX_TMPDIR:-/tmp}/tmux-UID/default``)."""
    env = os.environ if environ is None else environ
    inside = env.get("TMUX", "").split(",")[0]
    if inside:
        return inside
    return os.path.join(env.get("TMUX_TMPDIR") or "/tmp", f"tmux-{os.getuid()}", "default")


def recorded_socket(manifest: dict | None) -> str | None:
    """The tmux server's socket a ``--tmux`` run's record names (:func:`server_socket` when it
    started), read as data: a path, else None."""
    socket = (manifest or {}).get("tmux_socket")
    return socket if isinstance(socket, str) and socket else None


def attach_line(session: str, socket: str | None) -> str:
    """How a terminal here joins *session* of the server at *socket* (recorded by the run):
    ``tmux attach -t NAME``, with ``-S SOCKET`` when that is not the server this terminal reaches."""
    other = ["-S", socket] if socket is not None and socket != server_socket() else []
    return shlex.join(["tmux", *other, "attach", "-t", session])


def launch_text(plan: Plan, node: NodePlan) -> str:
    """What a window runs on *node*: ``plan --emit``'s bare script (the node's setup, then the launch)."""
    return node_script(plan, node)


def window_program(node: NodePlan, config: Path, exit_file: Path, target: Target, session: str) -> list[str]:
    """The window's program, run by ``sh`` whatever the user's shell: once *session* is tied to
    its ddpfab (:func:`tie_session`; else the window ends, its node not started), ssh with a
    terminal there, recording the session's pid (the node's process tree is that session; ``exec
    sh -c`` so that the node's login shell may be any) and starting the launch; then the exit
    status, here, and the window kept open to be read until the session closes."""
    inner = f"echo $$ > {shlex.quote(f'{node.remote_dir}/{TMUX_PID}')} && exec sh {shlex.quote(f'{node.remote_dir}/{LAUNCH}')}"
    remote = f"exec sh -c {shlex.quote(inner)}"
    if config_alias(node.name):
        ssh = config_ssh_argv(str(config), node.name, remote, tty=True)
    else:
        ssh = ssh_argv(target, remote, tty=True)
    said = f"ddpfab: {node.name}'s launch ended, exit code $code; this window stays until the session closes"
    tied = (f"n=0; until [ \"$(tmux show-options -qv -t {shlex.quote(f'={session}:')} {TIED})\" = 1 ]; do "
            f"n=$((n+1)); [ $n -gt {TIE_WAIT_S * 10} ] && exit 1; sleep 0.1; done; ")
    return ["sh", "-c", f"{tied}{shlex.join(ssh)}; code=$?; echo $code > {shlex.quote(str(exit_file))}; "
                        f"echo; echo \"{said}\"; exec sleep 2147483647"]


class TmuxError(DdpfabError):
    """A tmux command failed; the message says which and what tmux said."""

    check = "tmux"


class RunIdInUse(DdpfabError):
    """The run's id is taken where the run would start: its tmux session, or a node's record."""

    check = "tmux"


#: The placing command's exit status when the node has the run's record already
IN_USE = 3


def tmux(*args: str, check: bool = True, socket: str | None = None) -> subprocess.CompletedProcess:
    """``tmux ARGS`` (on the server at *socket*; None: this process's); with *check*, a TmuxError
    when it fails."""
    res = subprocess.run(["tmux", *(["-S", socket] if socket else []), *args], capture_output=True, text=True,
                         check=False)
    if check and res.returncode != 0:
        raise TmuxError(f"tmux {args[0]} failed: {res.stderr.strip() or f'exit code {res.returncode}'}")
    return res


@dataclass
class Windows:
    """The session's windows (by tmux window id: a node's name may hold a ``.``) and how each
    node's launch ended: its exit status from the window, or 255 when its window was closed."""

    plan: Plan
    session: str
    exits_dir: Path
    ids: dict[str, str] = field(default_factory=dict)
    ended: dict[str, int] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # the nodes, in the order their launch ended
    stopped: dict[str, str] = field(default_factory=dict)  # node -> why ddpfab ended its launch (:func:`_end_all`)
    tie: int | None = None  # this process's end of the session's tie (:data:`ALIVE`)

    @property
    def target(self) -> str:
        """The session, matched exactly (a bare name also matches a longer one: tmux's prefix rule)."""
        return f"={self.session}"

    def exit_file(self, name: str) -> Path:
        return self.exits_dir / f"{name}.exit"

    def poll(self) -> list[str]:
        """The nodes whose launch ended since the last poll (a window closed by hand: 255)."""
        open_ids = set(tmux("list-windows", "-t", self.target, "-F", "#{window_id}", check=False).stdout.split())
        new = []
        for name in self.running():
            path = self.exit_file(name)
            text = path.read_text().strip() if path.exists() else ""
            if text:
                self.ended[name] = int(text) if text.isdigit() else 255
            elif self.ids.get(name) in open_ids or not open_ids:  # (no windows at all: the session is gone)
                continue
            else:
                self.ended[name] = 255
            self.order.append(name)
            new.append(name)
        return new

    def alive(self) -> bool:
        return tmux("has-session", "-t", self.target, check=False).returncode == 0

    def attached(self) -> bool:
        """Someone looks at the session (a client is attached to it)."""
        # (display-message's -t is a pane's: the session's current one; a bare =NAME printed nothing)
        res = tmux("display-message", "-p", "-t", f"{self.target}:", "#{session_attached}", check=False)
        return res.returncode == 0 and res.stdout.strip() not in ("", "0")

    def interrupt(self, names: list[str]) -> None:
        """Ctrl-C in each of *names*' windows: to its torchrun, as a user's would be."""
        for name in names:
            if name in self.ids:
                tmux("send-keys", "-t", self.ids[name], "C-c", check=False)

    def close(self, name: str) -> None:
        if name in self.ids:
            tmux("kill-window", "-t", self.ids[name], check=False)

    def running(self) -> list[str]:
        return [n.name for n in self.plan.nodes if n.name not in self.ended]


def place_launches(plan: Plan, conns: dict[str, Connection], placing: Placing) -> None:
    """Each node's launch into its record dir, private (it may hold secret values), over stdin,
    on every node at once; it removes itself as its window starts it (:data:`SELF_REMOVE`). A node
    that has taken it is added to *placing*'s ``placed`` (what the end may remove or signal there:
    nothing else), and only then is its copy kept there (:func:`_place`'s keep line). A copy that
    is not in it is removed by its node: one cut short, one refused, one finished after the caller
    abandoned the placing (an interrupt: this function abandons it too), or one whose sender was
    killed. RunIdInUse when a node has the run's record already (a run with this id, from another
    runs dir, runs or ran there), TmuxError when a node could not take it: the first such node in
    the plan's order is named."""
    try:
        results = ssh.parallel(plan.nodes, lambda node: _place(plan, node, conns[node.name], placing))
    except BaseException:
        placing.abandon()
        raise
    for node in plan.nodes:
        outcome = results[node.name]
        if isinstance(outcome, Exception):
            raise outcome


class Placing:
    """What the nodes' placing threads share with the caller: ``placed``, and whether the caller
    has gone (:meth:`abandon`; it may be called again): after that a node is never added, and its
    copy is not kept there. The caller reads ``placed`` only after abandoning."""

    def __init__(self) -> None:
        self.placed: list[str] = []
        self.abandoned, self.lock = False, threading.Lock()

    def abandon(self) -> None:
        with self.lock:
            self.abandoned = True

    def keep(self, name: str) -> bool:
        """Add *name* to ``placed``, unless the placing was abandoned (then False)."""
        with self.lock:
            if not self.abandoned:
                self.placed.append(name)
            return not self.abandoned

    def unkeep(self, name: str) -> None:
        """Take *name* out of ``placed`` again (its node removed the copy itself), unless the
        caller may have read it already."""
        with self.lock:
            if not self.abandoned and name in self.placed:
                self.placed.remove(name)


def _place(plan: Plan, node: NodePlan, conn: Connection, placing: Placing) -> None:
    """*node*'s launch, as :func:`place_launches` says, in three steps on one channel: the node
    creates the launch file (or says that the run id is another run's there), reads the launch,
    and keeps it only when a last line follows it: the keep line, sent once *placing* has kept the
    node. A copy whose sender has gone (the placing abandoned, this process killed, the connection
    cut) gets its input's end without that line, and the node removes it itself."""
    d, mark = shlex.quote(node.remote_dir), secrets.token_hex(8)
    launch, created, kept = f"{d}/{LAUNCH}", f"ddpfab-created {mark}", f"# kept {mark}"
    place = _place_script(d, launch, created, kept)
    text = f"{SELF_REMOVE}# {mark}\n{launch_text(plan, node)}".encode()
    ours = f"grep -qx {shlex.quote('# ' + mark)} {launch} && rm -f {launch}"
    deadline, taken, code, err = time.monotonic() + PLACE_TIMEOUT_S, False, -1, b""
    chan = conn.transport.open_session(timeout=PLACE_TIMEOUT_S)
    try:
        chan.settimeout(PLACE_TIMEOUT_S)
        chan.exec_command(f"exec sh -c {shlex.quote(place)}")  # (whatever the login shell)
        if _said(chan, created.encode(), deadline):
            try:
                chan.sendall(text)  # in one write
                taken = placing.keep(node.name)
                if taken:
                    chan.sendall(f"\n{kept}\n".encode())
            except TimeoutError:
                raise
            except OSError:
                pass  # (it ended: its status says why)
        chan.shutdown_write()
        while not chan.exit_status_ready():
            if time.monotonic() > deadline:
                raise TimeoutError
            time.sleep(0.01)
        code = chan.recv_exit_status()
        err = _rest_of_stderr(chan, deadline)
    except BaseException as exc:
        if not taken:  # (the node removes it at its input's end; this is for a node that did not see it)
            _remove(conn, ours)
        if isinstance(exc, TimeoutError):
            raise TmuxError(f"{node.name}: no answer within {PLACE_TIMEOUT_S:g} s while the launch was placed "
                            f"in {node.remote_dir}") from None
        raise
    finally:
        chan.close()
    if code == IN_USE:  # (another run's files: never this run's to remove)
        raise RunIdInUse(f"{node.name}: run id {plan.run_id} is in use there ({node.remote_dir} holds a run's "
                         f"record: a run with this id, from another runs dir or machine, runs or ran there); "
                         f"give this run another {option('run_id')}")
    if code != 0:
        if code == 1 and taken:  # the node's script failed and removed the copy: nothing there is ours now
            placing.unkeep(node.name)
        if code not in (1, IN_USE) and not taken:  # (a lost connection's -1, a signal: the answer is lost)
            _remove(conn, ours)
        if placing.abandoned:  # (the caller has gone: the copy was not to be kept)
            return
        stderr = err.decode(errors="replace").strip()
        raise TmuxError(f"{node.name}: the launch could not be placed in {node.remote_dir} (exit code "
                        f"{code}{': ' + stderr[-300:] if stderr else ''})")


def _place_script(d: str, launch: str, created: str, kept: str) -> str:
    """The node's side of :func:`_place` (*d* and *launch* quoted): refuse another run's dir,
    create the launch file, say *created*, read the launch, keep it only if it ends with *kept*."""
    # (PIPE ignored: an ended channel fails the echo, which removes the file, instead of killing sh)
    return (f"trap '' PIPE && umask 077 && mkdir -p {d} && for f in agent.json {TMUX_PID} {LAUNCH}; do "
            f"if [ -e {d}/$f ]; then exit {IN_USE}; fi; done && set -C && "
            f"{{ true > {launch} || {{ [ -e {launch} ] && exit {IN_USE}; exit 1; }}; }} && set +C && "
            f"{{ echo && echo {created} && cat >> {launch} && "
            f"[ \"$(tail -n 1 {launch})\" = {shlex.quote(kept)} ] || {{ rm -f {launch}; exit 1; }}; }}")


def _rest_of_stderr(chan, deadline: float) -> bytes:
    """What *chan*'s command wrote on stderr, to its end (which can come after its exit status),
    within *deadline*."""
    err = b""
    try:
        while time.monotonic() < deadline:
            data = chan.recv_stderr(65536)
            if not data:
                break
            err += data
    except OSError:  # (a timeout: what came is enough to say why)
        pass
    return err


def _said(chan, line: bytes, deadline: float) -> bool:
    """Whether *chan*'s command wrote *line* (random: a line that ends with it is the command's)
    before its output's end; what a login shell prints before it is skipped."""
    buf = b""
    while time.monotonic() < deadline:
        data = chan.recv(4096)
        if not data:
            return False
        buf += data
        if any(ln.rstrip(b"\r").endswith(line) for ln in buf.split(b"\n")[:-1]):
            return True
        buf = buf[-(len(line) + 4096):]
    raise TimeoutError


def _remove(conn: Connection, ours: str) -> None:
    """Run *ours* (the removal of a copy by its mark), whatever happens: the copy is not the end's
    to remove. Tried twice: a connection the caller closed meanwhile is opened again by Fabric."""
    from invoke.exceptions import CommandTimedOut  # (Fabric's run raises it; see ssh.connect for why here)

    for _ in range(2):
        try:
            conn.run(f"exec sh -c {shlex.quote(ours)}", hide=True, warn=True, pty=False, in_stream=False,
                     timeout=PLACE_TIMEOUT_S)
            return
        except CommandTimedOut:
            return
        except Exception:  # noqa: BLE001 - anything but a timeout: once more
            continue


def end_node(conn: Connection, node: NodePlan, run_id: str, signal_name: str) -> bool:
    """Signal what is left of *node*'s launch (the node program's ``signal_tmux``: the processes of
    the session its window's ssh started that carry this run). True when some process was
    signalled."""
    reply = nodeprog.call(conn, node, {"op": "signal_tmux", "dir": node.remote_dir, "run_id": run_id,
                                       "signal": signal_name}, timeout=30)[0]
    return bool(reply.value(node.name).get("signalled"))


def _end_nodes(plan: Plan, conns: dict[str, Connection], names: list[str], signal_name: str) -> list[str]:
    """:func:`end_node` on *names* at once; those where some process was signalled (a node that
    cannot be reached now is not among them: nothing more can be done there from here)."""
    done = ssh.parallel([plan.node(n) for n in names], lambda node: end_node(conns[node.name], node, plan.run_id,
                                                                            signal_name))
    return [n for n in names if done.succeeded.get(n) is True]


def cleanup_node(conn: Connection, node: NodePlan, code: int | None = None, stopped: str | None = None) -> None:
    """Remove the launch this mode placed on the node (it holds the env's secret values); where its
    window started it, the node's record of the run is its session's pid and, when known, its
    exit code (*code*): ``ps`` lists the run as ended there, ``stop`` finds it ended. A launch that
    failed because ddpfab ended it (*stopped*: why) is recorded as stopped, as a supervisor records
    it (unless ``ddpfab stop`` wrote its own why first): ``ps`` says ``stopped``."""
    d = shlex.quote(node.remote_dir)
    line = f"rm -f {d}/{LAUNCH}"
    if code is not None:
        line += f" && if [ -f {d}/{TMUX_PID} ]; then echo {int(code)} > {d}/exit_code; fi"
        if code != 0 and stopped:
            line += (f" && if [ -f {d}/{TMUX_PID} ] && [ ! -e {d}/stopped ]; then "
                     f"printf '%s\\n' {shlex.quote(stopped)} > {d}/stopped; fi")
    conn.run(line, hide=True, warn=True, pty=False, in_stream=False)


def _say_ended(windows: Windows, names: list[str], printer: Printer, how: str = "") -> None:
    """*names*' launches ended: a line per exit code, its nodes folded (``node[1-31] (31 nodes)``)."""
    ranked = sorted(names, key=lambda n: windows.plan.node(n).node_rank)  # (not the order they ended in)
    for group, code in fold_by({n: windows.ended[n] for n in ranked}):
        whose = "its launch" if len(group) == 1 else "their launches"
        printer.note(f"{compact(group)}: {whose} ended, exit code {code}{how}")


def _wait_ended(windows: Windows, names: list[str], printer: Printer, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    ended: list[str] = []
    try:
        while any(n in windows.running() for n in names) and time.monotonic() < deadline:
            time.sleep(POLL_S)
            ended += windows.poll()
    finally:  # (said also when a second signal cuts the wait)
        _say_ended(windows, ended, printer, " (stopped)")


def _end_all(plan: Plan, conns: dict[str, Connection], windows: Windows, names: list[str],
             printer: Printer, why: str) -> None:
    """Ctrl-C in *names*' windows; what is left after the grace is ended over the connection
    (SIGTERM, then SIGKILL); a window whose launch still has not ended is closed. *why* (``stopped
    by ddpfab: node2 failed``) is each one's record of it, for ``ps`` (:func:`cleanup_node`)."""
    for name in names:
        windows.stopped.setdefault(name, why)
    if not windows.alive():
        _end_windowless(plan, conns, windows, names, printer)
        return
    windows.interrupt(names)
    _wait_ended(windows, names, printer, STOP_GRACE_S)
    for sig in ("TERM", "KILL"):
        # a node that cannot be reached now: its window is closed below
        _end_nodes(plan, conns, [n for n in names if n in windows.running()], sig)
        _wait_ended(windows, names, printer, STOP_GRACE_S)
    for name in [n for n in names if n in windows.running()]:
        windows.close(name)
        _ended(windows, name, printer, "its launch did not end when stopped; its window was closed")


def _end_windowless(plan: Plan, conns: dict[str, Connection], windows: Windows, names: list[str],
                    printer: Printer) -> None:
    """*names*' launches with the session gone (closed by hand, or by ``stop``): no window can say
    how a launch ended, so each node ends what is left of its launch itself, as ``stop`` does
    there (the node program's ``stop``: SIGTERM, SIGKILL after the grace) and says what it found
    (mostly nothing: the windows' ssh went with the session, and the launches with them). A node
    that cannot be reached now is left to its window's ssh, gone with the session."""
    _say_ended(windows, windows.poll(), printer)  # (one that ended before the session went wrote its status)
    left = [n for n in names if n in windows.running()]
    done = ssh.parallel([plan.node(n) for n in left], lambda node: nodeprog.call(
        conns[node.name], node, {"op": "stop", "dir": node.remote_dir, "grace": STOP_GRACE_S},
        timeout=STOP_GRACE_S + 30)[0].value(node.name))
    for name in left:
        if name not in done.succeeded:
            _ended(windows, name, printer, "cannot be reached now: its launch there ends with its window's ssh")
            continue
        said = done.succeeded[name].get("said") if isinstance(done.succeeded[name], dict) else None
        said = said if isinstance(said, str) else "ended (the node said nothing more)"
        _ended(windows, name, printer, _SAID.get(said, said))


#: The node program's ``stop`` words, as a closed session's end says them.
_SAID = {"absent": "nothing of its launch was left", "its tmux launch had ended": "its launch had ended with its window"}


def _ended(windows: Windows, name: str, printer: Printer, how: str) -> None:
    """*name*'s launch is over without a status from its window (255, as ssh says a lost session)."""
    windows.ended[name] = 255
    windows.order.append(name)
    printer.note(f"{name}: {how}")


def _leave_nothing(plan: Plan, conns: dict[str, Connection], placed: list[str],
                   codes: dict[str, int] | None = None, stopped: dict[str, str] | None = None) -> None:
    """After the run, on each node where it *placed* its launch: what is left of the launch's
    session (a rank its torchrun left behind) ended, then the launch removed and each node's exit
    code (*codes*) recorded beside its session's pid, with why ddpfab ended it where it did
    (*stopped*: :func:`cleanup_node`)."""
    signalled = _end_nodes(plan, conns, placed, "TERM")
    if signalled:
        time.sleep(STOP_GRACE_S)
        _end_nodes(plan, conns, signalled, "KILL")
    # every node at once; one that cannot be reached now keeps what is left there (a launch its
    # window started removed itself)
    ssh.parallel([plan.node(n) for n in placed],
                 lambda node: cleanup_node(conns[node.name], node, (codes or {}).get(node.name),
                                           (stopped or {}).get(node.name)))


def start_session(plan: Plan, targets: dict[str, Target], run_dir: Path) -> Windows:
    """The session, one window per node, in node_rank order, tied to this process (:func:`
    tie_session`); its name is the run's. TmuxError when tmux refuses (a session of that name
    exists) or the tie is not made: then the session is closed before anything runs on a node."""
    config = run_dir / "ssh_config"
    fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(ssh_config_text(targets))
    windows = Windows(plan, session_name(plan.run_id), run_dir / "tmux")
    windows.exits_dir.mkdir(mode=0o700, exist_ok=True)
    asked = False  # tmux was asked for the session: it may exist, though no window id came back
    try:
        for node in sorted(plan.nodes, key=lambda n: n.node_rank):
            program = window_program(node, config, windows.exit_file(node.name), targets[node.name], windows.session)
            if not windows.ids:
                asked = True
                made = tmux("new-session", "-d", "-s", windows.session, "-n", node.name, "-x", "200", "-y", "50",
                            "-P", "-F", "#{window_id}", *program)
                windows.ids[node.name] = made.stdout.strip()
                tie_session(windows)  # (the window waits for it before it starts its node)
            else:
                made = tmux("new-window", "-d", "-t", f"{windows.target}:", "-n", node.name, "-P", "-F",
                            "#{window_id}", *program)
                windows.ids[node.name] = made.stdout.strip()
    except BaseException:
        if windows.tie is not None:
            os.close(windows.tie)  # (untied: the job, if it runs, closes the session too)
            windows.tie = None
        # an interrupt while tmux made the session (Ctrl-C reaches the tmux client too) leaves one
        # with no window id here: closed when its window runs this run's program (one of that name
        # tmux refused to make is not this run's, and stays)
        if windows.ids or (asked and _runs_our_program(windows)):
            tmux("kill-session", "-t", windows.target, check=False)
        raise
    return windows


def _runs_our_program(windows: Windows) -> bool:
    """Whether the session of this run's name has a window running this run's program (its
    command names this run's exit files)."""
    res = tmux("list-panes", "-s", "-t", windows.target, "-F", "#{pane_start_command}", check=False)
    return res.returncode == 0 and str(windows.exits_dir) in res.stdout


def tie_session(windows: Windows) -> None:
    """Close the session when this process ends without :func:`untie` (killed): a tmux job opens
    a FIFO this process holds open, says so (the session option :data:`TIED`, which the windows
    wait for), and waits for a word; EOF (every writer gone) closes the session. TmuxError when
    the job has not said it within :data:`TIE_WAIT_S`."""
    fifo = windows.exits_dir / ALIVE
    os.mkfifo(fifo, 0o600)
    windows.tie = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # not inherited: only this process holds it
    path, target = shlex.quote(str(fifo)), shlex.quote(windows.target)
    options = shlex.quote(f"{windows.target}:")  # (an option's -t is a pane's: the session's current one)
    job = (f"exec 3< {path}; rm -f {path}; tmux set-option -t {options} {TIED} 1; "
           f"if read -r word <&3; then :; else tmux kill-session -t {target}; fi")
    tmux("run-shell", "-b", "-t", windows.target, job.replace("#", "##"))  # (run-shell expands #{...})
    deadline = time.monotonic() + TIE_WAIT_S
    while tmux("show-options", "-qv", "-t", f"{windows.target}:", TIED, check=False).stdout.strip() != "1":
        if time.monotonic() > deadline:
            raise TmuxError(f"tmux did not run the job that ties session {windows.session} to ddpfab "
                            f"within {TIE_WAIT_S} s")
        time.sleep(0.05)


def untie(windows: Windows) -> None:
    """This process has ended the run: the session stays as long as someone looks at it."""
    if windows.tie is not None:
        with contextlib.suppress(OSError):
            os.write(windows.tie, KEEP)
        os.close(windows.tie)
        windows.tie = None


def close_session(session: str, socket: str | None = None) -> str:
    """``stop`` of a ``--tmux`` run: its session closed (the ddpfab that watches it then ends every
    node's launch; without one, the windows' ssh going ends them), on the server at *socket* (the
    run's record's; None: this terminal's). What happened, in words."""
    if (shutil.which("tmux") is None
            or tmux("has-session", "-t", f"={session}", check=False, socket=socket).returncode != 0):
        return f"tmux session {session}: not found here (closed already, or another machine's)"
    tmux("kill-session", "-t", f"={session}", check=False, socket=socket)
    return f"tmux session {session}: closed"


def open_plan_session(plan: Plan, emit_dir: Path, targets: dict[str, Target]) -> str:
    """``plan --tmux``: a session with a window per node in *emit_dir*, each with the node's line
    from the emitted README typed at its prompt, not run: Enter in a window starts that node
    (with synchronize-panes, every node at once). Returns the session's name."""
    session = session_name(plan.run_id)
    for i, node in enumerate(sorted(plan.nodes, key=lambda n: n.node_rank)):
        if i == 0:
            made = tmux("new-session", "-d", "-s", session, "-n", node.name, "-c", str(emit_dir), "-x", "200",
                        "-y", "50", "-P", "-F", "#{window_id}")
        else:
            made = tmux("new-window", "-d", "-t", f"={session}:", "-n", node.name, "-c", str(emit_dir), "-P", "-F",
                        "#{window_id}")
        tmux("send-keys", "-t", made.stdout.strip(), "-l", interactive_line(node, targets))
    return session


def attach(session: str) -> subprocess.Popen | None:
    """The user's terminal onto the session, when there is one (inside tmux: switch to it)."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return None
    if os.environ.get("TMUX"):
        tmux("switch-client", "-t", f"={session}", check=False)
        return None
    return subprocess.Popen(["tmux", "attach-session", "-t", f"={session}"])


@dataclass
class Ended:
    """How a ``--tmux`` run ended."""

    exit_code: int
    first_failure: str | None  # the node whose launch failed first
    summary: str
    interrupted: str | None = None  # what ended it from outside (a signal to ddpfab, the session closed)
    exit_codes: dict[str, int] = field(default_factory=dict)  # node -> its launch's exit status


def _interrupted(plan: Plan, conns: dict[str, Connection], windows: Windows, printer: Printer,
                 exc: BaseException) -> Ended:
    printer.note(f"interrupted ({exc}): ending every node's launch")
    _end_all(plan, conns, windows, windows.running(), printer, f"stopped by ddpfab: the run was interrupted ({exc})")
    return Ended(exc.exit_code if isinstance(exc, Interrupted) else 130, None, f"interrupted ({exc})",
                 interrupted=str(exc))


def watch(plan: Plan, conns: dict[str, Connection], windows: Windows, printer: Printer) -> Ended:
    """Until every node's launch ended (or the run was interrupted: a signal to ddpfab, SIGHUP
    too, or the session closed)."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    first: str | None = None
    hangup = signal.getsignal(signal.SIGHUP)
    if threading.current_thread() is threading.main_thread():  # (the terminal went away: as Ctrl-C)
        signal.signal(signal.SIGHUP, lambda signum, frame: events.put(Interrupted(signum)))
    try:
        with signals_queued(events):
            while windows.running():
                with contextlib.suppress(queue.Empty):
                    return _interrupted(plan, conns, windows, printer, events.get(timeout=POLL_S))
                ended = windows.poll()
                _say_ended(windows, ended, printer)
                for name in ended:
                    code = windows.ended[name]
                    if code not in (0, 255) and first is None and (why := _stopped_by_stop(plan, conns, name)):
                        # `ddpfab stop` (from anywhere: it may not find this session) ended it: no failure
                        printer.note(f"{name}: {why}: ending every node's launch")
                        if windows.running():
                            _end_all(plan, conns, windows, windows.running(), printer,
                                     f"stopped by ddpfab: the run was stopped from outside on {name}")
                        return Ended(128 + signal.SIGTERM, None, f"stopped from outside on {name} ({why}); "
                                     "every node's launch was ended", interrupted=why)
                    if code != 0 and first is None:
                        first = name
                        others = windows.running()
                        if others:
                            printer.note(f"{name} failed: stopping the other nodes ({', '.join(others)})")
                            _end_all(plan, conns, windows, others, printer, f"stopped by ddpfab: {name} failed")
                if windows.running() and not windows.alive():
                    printer.note(f"the tmux session {windows.session} was closed: ending every node's launch")
                    _end_all(plan, conns, windows, windows.running(), printer,
                             f"stopped by ddpfab: the tmux session {windows.session} was closed")
                    return Ended(130, None, f"interrupted: the tmux session {windows.session} was closed",
                                 interrupted="tmux session closed")
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGHUP, hangup)
    return _verdict(plan, windows, first)


def _stopped_by_stop(plan: Plan, conns: dict[str, Connection], name: str) -> str | None:
    """What ``ddpfab stop`` wrote in *name*'s record of this run as it ended the node's launch
    (:func:`ddpfab.node.agent.stop_job`), read back as data; None when it wrote nothing (the
    launch failed, or was ended by this run) or the node cannot say within 5 s. (Not asked after
    ssh's own failure, 255: the node may be gone.)"""
    node = plan.node(name)
    try:
        reply = nodeprog.call(conns[name], node, {"op": "ps", "root": posixpath.dirname(node.remote_dir.rstrip("/")),
                                                   "run_id": plan.run_id}, timeout=5)[0]
    except Exception:  # noqa: BLE001 - a node that cannot say is judged by its exit code, as before
        return None
    runs = reply.result.get("runs") if reply.ok and isinstance(reply.result, dict) else None
    for rec in runs if isinstance(runs, list) else ():
        if isinstance(rec, dict) and rec.get("run_id") == plan.run_id and isinstance(rec.get("stopped"), str):
            return nodeprog.printable(rec["stopped"]) or None
    return None


def _verdict(plan: Plan, windows: Windows, first: str | None) -> Ended:
    if first is None:
        return Ended(0, None, f"succeeded: every node's launch ended with exit code 0 ({plan.nnodes} nodes)")
    node = plan.node(first)
    stopped = [n for n in windows.order if n != first and windows.ended[n] != 0]
    return Ended(windows.ended[first], first,
                 f"failed: {first} (node_rank {node.node_rank}) exit code {windows.ended[first]}"
                 + (f"; the others were stopped ({', '.join(stopped)})" if stopped else ""))


def run(plan: Plan, conns: dict[str, Connection], targets: dict[str, Target], run_dir: Path,
        printer: Printer, record: Callable[[Ended], None]) -> Ended:
    """Place the launches, open the session, watch it; *record(how it ended)*, then wait for an
    attached terminal to leave the session. On return every node's launch has ended (whatever
    went wrong in between: a failure to start, Ctrl-C) and what was placed on the nodes is removed;
    the session is gone unless someone looks at it."""
    from paramiko import SSHException  # (a cold connection's failure; see ssh.connect for why here)

    windows: Windows | None = None
    client = None
    placing = Placing()
    try:
        session = session_name(plan.run_id)
        if tmux("has-session", "-t", f"={session}", check=False).returncode == 0:
            raise RunIdInUse(f"tmux session {session} exists already (a run with this id, from another runs dir?); "
                             f"give this run another {option('run_id')}, or close that session: "
                             f"tmux kill-session -t {session}")
        place_launches(plan, conns, placing)
        windows = start_session(plan, targets, run_dir)
        printer.note(f"run {plan.run_id} in tmux session {windows.session}: one window per node "
                     f"(tmux attach -t {windows.session}; Ctrl-b w lists them; Ctrl-b : setw synchronize-panes)")
        client = attach(windows.session)
        ended = watch(plan, conns, windows, printer)
    except KeyboardInterrupt as exc:  # before the watch (or a second signal): end whatever started
        ended = Ended(exc.exit_code if isinstance(exc, Interrupted) else 130, None, f"interrupted ({exc})",
                      interrupted=str(exc) or "SIGINT")
    except (TmuxError, RunIdInUse, ssh.SSHError, SSHException, OSError, EOFError) as exc:
        printer.note(f"{option('tmux')}: could not start: {exc}")
        ended = Ended(1, None, f"failed to start in tmux: {exc}")
    finally:
        if windows is not None:
            untie(windows)
            if not windows.attached():
                tmux("kill-session", "-t", windows.target, check=False)
            else:  # it stays while someone looks at it, and closes when they detach (its windows only sleep)
                tmux("set-option", "-t", f"{windows.target}:", "destroy-unattached", "on", check=False)
        placing.abandon()  # (again: a second signal may have cut place_launches' own short)
        _leave_nothing(plan, conns, placing.placed, dict(windows.ended) if windows else None,
                       dict(windows.stopped) if windows else None)
    ended.exit_codes = dict(windows.ended) if windows else {}
    record(ended)
    if client is not None:
        client.wait()
    return ended
