"""Which directories a sync may write into: one set of rules for the controller and the nodes.

A workdir comes from the inventory (``ddpfab_workdir``) or is the controller's own directory.
Every command that uses it (sync, fetch, plan, run) takes it through :func:`resolve`, so they all
agree on the path; sync and fetch also check it on the node, *as the node resolves it*
(:func:`node_problem`: symlinks followed, the node's users and mounts), because a path that is
harmless here may be a symlink to ``/`` or another user's home there.

Rules, and why:

- absolute, or ``~`` / ``~/...`` (the SSH user's home on that node). ``~user`` is refused: each
  command would have to look up another user's home the same way on every node, and a workdir in
  someone else's home is not ddpfab's to write.
- no control characters, a trailing newline included (a YAML ``|`` block adds one; the path would
  be one string to Python and another to the shell).
- no ``..`` component: the path must name its directory without walking back out of it.
- not a system directory, not under a system tree (``/etc``, ``/usr``...), not any user's home
  directory itself, not a mount point: sync writes there, and a record of what it placed is only a
  promise about the files it placed, not about a whole filesystem.

This file is also part of the program the nodes run (:func:`ddpfab.remote.nodeprogram.program` sends its
source ahead of :mod:`ddpfab.node.treehash`): standard library only, Python 3.6+, no ddpfab imports.
As the program's first module it also holds the program's one PATH lookup (:func:`which`).
"""

import os
import posixpath

#: Directories that are never a workdir themselves.
SYSTEM_DIRS = ("/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/media",
               "/mnt", "/opt", "/proc", "/root", "/run", "/sbin", "/snap", "/srv", "/sys", "/tmp", "/usr", "/var",
               "/var/cache", "/var/lib", "/var/log", "/var/mail", "/var/spool", "/var/tmp", "/lost+found")
#: Trees no workdir may be inside of (the system's own files).
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run", "/sbin",
                "/sys", "/usr")


class WorkdirError(ValueError):
    """A workdir that no command may use; the message says why and what to write instead. (The
    node program sends it as an error reply with this ``code``; the controller's problem names the
    node: :meth:`ddpfab.remote.nodeprogram.Reply.value`, or a PlanError for the planner's own check.)"""

    code = "workdir"


def lexical_problem(raw):
    """Why the workdir value *raw* is not acceptable as written, or None (no filesystem access)."""
    if not isinstance(raw, str) or not raw:
        return "the workdir is empty; set ddpfab_workdir to an absolute path"
    for i, c in enumerate(raw):
        if ord(c) < 32 or ord(c) == 127:
            where = "ends in" if i == len(raw) - 1 else "holds"
            hint = " (a YAML '|' block adds a trailing newline: write the path as a plain scalar)" if c == "\n" else ""
            return "the workdir %r %s a control character %r%s" % (raw, where, c, hint)
    if raw.startswith("~") and raw != "~" and not raw.startswith("~/"):
        return ("the workdir %r names another user's home (~user): write the absolute path, or ~/... for the SSH "
                "user's own home" % raw)
    if not raw.startswith(("/", "~")):
        return "the workdir %r is not an absolute path (start it with / or ~/)" % raw
    if ".." in raw.split("/"):
        return "the workdir %r holds '..': write the directory it means, without '..'" % raw
    return None


def resolve(raw, home):
    """*raw* as the absolute, normalised path a node with SSH home *home* uses.

    With *home* unknown (an offline plan) a ``~/...`` path stays relative to the home (``x/y``),
    which is how an SSH session takes it. Raises WorkdirError when :func:`lexical_problem` objects.
    """
    why = lexical_problem(raw)
    if why:
        raise WorkdirError(why)
    if raw == "~" or raw.startswith("~/"):
        rest = raw[2:]
        if not home:
            return posixpath.normpath(rest) if rest.strip("/") else "."
        raw = home.rstrip("/") + "/" + rest
    return posixpath.normpath(raw).replace("//", "/")


def _homes():
    try:
        import pwd
    except ImportError:
        return []
    try:
        return [p.pw_dir for p in pwd.getpwall() if p.pw_dir]
    except OSError:
        return []


def which(cmd):
    """*cmd*'s path on this process's PATH, None where it is not there: shutil.which's answer for a
    plain name, without importing shutil (with bz2 and lzma, 1.5 ms of a node program's start, and
    every ``facts`` asks for nvidia-smi). An empty PATH finds nothing; an empty entry of it is the
    current directory (the name as it is joined, as shutil has it)."""
    dirs = os.environ.get("PATH", os.defpath)
    for d in dirs.split(os.pathsep) if dirs else ():
        path = os.path.join(d, cmd)
        if os.access(path, os.X_OK) and not os.path.isdir(path):
            return path
    return None


def source_problem(path):
    """Why a sync must not copy from *path*, the controller's current directory, or None: a
    system directory itself (from ``/`` it would read the whole machine) or a home (it would send
    its keys and dotfiles to every node). Directories under them (``/usr/src/app``, ``~/proj``)
    are projects like any other."""
    real = os.path.realpath(path)
    homes = [os.path.expanduser("~")] + [h for h in _homes() if h.startswith("/home/")]  # people's, not services'
    if real in SYSTEM_DIRS:
        why = "a system directory"
    elif any(real == os.path.realpath(h) for h in homes):
        why = "a home directory"
    else:
        return None
    return ("refusing to sync from %s: it is %s; ddpfab copies the current directory to the nodes: cd into the "
            "project (or run with --no-sync)" % (path, why))


def node_problem(path, home=None):
    """Why a sync must not write into *path* on this machine (resolved here: symlinks followed,
    this machine's users and mounts), or None. *path* is absolute (see :func:`resolve`)."""
    real = os.path.realpath(path)
    shown = path if real == path else "%s (%s)" % (path, real)
    if real in SYSTEM_DIRS or path in SYSTEM_DIRS:
        return "%s is a system directory" % shown
    for tree in SYSTEM_TREES:
        if real.startswith(tree + "/"):
            return "%s is inside the system directory %s" % (shown, tree)
    for h in _homes() + ([home] if home else []):
        if h not in ("/", "") and real == os.path.realpath(h):
            return "%s is a user's home directory" % shown
    if os.path.isdir(real) and os.path.ismount(real):
        return "%s is a mount point (a whole filesystem)" % shown
    return None
