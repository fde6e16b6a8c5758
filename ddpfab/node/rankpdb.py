"""A debugger in a rank of ``ddpfab run --pdb``: ``breakpoint()``, and an uncaught exception
(post-mortem), wait in pdb for the user instead of failing on a stdin that is /dev/null.
Standard library only: the node supervisor writes this file beside the ranks' ``sitecustomize``
(:mod:`ddpfab.node.exitguard`), which installs it in the ranks that :data:`RANKS_VAR` names.

How a stop reaches the user: the rank listens on a Unix socket in the run's private dir
(``<run dir>/pdb/rank-<RANK>.sock``, in a 0700 dir: only the job's user can connect, and a
debugger is that user's code execution), prints :data:`WAITS` on its stderr, and waits. ddpfab
sees that line in the rank's output, opens a channel on the node's SSH connection that relays
the socket, and the user's terminal drives pdb. ``continue`` without breakpoints closes the
session (the terminal is free again); ``quit`` does too, and the rank ends as pdb makes it end
(``BdbQuit``); after a post-mortem the rank exits with its exception, as without a debugger.
The session's end without a ``quit`` (the user's terminal closed, Ctrl-C in ``ddpfab debug``: the
relay went away) is no quit: the rank waits again where it is, for the next user (Ctrl-D at the
terminal is pdb's quit: ddpfab sends ``q``). An
exception raised inside a collective (:data:`COLLECTIVES`) gets no post-mortem: when one rank
fails, its peers' collectives fail after it, and the rank to debug is the one that failed first.
"""

import bdb
import os
import pdb
import socket
import sys
import threading

#: Which ranks stop: ``all``, or global ranks separated by commas.
RANKS_VAR = "DDPFAB_PDB"
#: The private dir of the ranks' sockets.
DIR_VAR = "DDPFAB_PDB_DIR"
#: The node's inventory name, for the prompt.
NODE_VAR = "DDPFAB_PDB_NODE"
#: The pid of the rank the hooks are installed in: processes it starts inherit it and stay without.
OWNER_VAR = "DDPFAB_PDB_PID"
#: An exception raised inside these modules is a collective's failure: most often a peer that went
#: away, whose own error is where a debugger helps. No post-mortem there (by where, not by text).
COLLECTIVES = ("torch.distributed.",)
#: The line a waiting rank prints; ddpfab matches it (launch/debugger.py, its WAITS).
WAITS = "ddpfab-pdb: rank %d (local rank %d) waits in pdb at %s (%s, pid %d)"


def wanted(spec, rank):
    """Whether *spec* (:data:`RANKS_VAR`'s value) names global rank *rank*."""
    if spec == "all":
        return True
    return str(rank) in spec.split(",")


def socket_path(directory, rank):
    return os.path.join(directory, "rank-%d.sock" % rank)


class Session:
    """One wait in the debugger: a socket that takes one connection, the user's."""

    def __init__(self, directory, rank, local_rank):
        self.rank, self.local_rank = rank, local_rank
        self.path = socket_path(directory, rank)
        self.conn = self.file = None
        self.kind = None
        try:
            os.unlink(self.path)  # a previous stop's, closed
        except OSError:
            pass
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # no umask change (it is the whole process's, its other threads' files included): the
            # socket's dir is 0700 already, and the socket itself is made 0600 before it listens
            self.listener.bind(self.path)
            os.chmod(self.path, 0o600)
            self.listener.listen(1)
        except OSError:
            self.listener.close()
            raise

    def wait(self, where, kind):
        """Say where the rank waits, then block until the user's relay connects; its stream. The
        line goes to the process's own stderr: torch's excepthook (init_process_group installs it)
        holds ``sys.stderr`` in a buffer while ours runs, and prints it only after."""
        self.kind = kind
        stream = sys.__stderr__ or sys.stderr
        stream.write(WAITS % (self.rank, self.local_rank, where, kind, os.getpid()) + "\n")
        stream.flush()
        self.conn, _ = self.listener.accept()
        self.listener.close()  # one user per stop: a second terminal finds no socket and says so
        try:
            os.unlink(self.path)
        except OSError:
            pass
        # a file each way: one text file for both would drop, at pdb's first answer, the commands
        # read ahead with the first (a write discards what a read buffered), so piped or pasted
        # lines after the first were lost
        self.file = _Duplex(self.conn.makefile("r", encoding="utf-8", errors="replace", newline="\n"),
                            self.conn.makefile("w", buffering=1, encoding="utf-8", errors="replace", newline="\n"))
        return self.file

    @property
    def open(self):
        """A user is attached and the session has not ended."""
        return self.file is not None

    def close(self):
        for thing in (self.file, self.conn, self.listener):
            try:
                if thing is not None:
                    thing.close()
            except OSError:
                pass
        self.file = self.conn = None
        try:
            os.unlink(self.path)
        except OSError:
            pass


class _Duplex(object):
    """A session's two text files over its socket as one stream: reads from *reader*, the rest
    (write, flush, encoding...) to *writer*."""

    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer

    def readline(self, *args):
        return self.reader.readline(*args)

    def read(self, *args):
        return self.reader.read(*args)

    def readlines(self, *args):
        return self.reader.readlines(*args)

    def readable(self):
        return True

    def __iter__(self):
        return iter(self.reader)

    def close(self):
        for f in (self.writer, self.reader):
            try:
                f.close()
            except (OSError, ValueError):
                pass

    def __getattr__(self, name):
        return getattr(self.writer, name)


class _Stream(object):
    """A session's stream to pdb, whose user may go away: a write after that goes nowhere (the
    user's program must not fail on it), and the read says so (an empty line: pdb's EOF)."""

    def __init__(self, file):
        self.file, self.gone = file, False

    def write(self, text):
        if not self.gone:
            try:
                self.file.write(text)
            except (OSError, ValueError):  # ValueError: the file was closed under us
                self.gone = True
        return len(text)

    def flush(self):
        if not self.gone:
            try:
                self.file.flush()
            except (OSError, ValueError):
                self.gone = True

    def readline(self, *args):
        if self.gone:
            return ""
        try:
            return self.file.readline(*args)
        except (OSError, ValueError):
            self.gone = True
            return ""

    def __getattr__(self, name):
        return getattr(self.file, name)


class RankPdb(pdb.Pdb):
    """pdb over a session's stream, whose prompt names the node and the rank. *reattach(where,
    kind)*: ``(session, stream)`` of a new session waited on, when the user went away without
    quitting (None: none could be made)."""

    def __init__(self, session, stream, node, reattach=None):
        self.stream = _Stream(stream)
        pdb.Pdb.__init__(self, stdin=self.stream, stdout=self.stream, nosigint=True)
        self.use_rawinput = False
        self.session = session
        self.reattach = reattach
        self.prompt = "%s rank %d (Pdb) " % (node, session.rank)

    def do_EOF(self, arg):
        """The session's end without a quit (ddpfab sends ``q`` for Ctrl-D): the user's relay went
        away. Wait for the next user here, then go on where this one left."""
        frame = self.curframe
        where = _where(frame) if frame is not None else "?"
        self.session.close()
        try:
            got = self.reattach(where, self.session.kind) if self.reattach is not None else None
        except KeyboardInterrupt:  # a SIGINT while nobody is attached ends the wait, as the first one's
            got = None
        if got is None:
            return pdb.Pdb.do_EOF(self, arg)
        self.session, stream = got
        self.stream = _Stream(stream)
        self.stdin = self.stdout = self.stream
        if frame is not None:
            self.print_stack_entry(self.stack[self.curindex])
        return None

    def set_continue(self):
        pdb.Pdb.set_continue(self)
        if not self.breaks:  # nothing can stop this rank again but a new breakpoint(): end the session
            self.session.close()

    def set_quit(self):
        pdb.Pdb.set_quit(self)
        self.session.close()


def _where(frame):
    return "%s:%d" % (frame.f_code.co_filename, frame.f_lineno)


def install(environ=None):
    """Install the hooks in this process if it is a rank that :data:`RANKS_VAR` names; True if it did."""
    env = os.environ if environ is None else environ
    spec, directory = env.get(RANKS_VAR), env.get(DIR_VAR)
    rank, local = env.get("RANK", ""), env.get("LOCAL_RANK", "")
    if not spec or not directory or not rank.isdigit() or not local.isdigit() or not wanted(spec, int(rank)):
        return False
    if env.get("PYTHONBREAKPOINT") == "0" or env.get(OWNER_VAR):  # breakpoint() turned off; not the rank
        return False
    env[OWNER_VAR] = str(os.getpid())
    hooks = Hooks(directory, int(rank), int(local), env.get(NODE_VAR) or socket.gethostname())
    sys.breakpointhook = hooks.breakpointhook
    sys.excepthook = hooks.excepthook
    return True


def _victim(etype, tb):
    """Whether an exception is a collective's failure: raised inside one, or of a collective's
    error type surfacing elsewhere (DDP's all-reduce in backward()): a peer went away (a victim),
    or ddpfab stops the job. By where and by type, never by text."""
    last = tb
    while last.tb_next is not None:
        last = last.tb_next
    return (str(last.tb_frame.f_globals.get("__name__", "")).startswith(COLLECTIVES)
            or (str(getattr(etype, "__module__", "")) + ".").startswith(COLLECTIVES))


class Hooks(object):
    """The rank's ``sys.breakpointhook`` and ``sys.excepthook``: a stop waits for the user on a
    session, the one already attached when there is one."""

    def __init__(self, directory, rank, local_rank, node):
        self.directory, self.rank, self.local_rank, self.node = directory, rank, local_rank, node
        self.owner = os.getpid()  # a process the rank forks (a DataLoader worker) keeps the defaults
        self.original_excepthook = sys.excepthook
        self.original_breakpointhook = sys.breakpointhook
        self.current = None  # the session a user is attached to: a stop while it lasts is driven there too
        self.lock = threading.Lock()  # one stop at a time: each would take the rank's one socket path

    def session_for(self, where, kind):
        """The attached session, else a new one waited on (None: no socket could be made, said)."""
        if self.current is not None and self.current.open:
            return self.current, self.current.file
        try:
            session = Session(self.directory, self.rank, self.local_rank)
        except OSError as exc:  # a socket path too long for AF_UNIX, a full disk: no debugger, said
            (sys.__stderr__ or sys.stderr).write("ddpfab: rank %d cannot wait in pdb (%s)\n" % (self.rank, exc))
            return None, None
        self.current = session
        return session, session.wait(where, kind)

    def reattach(self, where, kind):
        """After a user went away without quitting: ``(session, stream)`` of the next user, waited
        for here; None when no socket could be made."""
        with self.lock:
            session, stream = self.session_for(where, kind)
        return None if session is None else (session, stream)

    def breakpointhook(self, *args, **kwargs):
        if os.getpid() != self.owner:
            return self.original_breakpointhook(*args, **kwargs)
        frame = sys._getframe(1)
        with self.lock:
            session, stream = self.session_for(_where(frame), "breakpoint")
        if session is not None:
            RankPdb(session, stream, self.node, self.reattach).set_trace(frame)
        return None

    def excepthook(self, etype, value, tb):
        # the traceback, in the log, as without a debugger (under torch's excepthook: after the session)
        self.original_excepthook(etype, value, tb)
        if (tb is None or issubclass(etype, (bdb.BdbQuit, KeyboardInterrupt, SystemExit))
                or os.getpid() != self.owner or _victim(etype, tb)):
            return
        last = tb
        while last.tb_next is not None:
            last = last.tb_next
        session = debugger = None
        try:
            with self.lock:
                session, stream = self.session_for(_where(last.tb_frame), "post-mortem: %s" % etype.__name__)
            if session is not None:
                debugger = RankPdb(session, stream, self.node, self.reattach)
                debugger.reset()
                debugger.interaction(None, tb)
        except Exception:  # noqa: BLE001 - the debugger failed: the rank ends as it would have
            pass
        finally:
            if debugger is not None:  # (the session it ends with: a user who came back has a new one)
                debugger.session.close()
            elif session is not None:
                session.close()
