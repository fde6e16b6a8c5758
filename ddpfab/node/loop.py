"""The node program's request loop and the workdir's lock: the first part of the program.

The protocol (:func:`serve`): after the program's code, stdin carries requests, each one frame
(``LENGTH\\n`` then LENGTH bytes of JSON: ``{"id": N, "op": NAME, ...arguments}``), read byte-exactly
so whatever follows stays in the pipe. Each request gets one JSON line on stdout,
``{"id": N, "op": NAME, "ok": true, "result": {...}}`` or ``{"id": N, "op": NAME, "ok": false,
"error": TEXT}``: a failing operation is data, the next request still runs. The program ends at
stdin EOF (listeners of a mesh probe close then). Some operations take the session over and are
last in it: ``supervise`` (the job supervisor: stdin carries heartbeats, stdout the job's output),
``follow`` (a run's output, raw), ``stage`` with ``hold`` (its one reply, then EOF ends it), and
``--replicate``'s ``replica_send`` (its reply, then the file's bytes) and ``replica_receive`` (the
file's bytes follow its frame on stdin).

:mod:`ddpfab.node.workdir`, :mod:`ddpfab.node.treehash` and this module, in that order, are a whole
program by themselves (:data:`ddpfab.remote.nodeprogram.WORKDIR_PART`): they answer the workdir's operations
(probe, commit, hash, locate, stage, lock, unlock). A session that needs nothing else, sync's check
of an unchanged tree, ships that part alone: a third of the text, and a third less of the node
python's start. The modules after it add their operations to :data:`OPS`, :data:`TAKEOVER` and
:data:`RAW` (:mod:`ddpfab.node.ops`); a request for one the part does not have is refused as an
unknown operation. Standard library only, Python 3.6+.
"""

import errno
import fcntl
import json
import os
import shutil
import signal
import sys
import time

try:  # as a module of ddpfab; on a node their source comes first in the same program. Relative on
    # purpose: on a node with ddpfab installed, an absolute import would load that (other) version.
    from .treehash import (RecordError, digest, node_commit, node_hash, node_locate, node_probe, node_stage,
                           node_workdir)
    from .workdir import WorkdirError
except ImportError:
    pass

#: How a node program's replies start: a line that does not is not a reply (e.g. a warning a
#: sitecustomize printed) and is skipped by the controller.
REPLY_KEYS = ("id", "op", "ok")


# -- reading stdin and records ---------------------------------------------------------------------
def read_exactly(fd, n):
    """*n* bytes from *fd* (a pipe may deliver fewer per read), or fewer if it ends first."""
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def read_frame(fd=0):
    """One ``LENGTH\\n`` + LENGTH bytes frame from *fd*, read byte-exactly: what follows on stdin
    (heartbeats, the stop byte) must stay in the pipe. EOFError at a clean end (no byte of a
    frame read), ValueError for a broken or truncated frame."""
    header = b""
    while not header.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte and not header:
            raise EOFError("end of requests")
        if not byte or len(header) > 20:
            raise ValueError("a frame header is LENGTH and a newline, got %r" % header[:24]) from None
        header += byte
    try:
        n = int(header)
    except ValueError:
        raise ValueError("a frame header is LENGTH and a newline, got %r" % header[:24]) from None
    data = read_exactly(fd, n)
    if len(data) != n:
        raise ValueError("a frame is truncated (%d of %d bytes)" % (len(data), n))
    return data


def read_fields(fd, fields, longest=200):
    """The JSON object in open file *fd*, only its *fields* ((name, type) pairs) of the right type:
    a printable string of at most *longest* characters, a positive number, a list of short
    printable strings; {} when none is valid. (Lock and lease files: whoever wrote them, what
    they hold is data, checked, never trusted.)"""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = json.loads(os.read(fd, 4096).decode("utf-8"))
    except (OSError, ValueError):
        return {}
    out = {}
    for key, kind in fields if isinstance(data, dict) else ():
        v = data.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else kind):
            continue
        if isinstance(v, str) and (len(v) > longest or not v.isprintable()):
            continue
        if isinstance(v, (int, float)) and v <= 0:
            continue
        if kind is list:
            v = [g for g in v[:64] if isinstance(g, str) and len(g) < 80 and g.isprintable()]
        out[key] = v
    return out


# -- one writer per workdir (ddpfab.transfer.sync) ---------------------------------------------------------
#: Where a sync's lock files live (one per workdir, named by its real path's hash): in the SSH
#: user's home, not in the workdir, because the lock is taken before ddpfab may write there (a
#: workdir that does not exist yet, or that is refused as not ddpfab's, must stay untouched).
LOCK_DIR = "~/.ddpfab/locks"
#: The holder's fields a waiting sync reads back (as data: each checked for its type).
HOLDER_FIELDS = (("user", str), ("host", str), ("pid", int), ("since", float), ("src", str), ("node_pid", int))


def lock_path(real):
    """The lock file of workdir *real* (its resolved path) on this node."""
    name = "sync-%s.lock" % digest("sha256", os.fsencode(real)).hexdigest()[:32]
    return os.path.join(os.path.expanduser(LOCK_DIR), name)


def read_holder(fd):
    """Who holds the lock of open lock file *fd*, as the holder wrote it: only fields of the right
    type (a short printable string, a positive number); {} when nothing valid is there."""
    return read_fields(fd, HOLDER_FIELDS, longest=512)


def op_lock(req, session):
    """Take the write lock of the workdir this session's probe checked (``flock``: the kernel
    releases it when this program ends, however it ends) and write ``holder`` into it; wait up to
    ``wait_s`` seconds (the workdir: the probed one, else the request's). ``{"locked": true}``, or
    ``{"locked": false, "holder": ...}`` (who has it)."""
    real, checking = session.get("probed"), False
    if not real and req.get("workdir"):  # a check that only reads (sync's hash-only fast path)
        _, real = node_workdir(req)
        checking = True
    if not real:
        raise NodeOpError("lock: no workdir probed in this session")
    if session.get("lock", (None,))[0] == real:
        return {"locked": True}
    path = lock_path(real)
    if checking and not os.path.exists(path):
        # no sync ever locked this workdir (so none is changing it): a check creates nothing on the node
        return {"locked": True, "held": False}
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    deadline = time.monotonic() + max(0.0, float(req.get("wait_s", 0)))
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise
        if time.monotonic() >= deadline:
            holder = read_holder(fd)
            os.close(fd)
            return {"locked": False, "holder": holder}
        time.sleep(0.05)
    holder = dict(req.get("holder") or {}, node_pid=os.getpid())
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(holder).encode("utf-8"))
    session["lock"] = (real, fd)
    return {"locked": True}


def op_unlock(req, session):
    """Release this session's workdir lock (a sync that must wait for another node's lock holds
    none meanwhile: two syncs never wait for each other)."""
    held = session.pop("lock", None)
    if held:
        os.close(held[1])  # closing the only descriptor releases the flock
    return {"locked": False}


def _locked(fn):
    """An operation that changes a workdir: with ``locked`` in the request it runs only while this
    session holds that workdir's lock."""
    def op(req, session):
        if req.get("locked"):
            _, real = node_workdir(req)
            if session.get("lock", (None,))[0] != real:
                raise NodeOpError("%s is not locked by this session; refusing to change it" % real)
        out = fn(req, session)
        if req.get("op") == "probe" and isinstance(out, dict) and "real" in out:
            session["probed"] = out["real"]
        return out
    return op


# -- the loop -------------------------------------------------------------------------------------
class NodeOpError(Exception):
    """An operation's own failure, reported as its error reply (with its *code*, when it has one:
    a short stable key the controller acts on, so it never matches the error's text)."""

    def __init__(self, message, code=None):
        Exception.__init__(self, message)
        self.code = code


def _treehash(fn):
    """treehash's operations report some failures in their result (``{"error": ...}``)."""
    def op(req, session):
        out = fn(req)
        if isinstance(out, dict) and "error" in out:
            raise NodeOpError(out["error"], out.get("code"))
        return out
    return op


#: Operations with one reply each: the workdir's here, the others added by :mod:`ddpfab.node.ops`
#: (where the program has them: see the module's docstring).
OPS = {
    "probe": _locked(_treehash(node_probe)), "commit": _locked(_treehash(node_commit)), "hash": _treehash(node_hash),
    "lock": op_lock, "unlock": op_unlock,
    "locate": _treehash(node_locate), "stage": _treehash(node_stage),
}
#: Operations that take the session over (last in it); their exit status is the program's. Each
#: gets the request only (:mod:`ddpfab.node.ops` adds ``supervise`` and ``follow``).
TAKEOVER = {}  # type: dict
#: Operations that read raw bytes after their frame or write them after their reply, last in a
#: session like :data:`TAKEOVER`: each gets ``(request, session, fd, write)`` and returns the exit
#: status (:mod:`ddpfab.node.ops` adds ``replica_send`` and ``replica_receive``).
RAW = {}  # type: dict


def reply(rid, op, result=None, error=None, code=None):
    """One reply as its JSON line."""
    out = {"id": rid, "op": op, "ok": error is None}
    if error is None:
        out["result"] = result
    else:
        out["error"] = error
        if code:
            out["code"] = code
    return json.dumps(out) + "\n"


def handle(req, session, fn=None):
    """Run one request (by its op, or with *fn*); its reply line (never an exception: the next
    request still runs)."""
    if not isinstance(req, dict):
        return reply(None, None, error="a request is a JSON object, got %s" % type(req).__name__)
    rid, op = req.get("id"), req.get("op")
    fn = fn or (OPS.get(op) if isinstance(op, str) else None)
    if fn is None:
        known = ", ".join(sorted(list(OPS) + list(TAKEOVER) + list(RAW)))
        return reply(rid, op, error="unknown operation %r (known: %s)" % (op, known))
    try:
        return reply(rid, op, fn(req, session))
    except NodeOpError as exc:
        return reply(rid, op, error=str(exc), code=exc.code)
    except (WorkdirError, RecordError) as exc:
        return reply(rid, op, error=str(exc), code=exc.code)
    except OSError as exc:
        return reply(rid, op, error="%s: %s" % (getattr(exc, "filename", "") or "", exc.strerror or exc))
    except (KeyError, TypeError, ValueError) as exc:
        return reply(rid, op, error="bad request: %s: %r" % (type(exc).__name__, exc))
    except Exception as exc:  # noqa: BLE001 - one operation's bug must not lose the others' replies
        return reply(rid, op, error="failed: %s: %r" % (type(exc).__name__, exc))


def serve(fd=0, write=None, exit_at_eof=False):
    """Answer framed requests from *fd* until EOF; a takeover operation ends the loop with its
    exit status. Returns the program's exit status; with *exit_at_eof* (the program, not a test)
    the EOF ends the process at once (:func:`_exit_now`)."""
    write = write or (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    session = {}
    while True:
        try:
            raw = read_frame(fd)
        except EOFError:  # between frames: the controller is done
            if exit_at_eof:
                _exit_now(0)
            return 0
        except ValueError as exc:  # the stream is broken: nothing after it can be trusted
            write(reply(None, None, error="bad frame: %s" % exc))
            return 2
        try:
            req = json.loads(raw.decode("utf-8"))
        except ValueError as exc:
            write(reply(None, None, error="a request is JSON: %s" % exc))
            continue
        op = req.get("op") if isinstance(req, dict) else None
        if isinstance(op, str) and op in TAKEOVER:  # (an op that is no string is handle()'s to refuse)
            release(session)
            return TAKEOVER[op](req)
        if isinstance(op, str) and op in RAW:
            return RAW[op](req, session, fd, write)
        if op == "stage" and req.get("hold"):
            return _hold_stage(req, session, write, fd)
        write(handle(req, session))


def release(session):
    """Let go of what this session's requests hold (the workdir's lock, a master port's
    reservation, a mesh probe's listeners), as its end would: a takeover operation goes on in this
    process (a run's supervisor in its preparation's session), and torchrun binds the master port
    the probe listened on; the supervisor reserves that port again, for the job's life."""
    held = session.pop("lock", None)
    if held:
        os.close(held[1])
    for fd in session.pop("port_leases", ()):
        os.close(fd)
    listeners = session.pop("listeners", None)
    if listeners is not None:
        listeners.close()


def _exit_now(code):
    """End the process now, without the interpreter's teardown of the program's functions and
    their objects (a tenth of a short call's time, paid on every node: docs/design.md, "Start-up
    costs"). Only at the end of requests: every operation has returned and its reply is
    written; what the program still holds (the workdir's lock, listeners, a port's reservation)
    the kernel releases as at any exit, and none of its operations leaves work to a finalizer."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def raw_writer():
    """Write bytes to stdout as they are (a reply line, then a file's content)."""
    out = sys.stdout.buffer if hasattr(sys.stdout, "buffer") else sys.stdout

    def write(data):
        out.write(data)
        out.flush()
    return write


def _hold_stage(req, session, write, fd):
    """``stage`` with ``hold``: reply with the dir, keep it while stdin stays open, then remove it."""
    text = handle(req, session, _treehash(node_stage))
    if not json.loads(text)["ok"]:
        write(text)  # the refusal, as handle() words every operation's
        return 1
    out = json.loads(text)["result"]
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(0))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        write(reply(req.get("id"), "stage", out))
        while os.read(fd, 4096):
            pass
    finally:
        shutil.rmtree(out["dir"], ignore_errors=True)
    return 0
