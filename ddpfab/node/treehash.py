"""The synced tree's rules and content hash, shared verbatim by the controller and the nodes.

This one file is both a module ddpfab imports and part of the program each node runs (the node
program of :mod:`ddpfab.node`, whose ``probe``, ``commit``, ``hash``, ``locate`` and ``stage``
operations are the ``node_*`` functions here), so "the same algorithm on both sides" is true by
construction. Keep it self-contained: standard library only, Python 3.6+, no ddpfab imports.

What the hash covers: every regular file and symlink of the tree except the *skipped* paths
(below), sorted by relative path (as bytes). Per entry: its kind (file, executable file, symlink),
its relative path, and the sha256 of its content or its link target. Directories count through the
files in them; empty directories, owners, timestamps and permission bits other than the owner's
exec bit (the one git records) do not count. So the hash names the code, not the umask of the
machine it was checked out on, and a node holds the same tree exactly when the hashes agree.

Skipped paths are never sent and never hashed: ``runs/`` at the top (run records),
``__pycache__/`` (derived), ``.git`` (unless asked), ``.ddpfab/`` at the top (ddpfab's own record
of a workdir, see below), any virtualenv (a directory holding ``pyvenv.cfg``; not relocatable), and
whatever the *keep* patterns (``.ddpfabkeep``, ``--keep``; gitignore syntax) match.

The node side (``main``): sync owns only what it placed. Each workdir it writes into holds
``.ddpfab/sync.json``, the list of files ddpfab put there. A sync deletes only files on that list
that are gone here; everything else on a node (checkpoints, datasets, logs, ignored paths) is the
user's and is never touched. A directory that exists, is not empty and has no record is refused
unless adopted (``--adopt``), and a file that was there before ddpfab and that the project now
overwrites is moved aside into ``.ddpfab/kept/<time>/`` first. The hash of a workdir covers exactly
the recorded files.
"""

import base64
import hashlib
import json
import os
import re
import stat
import sys
import tempfile
import time

try:  # as a module of ddpfab; on a node, workdir.py's source comes first in the same program
    from .workdir import WorkdirError, lexical_problem, node_problem, resolve, which
except ImportError:
    pass

IGNORE_FILE = ".ddpfabignore"
KEEP_FILE = ".ddpfabkeep"
RUNS_DIR = "runs"
STATE_DIR = ".ddpfab"
RECORD = STATE_DIR + "/sync.json"
RECORD_VERSION = 1
CHUNK = 1 << 20
#: The codes of the node operations' refusals the controller acts on (a reply's ``code``):
#: a workdir ddpfab did not put there (``--adopt`` takes it over), a workdir without a record.
NOT_OURS, NO_RECORD = "not-ours", "no-record"

#: Why a path is skipped. A recorded file skipped for one of PROTECTED is never deleted either.
RUNS, CACHE, GIT, VENV, KEEP, STATE = "runs", "cache", "git", "venv", "keep", "state"
PROTECTED = (RUNS, GIT, VENV, KEEP, STATE)


# -- gitignore-syntax patterns ------------------------------------------------------------------
def _translate(pat):
    """A gitignore glob (no leading or trailing '/') as a regex over '/'-separated paths."""
    out, i, n = [], 0, len(pat)
    while i < n:
        c = pat[i]
        if c == "*":
            j = i
            while j < n and pat[j] == "*":
                j += 1
            whole = (i == 0 or pat[i - 1] == "/") and (j == n or pat[j] == "/")
            if j - i == 2 and whole:
                if j == n:  # trailing '**': everything below
                    out.append(".*")
                    i = j
                else:  # '**/': zero or more directories
                    out.append("(?:.*/)?")
                    i = j + 1
                continue
            out.append("[^/]*")
            i = j
            continue
        if c == "?":
            out.append("[^/]")
        elif c == "[":
            j = i + 1
            if j < n and pat[j] in "!^":
                j += 1
            if j < n and pat[j] == "]":
                j += 1
            while j < n and pat[j] != "]":
                j += 2 if pat[j] == "\\" else 1
            if j >= n:  # no closing bracket: a literal '['
                out.append(re.escape(c))
            else:
                body = pat[i + 1:j]
                neg = body[:1] in ("!", "^")
                if neg:
                    body = body[1:]
                body = body.replace("\\", "\\\\").replace("[", "\\[")
                for name, cls in (("alpha", "a-zA-Z"), ("digit", "0-9"), ("alnum", "a-zA-Z0-9"),
                                  ("upper", "A-Z"), ("lower", "a-z"), ("space", " \\t\\n\\r\\f\\v")):
                    body = body.replace("\\[:%s:]" % name, cls)
                out.append("[^/" + body + "]" if neg else "(?!/)[" + body + "]")
                i = j
        elif c == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(pat[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def compile_line(line):
    """One gitignore line as (regex, negated, dir_only), or None for blanks and comments."""
    line = line.rstrip("\n").rstrip("\r")
    while line.endswith(" ") and not line.endswith("\\ "):
        line = line[:-1]
    if not line or line.startswith("#"):
        return None
    negated = line.startswith("!")
    if negated:
        line = line[1:]
    dir_only = line.endswith("/")
    line = line.rstrip("/")
    if not line:
        return None
    anchored = "/" in line
    body = _translate(line.lstrip("/") if anchored else line)
    regex = re.compile(("^" if anchored else "^(?:.*/)?") + body + "$", re.DOTALL)
    return regex, negated, dir_only


class Patterns:
    """An ordered list of gitignore rules, each relative to the directory of the file it came from.

    ``decide(rel, is_dir)`` is True (matched, not negated), False (negated) or None (no rule
    applies); the last matching rule wins, as in git.
    """

    def __init__(self):
        self.rules = []

    def add(self, lines, base=""):
        for line in lines:
            rule = compile_line(line)
            if rule is not None:
                self.rules.append((base, rule))
        return self

    def decide(self, rel, is_dir):
        return _decide(self.rules, rel, is_dir)


def _decide(rules, rel, is_dir, verdict=None):
    for base, (regex, negated, dir_only) in rules:
        if dir_only and not is_dir:
            continue
        if base:
            if not rel.startswith(base + "/"):
                continue
            sub = rel[len(base) + 1:]
        else:
            sub = rel
        if regex.match(sub):
            verdict = not negated
    return verdict


def read_lines(path):
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except (FileNotFoundError, NotADirectoryError):
        return []
    return os.fsdecode(data).splitlines()


class IgnoreFiles:
    """Per-directory ignore files (``.gitignore``, ``.ddpfabignore``) under *root*, git-style:
    rules in a deeper file win over shallower ones, and nothing under an ignored directory can be
    re-included."""

    def __init__(self, root, names, extra=()):
        self.root, self.names = root, tuple(names)
        self.top = Patterns().add(extra)
        self._dir_rules = {}
        self._dir_ignored = {"": False}

    def _rules_of(self, d):
        if d not in self._dir_rules:
            p = Patterns()
            for name in self.names:
                p.add(read_lines(os.path.join(self.root, d, name)), d)
            self._dir_rules[d] = p.rules
        return self._dir_rules[d]

    def _verdict(self, rel, is_dir):
        """True (ignored), False (a negation was the last rule to match) or None (no rule did)."""
        parts = rel.split("/")
        verdict = self.top.decide(rel, is_dir)
        for k in range(len(parts)):
            verdict = _decide(self._rules_of("/".join(parts[:k])), rel, is_dir, verdict)
        return verdict

    def _decide(self, rel, is_dir):
        return bool(self._verdict(rel, is_dir))

    def negated(self, rel):
        """Whether file *rel*, or a directory above it, is named by a negation (``!PATTERN``) that
        is the last rule to match it: asked for on purpose."""
        parts = rel.split("/")
        return any(self._verdict("/".join(parts[:k]), k < len(parts)) is False for k in range(1, len(parts) + 1))

    def dir_ignored(self, rel):
        if rel not in self._dir_ignored:
            parent = rel.rpartition("/")[0]
            self._dir_ignored[rel] = self.dir_ignored(parent) or self._decide(rel, True)
        return self._dir_ignored[rel]

    def ignored(self, rel, is_dir=False):
        if is_dir:
            return self.dir_ignored(rel)
        parent = rel.rpartition("/")[0]
        return self.dir_ignored(parent) or self._decide(rel, False)


# -- what is skipped ----------------------------------------------------------------------------
class Skipper:
    """The paths sync never sends or hashes (see the module doc), identical on both sides."""

    def __init__(self, root, keep=(), with_git=False):
        self.root, self.with_git = root, with_git
        self.keep = Patterns().add(keep)
        self._dirs = {"": None}

    def dir_reason(self, rel):
        """Why directory *rel* (or one above it) is skipped, or None."""
        if rel not in self._dirs:
            parent = rel.rpartition("/")[0]
            self._dirs[rel] = self.dir_reason(parent) or self._own_dir_reason(rel)
        return self._dirs[rel]

    def _own_dir_reason(self, rel):
        name = rel.rpartition("/")[2]
        if rel == RUNS_DIR:
            return RUNS
        if rel == STATE_DIR:
            return STATE
        if name == "__pycache__":
            return CACHE
        if name == ".git" and not self.with_git:
            return GIT
        if os.path.isfile(os.path.join(self.root, rel, "pyvenv.cfg")):
            return VENV
        if self.keep.decide(rel, True):
            return KEEP
        return None

    def file_reason(self, rel):
        """Why file or symlink *rel* is skipped (its own name or a directory above it), or None."""
        parent, _, name = rel.rpartition("/")
        reason = self.dir_reason(parent) if parent else None
        if reason:
            return reason
        if name == ".git" and not self.with_git:
            return GIT
        if self.keep.decide(rel, False):
            return KEEP
        return None


#: The file ``ddpfab sync`` briefly creates in the source to detect a shared filesystem; never
#: part of the tree (a node may still list it after the controller removed it).
PROBE_PREFIX = ".ddpfab-sync-probe-"


def walk(root, skipper, ignore=None):
    """Files and symlinks under *root* (relative paths), and the skipped paths found on the way:
    ``(files, skipped)`` with skipped a list of ``(rel, reason, is_dir)``. Ignored paths (by
    *ignore*, an IgnoreFiles) are left out silently. Directories are not followed through links."""
    files, skipped, stack = [], [], [""]
    while stack:
        d = stack.pop()
        try:
            entries = list(os.scandir(os.path.join(root, d) if d else root))
        except FileNotFoundError:
            continue
        for e in entries:
            if e.name.startswith(PROBE_PREFIX):
                continue
            rel = d + "/" + e.name if d else e.name
            if e.is_dir(follow_symlinks=False):
                reason = skipper._own_dir_reason(rel)
                if reason:
                    skipped.append((rel, reason, True))
                elif ignore is None or not ignore.dir_ignored(rel):
                    stack.append(rel)
            elif e.is_file(follow_symlinks=False) or e.is_symlink():
                reason = skipper.file_reason(rel)
                if reason:
                    skipped.append((rel, reason, False))
                elif ignore is None or not ignore.ignored(rel):
                    files.append(rel)
    return files, skipped


# -- the hash -----------------------------------------------------------------------------------
#: Content digests are cached per file by (size, mtime, ctime, inode), like git's index: a re-sync
#: that changed nothing re-reads nothing. ctime cannot be set back by a user (utime sets it to
#: now), so a file rewritten with its old size and mtime still misses the cache. Entries younger
#: than RACY_S are not cached (a write in the same clock tick would leave every stamp equal).
CACHE_VERSION = 1
RACY_S = 2.0
CACHE_DAYS = 30


#: The interpreter's own implementations of the digests of short inputs, by name (``_sha2`` from
#: Python 3.12, ``_sha256`` before).
_OWN_DIGESTS = {"sha256": ("_sha2", "_sha256"), "sha1": ("_sha1",)}


def digest(name, data=b""):
    """A new ``name`` ("sha256" or "sha1") hash of *data*, for short inputs: paths, names, the
    tree hash over the files' records. The interpreter's own implementation where it has one:
    hashlib loads OpenSSL's libcrypto, 2.5 ms of a node program start that only checks a hash
    (as much as all its work); the digest is the same. File contents go through hashlib, whose
    OpenSSL is the faster on bulk, and only where the cache has no digest."""
    make = _DIGESTS.get(name)
    if make is None:
        for module in _OWN_DIGESTS[name]:
            try:
                make = getattr(__import__(module), name)
                break
            except (ImportError, AttributeError):
                continue
        else:
            make = getattr(hashlib, name)
        _DIGESTS[name] = make
    return make(data)


_DIGESTS = {}  # type: dict  # name -> the constructor digest() found for it


def cache_path(root):
    """Where the digest cache of tree *root* lives (outside the tree, under the user's cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    key = digest("sha256", os.fsencode(os.path.abspath(root))).hexdigest()[:24]
    return os.path.join(base, "ddpfab", "treehash", key + ".json")


def _load_cache(path):
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("v") != CACHE_VERSION:
        return {}
    return data.get("files") or {}


def _save_cache(path, files):
    """Write the cache atomically; drop the caches of trees not hashed for CACHE_DAYS."""
    tmp = "%s.%d.tmp" % (path, os.getpid())
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as fh:
            json.dump({"v": CACHE_VERSION, "files": files}, fh)
        os.replace(tmp, path)
        old = time.time() - CACHE_DAYS * 86400
        for entry in os.scandir(os.path.dirname(path)):
            if entry.name.endswith(".json") and entry.stat().st_mtime < old:
                os.unlink(entry.path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def entry_record(root, rel, old=None, new=None, now=None):
    """One entry's contribution to the tree hash: kind, path, content digest or link target.
    With caches (*old* to read, *new* to fill), a file whose stamps match is not re-read."""
    path = os.path.join(root, rel)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        kind, payload, size = b"l", os.fsencode(os.readlink(path)), 0
    elif stat.S_ISREG(st.st_mode):
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        hit = (old or {}).get(rel)
        if hit and hit[:4] == stamp:
            digest = hit[4]
        else:
            h = hashlib.sha256()
            with open(path, "rb") as fh:
                while True:
                    block = fh.read(CHUNK)
                    if not block:
                        break
                    h.update(block)
            digest = h.hexdigest()
        if new is not None and now - max(st.st_mtime_ns, st.st_ctime_ns) / 1e9 > RACY_S:
            new[rel] = stamp + [digest]
        kind = b"x" if st.st_mode & stat.S_IXUSR else b"f"
        payload, size = digest.encode(), st.st_size
    else:
        raise OSError("%s: not a regular file or symlink" % path)
    return kind + b" " + os.fsencode(rel) + b"\0" + payload + b"\0", size


def tree_digest(root, rels, detail=False, cache=False):
    """``{"tree_hash", "files", "bytes"}`` of *rels* under *root* (plus, with *detail*, ``"entries"``,
    a per-path digest, and ``"sizes"``: for naming the paths two trees differ in, and how). With
    *cache*, content digests are reused from, and saved to, :func:`cache_path`."""
    total, tree, entries, sizes = 0, digest("sha256"), {}, {}
    where = cache_path(root) if cache else None
    old, new, now = (_load_cache(where), {}, time.time()) if cache else (None, None, None)
    for rel in sorted(set(rels), key=os.fsencode):
        record, size = entry_record(root, rel, old, new, now)
        total += size
        tree.update(record)
        if detail:
            entries[rel] = digest("sha256", record).hexdigest()[:16]
            sizes[rel] = size
    if cache and new != old:
        _save_cache(where, new)
    out = {"tree_hash": tree.hexdigest(), "files": len(set(rels)), "bytes": total}
    if detail:
        out["entries"], out["sizes"] = entries, sizes
    return out


def diff_entries(ours, theirs, limit=5):
    """Paths whose entries differ between two ``entries`` maps: 'path (what)' strings."""
    out = []
    for rel in sorted(set(ours) | set(theirs), key=os.fsencode):
        if rel not in theirs:
            out.append("%s (missing there)" % rel)
        elif rel not in ours:
            out.append("%s (only there)" % rel)
        elif ours[rel] != theirs[rel]:
            out.append("%s (differs)" % rel)
    more = len(out) - limit
    return out[:limit] + (["... %d more" % more] if more > 0 else [])


# -- the node side: the workdir record ---------------------------------------------------------
class RecordError(Exception):
    """A workdir record that cannot be trusted (not ddpfab's format); sent as an error reply with
    this ``code`` (the controller's problem names the node)."""

    code = "record"


def rel_ok(rel):
    """A recorded or requested path: relative, inside the workdir, not into ddpfab's own state."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\0" in rel:
        return False
    parts = rel.split("/")
    return all(p not in ("", ".", "..") for p in parts) and parts[0] != STATE_DIR


def read_record(root):
    """The record of workdir *root* (a dict with ``files``), None when there is none."""
    path = os.path.join(root, RECORD)
    try:
        with open(path, "rb") as fh:
            data = json.loads(fh.read().decode("utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise RecordError("%s cannot be read (%s)" % (path, exc)) from None
    files = data.get("files") if isinstance(data, dict) else None
    if data.get("v") != RECORD_VERSION or not isinstance(files, list) or not all(rel_ok(f) for f in files):
        raise RecordError("%s is not a ddpfab %d record" % (path, RECORD_VERSION))
    return data


def write_record(root, files, origin, **extra):
    """Replace the record of *root* atomically (a crash leaves the old one or the new one)."""
    state = os.path.join(root, STATE_DIR)
    os.makedirs(state, exist_ok=True)
    data = dict(extra, v=RECORD_VERSION, origin=origin, time=time.time(), files=sorted(set(files), key=os.fsencode))
    tmp = tempfile.NamedTemporaryFile("w", dir=state, prefix="sync.json.", delete=False)  # noqa: SIM115 - closed below
    try:
        with tmp:
            json.dump(data, tmp)
        os.replace(tmp.name, os.path.join(root, RECORD))
    except BaseException:
        os.unlink(tmp.name)
        raise


def _open_parent(root, rel):
    """Descriptors of *root* and each directory on the way to *rel*, never following a symlink
    (a node-side symlink must not lead a delete or a move out of the workdir)."""
    fds = [os.open(root, os.O_RDONLY | os.O_DIRECTORY)]
    try:
        for part in rel.split("/")[:-1]:
            fds.append(os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fds[-1]))
    except OSError:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def remove_placed(root, rel):
    """Delete file or symlink *rel* of *root* (not a directory), then its emptied parents (also
    when the file is gone already: a sync interrupted mid-copy leaves the directories rsync made
    for files it never wrote). True when something was deleted."""
    parts = rel.split("/")
    try:
        fds = _open_parent(root, rel)
    except OSError:  # gone already, or a parent is a symlink or not a directory: not ours to follow
        return False
    try:
        try:
            st = os.stat(parts[-1], dir_fd=fds[-1], follow_symlinks=False)
        except OSError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode):
            return False
        if st is not None:
            os.unlink(parts[-1], dir_fd=fds[-1])
        for i in range(len(parts) - 1, 0, -1):
            try:
                os.rmdir(parts[i - 1], dir_fd=fds[i - 1])
            except OSError:  # not empty (the user's files are there) or gone: stop
                break
        return st is not None
    finally:
        for fd in fds:
            os.close(fd)


def _stage_root(root):
    return os.path.join(root, STATE_DIR, "stage")


def node_workdir(req):
    """``(lexical, real)`` of the request's workdir on this node, or raises WorkdirError."""
    path = resolve(req["workdir"], os.path.expanduser("~"))
    return path, os.path.realpath(path)


def node_probe(req):
    """Before a sync: resolve and check the workdir as this node sees it, tell whether it is the
    controller's own directory (a shared filesystem: the controller's probe file is visible), and
    whose it is: ``state`` new (created now), owned (has a record), empty, adopted, or missing (not
    created: a dry run). A non-empty directory without a record is refused unless ``adopt``.
    Unless a dry run (``create`` false), it also prepares the copy of ``files`` (``_prepare``); the
    reply's ``record`` is what ddpfab had placed before."""
    home = os.path.expanduser("~")
    try:
        workdir, real = node_workdir(req)
    except WorkdirError as exc:
        return {"error": "refusing to sync: %s" % exc}
    out = {"workdir": workdir, "real": real, "home": home, "python": sys.version.split()[0],
           "rsync": which("rsync"), "shared": False}
    nonce = req.get("nonce")
    if nonce and os.path.exists(os.path.join(real, nonce)):
        out["shared"] = True
        return out
    if not nonce and os.path.exists(real):
        return {"error": "refusing to sync: cannot tell whether %s is the controller's own directory on a shared "
                         "filesystem (%s); fix that, or sync into a directory that does not exist yet"
                         % (workdir, req.get("nonce_error") or "no probe file")}
    why = node_problem(workdir, home)
    if why:
        return {"error": "refusing to sync: the workdir %s; set ddpfab_workdir to a directory of its own, e.g. "
                         "/opt/ddpfab/PROJECT or ~/PROJECT" % why}
    create = req.get("create", True)
    if not os.path.isdir(real):
        if os.path.lexists(real):
            return {"error": "refusing to sync: the workdir %s exists and is not a directory" % workdir}
        out["state"] = "missing"
        if create:
            os.makedirs(real)
            write_record(real, req.get("files", ()), "created")
            out["state"] = "new"
        return out
    try:
        record = read_record(real)
    except RecordError as exc:
        return {"error": "refusing to sync: %s; move it away and sync with --adopt" % exc, "code": NOT_OURS}
    if record is not None:
        out["state"], out["record"] = "owned", record["files"]
        if create:
            out.update(_prepare(real, record, req.get("files", ())))
        return out
    entries = sorted(os.listdir(real))
    if entries and not req.get("adopt"):
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        return {"error": "refusing to sync into %s: it holds %d entries (%s) and no ddpfab record (%s), so ddpfab "
                         "did not put them there. Pass --adopt to take the directory over (nothing there is "
                         "deleted; a file the project overwrites is kept under %s/kept/), or set ddpfab_workdir "
                         "to a new or empty directory" % (workdir, len(entries), shown, RECORD, STATE_DIR),
                "code": NOT_OURS}
    out["state"] = "adopted" if entries else "empty"
    if create:
        write_record(real, [], out["state"])
        out.update(_prepare(real, read_record(real), req.get("files", ())))
    return out


def _prepare(real, record, files):
    """Before the copy: record *files* as placed (a sync killed mid-copy still owns them) and move
    aside what is in the way of a file new to the record but was not placed by ddpfab. A directory
    in the way (the project turned ``d/f`` into a file ``d``) loses first the placed files the
    project no longer has (the commit would delete them anyway), then, holding files a node made,
    is moved aside whole."""
    owned = set(record["files"])
    stamp = time.strftime("%Y%m%d-%H%M%S") + "-%d" % os.getpid()
    new = [rel for rel in files if rel_ok(rel) and rel not in owned]
    gone = owned - set(files)
    kept = []
    for rel in new:
        try:
            fds = _open_parent(real, rel)
        except OSError:
            continue  # its directory is not there yet (or not a plain directory: rsync will say)
        try:
            name = rel.rpartition("/")[2]
            try:
                st = os.stat(name, dir_fd=fds[-1], follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                for old in sorted(o for o in gone if o.startswith(rel + "/")):
                    remove_placed(real, old)  # prunes the dirs it empties, this one too
                try:
                    os.stat(name, dir_fd=fds[-1], follow_symlinks=False)
                except FileNotFoundError:
                    continue
            dest = os.path.join(real, STATE_DIR, "kept", stamp, rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            os.rename(name, dest, src_dir_fd=fds[-1])
            kept.append(rel)
        finally:
            for fd in fds:
                os.close(fd)
    if new:
        write_record(real, owned | set(new), record.get("origin", "created"))
    return {"kept": kept, "kept_dir": os.path.join(real, STATE_DIR, "kept", stamp) if kept else None}


def node_commit(req):
    """After the copy: delete the recorded files the controller no longer has, record exactly
    the files now placed, and hash them (the verification)."""
    _, real = node_workdir(req)
    record = read_record(real)
    if record is None:
        return {"error": "no ddpfab record in %s" % real, "code": NO_RECORD}
    owned = set(record["files"])
    deleted = [rel for rel in req["delete"] if rel_ok(rel) and rel in owned and remove_placed(real, rel)]
    files = [rel for rel in req["files"] if rel_ok(rel)]
    write_record(real, files, record.get("origin", "created"))
    out = tree_digest(real, files, cache=req.get("cache", False))
    out["deleted"] = len(deleted)
    return out


def node_hash(req):
    """The tree hash of the files ddpfab placed in the node's workdir (its record), or of the
    listed paths (a shared directory)."""
    _, real = node_workdir(req)
    if not os.path.isdir(real):
        return {"error": "workdir %s does not exist" % real}
    rels = req.get("paths")
    if rels is None:
        record = read_record(real)
        if record is None:
            return {"error": "no ddpfab record in %s: run ddpfab sync" % real, "code": NO_RECORD}
        rels = record["files"]
    return tree_digest(real, rels, detail=req.get("detail", False), cache=req.get("cache", False))


def node_locate(req):
    """For ``ddpfab fetch``: the real path of *path* (relative: in the workdir), which must lie in
    the workdir or the node's run dirs, its kind and size."""
    home = os.path.expanduser("~")
    path = req["path"]
    if lexical_problem(path if path.startswith(("/", "~")) else "/" + path):
        return {"error": "the path %r is refused: write it without '..', control characters or ~user, relative to "
                         "the workdir or absolute" % path}
    workdir, real_wd = node_workdir(req)
    runs = os.path.realpath(resolve(req["runs_dir"], home))
    target = resolve(path, home) if path.startswith(("/", "~")) else os.path.join(workdir, path)
    real = os.path.realpath(target)
    if not any(real == r or real.startswith(r.rstrip("/") + "/") for r in (real_wd, runs)):
        return {"error": "%s is outside the workdir %s and the run dirs %s: fetch reads only those" % (target, workdir, runs)}
    if real in (real_wd, runs):  # however spelt ('./.', its absolute path): one rule, here
        return {"error": "%s is the %s itself: name a file or directory in it" % (
            target, "workdir" if real == real_wd else "run dirs' directory")}
    if not os.path.exists(real):
        return {"error": "%s does not exist" % target}
    if not (os.path.isdir(real) or os.path.isfile(real)):  # a FIFO, socket or device: rsync copies nothing
        return {"error": "%s is not a file or a directory: fetch copies those" % target}
    if os.path.isdir(real):
        n = size = 0
        for dp, _, fns in os.walk(real):
            for f in fns:
                n += 1
                size += os.lstat(os.path.join(dp, f)).st_size
        return {"path": real, "kind": "dir", "files": n, "bytes": size}
    return {"path": real, "kind": "file", "files": 1, "bytes": os.stat(real).st_size}


def node_stage(req):
    """Write the given files (base64) into a new private dir under the workdir's state dir (a
    forwarding node's file list and known_hosts); return its path. (``hold``: the node program
    keeps it while its stdin stays open, then removes it.)"""
    _, real = node_workdir(req)
    os.makedirs(_stage_root(real), exist_ok=True)
    d = tempfile.mkdtemp(prefix="s-", dir=_stage_root(real))
    for name, data in req["files"].items():
        with open(os.path.join(d, name), "wb") as fh:
            fh.write(base64.b64decode(data))
    return {"dir": d}
