"""The synced tree's rules and content hash, shared verbatim by the controller and the nodes.

This one file is both a module ddpfab imports and the program each node runs (its source is sent
with ``python3 -c``, the request as JSON on stdin), so "the same algorithm on both sides" is true
by construction. Keep it self-contained: standard library only, Python 3.6+, no ddpfab imports.

What the hash covers: every regular file and symlink of the tree except the *skipped* paths
(below), sorted by relative path (as bytes). Per entry: its kind (file, executable file, symlink),
its relative path, and the sha256 of its content or its link target. Directories count through the
files in them; empty directories, owners, timestamps and permission bits other than the owner's
exec bit (the one git records) do not count. So the hash names the code, not the umask of the
machine it was checked out on, and a node holds the same tree exactly when the hashes agree.

Skipped paths are never sent, never hashed, and (except ``__pycache__``) never deleted on a node:
``runs/`` at the top (run records), ``__pycache__/`` (derived; deleted on nodes by sync),
``.git`` (unless asked), any virtualenv (a directory holding ``pyvenv.cfg``; not relocatable), and
whatever the *keep* patterns (``.ddpfabkeep``, ``--keep``; gitignore syntax) match, which is how
training outputs that live in the workdir (checkpoints, caches) survive a sync.
"""

import base64
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import time

IGNORE_FILE = ".ddpfabignore"
KEEP_FILE = ".ddpfabkeep"
RUNS_DIR = "runs"
CHUNK = 1 << 20

#: Why a path is skipped. All but CACHE are also protected from deletion on the nodes.
RUNS, CACHE, GIT, VENV, KEEP = "runs", "cache", "git", "venv", "keep"
PROTECTED = (RUNS, GIT, VENV, KEEP)


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

    def _decide(self, rel, is_dir):
        parts = rel.split("/")
        verdict = self.top.decide(rel, is_dir)
        for k in range(len(parts)):
            verdict = _decide(self._rules_of("/".join(parts[:k])), rel, is_dir, verdict)
        return bool(verdict)

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


def cache_path(root):
    """Where the digest cache of tree *root* lives (outside the tree, under the user's cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    key = hashlib.sha256(os.fsencode(os.path.abspath(root))).hexdigest()[:24]
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
    """``{"tree_hash", "files", "bytes"}`` of *rels* under *root* (plus ``"entries"``, a per-path
    digest, with *detail*: for naming the paths two trees differ in). With *cache*, content
    digests are reused from, and saved to, :func:`cache_path`."""
    total, tree, entries = 0, hashlib.sha256(), {}
    where = cache_path(root) if cache else None
    old, new, now = (_load_cache(where), {}, time.time()) if cache else (None, None, None)
    for rel in sorted(set(rels), key=os.fsencode):
        record, size = entry_record(root, rel, old, new, now)
        total += size
        tree.update(record)
        if detail:
            entries[rel] = hashlib.sha256(record).hexdigest()[:16]
    if cache and new != old:
        _save_cache(where, new)
    out = {"tree_hash": tree.hexdigest(), "files": len(set(rels)), "bytes": total}
    if detail:
        out["entries"] = entries
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


# -- rsync filter rules -------------------------------------------------------------------------
def rsync_escape(rel, wild=False):
    """*rel* for an rsync filter rule. rsync reads backslashes as escapes only in patterns that
    hold a wildcard, so escape (``\\ * ? [``) exactly when there is or will be one."""
    if wild or any(c in rel for c in "*?["):
        return "".join("\\" + c if c in "\\*?[" else c for c in rel)
    return rel


def protect_rules(skipped):
    """Receiver-side rsync rules that keep a node's own skipped paths from --delete-excluded."""
    return ["P /" + rsync_escape(rel) + ("/" if is_dir else "")
            for rel, reason, is_dir in sorted(skipped) if reason in PROTECTED]


# -- the node side ------------------------------------------------------------------------------
#: Directories a sync must never mirror into: it deletes whatever is not in the project there.
NEVER_WORKDIRS = ("/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib64", "/opt", "/proc", "/root",
                  "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var")


def unsafe_workdir(path, home):
    """Why mirroring into *path* would be a disaster (it is a system dir or the home), or None."""
    real = os.path.realpath(path)
    if real in NEVER_WORKDIRS or path in NEVER_WORKDIRS:
        return "%s is a system directory" % path
    if home and real == os.path.realpath(home):
        return "%s is the home directory" % path
    return None


def node_probe(req):
    """Before a sync: resolve and create the workdir, tell whether it is the controller's own
    directory (a shared filesystem: its probe file is visible), list what must be protected."""
    workdir = os.path.abspath(os.path.expanduser(req["workdir"]))
    out = {"workdir": workdir, "home": os.path.expanduser("~"), "python": sys.version.split()[0],
           "rsync": shutil.which("rsync"), "shared": False, "created": False}
    if req.get("nonce") and os.path.exists(os.path.join(workdir, req["nonce"])):
        out["shared"] = True
        return out
    why = unsafe_workdir(workdir, out["home"])
    if why:
        return {"error": "refusing to sync: the workdir %s, and a sync deletes everything there that is not "
                         "in the project; set ddpfab_workdir to a directory of its own" % why}
    if not os.path.isdir(workdir):
        if not req.get("create", True):
            out["missing"] = True
            return out
        os.makedirs(workdir)
        out["created"] = True
    _, skipped = walk(workdir, Skipper(workdir, req.get("keep", ()), req.get("with_git", False)))
    out["protect"] = protect_rules(skipped)
    return out


def node_hash(req):
    """The tree hash of the node's workdir (or of the listed paths, for a shared directory)."""
    workdir = os.path.abspath(os.path.expanduser(req["workdir"]))
    if not os.path.isdir(workdir):
        return {"error": "workdir %s does not exist" % workdir}
    if req.get("paths") is not None:
        rels = req["paths"]
    else:
        rels, _ = walk(workdir, Skipper(workdir, req.get("keep", ()), req.get("with_git", False)))
    return tree_digest(workdir, rels, detail=req.get("detail", False), cache=req.get("cache", False))


def node_stage(req):
    """Write the given files (base64) into a new private temp dir; return its path."""
    d = tempfile.mkdtemp(prefix="ddpfab-sync-")
    for name, data in req["files"].items():
        with open(os.path.join(d, name), "wb") as fh:
            fh.write(base64.b64decode(data))
    return {"dir": d}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    raw = argv[0] if argv and argv[0] != "-" else sys.stdin.read()
    req = json.loads(raw)
    ops = {"probe": node_probe, "hash": node_hash, "stage": node_stage}
    try:
        out = ops[req["op"]](req)
    except OSError as exc:
        out = {"error": "%s: %s" % (getattr(exc, "filename", "") or "", exc.strerror or exc)}
    sys.stdout.write(json.dumps(out) + "\n")
    return 1 if "error" in out else 0


if __name__ == "__main__":
    sys.exit(main())
