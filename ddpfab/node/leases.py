"""GPU leases on a node (part of the node program: stdlib only, Python 3.6+).

A lease is a Unix socket bound to the GPU's abstract name (Linux: a name in the node's network
namespace, no file): the kernel lets one socket hold a name, and the job's supervisor binds it
before it starts the job and keeps it for as long as it lives. The kernel drops the name however
the supervisor ends, SIGKILL included, so no lease outlives its job; any user can bind a free
GPU's name, whoever held it before; and no user can take it from its holder (a lock file could be
removed by its creator, or by the owner of its dir, while another user holds it: then a second
grant). Readers see which names are held in /proc/net/unix, binding none. Who holds a lease is
written, as data, in ``gpu-INDEX.holder`` in :data:`LEASE_DIR` (mode 1777, like /tmp), read by
:func:`read_lease_holder` (typed fields only) and shown only while the name is held and the
record's process is alive; a record removed or made to lie never frees the GPU. A supervisor's
master port is held the same way (``port-PORT``), its reservation record in ``port-PORT.lock``.

GPUs that a process uses without a lease (another tool's job: ``nvidia-smi --query-compute-apps``)
are busy too: they are never granted, and shown with their processes.
"""

import errno
import fcntl
import json
import os
import pwd
import socket
import stat
import subprocess
import time

try:  # as a module of ddpfab; on a node, their source comes first in the same program
    from .loop import read_fields
    from .treehash import digest
    from .workdir import which
except ImportError:
    pass

#: Where every user's lease records, port reservations and queue tickets meet. ``DDPFAB_LEASE_DIR``
#: overrides it (tests of one host's leases in a private dir: the GPUs' lock names follow it).
LEASE_DIR = os.environ.get("DDPFAB_LEASE_DIR") or "/tmp/ddpfab-leases"
#: How a reader opens a file of the lease dir: never through a link, never waiting on a FIFO.
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
#: The fields of a holder record a reader takes, each with its type.
LEASE_FIELDS = (("run_id", str), ("user", str), ("pid", int), ("since", float), ("gpus", list), ("until", float))
#: How long a master port the probe found free stays reserved for its run after the probe's
#: session ended, until the master's supervisor takes it for the job's life: jobs probed or
#: released from the queue at the same instant never pick the same port.
PORT_RESERVE_S = 120.0
#: A supervisor refreshes its lease files' times this often, so /tmp cleaners (systemd-tmpfiles
#: removes files unused for 10 days) never remove a held lease's file.
TOUCH_S = 3600.0


class LeaseError(Exception):
    """The lease dir cannot be used safely, or a GPU asked for does not exist; the message says why."""


def lease_dir():
    """The lease dir, made (mode 1777) when missing; refused when it is not what it must be: a real
    directory (not a link) that is sticky and writable by all, or owned by root or by us."""
    d = LEASE_DIR
    try:
        os.mkdir(d, 0o700)
        os.chmod(d, 0o1777)  # mkdir's mode passes through the umask
    except OSError as exc:
        if exc.errno != errno.EEXIST:
            raise LeaseError("cannot make the GPU lease dir %s: %s" % (d, exc.strerror)) from None
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise LeaseError("%s is not a directory (a link or a file): GPU leases need it as a directory" % d)
    if st.st_mode & 0o1777 != 0o1777:
        raise LeaseError("%s has mode %o, not 1777: not every user can lease GPUs there (fix: chmod 1777 %s)"
                         % (d, st.st_mode & 0o7777, d))
    return d


def gpu_table():
    """This node's GPUs as nvidia-smi lists them: [(index, uuid)], or [] without nvidia-smi."""
    if not which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=20).stdout
    table = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit():
            table.append((parts[0], parts[1]))
    return table


def _ancestors(pid):
    """*pid* and its ancestors (by /proc, readable for every user's processes)."""
    seen = []
    while pid > 1 and pid not in seen:
        seen.append(pid)
        try:
            with open("/proc/%d/stat" % pid, "rb") as fh:
                data = fh.read()
            pid = int(data[data.rfind(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return seen


def compute_apps(table):
    """GPU index -> [{"pid", "name"}] of the processes nvidia-smi says use it."""
    if not table or not which("nvidia-smi"):
        return {}
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,process_name", "--format=csv,noheader"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=20).stdout
    index = dict((uuid, i) for i, uuid in table)
    apps = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",", 2)]
        if len(parts) == 3 and parts[0] in index and parts[1].isdigit():
            apps.setdefault(index[parts[0]], []).append({"pid": int(parts[1]), "name": parts[2][:200]})
    return apps


def _holder_path(gpu):
    return os.path.join(LEASE_DIR, "gpu-%s.holder" % gpu)


def _name(what):
    """The abstract socket name of *what* (``gpu-0``, ``port-29500``), without its leading NUL:
    the same for every user of the lease dir, however its path is spelled."""
    where = os.path.abspath(os.path.normpath(LEASE_DIR))
    return "ddpfab-lease-%s-%s" % (digest("sha1", where.encode("utf-8", "surrogateescape")).hexdigest()[:16], what)


def _bind_name(what):
    """The descriptor of a socket bound to *what*'s name (close it to release), or None when
    another process holds it. Not inherited by the job (close-on-exec)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + _name(what))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            return None
        raise LeaseError("cannot bind the lease name of %s: %s" % (what, exc.strerror)) from None
    return sock.detach()


def _held_names():
    """The lease names bound in this network namespace, from /proc/net/unix (readable by every
    user; reading it binds no name, so a reader never takes a name a taker wants), or None."""
    try:
        with open("/proc/net/unix", "rb") as fh:
            lines = fh.read().splitlines()[1:]
    except OSError:
        return None
    return set(p[-1][1:].decode("ascii", "replace") for p in (ln.split() for ln in lines)
               if len(p) >= 8 and p[-1].startswith(b"@ddpfab-lease-"))


def _is_held(what, names):
    """Whether *what*'s name is held (by *names*, :func:`_held_names`; else by a bind's answer)."""
    if names is not None:
        return _name(what) in names
    fd = _bind_name(what)
    if fd is not None:
        os.close(fd)
    return fd is None


#: TRANSITION: ddpfab before lease names (up to 065ce2b) leased a GPU by a flock on
#: ``gpu-INDEX.lock``. Until no node runs such a version, a lease also takes that flock (so an
#: older job cannot take the GPU) and a flock held there counts as a lease (an older job's).
def _legacy_lock(gpu):
    """The old lock file of *gpu*, flocked: its descriptor, None when an older job holds it, or
    -1 when it cannot be used (a link, a FIFO: then no older job can use it either)."""
    try:
        fd = _open_lease(os.path.join(LEASE_DIR, "gpu-%s.lock" % gpu))
    except (OSError, LeaseError):
        return -1
    if _try_flock(fd):
        return fd
    os.close(fd)
    return None


def _alive(pid):
    return os.path.exists("/proc/%d" % pid)


def _open_lease(path):
    """A file of the lease dir (a lock or a record), opened for writing where we may (else
    read-only: flock needs no more), never blocking on a FIFO, made when missing (mode 0666 so
    that later holders of other users can write who they are). Never through a link. An existing
    file is opened without O_CREAT: the kernel's protected_regular refuses O_CREAT on another
    user's file in a sticky dir."""
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)  # a FIFO there must not block
    while True:
        for mode in (os.O_RDWR, os.O_RDONLY):
            try:
                fd = os.open(path, mode | flags)
            except OSError as exc:
                if exc.errno == errno.EACCES and mode == os.O_RDWR:
                    continue
                if exc.errno != errno.ENOENT:
                    raise
                break
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise LeaseError("%s is not a regular file; GPU leases refuse it" % path)
            return fd
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | flags, 0o666)
        except OSError as exc:
            if exc.errno == errno.EEXIST:
                continue  # another user made it meanwhile: open theirs
            raise
        os.fchmod(fd, 0o666)
        return fd


def read_lease_holder(fd):
    """Who holds the lease of open file *fd*, as written (:func:`read_fields`)."""
    return read_fields(fd, LEASE_FIELDS)


def _holder_of(gpu, name=None):
    """Who holds GPU *gpu*'s lease, as its record (or file *name* in the lease dir) says ({} when
    the record is missing, unreadable or names a process that is gone: a holder that could not
    write its own)."""
    try:
        fd = os.open(os.path.join(LEASE_DIR, name) if name else _holder_path(gpu), READ_FLAGS)
    except OSError:
        return {}
    try:
        rec = read_lease_holder(fd) if stat.S_ISREG(os.fstat(fd).st_mode) else {}
    finally:
        os.close(fd)
    return rec if rec.get("pid") and _alive(rec["pid"]) else {}


def _try_flock(fd):
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


def lease_state(table=None, apps=None):
    """Every GPU's state: [{"gpu", "uuid", "state": free|leased|busy, "holder", "procs"}]. A leased
    GPU names its holder; a busy one (used without a lease) its processes. *table* and *apps*:
    :func:`gpu_table`'s and :func:`compute_apps`' answers when the caller has them (each is a run
    of nvidia-smi)."""
    table = gpu_table() if table is None else table
    if not table:
        return []  # no GPU: nothing to lease, and no lease dir made
    lease_dir()
    apps = compute_apps(table) if apps is None else apps
    out = []
    names = _held_names()
    for gpu, uuid in table:
        holder = None
        if _is_held("gpu-%s" % gpu, names):
            holder = _holder_of(gpu)
        else:
            legacy = _legacy_lock(gpu)
            if legacy is None:
                holder = _holder_of(gpu, "gpu-%s.lock" % gpu)  # an older ddpfab's lease, its record in its lock file
            elif legacy >= 0:
                os.close(legacy)
        procs = apps.get(gpu, [])
        if holder is not None and holder.get("pid"):  # its own job's processes are no foreign use
            procs = [p for p in procs if holder["pid"] not in _ancestors(p["pid"])]
        st = "leased" if holder is not None else ("busy" if procs else "free")
        out.append({"gpu": gpu, "uuid": uuid, "state": st, "holder": holder, "procs": procs})
    return out


def lease_user():
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def pinned_gpus(table, pin):
    """The GPU indexes a pin (``ddpfab_gpu_ids``: indexes or UUIDs) names on this node, in order;
    LeaseError for one the node does not have."""
    by_uuid = dict((u, i) for i, u in table)
    indexes = [i for i, _ in table]
    out = []
    for g in pin:
        g = str(g)
        i = g if g in indexes else by_uuid.get(g)
        if i is None:
            raise LeaseError("GPU %s is not on this node (nvidia-smi lists %s)" % (g, ", ".join(indexes) or "none"))
        out.append(i)
    return out


def take_leases(count, pin, run_id, table=None, among=None):
    """Lease *count* GPUs (the pinned ones, when *pin*; only of *among*, when given), none of them
    leased or busy. Returns
    ``(fds, gpus, None)`` when granted (keep the fds open: the lease names and the records; close
    them all to release), else
    ``(None, None, states)`` with every GPU's state (nothing is held then)."""
    table = gpu_table() if table is None else table
    lease_dir()
    candidates = pinned_gpus(table, pin) if pin else [i for i, _ in table]
    if among is not None:
        candidates = [g for g in candidates if g in among]
    if count > len(candidates):
        raise LeaseError("%d GPUs asked, this node has %d%s" % (count, len(candidates), " pinned" if pin else ""))
    busy = set(i for i, procs in compute_apps(table).items() if procs)
    fds, got = [], []
    for gpu in candidates:
        if len(got) == count:
            break
        if gpu in busy:
            continue
        lock = _bind_name("gpu-%s" % gpu)
        if lock is None:
            continue
        legacy = _legacy_lock(gpu)
        if legacy is None:  # an older ddpfab's reader flocks for microseconds: one second look
            time.sleep(0.01)
            legacy = _legacy_lock(gpu)
        if legacy is None:  # an older ddpfab's job holds it
            os.close(lock)
            continue
        fds += [lock] + ([legacy] if legacy >= 0 else [])
        got.append(gpu)
    if len(got) < count:
        for fd in fds:
            os.close(fd)  # closing the only descriptor releases the name
        return None, None, lease_state(table)
    record = json.dumps({"run_id": run_id, "user": lease_user(), "pid": os.getpid(), "since": time.time(),
                         "gpus": got}).encode("utf-8")
    for gpu in got:
        try:
            fd = _open_lease(_holder_path(gpu))
        except (OSError, LeaseError):
            continue  # no record (a link or another user's file in the way): the lease still holds
        fds.append(fd)  # kept open for touch_leases (a /tmp cleaner must not remove it)
        try:
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, record)
        except OSError:
            pass  # a read-only descriptor (another user's file, made unwritable): the lease still holds
    return fds, got, None


def touch_leases(fds):
    """Refresh the lease files' times (see :data:`TOUCH_S`)."""
    for fd in fds:
        try:
            os.utime(fd)
        except (OSError, NotImplementedError, TypeError):
            pass


def describe_leases(states, only=None):
    """One line per GPU that is not free (among *only*): who holds it, or what uses it."""
    lines = []
    for s in states:
        if s["state"] == "free" or (only is not None and s["gpu"] not in only):
            continue
        if s["state"] == "leased" and not s["holder"]:
            lines.append("GPU %s leased by a process that left no record of itself (as root, `ss -xap | grep "
                         "ddpfab-lease-` names it)" % s["gpu"])
        elif s["state"] == "leased":
            h = s["holder"]
            age = time.time() - h["since"] if isinstance(h.get("since"), float) else None
            lines.append("GPU %s leased by run %s (user %s, pid %s%s)" % (
                s["gpu"], h.get("run_id", "?"), h.get("user", "?"), h.get("pid", "?"),
                ", for %.0f s" % age if age is not None else ""))
        else:
            lines.append("GPU %s busy without a lease: %s" % (
                s["gpu"], ", ".join("pid %d (%s)" % (p["pid"], p["name"]) for p in s["procs"])))
    return lines


def uses_leases():
    """Whether this node takes part in leasing: it has GPUs to lease (nvidia-smi) or a lease dir.
    (A CPU node without one is left as it was: no lease dir is made there.)"""
    return bool(which("nvidia-smi")) or os.path.isdir(LEASE_DIR)


def reserve_port(port, run_id, hold=False):
    """Reserve master port *port* for run *run_id* (a flock on ``port-PORT.lock`` and a record):
    for :data:`PORT_RESERVE_S` after this process ends, or, with *hold* (the job's supervisor),
    for as long as it lives (then also by the port's lease name, which no one can remove).
    Returns the descriptors to keep open, or None when another run has it (its supervisor holds
    it, or its reservation has not run out)."""
    lease_dir()
    what = "port-%d" % int(port)
    name = None
    if hold:
        name = _bind_name(what)
        if name is None:
            return None
    elif _is_held(what, _held_names()):
        return None
    fd = _open_lease(os.path.join(LEASE_DIR, what + ".lock"))
    keep = [fd] + ([name] if name is not None else [])
    deadline = time.monotonic() + (10.0 if hold else 0.0)  # the own probe's session may still be ending
    while not _try_flock(fd):
        if time.monotonic() >= deadline:
            for k in keep:
                os.close(k)
            return None
        time.sleep(0.05)
    rec = read_lease_holder(fd)
    if rec.get("run_id") not in (None, run_id) and rec.get("until", 0.0) > time.time():
        for k in keep:
            os.close(k)
        return None
    now = time.time()
    record = {"run_id": run_id, "user": lease_user(), "pid": os.getpid(), "since": now}
    if not hold:
        record["until"] = now + PORT_RESERVE_S
    try:
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(record).encode("utf-8"))
    except OSError:
        pass
    return keep


# -- the queue: tickets in arrival order ----------------------------------------------------------
#: A waiting job's ticket: ``wait-KEY.ticket``, KEY = its arrival time (the controller's, the same
#: on every node of the job) and run id, so every node orders the same jobs the same way. The
#: waiter holds an exclusive flock on its ticket while it waits: a dead waiter's ticket is free,
#: and ignored by everyone (and removed by the next waiter of the same user).
TICKET_FIELDS = (("run_id", str), ("user", str), ("pid", int), ("since", float), ("count", int), ("pin", list),
                 ("key", str))


def ticket_key(arrival, run_id):
    return "%017.6f-%s" % (float(arrival), run_id)


def make_ticket(key, record):
    """This job's ticket in the queue (its flock held): the descriptor and path."""
    path = os.path.join(lease_dir(), "wait-%s.ticket" % key)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps(dict(record, key=key)).encode("utf-8"))
    return fd, path


def drop_ticket(fd, path):
    try:
        os.unlink(path)
    except OSError:
        pass
    os.close(fd)


def tickets(own_path=None):
    """The live tickets in the queue, in arrival order (their waiters hold their flocks); a dead
    waiter's ticket of this user is removed on the way."""
    d = LEASE_DIR
    out = []
    try:
        names = sorted(n for n in os.listdir(d) if n.startswith("wait-") and n.endswith(".ticket"))
    except OSError:
        return []
    for name in names:
        path = os.path.join(d, name)
        if path == own_path:
            out.append({"key": name[5:-7], "own": True})
            continue
        try:
            fd = os.open(path, READ_FLAGS)
        except OSError:
            continue
        try:
            if _try_flock(fd):  # nobody waits on it: a dead waiter's
                if os.fstat(fd).st_uid == os.getuid():
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
                continue
            rec = read_fields(fd, TICKET_FIELDS)
            if rec.get("key") == name[5:-7]:
                out.append(rec)
        finally:
            os.close(fd)
    return out


def grantable(states, ahead, count, pin):
    """The free GPUs a job asking *count* GPUs (or the pinned ones) may take now, or None: what is
    left after every ticket *ahead* of it has been given, in order, what it asks of the free GPUs
    (a large job first in line keeps the GPUs it waits for: no starvation by small ones)."""
    free = [s["gpu"] for s in states if s["state"] == "free"]
    index = dict((s["uuid"], s["gpu"]) for s in states)
    for t in ahead:
        want = [index.get(g, g) for g in t.get("pin") or ()]
        if want:
            free = [g for g in free if g not in want]
        else:
            free = free[t.get("count", 0):]
    if pin:
        return free if all(index.get(g, g) in free for g in pin) else None
    return free if len(free) >= count else None
