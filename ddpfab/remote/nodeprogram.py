"""The controller's side of the one program ddpfab runs on nodes (:mod:`ddpfab.node`): building
and shipping it, and its one protocol.

Every node-side operation is an operation of one stdlib-only program: facts (the probe), the
data-plane probe (mesh), the tree hash and the rest of sync's node side, job control (ps, stop,
per-rank logs, follow) and the job supervisor. Its source is the :data:`SOURCES` concatenated
(:func:`program`); its protocol is :func:`ddpfab.node.loop.serve`'s: framed JSON requests on
stdin, one JSON reply line per request on stdout, a failure as data (``ok: false``). Its first
part (:data:`WORKDIR_PART`: the loop and the workdir's operations) is a program by itself, which
a session that needs nothing else ships alone (sync's check of an unchanged tree).
:mod:`ddpfab.node.exitguard` is not part of it: it is the ranks' ``sitecustomize``, whose source
travels in the supervisor's job spec and which the supervisor writes into the run's dir.

Shipping: once per SSH session, on stdin. The command line is a short loader (:data:`LOADER`:
read the program from stdin, run it), so ``ps`` on a node shows ``python -S -c <loader> MAGIC CODE
SOURCE ddpfab-node`` (or ``ddpfab-agent RUN_ID`` for a supervisor) and nothing secret: requests,
and the supervisor's env among them, travel inside the SSH session. The program travels compiled
by the controller's python and as source: a node python with the same bytecode magic (the usual
case: one python build across a cluster) runs the compiled code, any other compiles the source.
Compiling the program is most of a start (docs/design.md, "Start-up costs"). The program is not
cached on the node: a cache would be a file ddpfab keeps in the user's home that every version of
ddpfab must trust, check and clean up, while one session per node carries everything a launch
needs before its supervisor starts.

The controller keeps a :class:`Session` open per node while it needs the node (probe, hash check,
mesh probe: one python start per node before a launch), or uses :func:`call` for one exchange.
Replies are validated (:func:`parse_reply`) and taken only as the answer to a request sent, by its
id and op (:func:`match_replies`, :class:`Session`): records are data, never executed. What a
node says reaches the terminal through :func:`printable` (no terminal escapes).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
from typing import Any, NamedTuple
import json
import marshal
import re
import shlex
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from ddpfab.hosts import nodeenv
from ddpfab.node import agent, leases, loop, ops, resources, stacks, treehash, workdir
from ddpfab.problems import NodeError
from ddpfab.results import GroupResult

#: The modules that make the node program, in order (each may use the names of those before it).
SOURCES = (workdir, treehash, loop, leases, resources, agent, stacks, ops)
#: The parts a session can ship: the whole program, or its first part alone (the workdir's
#: operations: probe, commit, hash, locate, stage, lock, unlock), a third of the text and of the
#: node python's work to load it (sync's check of an unchanged tree starts python on every node).
WHOLE, WORKDIR_PART = "whole", "workdir"
PARTS = {WHOLE: SOURCES, WORKDIR_PART: SOURCES[:3]}
#: What the program runs once its modules are defined: the loop (under the name the loader gives it).
_MAIN = b'''
if __name__ == "ddpfab-node":  # the name the loader runs the shipped program under
    sys.exit(serve(exit_at_eof=True))
'''

#: The longest reply line a :class:`Session` takes (the largest real ones, a ``mesh_connect`` over
#: 128 nodes or full facts, are well under 1 MiB): past it the node is not answering as the
#: protocol says, and its buffer must not grow without end.
MAX_REPLY_LINE = 8 * 2**20
#: How much of the output before a program's first reply a session keeps (:attr:`Session.stray`).
STRAY_BYTES = 300
#: The most a :meth:`Session.poll` reads at once: a node that never stops writing must not keep
#: :func:`exchange` from the other nodes' channels and from its deadline.
POLL_BYTES = 2**20
#: How long a program's output may still come after its exit status without its EOF (see
#: :meth:`Session.take`): only a program that left something holding its stdout waits this long.
OUTPUT_GRACE_S = 2.0

#: What a node's python runs (``python -S -c LOADER MAGIC CODE SOURCE WORDS...``): read the program
#: from stdin, first compiled by the controller's python (CODE bytes: marshal, zlib), then as
#: source (SOURCE bytes, zlib), and run it; it then reads its requests from stdin. A python whose
#: bytecode magic is MAGIC (the controller's) runs the compiled code, any other compiles the
#: source: compiling is most of the program's start. Short and readable in ``ps``, and nothing in
#: it (or after it) is secret. (The code uncompressed saved the node's python 1.7 ms of a 12 ms
#: start, but its sshd and the controller spent as much on the 150 kB more: measured at 128 nodes.)
LOADER = ("import os,sys,zlib,marshal\n"
          "try:from _frozen_importlib_external import MAGIC_NUMBER as m\n"  # what importlib.util gives,
          "except ImportError:from importlib.util import MAGIC_NUMBER as m\n"  # without importing it
          "def r(n):\n"
          " b=b''\n"
          " while len(b)<n:\n"
          "  c=os.read(0,n-len(b))\n"
          "  if not c:sys.exit('ddpfab-node: no code on stdin')\n"
          "  b+=c\n"
          " return b\n"
          "c,s=r(int(sys.argv[2])),r(int(sys.argv[3]))\n"  # the source inflated only where it is compiled
          "c=marshal.loads(zlib.decompress(c)) if m.hex()==sys.argv[1] else compile(zlib.decompress(s),'ddpfab-node','exec')\n"
          "exec(c,{'__name__':'ddpfab-node'})")


#: Standard modules the shipped program imports at their first use instead of at its start: a
#: session asks for one or two operations, most of which need none of them, and importing them all
#: was most of a start's CPU after the interpreter's own (a start 78 -> 40 ms of CPU, measured with
#: ``python -S``; at 64 nodes sharing a lab's two cores that is seconds of every check and sync).
#: The modules stay plain modules with their imports at the top; only the shipped text differs.
#: json, which every request needs, is the program's own :data:`_FIRST_USE` ``_Json``.
LAZY_MODULES = ("_socket", "base64", "fnmatch", "hashlib", "re", "select", "shutil", "signal", "socket", "subprocess",
                "tempfile", "threading")
_FIRST_USE = b'''
from _frozen_importlib_external import PathFinder as _PathFinder
_LEGACY_SITE = _PathFinder.find_spec("json") is None  # a legacy virtualenv (< 20) links part of the
if _LEGACY_SITE:  # standard library, its site.py the rest
    import site
    site.main()


class _FirstUse(object):
    """A standard module imported at its first use (ddpfab.remote.nodeprogram.LAZY_MODULES)."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        return getattr(__import__(self._name), attr)


class _Json(object):
    """json's ``loads`` and ``dumps`` of the program's requests, replies and records, done by
    json's own C parts (``_json``, what json itself uses for them) without importing json, which
    imports re and enum: a third of a start (``load``/``dump``: through a file's text). Whatever
    else is asked (other arguments, other names), and any input the C parts refuse, goes to json
    itself: its results and its errors."""

    strict, object_hook, object_pairs_hook = True, None, None  # what _json's scanner reads
    parse_float, parse_int = float, int
    parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__

    def __init__(self):
        try:
            import _json
            self._c, self._scan = _json, _json.make_scanner(self)
        except Exception:  # noqa: BLE001 - no C parts here: json itself
            self._c = None

    def __getattr__(self, attr):
        return getattr(__import__("json"), attr)

    def loads(self, s, **kw):
        if self._c is not None and not kw and isinstance(s, str):
            try:
                obj, end = self._scan(s, len(s) - len(s.lstrip(" \\t\\n\\r")))
                if not s[end:].strip(" \\t\\n\\r"):
                    return obj
            except Exception:  # noqa: BLE001 - json says what is wrong with it
                pass
        return __import__("json").loads(s, **kw)

    def load(self, fh, **kw):
        return self.loads(fh.read(), **kw)  # as json.load

    def dump(self, obj, fh, **kw):
        fh.write(self.dumps(obj, **kw))  # json.dump's text (it writes it in pieces)

    def dumps(self, obj, **kw):
        if self._c is not None and not kw:
            try:
                return "".join(self._c.make_encoder({}, _json_refuse, self._c.encode_basestring_ascii, None, ": ",
                                                    ", ", False, False, True)(obj, 0))
            except Exception:  # noqa: BLE001 - json says what is wrong with it
                pass
        return __import__("json").dumps(obj, **kw)


def _json_refuse(obj):
    raise TypeError("not JSON serializable")


_JSON = _Json()

'''
_LAZY_JSON = re.compile(rb"^import json$", re.MULTILINE)
_LAZY_IMPORT = re.compile(rb"^import (%s)$" % b"|".join(m.encode() for m in LAZY_MODULES), re.MULTILINE)
#: ``importlib.util.find_spec(...)`` works through the package's name: ``__import__`` of the
#: submodule returns the package, with the submodule imported as its attribute.
_LAZY_IMPORTLIB = re.compile(rb"^import importlib\.util$", re.MULTILINE)


@functools.cache
def program(part: str = WHOLE) -> bytes:
    """The node program's source: the modules of *part* (:data:`PARTS`), concatenated, each
    top-level import of one of the :data:`LAZY_MODULES` made an import at first use, then the loop."""
    source = b"\n".join(Path(str(m.__file__)).read_bytes() for m in PARTS[part])
    source = _LAZY_IMPORTLIB.sub(b"importlib = _FirstUse('importlib.util')", source)
    source = _LAZY_JSON.sub(b"json = _JSON", source)
    return _FIRST_USE + _LAZY_IMPORT.sub(rb"\1 = _FirstUse('\1')", source) + _MAIN


#: Held while the program is built: sessions open on many threads at once (``ssh.parallel``), and
#: lru_cache lets every thread that asks before the first has finished build it too: the threads
#: of a 128-node check each compiled the ~160 kB program under the GIL (50 ms each; 8 nodes' run
#: spent 0.4 s on it).
_BUILDING = threading.Lock()


def _shipped(part: str = WHOLE) -> tuple[str, bytes, bytes]:
    """(this python's bytecode magic, the compiled program, its source) as :data:`LOADER` reads
    them (compiled as the node compiles it: no ``__future__`` flags of this module, asserts kept
    whatever -O this python runs with); built once per process and part, by one thread."""
    with _BUILDING:
        return _build(part)


@functools.cache
def _build(part: str) -> tuple[str, bytes, bytes]:
    code = compile(program(part), "ddpfab-node", "exec", dont_inherit=True, optimize=0)
    return (importlib.util.MAGIC_NUMBER.hex(), zlib.compress(marshal.dumps(code), 6),
            zlib.compress(program(part), 6))


def shipped(part: str = WHOLE) -> bytes:
    """What comes first on the program's stdin: its compiled code, then its source."""
    _, code, source = _shipped(part)
    return code + source


def argv(python: str, *words: str, part: str = WHOLE) -> list[str]:
    """``python -S -c LOADER MAGIC CODE SOURCE WORDS...``: the program comes first on stdin
    (:func:`stdin_for`). Without site (``-S``): the program is the standard library's alone, and
    site is a good part of a start (a third on a venv with editable installs); the one operation
    that looks at installed packages (facts: torch) finds torch in the site-packages directories
    and loads site only where it is not there (``ops._torch_spec``). So a
    sitecustomize or ``.pth`` hook does not run in the node program or its supervisor; the job's
    own pythons (torchrun, the ranks) start as usual, with site."""
    magic, code, source = _shipped(part)
    return [python, "-S", "-c", LOADER, magic, str(len(code)), str(len(source)), *words]


def command(node, *words: str, fallback: str | None = None, part: str = WHOLE) -> str:
    """:func:`argv` as a shell line for *node* (a Node or a NodePlan), after the bootstrap that reads
    its environment's prefix from stdin (:func:`setup_head` goes first there; the prefix is
    :func:`ddpfab.hosts.nodeenv.prefix`: setup lines, and the choice of its python while that is
    the node's to make); with *fallback* (e.g. ``python3``) that python runs it where an explicit
    python does not exist there (sync may come before the node's venv does); *part*: which of
    the program's :data:`PARTS` it reads from stdin."""
    pre, _ = nodeenv.setup_stdin(node, record_env=True)
    if nodeenv.undecided(node):
        return f"{pre}exec {nodeenv.python_word(node)} {shlex.join(argv('', *words, part=part)[1:])}"
    python = node.python
    if not fallback or fallback == python:
        return pre + ("exec " if pre else "") + shlex.join(argv(python, *words, part=part))
    return (f"{pre}if command -v {shlex.quote(python)} >/dev/null; then exec {shlex.join(argv(python, *words, part=part))}; "
            f"else exec {shlex.join(argv(fallback, *words, part=part))}; fi")


def setup_head(node) -> bytes:
    """What goes first on the stdin of :func:`command`'s session on *node*: its setup (the node's
    prefix, read by the command's bootstrap: :func:`ddpfab.hosts.nodeenv.setup_stdin`), or b""."""
    return nodeenv.setup_stdin(node, record_env=True)[1]


def frame(request: dict) -> bytes:
    """One request as the program reads it: ``LENGTH\\n`` + its JSON."""
    data = json.dumps(request).encode()
    return b"%d\n" % len(data) + data


def stdin_for(*requests: dict) -> bytes:
    """The program, then *requests* (give each an ``id``; :func:`numbered` does)."""
    return shipped() + b"".join(frame(r) for r in requests)


def numbered(*requests: dict, start: int = 1) -> list[dict]:
    """*requests* with ids ``start``, ``start + 1``, ..."""
    return [{**r, "id": i} for i, r in enumerate(requests, start)]


class NodeProgramError(NodeError):
    """A node's program did not answer as the protocol says (or an operation failed, raised by
    :meth:`Reply.value`); the message names the host. (Not an ``ssh.SSHError``: this module is
    also sync's, which does not load paramiko, ~0.2 s, for OpenSSH work.)"""

    def __init__(self, node: str, found: str, kind: str = "program"):
        """*found*: what went wrong (the message is ``host NODE: FOUND``)."""
        super().__init__(node, f"host {node}: {found}", kind, found)


@dataclass(frozen=True)
class Reply:
    """One operation's answer. ``ok`` with its ``result``, or not ok with its ``error`` (and,
    for a refusal the controller acts on, its ``code``: e.g. ``treehash.NOT_OURS``)."""

    id: int | None
    op: str | None
    ok: bool
    result: dict = field(default_factory=dict)
    error: str = ""
    code: str = ""

    def value(self, node: str) -> dict:
        """The result, or a NodeProgramError naming *node* and the operation: the node side's own
        failure (its exceptions are shipped stdlib-only, without ddpfab's problems) becomes a
        problem here, its ``code`` (``workdir``, ``record``, ``treehash.NOT_OURS``...) the kind."""
        if not self.ok:
            raise NodeProgramError(node, f"{self.op}: {self.error}", kind=self.code or "program")
        return self.result


#: Control characters but newline and tab (C0, DEL, C1): a terminal would act on them (an escape
#: sequence retitles or clears it, a carriage return overwrites the line).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: object) -> str:
    """*text* (something a node said) safe to print: each control character written as ``\\xNN``.
    Everything a node program says goes through here before it reaches the terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))


def parse_reply(line: bytes | str) -> Reply | None:
    """A reply line, validated; None when the line is no reply (not JSON, not an object with the
    reply's keys and types)."""
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, dict) or not all(k in data for k in loop.REPLY_KEYS):
        return None
    rid, op, ok = data["id"], data["op"], data["ok"]
    if not (rid is None or (isinstance(rid, int) and not isinstance(rid, bool))) or not (op is None or isinstance(op, str)) \
            or not isinstance(ok, bool):
        return None
    if ok:
        result = data.get("result")
        return Reply(rid, op, True, result=result) if isinstance(result, dict) else None
    code = data.get("code")
    return Reply(rid, op, False, error=printable(data.get("error") or "failed (no reason given)"),
                 code=code if isinstance(code, str) else "")


def _keep(got: dict[int | None, Reply], sent: dict[int, str], line: bytes | str) -> None:
    """Add *line*'s reply to *got* when it answers a request of *sent* (id -> op): the same id and
    the same op, and the first such (a duplicate is dropped). A refusal of the stream itself (no
    id, not ok: a bad frame) is kept under None. Anything else is dropped: a reply to nothing
    asked is no answer. (The one rule of :func:`match_replies` and :class:`Session`.)"""
    r = parse_reply(line)
    if r is None:
        return
    if r.id is None:
        if not r.ok:
            got.setdefault(None, r)
    elif sent.get(r.id) == r.op:
        got.setdefault(r.id, r)


def _answers(requests: list[dict], got: dict[int | None, Reply], exit_code: int | None, stderr: str,
             python: str | None = None) -> list[Reply]:
    """The reply in *got* to each of *requests*; a request without one gets an error reply saying
    why (the program's refusal of the stream, else its exit status and stderr; nothing at all from
    a program that exited: its *python* did not run it)."""
    why = "no reply" + (f" (exit {exit_code})" if exit_code is not None else "") + \
        (f": {printable(stderr.strip()[-300:])}" if stderr.strip() else "")
    if not got and not stderr.strip() and exit_code is not None and 0 < exit_code < 128 and python:
        why += (f": the node's python {printable(python)} ended without a word: it is no python 3 that runs "
                "ddpfab's node program; set ddpfab_python")
    if None in got:  # the program refused the stream itself (a bad frame)
        why = got[None].error
    return [got.get(r["id"]) or Reply(r["id"], r["op"], False, error=why) for r in requests]


def match_replies(node: str, requests: list[dict], lines: list[bytes] | list[str], exit_code: int | None,
                  stderr: str = "", python: str | None = None) -> list[Reply]:
    """The reply to each of *requests* (by id and op; the first, if a node repeats one) among
    *lines*; a request without one gets an error reply saying why (the program's exit status and
    stderr)."""
    got: dict[int | None, Reply] = {}
    sent = {r["id"]: r["op"] for r in requests}
    for line in lines:
        _keep(got, sent, line)
    return _answers(requests, got, exit_code, stderr, python)


def start_failure(node, exit_code: int | None, stderr: str = "",
                  fallback: str | None = None) -> NodeProgramError | None:
    """Why the program did not start on *node*, when its exit status says so: a setup line of
    its own failed (:data:`ddpfab.hosts.nodeenv.SETUP_FAILED`, the line named), or its python is not
    there (127; with *fallback*, as in :func:`command`, neither python was)."""
    failed = nodeenv.node_setup_failure(node, exit_code, stderr)
    if failed:
        return NodeProgramError(node.name, failed, kind="setup")
    if exit_code != 127:
        return None
    if nodeenv.undecided(node):
        return NodeProgramError(node.name, "no python there: no python3 on PATH and no venv from ddpfab provision; "
                                           "provision the node or set ddpfab_python", kind="python")
    if fallback and fallback != node.python:
        return NodeProgramError(node.name, f"neither {node.python} nor {fallback} found there; the node program "
                                           "needs a python (3.6+, standard library only) on the nodes", kind="python")
    return NodeProgramError(node.name, f"python {node.python!r} not found there; set "
                                       "ddpfab_python to the python that has torch", kind="python")


def call(conn, node, *requests: dict, timeout: float = 60, words: tuple[str, ...] = ("ddpfab-node",)) -> list[Reply]:
    """Start the program on *node* over its open connection, send *requests*, close stdin and
    return one reply per request. SSHError when the connection fails, NodeProgramError when the
    node's python is missing."""
    # here, not at the top: mesh (and through it the command line's parser) imports this module, and
    # must not pay for paramiko (see LAZY in ddpfab/cli/__init__.py)
    from ddpfab.remote import ssh

    reqs = numbered(*requests)
    res = ssh.run(conn, node.name, command(node, *words), timeout=timeout,
                  stdin=setup_head(node) + stdin_for(*reqs))
    missing = start_failure(node, res.exit_code, res.stderr)
    if missing:
        raise missing
    return match_replies(node.name, reqs, res.stdout.splitlines(), res.exit_code, res.stderr,
                         getattr(node, "python", None))


class Session:
    """The program running on one node over a channel of its open connection, kept open for
    several exchanges; nothing is left on the node when it closes (stdin EOF ends the program)."""

    def __init__(self, conn, node, words: tuple[str, ...] = ("ddpfab-node",), timeout: float = 30,
                 fallback: str | None = None, first: list[dict] | tuple[dict, ...] = (), last: bool = False,
                 part: str = WHOLE):
        """Open the session and ship the program (its *part*: :data:`PARTS`), with *first*
        (requests, numbered here: see :attr:`first`) in the same write: the node answers them as
        soon as its program runs. With *last*, EOF follows them: nothing more is asked, and the
        program ends once it has answered (no round trip to end it, and its exit status comes with
        its replies)."""
        self.node = node
        self.words = tuple(words)  # what ps shows after the loader (supervisor_words: a run's supervisor)
        self._ids = itertools.count(1)
        self._buf = bytearray()  # the line begun and not yet ended
        self._sent: dict[int, str] = {}  # id -> op of each request sent and not yet taken
        self._replies: dict[int | None, Reply] = {}
        self._err = b""
        self._broken: NodeProgramError | None = None
        self._fallback = fallback
        self._ended_at: float | None = None  # when the exit status came without the output's end
        self._replied = False  # the program answered something once (so its python did run it)
        #: what came on stdout before the program's first reply and is none (a shell's login banner)
        self.stray = b""
        self.chan = conn.transport.open_session(timeout=timeout)
        line, preamble = command(node, *words, fallback=fallback, part=part), setup_head(node) + shipped(part)
        exec_program = getattr(self.chan, "exec_program", None)  # a held channel: the start may be running already
        if exec_program is not None:
            exec_program(line, preamble)
            preamble = b""
        else:
            self.chan.exec_command(line)
        #: the *first* requests as sent, with their ids (for :func:`exchange`'s ``sent``)
        self.first = self._number(first)
        self._write(preamble + b"".join(frame(r) for r in self.first))
        if last and not self.ended:
            self.chan.shutdown_write()

    def _number(self, requests) -> list[dict]:
        reqs = [{**r, "id": next(self._ids)} for r in requests]
        self._sent.update((r["id"], r["op"]) for r in reqs)
        return reqs

    def _write(self, data: bytes) -> None:
        """*data* to the program's stdin. A program that has ended already (a setup line failed,
        no python: the shell exits at once) closes the channel under a write: then :meth:`take`
        names why from its exit status, and the write is no error of its own."""
        try:
            self.chan.sendall(data)
        except OSError:
            if not self.ended:
                raise

    def send(self, *requests: dict) -> list[dict]:
        """Send *requests* (numbered here) without waiting; returns them with their ids."""
        reqs = self._number(requests)
        self._write(b"".join(frame(r) for r in reqs))
        return reqs

    def poll(self) -> bool:
        """Take what the node has sent, up to :data:`POLL_BYTES`; False when nothing was there.
        A NodeProgramError when the node sends a line longer than :data:`MAX_REPLY_LINE`."""
        if self._broken is not None:
            raise self._broken
        got, budget = False, POLL_BYTES
        while budget > 0 and self.chan.recv_stderr_ready():
            data = self.chan.recv_stderr(65536)
            if not data:
                break
            got = True
            budget -= len(data)
            self._err = (self._err + data)[-4096:]
        while budget > 0 and self.chan.recv_ready():
            data = self.chan.recv(65536)
            if not data:
                break
            got = True
            budget -= len(data)
            self._take_lines(data)
        return got

    def _take_lines(self, data: bytes) -> None:
        """The complete lines *data* ends (only *data* is searched: a long line costs no rescans)."""
        first = data.find(b"\n")
        if first < 0:
            self._buf += data
        else:
            self._buf += data[:first]
            lines = [bytes(self._buf), *data[first + 1:].split(b"\n")]
            self._buf = bytearray(lines.pop())
            for line in lines:
                if not self._replied and line.strip() and len(self.stray) < STRAY_BYTES and parse_reply(line) is None:
                    self.stray += line[:STRAY_BYTES] + b"\n"  # a login shell's banner, before the program spoke
                _keep(self._replies, self._sent, line)
            self._replied = self._replied or bool(self._replies)
        if len(self._buf) > MAX_REPLY_LINE:
            self._buf = bytearray()
            self._broken = NodeProgramError(
                self.node.name, f"the node program sent a line of over "
                                f"{MAX_REPLY_LINE >> 20} MiB (no reply is that long): it does not answer as "
                                "ddpfab's node program does")
            raise self._broken

    @property
    def ended(self) -> bool:
        return self.chan.exit_status_ready() or self.chan.closed

    @property
    def idle(self) -> bool:
        """Every request answered and taken, nothing else sent or arriving, the program still
        running: a takeover request (``supervise``) may follow, and the channel is that
        operation's from then on (:meth:`take_over`)."""
        return (not self._sent and not self._replies and self._broken is None and not self._buf
                and not self.ended and not self.chan.recv_ready())

    def take_over(self, request: dict) -> Any:
        """Send *request*, a takeover operation, as this session's last: its channel, which
        carries that operation's output from now on (nothing of this session reads it again)."""
        self.chan.set_combine_stderr(True)  # as the supervisor's own session has it (its stderr joins stdout too)
        self._write(frame({**request, "id": next(self._ids)}))
        return self.chan

    def _all_output(self) -> bool:
        """The ended program's output is all here: sshd sends its exit status as soon as it ends,
        which can be before the last of its output (still in the pipe); EOF comes after that. So
        its EOF, a closed channel, or (something of its own keeps its stdout open) a grace of
        :data:`OUTPUT_GRACE_S` after the exit status."""
        if self.chan.eof_received or self.chan.closed:
            return True
        if self._ended_at is None:
            self._ended_at = time.monotonic()
        return time.monotonic() - self._ended_at > OUTPUT_GRACE_S

    def take(self, reqs: list[dict]) -> list[Reply] | None:
        """The replies to *reqs* when all have come, else None (an ended program: error replies)."""
        if all(r["id"] in self._replies for r in reqs):
            return self._pop(reqs, [self._replies[r["id"]] for r in reqs])
        if self.ended and not self.chan.recv_ready() and self._all_output():
            code = self.chan.recv_exit_status()
            missing = start_failure(self.node, code, self._err.decode(errors="replace"), self._fallback)
            if missing:
                raise missing
            return self._pop(reqs, _answers(reqs, self._replies, code, self._err.decode(errors="replace"),
                                            None if self._replied else getattr(self.node, "python", None)))
        return None

    def _pop(self, reqs: list[dict], replies: list[Reply]) -> list[Reply]:
        """*replies*, with *reqs* forgotten (a later reply with one of their ids is dropped)."""
        for r in reqs:
            self._replies.pop(r["id"], None)
            self._sent.pop(r["id"], None)
        return replies

    def close(self) -> None:
        """EOF to the program (it ends, closing whatever it holds open) and close the channel."""
        close_all({self.node.name: self})


def start(conn, node, **kwargs) -> Session:
    """A :class:`Session` on *conn* (*kwargs*: its own); a channel that does not open (the
    connection broke) is a NodeProgramError naming the node."""
    try:
        return Session(conn, node, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure to open is the node's, not the caller's
        raise NodeProgramError(node.name, f"could not start the node program: {exc}", kind="ssh") from None


def open_sessions(nodes, conns: dict, words: tuple[str, ...] = ("ddpfab-node",),
                  first: dict[str, list[dict]] | None = None, last: bool = False, part: str = WHOLE
                  ) -> tuple[dict[str, Session], dict[str, NodeProgramError]]:
    """A :class:`Session` on every node in *conns*, opened concurrently (each open is two round
    trips to the node's sshd and the program's transfer: one after the other, 64 nodes took
    seconds); (sessions, node -> why its session did not open). *first*: node -> the requests
    to ship with its program (each session's :attr:`Session.first`), *last*: and EOF after them;
    *part*: which part of the program (:data:`PARTS`)."""
    # here, not at the top: see call()
    from ddpfab.remote import ssh

    first = first or {}
    opened = ssh.parallel([n for n in nodes if n.name in conns],
                          lambda n: start(conns[n.name], n, words=words, first=first.get(n.name, ()), last=last,
                                          part=part),
                          release=lambda s: close_all({s.node.name: s}, 0))  # (not waiting: the caller has gone)
    return dict(opened.succeeded), {name: _as_node_error(name, exc) for name, exc in opened.failed.items()}


def _as_node_error(name: str, exc: Exception) -> NodeProgramError:
    return exc if isinstance(exc, NodeProgramError) else NodeProgramError(name, f"could not start the node program: {exc}")


def exchange(sessions: dict[str, Session], requests: dict[str, list[dict]], timeout: float,
             sent: dict[str, list[dict]] | None = None) -> GroupResult[list[Reply]]:
    """Send each session its *requests* (or wait for those already *sent*) and wait for every
    reply, polling all channels from this thread (no thread per node); by *timeout* a session
    still silent gets a NodeProgramError. Per node (those of *sent*, then those of *requests*):
    its replies, in request order, or the error."""
    out: dict[str, list[Reply] | Exception] = {}
    pending: dict[str, list[dict]] = {}
    for name, reqs in (sent or {}).items():
        pending[name] = reqs
    for name, reqs in requests.items():
        try:
            pending[name] = sessions[name].send(*reqs)
        except Exception as exc:  # noqa: BLE001
            out[name] = NodeProgramError(name, f"the node program's session broke: {exc}")
    deadline = time.monotonic() + timeout
    while pending:
        progressed = False
        for name in list(pending):
            s = sessions[name]
            try:
                progressed |= s.poll()
                got = s.take(pending[name])
            except NodeProgramError as exc:
                out[name], got = exc, None
                del pending[name]
                continue
            except Exception as exc:  # noqa: BLE001
                out[name], got = NodeProgramError(name, f"the node program's session broke: {exc}"), None
                del pending[name]
                continue
            if got is not None:
                out[name] = got
                del pending[name]
        if pending and time.monotonic() > deadline:
            for name, reqs in pending.items():
                out[name] = NodeProgramError(name, f"no answer to {', '.join(r['op'] for r in reqs)} "
                                                   f"within {timeout:g} s", kind="timeout")
            break
        if pending and not progressed:
            time.sleep(0.005)
    return GroupResult({name: out[name] for name in [*(sent or {}), *requests]})


def close_all(sessions: dict[str, Session], wait: float | None = None, wait_for: set[str] | None = None) -> None:
    """Close every session: EOF to all first, then wait up to *wait* seconds in all for the
    programs of *wait_for* (default: all) to end (a mesh listener on the master port must be gone
    before torchrun binds it), then close the channels. By default 5 s, but none while an
    exception is on its way (called from a ``finally``): Ctrl-C or a failure must not wait for a
    slow node. A program not waited for ends on its own at its EOF."""
    if wait is None:
        wait = 0.0 if sys.exc_info()[1] is not None else 5.0
    for s in sessions.values():
        try:
            s.chan.shutdown_write()
        except Exception:  # noqa: BLE001 - closing must not raise
            pass
    deadline = time.monotonic() + wait
    for name, s in sessions.items():
        try:
            while (wait_for is None or name in wait_for) and not s.chan.exit_status_ready() \
                    and time.monotonic() < deadline:
                time.sleep(0.005)
        except Exception:  # noqa: BLE001
            pass
        finally:
            s.chan.close()


# -- what the supervisor and job control send ---------------------------------------------------
def supervisor_words(run_id: str) -> tuple[str, str]:
    """What ``ps`` on a node shows after the loader for a run's supervisor (``ddpfab stop`` and
    ``ps`` check a pid's command line for the run id)."""
    return ("ddpfab-agent", run_id)


def supervisor_input(spec: dict) -> bytes:
    """The supervisor's stdin: the program, then the ``supervise`` request with the job spec
    (env values included: inside the SSH session, never in a command line)."""
    return stdin_for({"id": 1, "op": "supervise", "spec": spec})


class StopReply(NamedTuple):
    """What :func:`stop` did on one node.

    Args:
        said: one line saying what happened there.
        stopped: nothing of the job is left there.
        known: the node knew the run (its record, a launch, or processes of it).
    """

    said: str
    stopped: bool
    known: bool = True


#: What ``ddpfab stop`` leaves in the record of a ``run --tmux`` launch it ends (agent.stop_job).
STOPPED_BY_STOP = "stopped by `ddpfab stop`"


def stop(conn, node, remote_dir: str, grace: float, timeout: float) -> StopReply:
    """End run *remote_dir*'s job on *node* (its supervisor, then what is left of the job by its
    marker)."""
    reply = call(conn, node, {"op": "stop", "dir": remote_dir, "grace": grace, "why": STOPPED_BY_STOP},
                 timeout=timeout)[0]
    if not reply.ok:
        return StopReply(reply.error, False)
    # (a node program without "known", an older one, knew it: never a false "no such run")
    return StopReply(printable(reply.result.get("said", "")), reply.result.get("stopped") is True,
                     reply.result.get("known") is not False)
