"""The node supervisor ("agent"): the node program's ``supervise`` operation (:mod:`ddpfab.node`).

ddpfab sends the node program's source and then the job spec over the SSH session's stdin (nothing
to install on the nodes beyond a python; nothing secret in any command line: ``ps`` on the node
shows ``python -S -c <a short loader> MAGIC CODE SOURCE ddpfab-agent RUN_ID``). The spec holds the job's argv, workdir
and environment as data; the job is started without a shell, so its env values (secrets
included) are in no process's argv, only in the job's own environment, which only its user (and
root) can read. It:

- becomes a child subreaper, so every descendant of the job stays its descendant even when its
  parent dies (torchrun starts its workers in sessions of their own, so a process group alone
  would miss them);
- writes its own record (``agent.json``) under the run's remote dir *before* starting the job (a
  supervisor that cannot record itself, e.g. on a full disk, starts nothing), then starts the job
  in a new session with ``DDPFAB_JOB=<run id>`` in its environment (every process of the job
  inherits it, so ``ddpfab stop`` and the controller's cleanup find the job even when this
  supervisor was killed), and relays the output to ddpfab (stdout) and to ``output.log`` there;
- ends the whole job tree (TERM, then KILL after a grace period) when ddpfab closes its end of the
  link (stdin EOF: that is what an SSH session delivers when the controller exits, is killed, or
  says stop; a ``!`` byte asks for a fast stop), when ddpfab's heartbeat (a byte on stdin every second) stops for longer than the
  spec's ``silence`` (the network to the controller is cut: no EOF ever arrives then), when it gets
  SIGTERM/SIGHUP/SIGINT, or when the job's main process exits;
- with ``detached`` in the spec it ignores stdin and writes only to ``output.log``: the job then
  lives on without ddpfab until it ends or ``ddpfab stop`` signals this agent; with ``console``
  too (a job started by hand from ``plan --emit``'s script) its output also goes to stdout (a
  thread of its own: a stalled terminal stalls nothing), its input is that terminal when the
  script was started on one, and the job ends when that terminal goes;
- with ``watch_workers`` in the spec (torchrun with ``--max-restarts=0``: any failed worker ends
  the job) it watches torchrun's workers through pidfds and, the moment one exits with an error,
  ends the node's job itself instead of waiting for torchrun to notice, tear down and exit (about a
  second with torch loaded): that second is most of a crash's teardown time;
- exits with the job's exit code (128+N for a signal), after writing it to ``exit_code``; its
  ``result.json`` says when the job failed (``failed_at``, this node's clock) if it failed on its
  own, so ddpfab can blame the node that failed first.

Killing is by this job's process tree only, never by a name pattern: two jobs may share a host.
"""

import json
import os
import re
import select
import shutil
import signal
import stat
import threading
import time

try:  # as a module of ddpfab; on a node leases.py's source comes first in the same program
    from .leases import (TOUCH_S, compute_apps, describe_leases, drop_ticket, grantable, gpu_table, lease_state,
                         lease_user, make_ticket, reserve_port, take_leases, ticket_key, tickets, touch_leases,
                         uses_leases)
except ImportError:
    pass

PR_SET_CHILD_SUBREAPER = 36
#: Seconds between TERM and KILL when the job is stopped because another node failed: the
#: collective is broken, so there is nothing to wait for (the workers die on TERM at once; this
#: only cuts short torchrun's own slow shutdown).
FAST_GRACE = 0.1
#: Why ddpfab ends a job fast (``!``, then this byte), as the job's record says it; a bare ``!``
#: (or one whose byte is not here) is another node's failure.
HUNG, STOPPED_OUTSIDE, HOLDER_ENDED = b"h", b"o", b"c"
FAST_STOPS = {HUNG: "the job hung (--on-hang stop)", STOPPED_OUTSIDE: "another node was stopped from outside the run",
              HOLDER_ENDED: "the connection holder ended"}
FAILED_ELSEWHERE = "another node failed"
#: Seconds between a worker's failure and ending the node's job: torchrun's ``--tee`` relays the
#: workers' log files every 0.1 s, so this lets the crashed rank's last lines (its traceback) reach
#: the stream before torchrun is stopped.
TAIL_SETTLE = 0.25
#: Seconds the same waits after a worker ended by a SIGTERM from outside: torchrun's monitor (every
#: 0.1 s, slower under load) logs that worker's end as the first failure it observed.
OUTSIDE_SETTLE = 1.0
#: Modules whose process is torchrun (or the legacy launcher); its children are the workers.
LAUNCHER_MODULES = (b"torch.distributed.run", b"torch.distributed.launch")
#: Every process of a job carries ``JOB_MARKER=<run id>`` in its environment.
JOB_MARKER = "DDPFAB_JOB"
#: The agent's exit code when it could not start the job at all (no record, no workdir, no program).
CANNOT_START = 125
#: The agent's exit code when the GPUs the job needs are leased or busy (EX_TEMPFAIL: try later).
LEASES_HELD = 75
#: ... and when its ``--wait`` was cancelled before it started (ddpfab stop, Ctrl-C of ddpfab: 128 + SIGTERM,
#: what a stopped job reports; its record says "cancelled while waiting").
CANCELLED_WAITING = 143


def marked_processes(run_id, uid=None):
    """Pids of the processes whose environment holds ``DDPFAB_JOB=<run_id>`` (only those of
    *uid*, default ours: another user's environ cannot be read anyway)."""
    want = ("%s=%s" % (JOB_MARKER, run_id)).encode()
    uid = os.getuid() if uid is None else uid
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            if os.stat("/proc/" + entry).st_uid != uid:
                continue
            with open("/proc/%s/environ" % entry, "rb") as fh:
                if want in fh.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


#: A ``run --tmux`` launch's record in its run dir (no supervisor runs it): the pid of the shell
#: its window's ssh started, which leads its session (written by ddpfab.launch.tmuxrun's window).
TMUX_PID = "tmux.pid"


def tmux_session(run_dir):
    """The session of a ``run --tmux`` launch recorded in *run_dir* (its window's shell's pid),
    or None when none was recorded there."""
    try:
        with open(os.path.join(os.path.expanduser(run_dir), TMUX_PID)) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def session_processes(sid, run_id):
    """Pids of session *sid*'s processes that carry run *run_id* (``DDPFAB_RUN_ID``: a pid or
    session id reused since is not taken for the run's)."""
    want = ("DDPFAB_RUN_ID=%s" % run_id).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry, "rb") as fh:
                fields = fh.read().rpartition(b")")[2].split()
            if int(fields[3]) != sid:  # after the command's ")": state, ppid, pgrp, session
                continue
            with open("/proc/%s/environ" % entry, "rb") as fh:
                if want in fh.read().split(b"\0"):
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _signal_all(pids, signum):
    sent = 0
    for pid in pids:
        try:
            os.kill(pid, signum)
            sent += 1
        except OSError:
            pass
    return sent


def signal_tmux_launch(run_dir, run_id, signal_name):
    """Send SIG*signal_name* to what is left of run *run_id*'s ``run --tmux`` launch here (the
    processes of its session that carry the run); how many processes got it."""
    signum = getattr(signal, "SIG" + str(signal_name), None)
    if not isinstance(signum, signal.Signals):
        raise ValueError("no signal SIG%s" % signal_name)
    sid = tmux_session(run_dir)
    return _signal_all(session_processes(sid, run_id), signum) if sid is not None else 0


def _end_tmux_launch(sid, run_id, grace, run_dir, why=None):
    """``ddpfab stop`` of the ``run --tmux`` launch of session *sid* (SIGTERM, SIGKILL after
    *grace* s), *why* written first to its record in *run_dir* when it still runs: (what happened,
    1 if some of it would not end). The session is read once: the run's own teardown may remove
    its record meanwhile."""
    found = session_processes(sid, run_id)
    if found and why:
        try:
            _write(os.path.join(run_dir, "stopped"), why + "\n")
        except OSError:
            pass  # the stop itself matters more than its record
    if not _signal_all(found, signal.SIGTERM):
        return "its tmux launch had ended", 0
    for wait in (grace, 5):
        deadline = time.monotonic() + wait
        while session_processes(sid, run_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _signal_all(session_processes(sid, run_id), signal.SIGKILL):
            return "stopped its tmux launch", 0
    return "its tmux launch would not end", 1


def end_marked(run_id, grace):
    """End every process of job *run_id* found by its marker (TERM, KILL after *grace* s); the
    number of processes found. For a job whose supervisor is gone."""
    pids = marked_processes(run_id)
    if not pids:
        return 0
    signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and marked_processes(run_id):
        time.sleep(0.05)
    for _ in range(100):
        left = marked_processes(run_id)
        if not left:
            break
        signal_all(left, signal.SIGKILL)
        time.sleep(0.02)
    return len(pids)


def _set_subreaper():
    # imported here: only the supervisor needs it, and every other start of the node program
    # (one per node per command) would pay for it
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the process-group kill below still applies


def _processes():
    """(pid, state, ppid) of every process we can see, from /proc/<pid>/stat."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % entry, "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # the name may hold spaces and parens
        yield int(entry), fields[0], int(fields[1])


def descendants(pid):
    tree = {}
    for p, state, ppid in _processes():
        if state != b"Z":
            tree.setdefault(ppid, []).append(p)
    out, todo = [], list(tree.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(tree.get(p, []))
    return out


def signal_all(pids, sig):
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _reap(keep):
    """Reap zombie children (orphans that a subreaper inherits), except *keep*: the job's own
    status belongs to its Popen, which would otherwise report a killed job as exit 0."""
    me = os.getpid()
    for p, state, ppid in _processes():
        if state == b"Z" and ppid == me and p != keep:
            try:
                os.waitpid(p, os.WNOHANG)
            except ChildProcessError:
                pass


def end_tree(grace, keep):
    """TERM every descendant of this agent, then KILL what is left after *grace* seconds."""
    me = os.getpid()
    pids = descendants(me)
    if not pids:
        return
    signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        _reap(keep)
        pids = descendants(me)
        if not pids:
            return
        time.sleep(0.05)
    deadline = time.monotonic() + 5  # a process stuck in the kernel (D state) cannot be waited for forever
    while pids and time.monotonic() < deadline:
        signal_all(pids, signal.SIGKILL)
        time.sleep(0.02)
        _reap(keep)
        pids = descendants(me)


def is_launcher(pid):
    """Is *pid* torchrun: ``python -m torch.distributed.run|launch ...`` or the ``torchrun`` script?
    (Whole argv words: the ``sh -c`` around it holds the same text inside one word.)"""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            argv = fh.read().split(b"\0")
    except OSError:
        return False
    if any(a == b"-m" and b in LAUNCHER_MODULES for a, b in zip(argv, argv[1:])):
        return True
    return any(os.path.basename(a) == b"torchrun" for a in argv[:2])


def torchrun_workers(root):
    """The workers torchrun started under *root* (pids), or [] while it has not started them."""
    below = _live_children(root)
    children = _live_children
    if below is None:  # no children files: one scan answers every look of this walk
        children = _children_by_scan()
        below = children(root)
    if is_launcher(root):
        return list(below or [])
    todo = list(below or [])
    while todo:
        p = todo.pop()
        if is_launcher(p):
            return list(children(p) or [])
        todo.extend(children(p) or [])
    return []


def _live_children(pid):
    """*pid*'s children that have not exited (from ``/proc/PID/task/*/children``: a few reads, where
    a look at every process costs a read per process, 5 times a second while torchrun starts, on
    every node); None where the kernel has no such file (CONFIG_PROC_CHILDREN)."""
    try:
        tasks = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return []  # gone
    found = []
    for tid in tasks:
        try:
            with open("/proc/%d/task/%s/children" % (pid, tid), "rb") as fh:
                found.extend(int(c) for c in fh.read().split())
        except FileNotFoundError:
            if not os.path.exists("/proc/%d/task/%s" % (pid, tid)):
                continue  # the thread ended meanwhile
            return None
        except OSError:
            continue
    return [c for c in found if (proc_stat(c) or ("Z",))[0] != "Z"]


def proc_stat(pid):
    """(state letter, utime + stime in clock ticks) of *pid*, or None when it is gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()  # the name may hold spaces and parens
    return fields[0].decode("ascii", "replace"), int(fields[11]) + int(fields[12])


def _children_by_scan():
    """A children lookup built from one look at every process (the kernels without ``children``)."""
    tree = {}
    for p, state, ppid in _processes():
        if state != b"Z":
            tree.setdefault(ppid, []).append(p)
    return tree.get


def exit_status(pid):
    """How a process that just exited ended, read from its zombie before its parent reaps it:
    ("exit", code), ("signal", number), or None when it is gone (or not a zombie)."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    if fields[0] != b"Z" or len(fields) < 50:  # exit_code is field 52 (Linux >= 3.5)
        return None
    status = int(fields[49])
    if status & 0x7F:
        return ("signal", status & 0x7F)
    return ("exit", (status >> 8) & 0xFF)


def worker_identity(pid):
    """The ranks torchrun gave worker *pid* (``{"rank": 3, "local_rank": 1}``, from its environment,
    read while it runs) and its command name; {} when they cannot be read."""
    found = {}
    try:
        with open("/proc/%d/environ" % pid, "rb") as fh:
            for item in fh.read().split(b"\0"):
                key, _, value = item.partition(b"=")
                if key in (b"RANK", b"LOCAL_RANK") and value.isdigit() and len(value) < 8:
                    found[key.decode().lower()] = int(value)
        with open("/proc/%d/comm" % pid, "rb") as fh:
            found["comm"] = fh.read().strip().decode("utf-8", "replace")[:32]
    except OSError:
        pass
    return found


def watch_workers(root, on_failure, stop, interval=0.2, who=None, on_exit0=None):
    """Call ``on_failure(pid, how)`` when one of torchrun's workers exits with an error (and
    ``on_exit0(pid)`` when one exits 0); *who*, a dict, gets each worker's
    :func:`worker_identity` by pid as it is first seen.

    pidfds (Linux >= 5.3, Python >= 3.9) wake us the moment a worker exits, while it is still a
    zombie whose exit status /proc shows; torchrun reaps it within its 0.1 s monitor interval. When
    we lose that race, or have no pidfds, nothing happens: torchrun's own exit still ends the job.
    One exception: a worker killed by SIGTERM after one whose status we lost is torchrun ending the
    others because that one failed (it stops them only then), so the failure is the earlier one's,
    how unseen: ``("status", "unseen")`` (under load, the SIGTERM would otherwise be named as the abort).
    """
    import select

    if not hasattr(os, "pidfd_open"):
        return
    poller, fds, seen, unseen = select.poll(), {}, set(), []
    try:
        while not stop.is_set() and not fds:  # until torchrun has started its workers
            _watch_new_workers(root, poller, fds, seen, who)
            if not fds:
                stop.wait(interval)
        rescans = 5  # the first look may land while torchrun is still starting the others
        while not stop.is_set() and fds:
            if rescans:
                rescans -= 1
                _watch_new_workers(root, poller, fds, seen, who)
            if who is not None:  # a worker first seen between torchrun's fork and its exec has no ranks yet
                for pid in fds.values():
                    if "local_rank" not in who.get(pid, {}):
                        who[pid] = worker_identity(pid)
            ended = []
            for fd, _ in poller.poll(interval * 1000):
                pid = fds.pop(fd)
                poller.unregister(fd)
                os.close(fd)
                ended.append((pid, exit_status(pid)))
            # of workers that ended together, one that failed by itself comes before those torchrun
            # then ended with SIGTERM (the poll returns them in fd order)
            ended.sort(key=lambda e: e[1] == ("signal", signal.SIGTERM))
            for pid, how in ended:
                if how is None:
                    unseen.append(pid)  # reaped before we read it: it ended, how is not known
                elif how == ("signal", signal.SIGTERM) and unseen:
                    on_failure(unseen[0], ("status", "unseen"))
                    return
                elif how != ("exit", 0):
                    on_failure(pid, how)
                    return
                elif on_exit0 is not None:
                    on_exit0(pid)
    finally:
        for fd in fds:
            os.close(fd)


def _watch_new_workers(root, poller, fds, seen, who):
    """:func:`watch_workers`' look for workers not *seen* yet: each one's pidfd goes into *fds*
    (fd -> pid) and *poller*, its :func:`worker_identity` into *who* (when given)."""
    for pid in torchrun_workers(root):
        if pid in seen:
            continue
        seen.add(pid)
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # gone already
            continue
        if who is not None:
            who[pid] = worker_identity(pid)
        fds[fd] = pid
        poller.register(fd, select.POLLIN)


def failed_worker_record(pid, how, identity):
    """``{"pid", "signal"|"exit"|"status", "rank"?, "local_rank"?, "oom"?}``: the first worker seen failing
    (``oom``, after a SIGKILL: whether the kernel log names the OOM killer; absent where it cannot be read)."""
    record = {"pid": pid, how[0]: how[1]}
    record.update(identity)
    return record


#: Seconds around a worker's death in which the kernel's record of an OOM kill is taken as its.
OOM_WINDOW = 5.0
#: Seconds before a worker's death in which an OOM kill of it leaves the answer open (a process can
#: take this long to exit after the kill: a GPU context torn down), rather than "not the OOM killer".
OOM_DOUBT = 60.0
#: Records read from the kernel log at most (its ring holds a few thousand).
KMSG_RECORDS = 100000


def oom_killed(pid, comm, died_at, window=OOM_WINDOW):
    """Did the kernel's OOM killer end process *pid* (command name *comm*) around *died_at*
    (``time.time()``)? Read from the kernel log (``/dev/kmsg``). None where nobody here can know:
    the log cannot be read (not root, ``dmesg_restrict``, no such device), the process cannot be
    matched (in a PID namespace without its command name), or an OOM kill of it lies outside the
    window but within :data:`OOM_DOUBT` seconds (a slow exit after the kill)."""
    by_name = not in_init_pid_namespace()
    if by_name and not comm:
        return None
    now_us = time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6 - (time.time() - died_at) * 1e6
    found = _kmsg_oom(pid, comm, by_name, (now_us - window * 1e6, now_us - OOM_DOUBT * 1e6))
    if found is None:
        return None
    return True if found[0] else None if found[1] else False


def _kmsg_oom(pid, comm, by_name, since_us):
    """(an OOM kill of *pid* since ``since_us[0]``, one since ``since_us[1]``) in the kernel log;
    None where it cannot be read as one (not a character device: a container's stand-in)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISCHR(os.fstat(fd).st_mode):
            return None
        records = list(_kmsg_records(fd))
    finally:
        os.close(fd)
    return tuple(oom_kill_in(records, pid, comm, since, by_name) for since in since_us)


def _kmsg_records(fd):
    """The kernel log's records, one per read, until its end (at most :data:`KMSG_RECORDS`)."""
    for _ in range(KMSG_RECORDS):
        try:
            record = os.read(fd, 8192)
        except BlockingIOError:
            return  # the end of the log
        except OSError:  # EPIPE: a record was overwritten while we read; read on
            continue
        if not record:  # (not /dev/kmsg after all: a file or a FIFO ends so)
            return
        yield record.decode("utf-8", "replace")


#: The initial PID namespace's inode number (the kernel's PROC_PID_INIT_INO): outside it, the
#: kernel log's pids are not ours.
INIT_PID_NS = 0xEFFFFFFC


def in_init_pid_namespace():
    """Whether this process sees the kernel's own pids (the kernel log names processes by them)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino == INIT_PID_NS
    except OSError:
        return False


def oom_kill_in(records, pid, comm, since_us, by_name=None):
    """Is one of *records* (``PRIO,SEQ,USEC,FLAGS;TEXT``) of time *since_us* or later the OOM
    killer's ``Killed process PID (COMM)`` of *pid*? Inside a PID namespace (*by_name*, default:
    :func:`in_init_pid_namespace` says no) the log names the host's pid, so there the command
    name *comm* and the time decide."""
    by_name = (not in_init_pid_namespace()) if by_name is None else by_name
    for record in records:
        head, _, text = record.partition(";")
        fields = head.split(",")
        if len(fields) < 3 or not fields[2].isdigit() or int(fields[2]) < since_us:
            continue
        m = re.search(r"Killed process (\d+) \(([^)]*)\)", text)
        if m and (int(m.group(1)) == pid or (by_name and comm is not None and m.group(2) == comm)):
            return True
    return False


def _restarts(log_dir):
    """torchrun keeps one ``attempt_N`` dir per (re)start of the worker group."""
    if not log_dir or not os.path.isdir(log_dir):
        return 0
    attempts = [0]
    for sub in os.listdir(log_dir):
        path = os.path.join(log_dir, sub)
        if os.path.isdir(path):
            attempts += [int(a.split("_", 1)[1]) for a in os.listdir(path)
                         if a.startswith("attempt_") and a.split("_", 1)[1].isdigit()]
    return max(attempts)


def _write(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


#: Run records a node keeps under its runs dir (the newest; ``keep_records`` in the spec overrides):
#: older ones are removed when a job starts, except any whose supervisor still runs.
KEEP_RECORDS = 20
#: A run record's name: a run id as ddpfab makes them (runs.new_run_id), sortable by time.
RECORD_NAME = r"^\d{8}-\d{6}-[0-9a-f]{6}$"  # a pattern (re is imported at first use: ddpfab.node)


def prune_records(root, own, keep):
    """Remove the oldest run records under *root* beyond the newest *keep* (not counting *own*).

    Only what ddpfab can prove is its own: a directory (not a link) named like a run id, holding
    the ``agent.json`` a supervisor wrote for that run id; never one whose supervisor still runs.
    Anything else in *root* is left alone. Returns the names removed."""
    records = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name == own or not re.match(RECORD_NAME, name) or os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, "agent.json")) as fh:
                rec = json.load(fh)
        except (OSError, ValueError):
            continue
        if rec.get("run_id") != name:
            continue
        try:
            with open("/proc/%d/cmdline" % int(rec["agent_pid"]), "rb") as fh:
                if name.encode() in fh.read():
                    continue  # its supervisor still runs: a running (or detached) job
        except (OSError, KeyError, TypeError, ValueError):
            pass
        records.append(name)
    removed = records[:max(0, len(records) - keep)]
    for name in removed:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return removed


def _job_env(spec):
    """This session's environment, the plan's env over it, and the job marker (always last)."""
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in (spec.get("env") or {}).items()})
    env[JOB_MARKER] = str(spec.get("run_id"))
    return env


def _job_argv(spec):
    """The job's argv: the plan's (no shell: nothing is parsed), or a shell line (tests only)."""
    if spec.get("argv"):
        return [str(a) for a in spec["argv"]]
    return ["/bin/sh", "-c", spec["command"]]


def _say(text):
    """A line for ddpfab (our stdout is its channel) that also goes to stderr when detached."""
    try:
        os.write(1, ("ddpfab-agent: %s\n" % text).encode())
    except OSError:
        pass


#: Under the run's remote dir: the ranks' exit guard (as sitecustomize.py) and their done records.
GUARD_DIR, RANKS_DIR, PDB_DIR = "exitguard", "ranks", "pdb"


def exit_guard_env(spec, run_dir, env):
    """*env* with the ranks' ``sitecustomize`` installed: the exit guard (:mod:`ddpfab.node.exitguard`,
    its source and mode in the spec's ``exit_guard``) and, with ``--pdb``, the debugger hooks (the
    spec's ``pdb``: :mod:`ddpfab.node.rankpdb`'s source, the ranks, the node's name), in a dir of
    this run's first on PYTHONPATH, with where the ranks write their done records and their
    debugger sockets. With neither in the spec, or when the files cannot be written (said on the
    stream), *env* as it was: the job runs without them."""
    guard, debug, dap = spec.get("exit_guard"), spec.get("pdb"), spec.get("debugpy")
    if not isinstance(guard, dict) or not isinstance(guard.get("source"), str):
        return env
    guarded = guard.get("mode") in ("on", "record")  # "off": the file only, for the debugger
    debugged = isinstance(debug, dict) and isinstance(debug.get("ranks"), str) and isinstance(debug.get("source"), str)
    dapped = isinstance(dap, dict) and isinstance(dap.get("ranks"), str) and isinstance(dap.get("source"), str)
    if not guarded and not debugged and not dapped:
        return env
    guard_dir, ranks_dir, pdb_dir = (os.path.join(run_dir, d) for d in (GUARD_DIR, RANKS_DIR, PDB_DIR))
    try:
        for d in (guard_dir, ranks_dir) + ((pdb_dir,) if debugged else ()):
            os.makedirs(d, mode=0o700, exist_ok=True)
        _write(os.path.join(guard_dir, "sitecustomize.py"), guard["source"])
        if debugged:
            _write(os.path.join(guard_dir, "ddpfab_rankpdb.py"), debug["source"])
        if dapped:
            _write(os.path.join(guard_dir, "ddpfab_rankdebugpy.py"), dap["source"])
    except OSError as exc:
        _say("cannot install the exit guard or the debugger in %s (%s); the ranks run without them" % (run_dir, exc))
        return env
    env = dict(env)
    env["PYTHONPATH"] = guard_dir + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if guarded:
        env["DDPFAB_EXIT_GUARD"], env["DDPFAB_EXIT_GUARD_DIR"] = guard["mode"], ranks_dir
    if debugged:
        env["DDPFAB_PDB"], env["DDPFAB_PDB_DIR"] = debug["ranks"], pdb_dir
        env["DDPFAB_PDB_NODE"] = str(debug.get("node", ""))
    if dapped:
        env["DDPFAB_DEBUGPY"] = dap["ranks"]
    return env


def ranks_done(run_dir):
    """local rank -> the done record its exit guard wrote (rank, pid, code, restart), validated:
    a record that is not what the guard writes is left out (that rank counts as not finished)."""
    ranks_dir = os.path.join(run_dir, RANKS_DIR)
    done = {}
    try:
        names = os.listdir(ranks_dir)
    except OSError:
        return done
    for name in names:
        m = re.match(r"^rank-(\d{1,6})\.json$", name)
        if not m:
            continue
        try:
            with open(os.path.join(ranks_dir, name)) as fh:
                rec = json.loads(fh.read(4096))
        except (OSError, ValueError):
            continue
        if not isinstance(rec, dict):
            continue
        code, pid = rec.get("code"), rec.get("pid")
        fields = (rec.get("rank"), rec.get("local_rank"), rec.get("restart"))
        if not all(isinstance(f, str) and f and f.isdigit() and f.isascii() for f in fields) or fields[1] != m.group(1):
            continue
        if type(pid) is not int or not (code is None or type(code) is int):
            continue
        done[int(m.group(1))] = {"rank": int(fields[0]), "local_rank": int(fields[1]), "pid": pid, "code": code,
                                 "restart": int(fields[2]), "time": _record_time(rec.get("time"))}
    return done


def _record_time(at):
    """A record's ``time`` (a time.time()) as a finite float, or None (records are data)."""
    if type(at) not in (int, float):
        return None
    try:
        at = float(at)
    except OverflowError:
        return None
    return at if at - at == 0 else None  # (inf - inf and nan - nan are nan)


def failed_before(run_dir, at):
    """The first rank whose exit guard recorded a failure (an exit code other than 0) before *at*
    (a time.time()), or None: a worker that failed on its own before a stop came, which the
    worker watch missed (it died before the watch's first look, or torchrun reaped it first)."""
    failed = [r for r in ranks_done(run_dir).values()
              if r["code"] not in (None, 0) and r["time"] is not None and r["time"] <= at]
    return min(failed, key=lambda r: r["time"]) if failed else None


def finished_before(run_dir, pid):
    """Did the rank with *pid* record that its work ended with exit code 0?"""
    return any(r["pid"] == pid and r["code"] == 0 for r in ranks_done(run_dir).values())


def exit_race(spec, run_dir, code, stopped, failed):
    """The node's job failed (*code*) on its own (not *stopped*), yet every one of its ranks
    (``nproc`` in the spec) recorded that its work ended with exit code 0, in the same attempt:
    then the failure came after the work, at exit. Returns ``{"ranks": [...], "aborted": [...]}``
    (*failed*: (pid, how) of workers seen failing; the aborted ones among the finished ranks, as
    ``{"rank", "local_rank", "signal"|"exit"}``), else None."""
    nproc = spec.get("nproc")
    if code == 0 or stopped or type(nproc) is not int or nproc < 1:
        return None
    done = ranks_done(run_dir)
    if sorted(done) != list(range(nproc)) or any(r["code"] != 0 for r in done.values()):
        return None
    if len({r["restart"] for r in done.values()}) != 1:
        return None
    by_pid = {r["pid"]: r for r in done.values()}
    aborted = [{"rank": by_pid[pid]["rank"], "local_rank": by_pid[pid]["local_rank"], how[0]: how[1]}
               for pid, how, *_ in failed if pid in by_pid]
    return {"ranks": sorted(r["rank"] for r in done.values()), "aborted": aborted}


#: Seconds a launcher may go on after every rank of its node finished (done record with exit code
#: 0, process gone) before the supervisor ends it: torchrun then only waits at its exit barrier for
#: the other nodes' launchers (300 s when one of them failed), and ddpfab waits for every node anyway.
BARRIER_GRACE = 5.0
AT_BARRIER = "every rank finished its work; the launcher was waiting at its exit barrier"


def watch_finished(spec, run_dir, root, on_finished, stop, interval=0.5):
    """Call ``on_finished()`` once every rank of this node (``nproc``) has recorded that its work
    ended with exit code 0 and none of the launcher's workers is alive any more, and the launcher
    (*root*'s tree) has gone on for :data:`BARRIER_GRACE` seconds since."""
    nproc = spec.get("nproc")
    if type(nproc) is not int or nproc < 1 or not isinstance(spec.get("exit_guard"), dict):
        return
    since = None
    while not stop.wait(interval):
        done = ranks_done(run_dir)
        finished = (sorted(done) == list(range(nproc)) and all(r["code"] == 0 for r in done.values())
                    and not any(os.path.exists("/proc/%d" % r["pid"]) and exit_status(r["pid"]) is None
                                for r in done.values()))
        if not finished:
            since = None
        elif since is None:
            since = time.monotonic()
        elif time.monotonic() - since >= BARRIER_GRACE:
            on_finished()
            return


#: Seconds a stream's unfinished line is held for its end before it is passed on as it is (a
#: prompt, a progress bar that redraws with ``\r``).
LINE_HOLD = 0.5
#: ... and the most of it held (a stream that never ends a line).
LINE_HOLD_BYTES = 1 << 16


def _tapped(emit, seen):
    """``emit`` for :func:`relay_lines`: ``(fd, chunk)`` to *seen* (if any), the chunk on."""
    def tapped(fd, chunk):
        if seen is not None:
            seen(fd, chunk)
        emit(chunk)
    return tapped


class RankLines(object):
    """Counts the lines torchrun's ``--tee`` relayed for each local rank, by stream; *streams*:
    fd -> "stdout"/"stderr". Called with ``(fd, chunk)`` for each chunk the relay passes on."""

    def __init__(self, streams):
        self.streams = streams
        self.tag = re.compile(br"^\[default(\d+)\]:")
        self.count = {}  # (stream, local rank) -> lines relayed
        self._line = {}  # fd -> the local rank whose line is open (None: not a rank's); absent: at a line's start

    def __call__(self, fd, chunk):
        pieces = chunk.split(b"\n")
        for i, piece in enumerate(pieces):
            ended = i < len(pieces) - 1
            if fd not in self._line and (piece or ended):
                tag = self.tag.match(piece)
                self._line[fd] = int(tag.group(1)) if tag else None
            if ended:
                local = self._line.pop(fd, None)
                if local is not None:
                    key = (self.streams.get(fd), local)
                    self.count[key] = self.count.get(key, 0) + 1


#: The most lines of a failed rank's log that are relayed after its job ended (its traceback's end).
CATCH_UP_LINES = 200


def unrelayed_lines(log_dir, local_rank, relayed, limit=CATCH_UP_LINES):
    """The lines local rank *local_rank* wrote to its log files under torchrun's *log_dir* (the
    newest attempt) past the *relayed* counts (:attr:`RankLines.count`), tagged as ``--tee`` tags
    them, stdout's first; the last *limit* of each. torchrun's tee polls the files every 0.1 s, and
    a job ended right after a rank failed (under load, or stopped by ddpfab) can take the end of
    its traceback with it: this is that end."""
    newest = None
    try:
        for sub in os.listdir(log_dir):
            path = os.path.join(log_dir, sub)
            if not os.path.isdir(path):
                continue
            for attempt in os.listdir(path):
                number = attempt.split("_", 1)[1] if attempt.startswith("attempt_") else ""
                if number.isdigit() and (newest is None or int(number) > newest[0]):
                    newest = (int(number), os.path.join(path, attempt, str(int(local_rank))))
    except OSError:
        return []
    if newest is None:
        return []
    out = []
    for stream in ("stdout", "stderr"):
        skip, tail = relayed.get((stream, local_rank), 0), []
        try:  # read as torchrun's tee reads them (text, universal newlines): one of its lines is one here
            with open(os.path.join(newest[1], "%s.log" % stream), errors="replace") as fh:
                for number, line in enumerate(fh):
                    if number >= skip:
                        tail.append(line)
                        if len(tail) >= 2 * limit:
                            del tail[:-limit]
        except (OSError, ValueError):
            continue
        for line in tail[-limit:]:
            text = "[default%d]:%s" % (local_rank, line if line.endswith("\n") else line + "\n")
            out.append(text.encode("utf-8", "replace"))
    return out


def relay_lines(fds, emit, hold=LINE_HOLD, seen=None):
    """Pass what the job writes to *fds* (its stdout and stderr) to ``emit`` as one stream of whole
    lines (ended by ``\n`` or ``\r``), until every fd is at its end.

    One stream's line is never cut by another's: torchrun's ``--tee`` relays each rank's log file
    by lines as it finds them, so a line the rank wrote in two writes (an unbuffered ``print``: the
    text, then its newline) reaches torchrun's stdout in two pieces, and torchrun's own stderr (a
    c10d warning) could come between them: ``STEP {...}[W1203 socket.cpp:207] ...``. A stream's
    unfinished line waits for its end, for *hold* seconds at most. Lines are passed on in the order
    they are read; when both streams have lines waiting at once, stdout's go first. *seen*, when
    given, is called with ``(fd, chunk)`` for each chunk before it is passed on."""
    emit = _tapped(emit, seen)
    pending = dict((fd, b"") for fd in fds)
    since = {}  # fd -> when its unfinished line began
    while pending:
        timeout = max(0.0, min(since.values()) + hold - time.monotonic()) if since else None
        ready = select.select(list(pending), [], [], timeout)[0]
        for fd in ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            data = pending[fd] + chunk
            if not chunk:  # its end: what is left goes as it is
                if data:
                    emit(fd, data)
                del pending[fd]
                since.pop(fd, None)
                continue
            # a "\r" as the last byte may be the first half of a "\r\n": it waits for what follows
            cut = max(data.rfind(b"\n"), data.rfind(b"\r", 0, len(data) - 1)) + 1
            if cut:
                emit(fd, data[:cut])
            pending[fd] = data[cut:]
            if not pending[fd]:
                since.pop(fd, None)
            elif cut or fd not in since:
                since[fd] = time.monotonic()
        now = time.monotonic()
        for fd, began in list(since.items()):
            if now - began >= hold or len(pending[fd]) >= LINE_HOLD_BYTES:
                emit(fd, pending[fd])
                pending[fd] = b""
                del since[fd]


def main(spec):
    """Supervise the job *spec* describes on this node (see the module's docstring); its exit code."""
    sup = Supervisor(spec)
    code = sup.open_record()
    if code is not None:
        return code
    leases, gpus = hold_leases(spec, sup.run_dir, sup.log)
    if leases is None:
        return _recorded_code(sup.run_dir)
    if gpus is not None:  # the job sees exactly its leased GPUs
        sup.spec = dict(spec, env=dict(spec.get("env") or {}, CUDA_VISIBLE_DEVICES=",".join(gpus)))
    sup.last_beat = time.monotonic()  # the controller's silence counts from here, not from a wait in the queue
    _set_subreaper()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, sup.on_signal)
    code = sup.start_job()
    if code is not None:
        return code
    sup.watch()
    return sup.finish()


class _Console(object):
    """A job started by hand: its output on this process's stdout (that terminal), written by a
    thread of its own, so a stalled terminal (Ctrl-S, a suspended ssh) never stalls the relay and
    with it the ranks: ``output.log`` keeps everything, what the terminal cannot take in time is
    dropped there (and said). A terminal gone (the write fails, or the descriptor hangs up while
    idle) calls *gone*."""

    LIMIT = 8 << 20  # bytes waiting for the terminal before more are dropped

    def __init__(self, gone):
        self.chunks, self.size, self.dropped = [], 0, 0
        self.unwritten = 0  # chunks put and not yet written (or given up on)
        self.cond = threading.Condition()
        self.gone = gone
        threading.Thread(target=self.run, daemon=True).start()

    def put(self, chunk):
        with self.cond:
            if self.size + len(chunk) > self.LIMIT:
                self.dropped += len(chunk)
                return
            self.chunks.append(chunk)
            self.size += len(chunk)
            self.unwritten += 1
            self.cond.notify_all()

    def drain(self, timeout=2.0):
        """Wait until the terminal has what was put (the process ends next, and the thread with
        it), for at most *timeout* seconds: a stalled terminal does not hold the end up."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.unwritten and time.monotonic() < deadline:
                self.cond.wait(0.05)

    def _written(self, all_of_it=False):
        with self.cond:
            self.unwritten = 0 if all_of_it else self.unwritten - 1
            self.cond.notify_all()

    def take(self, poller):
        """The next chunk and the bytes dropped before it; None when the terminal hung up."""
        with self.cond:
            while not self.chunks:
                self.cond.wait(1.0)
                if not self.chunks and poller.poll(0):  # (hang-up and errors are always reported)
                    return None
            chunk = self.chunks.pop(0)
            self.size -= len(chunk)
            dropped, self.dropped = self.dropped, 0
            return chunk, dropped

    def run(self):
        poller = select.poll()
        poller.register(1, 0)
        while True:
            got = self.take(poller)
            try:
                if got is None:
                    raise OSError("hang-up")
                chunk, dropped = got
                if dropped:
                    chunk = (b"[ddpfab-agent: %d bytes not shown here (the terminal was slow); output.log has them]\n"
                             % dropped) + chunk
                while chunk:
                    chunk = chunk[os.write(1, chunk):]
                self._written()
            except OSError:
                self._written(all_of_it=True)  # (nothing more reaches that terminal)
                self.gone()
                return


def _terminal(fd):
    """*fd* when it is the terminal this process runs in the foreground of, for the job's input;
    else None, and *fd* closed. The job runs in a session of its own, where no terminal stops it
    for reading: a script started in the background (``&``) must not hand it the keyboard of
    the shell it was started from."""
    if not isinstance(fd, int) or isinstance(fd, bool) or fd < 3:
        return None
    try:
        if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
            return fd
    except OSError:
        pass
    try:
        os.close(fd)
    except OSError:
        pass
    return None


class Supervisor(object):
    """One job on this node, from its record to its result: :func:`main`'s steps, and the state the
    threads that watch the job share (the link, the workers, the exit barrier)."""

    def __init__(self, spec):
        self.spec = spec
        self.run_id = spec.get("run_id")
        self.run_dir = os.path.expanduser(spec["dir"])
        self.grace = float(spec.get("grace", 3))
        self.grace_now = self.grace  # lowered to FAST_GRACE for a fast stop
        self.silence = float(spec.get("silence", 0))
        self.detached = bool(spec.get("detached"))
        # a job started by hand (``plan --emit``'s script): detached from any controller, its
        # output also on this process's stdout, the terminal of whoever started it
        self.console = _Console(lambda: self.request_stop("terminal went away")) if spec.get("console") else None
        # and that terminal is the job's input (the script keeps it for the job as ``terminal``):
        # a breakpoint() in a rank waits there, as under a torchrun started by hand
        self.terminal = _terminal(spec.get("terminal")) if self.console is not None else None
        self.record_path = os.path.join(self.run_dir, "agent.json")
        self.log = None
        self.job = None
        self.stop = threading.Event()
        self.reason = None  # why it was stopped, for people (None: it ended by itself)
        self.by_worker = False  # what stopped it, as data
        self.failed_at = []  # when it failed (this node's clock), as each way of seeing it saw it
        self.last_beat = time.monotonic()
        self.link_ok = True
        self.failed_workers = []  # (pid, how, identity) of each worker seen failing, in order
        self.workers = {}  # pid -> worker_identity(pid), filled by watch_workers
        self.own_failure_since = None  # time.monotonic() when a worker failed before any stop
        self.stop_at = None  # time.time() when something stopped the job
        self.ended_0 = []  # pids of workers the watch saw exit 0
        self.at_barrier = False
        self.signalled = None  # the signal that asks for a stop, for the main loop to take
        self.stop_signal = None  # ... the one that stopped the job, as data (``ddpfab stop``, a kill)
        self.relayed = None
        self.relayer = None

    # -- before the job -----------------------------------------------------------------------
    def open_record(self):
        """Our own record first: a supervisor nobody can find must not start anything. None, or
        the exit code when nothing may start."""
        if os.path.exists(self.record_path):
            _say("run id %s was used on this node already (%s); the job was not started" % (self.run_id, self.run_dir))
            return CANNOT_START
        try:
            os.makedirs(self.run_dir, mode=0o700, exist_ok=True)
            os.chmod(self.run_dir, 0o700)
            self.log = open(os.path.join(self.run_dir, "output.log"), "ab")  # noqa: SIM115 - open for the job's life
            self._record(None)
        except OSError as exc:
            _say("cannot write the run record in %s (%s); the job was not started" % (self.run_dir, exc))
            return CANNOT_START
        try:  # housekeeping must never fail the job
            prune_records(os.path.dirname(self.run_dir.rstrip("/")), os.path.basename(self.run_dir.rstrip("/")),
                          int(self.spec.get("keep_records", KEEP_RECORDS)))
        except (OSError, ValueError):
            pass
        return None

    def _record(self, pid):
        _write(self.record_path, json.dumps({"run_id": self.run_id, "agent_pid": os.getpid(), "pid": pid, "pgid": pid,
                                             "started": time.time(), "marker": JOB_MARKER,
                                             # its program prepared the run first (ddpfab.node.ops.supervise)
                                             "adopted": bool(self.spec.get("adopted"))}) + "\n")

    def start_job(self):
        """Start the job in a session of its own, and name it in the record. None, or the exit
        code when it could not start (127, recorded as the job's)."""
        import subprocess

        spec = self.spec
        try:
            self.job = subprocess.Popen(_job_argv(spec), cwd=os.path.expanduser(spec.get("workdir") or "~"),
                                        env=exit_guard_env(spec, self.run_dir, _job_env(spec)),
                                        stdin=subprocess.DEVNULL if self.terminal is None else self.terminal,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            text = "cannot start the job in %s: %s" % (spec.get("workdir"), exc)
            self.log.write(("ddpfab-agent: %s\n" % text).encode())
            self.log.close()
            _say(text)
            _write(os.path.join(self.run_dir, "result.json"), json.dumps({
                "exit_code": 127, "ended": time.time(), "failed_at": time.time(), "stopped": None,
                "restarts": 0}) + "\n")
            _write(os.path.join(self.run_dir, "exit_code"), "127\n")
            return 127
        try:
            self._record(self.job.pid)
        except OSError as exc:  # the first record names us; the job is found by its marker anyway
            _say("cannot update the run record (%s)" % exc)
        return None

    # -- while it runs ------------------------------------------------------------------------
    def on_signal(self, signum, frame):
        """SIGTERM, SIGHUP, SIGINT: a stop, taken by the main loop. The handler runs in the main
        thread between two of its steps, which may be inside ``self.stop.wait`` with the event's
        own lock held: ``stop.set()`` here would wait for that lock for ever (the supervisor, and
        its job, would outlive ``ddpfab stop``). So it takes no lock."""
        self.signalled = signum

    def _take_signal(self):
        if self.signalled is not None and not self.stop.is_set():
            job = getattr(self, "job", None)
            if job is None or job.poll() is None:  # the signal stopped it (not a job that had ended on its own)
                self.stop_signal = self.signalled
            self.request_stop("signal %d" % self.signalled)

    def request_stop(self, why, worker=False):
        if not self.stop.is_set():
            self.reason, self.by_worker, self.stop_at = why, worker, time.time()
            self.stop.set()

    def watch_link(self):
        """ddpfab writes only heartbeats to stdin; EOF means it closed the link or went away."""
        try:
            while True:
                data = os.read(0, 4096)
                if not data:
                    break
                self.last_beat = time.monotonic()
                at = data.find(b"!")
                if at >= 0:  # the job is lost anyway (another node failed, a hang): end it fast
                    if at == len(data) - 1 and select.select([0], [], [], 0.2)[0]:  # its reason, read apart
                        data += os.read(0, 1)
                    self.grace_now = min(self.grace, FAST_GRACE)
                    self.request_stop("stopped by ddpfab: " + FAST_STOPS.get(data[at + 1:at + 2], FAILED_ELSEWHERE))
        except OSError:
            pass
        self.request_stop("controller link closed")

    def emit(self, chunk):
        try:
            self.log.write(chunk)
            self.log.flush()
        except OSError:
            pass  # a full disk must not stop the relay (nor the job)
        if self.console is not None:
            self.console.put(chunk)
        elif self.link_ok and not self.detached:
            try:
                os.write(1, chunk)
            except OSError:
                self.link_ok = False
                self.request_stop("controller link broken")

    def relay(self):
        relay_lines((self.job.stdout.fileno(), self.job.stderr.fileno()), self.emit, seen=self.relayed)

    def worker_failed(self, pid, how):
        if self.stop.is_set() or self.job.poll() is not None:
            return  # ended already: a worker that dies now was ended by torchrun's exit or by us
        identity = dict(self.workers.get(pid) or {})
        comm = identity.pop("comm", None)
        if how == ("signal", signal.SIGKILL):  # oom: False when the kernel log was read and has no OOM kill of it
            oom = oom_killed(pid, comm, time.time())
            if oom is not None:
                identity["oom"] = oom
        if how == ("signal", signal.SIGTERM) and failed_before(self.run_dir, time.time()) is None:
            # the first worker to end, by SIGTERM, no rank failing before it: neither torchrun (it
            # sends it only after a failure) nor ddpfab (its stop is set first) sent it
            identity["outside"] = True
        self.failed_workers.append((pid, how, identity))
        if finished_before(self.run_dir, pid):
            return  # it finished its work, then died at exit: torchrun ends the job, not a failure yet
        self.failed_at.append(time.time())
        if self.own_failure_since is None:
            self.own_failure_since = time.monotonic()
        # let torchrun relay the worker's last lines first; after a SIGTERM from outside, also its
        # own word of that worker's end (what the controller confirms "outside" by)
        if self.stop.wait(OUTSIDE_SETTLE if identity.get("outside") else TAIL_SETTLE):
            return
        self.grace_now = min(self.grace, FAST_GRACE)
        self.request_stop(_worker_text(pid, how), worker=True)

    def ranks_finished(self):
        # not after a worker failed: torchrun is then handling that failure, not waiting at a barrier
        if not self.stop.is_set() and self.job.poll() is None and not self.failed_workers:
            self.at_barrier = True
            self.request_stop(AT_BARRIER)

    def watch(self):
        """The watchers' threads, then wait until the job ends or something stops it."""
        job, spec = self.job, self.spec
        self.relayed = RankLines({job.stdout.fileno(): "stdout", job.stderr.fileno(): "stderr"})
        if not self.detached:
            threading.Thread(target=self.watch_link, daemon=True).start()
        if spec.get("watch_workers"):
            threading.Thread(target=watch_workers, args=(job.pid, self.worker_failed, self.stop),
                             kwargs={"who": self.workers, "on_exit0": self.ended_0.append}, daemon=True).start()
        threading.Thread(target=watch_finished, args=(spec, self.run_dir, job.pid, self.ranks_finished, self.stop),
                         daemon=True).start()
        self.relayer = threading.Thread(target=self.relay, daemon=True)
        self.relayer.start()
        while job.poll() is None and not self.stop.is_set():
            self.stop.wait(0.05)
            self._take_signal()
            if self.silence and not self.detached and time.monotonic() - self.last_beat > self.silence:
                self.request_stop("controller silent for %.0f s" % self.silence)
        self._take_signal()  # one that came in the loop's last slice
        if job.poll() is not None and self.reason is None:
            self.failed_at.append(time.time())  # the job ended by itself (its failure time if it failed)

    # -- after it -----------------------------------------------------------------------------
    def finish(self):
        """End whatever is left of the job tree, then record how it ended; its exit code."""
        if self.own_failure_since is not None:  # a stop while the failed worker's last lines were relayed waits
            time.sleep(max(0.0, TAIL_SETTLE - (time.monotonic() - self.own_failure_since)))
        end_tree(self.grace_now, self.job.pid)  # the main process ended or we were told to stop: nothing outlives it
        code = self.job.wait()
        self.relayer.join(timeout=2)
        # torchrun itself killed by a signal nobody here sent (a kill -9, the OOM killer): no worker
        # failed first, so only this says what ended the node's job
        launcher = {"pid": self.job.pid, "signal": -code} if code < 0 and self.reason is None else None
        if code < 0:
            code = 128 - code
        # a worker failed before anything stopped the job: the node failed on its own, also when
        # ddpfab's stop (another node saw the same failure first) came while its last lines were relayed
        own_failure = self.own_failure_since is not None
        missed = self._missed_failure(own_failure)
        if missed is not None:  # a rank had failed before the stop, or before the worker seen failing
            self.failed_workers.insert(0, (missed["pid"], ("exit", missed["code"]),
                                           {"rank": missed["rank"], "local_rank": missed["local_rank"]}))
            self.failed_at.append(missed["time"])
            own_failure = True
        first = self.failed_workers[0] if self.failed_workers else None
        local = first[2].get("local_rank") if own_failure and first else None
        if type(local) is int and not self.relayer.is_alive():  # what torchrun had not relayed of it: its traceback
            for line in unrelayed_lines(self.spec.get("log_dir") or "", local, self.relayed.count):
                self.emit(line)
        if own_failure:
            code = 1  # what torchrun itself exits with when a worker fails
            self.reason = _worker_text(first[0], first[1]) if missed is None else (
                "a worker failed (pid %d, exit %s) %s" % (first[0], first[1][1], "before the stop came" if self.stop_at
                                                        and self.own_failure_since is None else "unseen by the watch"))
        if self.at_barrier and self.reason == AT_BARRIER:
            code, self.reason = 0, None  # ended by us after the work was done: the job succeeded on this node
        elif code != 0 and not own_failure and self.reason is not None and self._all_ended_0():
            code = 0  # stopped while torchrun waited at its exit barrier: every rank had finished its work
        self._result(code, own_failure, None if own_failure else launcher)
        if self.console is not None:  # a job started by hand: its terminal's last line says how it ended
            self.emit(("ddpfab-agent: %s\n" % self.ended_line(code, own_failure)).encode())
            self.console.drain()
        self.log.close()
        return code

    def ended_line(self, code, own_failure):
        """How this node's job ended, in one line for the terminal of a job started by hand."""
        if code == 0:
            return "run %s: this node's job ended (exit 0)" % self.run_id
        if own_failure or not self.reason:
            first = self.failed_workers[0] if own_failure and self.failed_workers else None
            who = first[2] if first else {}
            what = self.reason or "torchrun ended so"
            if first and type(who.get("rank")) is int and first[1][0] in ("exit", "signal"):
                how = first[1][1] if first[1][0] == "exit" else name_of_signal(first[1][1])
                what = "rank %d (local rank %s) ended with %s %s" % (who["rank"], who.get("local_rank"), first[1][0], how)
            return "run %s: this node's job failed: %s (exit %d)" % (self.run_id, what, code)
        if self.stop_signal is not None:
            return ("run %s: this node's job was stopped from outside: %s to its supervisor (`ddpfab stop %s`, or a "
                    "kill) (exit %d)" % (self.run_id, name_of_signal(self.stop_signal), self.run_id, code))
        return "run %s: this node's job was stopped: %s (exit %d)" % (self.run_id, self.reason, code)

    def _ended_0(self):
        """``[{"rank", "local_rank"}]`` of the ranks that ended with exit 0: by their exit guard's
        record, or seen by the worker watch (a rank that left by ``os._exit(0)`` records nothing)."""
        ended = {r["local_rank"]: r["rank"] for r in ranks_done(self.run_dir).values() if r["code"] == 0}
        for pid in self.ended_0:
            who = self.workers.get(pid) or {}
            if type(who.get("local_rank")) is int and type(who.get("rank")) is int:
                ended.setdefault(who["local_rank"], who["rank"])
        return [{"rank": rank, "local_rank": local} for local, rank in sorted(ended.items())]

    def _all_ended_0(self):
        """Every rank of the node (the spec's ``nproc``) ended with exit 0."""
        nproc = self.spec.get("nproc")
        return type(nproc) is int and nproc > 0 and \
            {r["local_rank"] for r in self._ended_0()} >= set(range(nproc))

    def _missed_failure(self, own_failure):
        """A rank's failure its exit guard recorded and the worker watch did not see first: before
        the stop came (no worker seen failing), or before the worker it saw when that one only
        followed it (ended by SIGTERM, torchrun's to a sibling, or reaped unseen); None else.
        Only where every failed worker fails the job (``watch_workers``: no torchrun restarts,
        whose earlier attempts leave their records behind)."""
        if self.reason == AT_BARRIER or not self.spec.get("watch_workers"):
            return None
        if own_failure:
            first = self.failed_workers[0] if self.failed_workers else None
            if first is None or first[1] not in (("signal", signal.SIGTERM), ("status", "unseen")):
                return None  # a worker that failed by itself is the failure: no record goes before it
            at = min(self.failed_at) if self.failed_at else None
        else:
            at = self.stop_at
        missed = failed_before(self.run_dir, at) if at is not None else None
        if missed is None or (self.failed_workers and missed["pid"] == self.failed_workers[0][0]):
            return None
        return missed

    def _result(self, code, own_failure, launcher=None):
        reason, run_dir = self.reason, self.run_dir
        if reason:
            _write(os.path.join(run_dir, "stopped"), reason + "\n")
        failed = code != 0 and (own_failure or not reason)
        stopped = [reason] if reason else []
        race = exit_race(self.spec, run_dir, code, stopped, self.failed_workers)
        _write(os.path.join(run_dir, "result.json"), json.dumps({
            "exit_code": code, "ended": time.time(), "stopped": reason, "stop_signal": self.stop_signal,
            "failed_at": min(self.failed_at) if failed and self.failed_at and not race else None,
            "restarts": _restarts(self.spec.get("log_dir")), "exit_race": race,
            # the first worker seen failing, as data: torchrun, ended at once, may not have named it
            "failed_worker": failed_worker_record(*self.failed_workers[0]) if self.failed_workers else None,
            "launcher": launcher,
            # on a node whose job failed, the ranks that had ended their work (exit 0) before: one
            # that left early while its peers still waited for it is the failure's likely start
            "ended_0": self._ended_0() if failed and not race else []}) + "\n")
        _write(os.path.join(run_dir, "exit_code"), "%d\n" % code)  # last: its presence means "done"


def name_of_signal(number):
    """``SIGTERM`` for 15; ``signal 99`` for a number with no name here."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return "signal %d" % number


def _worker_text(pid, how):
    return "a worker failed (pid %d, %s %s); ended without waiting for torchrun" % (pid, how[0], how[1])


def hold_leases(spec, run_dir, log):
    """Lease the GPUs the spec's ``gpus`` asks for (``{"count": N, "pin": [ids]}``) before the job
    starts: ``(descriptors, gpu indexes)`` to keep open for the job's life (the kernel releases them
    when this supervisor ends, however it ends; on the master also the reserved ``master_port``),
    ``(descriptors, None)`` when no GPU is asked, or
    ``(None, None)`` when they are held or busy: then this says which, by whom, and records the
    refusal (exit :data:`LEASES_HELD`) as a job that never started; or when a ``--wait`` was
    cancelled (``ddpfab stop``, a signal, ddpfab gone): then its record says "cancelled while
    waiting" (exit :data:`CANCELLED_WAITING`), so ``ps`` and the history show it."""
    want, port, run_id = spec.get("gpus"), spec.get("master_port"), str(spec.get("run_id"))
    held, why, code, stop_signal = [], None, LEASES_HELD, None
    try:
        if port and uses_leases():  # the master: the port the probe reserved, now for the job's life
            fds = reserve_port(port, run_id, hold=True)
            if fds is None:
                why = "master port %s is reserved by another run here (started at the same time?)" % port
            else:
                held += fds
        if want and why is None:
            count, pin = int(want.get("count", 0)), [str(g) for g in want.get("pin") or ()]
            if spec.get("wait"):
                fds, gpus, states, stop_signal = wait_for_leases(spec, count, pin, run_id)
            else:
                fds, gpus, states = take_leases(count, pin, run_id)
            if fds is None and isinstance(states, str):  # stopped while it waited
                why, code = states, CANCELLED_WAITING
            elif fds is not None:
                held += fds
                threading.Thread(target=_keep_leases_fresh, args=(held,), daemon=True).start()
                _say("leased GPU %s" % ",".join(gpus))
                return held, gpus
            else:
                why = "%d GPU%s wanted%s, not free here: %s" % (
                    count, "" if count == 1 else "s", " (pinned: %s)" % ",".join(pin) if pin else "",
                    "; ".join(describe_leases(states, only=pin or None)) or "none free")
    except Exception as exc:  # noqa: BLE001 - nvidia-smi hung, a lease dir refused...: no job, and a record saying why
        why = "cannot lease GPUs: %s" % exc
    if why is None:
        return held, None
    for fd in held:
        os.close(fd)
    _say(why + "; the job was not started")
    try:
        log.write(("ddpfab-agent: %s\n" % why).encode())
        log.close()
        cancelled = code == CANCELLED_WAITING
        _write(os.path.join(run_dir, "result.json"), json.dumps({
            "exit_code": code, "ended": time.time(), "failed_at": None if cancelled else time.time(),
            "stopped": why if cancelled else None, "cancelled": cancelled, "stop_signal": stop_signal,
            "restarts": 0, "leases": why}) + "\n")
        _write(os.path.join(run_dir, "exit_code"), "%d\n" % code)
    except OSError:
        pass
    return None, None


def _recorded_code(run_dir):
    """The exit code :func:`hold_leases` recorded for a job it did not start."""
    try:
        with open(os.path.join(run_dir, "exit_code")) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return LEASES_HELD


#: How often a waiting supervisor looks at the queue and the leases (a release is seen this soon).
WAIT_POLL_S = 0.2
#: How often it asks nvidia-smi which processes use the GPUs (use without a lease keeps a GPU from
#: being granted): each ask is a run of nvidia-smi (a program start and a driver query), and every
#: waiting job on the node would make five a second. A grant asks again itself.
WAIT_APPS_S = 2.0


def wait_for_leases(spec, count, pin, run_id):
    """``--wait``: queue for the GPUs in arrival order (:mod:`ddpfab.node.leases`' tickets), take
    them when this job is first in line for them, then hold them until ddpfab says go. A job that
    holds its GPUs here but has not gone yet gives them back when an earlier job waits on this
    node for GPUs it cannot get (the earlier job may be waiting for this one elsewhere: no
    deadlock, no starvation). Says its place and what it waits for whenever that changes.

    The go is two-phase so that a job starts on all its nodes or on none (a node yielding as the
    go arrives would otherwise start it partly): ``p<round>;`` on stdin asks "do you still hold
    them?": a node holding them answers ``ready for round <round>`` and from then on does not
    yield; ``g`` (sent only when every node answered that round) starts the job, ``u`` (the round
    failed: some node yielded) lets this node yield again. A ``g`` without a ``ready`` before it
    is ignored. Returns ``(fds, gpus, None, None)``, or ``(None, None, why, signal)`` when told to
    stop: by a signal (``ddpfab stop``, a kill: *signal* is its number), or by ddpfab (EOF, ``!``,
    or its heartbeat gone for the spec's silence: *signal* is None)."""
    wait = _LeaseWait(spec, count, pin, run_id)
    caught = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    for sig in caught:
        signal.signal(sig, wait.cancel)
    reader = threading.Thread(target=wait.link, daemon=True)
    reader.start()
    wait.fd, wait.path = make_ticket(wait.key, wait.record)
    try:
        while True:
            done = wait.step()
            if done is not None:
                return done
            time.sleep(WAIT_POLL_S)
    finally:
        wait.cleanup(caught)


class _LeaseWait(object):
    """One :func:`wait_for_leases`: where the link stands (``granted``, ``ready`` and ``go``, changed
    under ``lock``; ``stop``, the reason to give up; ``beat``, ddpfab's last byte), this job's ticket
    (``fd``, ``path``: ``fd`` None while it holds GPUs) and the GPUs it holds (``held``, ``gpus``)."""

    def __init__(self, spec, count, pin, run_id):
        self.count, self.pin, self.run_id = count, pin, run_id
        self.key = ticket_key(spec["wait"].get("arrival", time.time()), run_id)
        self.record = {"run_id": run_id, "user": lease_user(), "pid": os.getpid(), "since": time.time(),
                       "count": count, "pin": list(pin)}
        self.silence = float(spec.get("silence", 0))
        self.go, self.granted, self.ready, self.stop, self.beat = False, False, False, None, time.monotonic()
        self.signal = None  # the signal that cancelled the wait, as data (the result record's stop_signal)
        self.lock = threading.Lock()
        self.fd, self.path = None, None
        self.held, self.gpus, self.said = None, None, None
        self.table, self.apps, self.asked, self.leased = None, None, 0.0, set()

    def link(self):
        # stdin until the go (then the supervisor's own link watcher reads it) or the end
        pending = b""
        try:
            while True:
                data = os.read(0, 4096)
                if not data:
                    break
                self.beat = time.monotonic()
                if b"!" in data:
                    break
                pending += data.replace(b"\n", b"")
                while pending:
                    op = pending[:1]
                    if op == b"p":  # are you still holding them? (the round's number up to the ';')
                        end = pending.find(b";")
                        if end < 0:
                            break  # the rest of it comes with the next read
                        rnd, pending = pending[1:end], pending[end + 1:]
                        with self.lock:
                            if self.granted and rnd.isdigit():
                                self.ready = True  # no yield from now on, until a go or a "u"
                                _say("ready for round %s" % rnd.decode())
                        continue
                    pending = pending[1:]
                    with self.lock:
                        if op == b"u":
                            self.ready = False
                        elif op == b"g" and self.ready:  # only after this node said ready
                            self.go = True
                            return
        except OSError:
            pass
        if self.stop is None:  # (a signal's cancel came first: its record says so)
            self.stop = "cancelled while waiting for GPUs (stopped by ddpfab)"

    def cancel(self, signum, frame):  # ddpfab stop TERMs a waiter: a record, not a silent death
        self.stop, self.signal = "cancelled while waiting for GPUs (signal %d)" % signum, signum

    def step(self):
        """One poll: ``(fds, gpus, None, None)`` on the go, ``(None, None, why, signal)`` when told to
        stop, else None."""
        if self.silence and time.monotonic() - self.beat > self.silence:
            self.stop = "cancelled while waiting for GPUs (controller silent for %.0f s)" % self.silence
        if self.stop is not None:
            if self.held:
                for h in self.held:
                    os.close(h)
            return None, None, self.stop, self.signal
        if self.fd is not None and os.fstat(self.fd).st_nlink == 0:  # removed (by the lease dir's owner): queue again
            os.close(self.fd)
            self.fd, self.path = make_ticket(self.key, self.record)
        queue = tickets(self.path if self.fd is not None else None)
        ahead = [t for t in queue if t.get("key", "") < self.key and not t.get("own")]
        states = self.gpu_states()
        if self.held is None:
            self.take(states, ahead)
        else:
            self.yield_to_earlier(states, queue, ahead)
            if self.go:
                return self.held, self.gpus, None, None
        return None

    def gpu_states(self):
        """The GPUs' lease states; nvidia-smi's processes asked every :data:`WAIT_APPS_S` (and after a release)."""
        if self.apps is None or time.monotonic() - self.asked >= WAIT_APPS_S:
            if self.table is None or len(self.table) < max(self.count, len(self.pin)):  # (a node's GPUs stay; a failed ask not)
                self.table = gpu_table()
            self.apps, self.asked = compute_apps(self.table), time.monotonic()
        states = lease_state(self.table, self.apps)
        now_leased = set(s["gpu"] for s in states if s["state"] == "leased")
        if any(self.apps.get(g) for g in self.leased - now_leased):
            # a release of a GPU *apps* lists processes on: its holder's, gone with it now (our
            # own yield, or a GPU that read as leased for one poll, lists none: no ask)
            self.apps, self.asked = compute_apps(self.table), time.monotonic()
            states = lease_state(self.table, self.apps)
            now_leased = set(s["gpu"] for s in states if s["state"] == "leased")
        self.leased = now_leased
        return states

    def take(self, states, ahead):
        """Take the GPUs when this job is first in line for them, else say its place when that changed."""
        among = grantable(states, ahead, self.count, self.pin)
        if among is not None:  # (take_leases asks nvidia-smi again: a use since is seen)
            self.held, self.gpus, fresh = take_leases(self.count, self.pin, self.run_id, table=self.table, among=among)
            if fresh is not None:
                self.apps = None
        if self.held is not None:
            with self.lock:
                self.granted = True
            drop_ticket(self.fd, self.path)
            self.fd = None
            _say("granted GPU %s; waiting for the other nodes" % ",".join(self.gpus))
            self.said = None
        else:
            text = "waiting: place %d in this node's queue; %s" % (
                len(ahead) + 1, "; ".join(describe_leases(states, only=self.pin or None)) or "GPUs are free, "
                "kept for the jobs ahead")
            if text != self.said:
                _say(text)
                self.said = text

    def yield_to_earlier(self, states, queue, ahead):
        """Give the held GPUs back (and queue again) for an earlier job that cannot get its GPUs here."""
        for t in ahead:  # an earlier job that cannot get its GPUs here: give ours back
            before = [u for u in queue if u.get("key", "") < t.get("key", "") and not u.get("own")]
            if grantable(states, before, t.get("count", 0), t.get("pin") or ()) is None:
                with self.lock:
                    if self.go or self.ready:
                        break  # promised to ddpfab (or going): yield only after a "u"
                    self.granted = False
                for h in self.held:
                    os.close(h)
                self.held = None
                self.fd, self.path = make_ticket(self.key, self.record)
                _say("yielded GPU %s to run %s, which came first" % (",".join(self.gpus), t.get("run_id", "?")))
                break

    def cleanup(self, caught):
        for sig in caught:  # main() installs the job's own handlers next
            signal.signal(sig, signal.SIG_DFL)
        if self.fd is not None:
            drop_ticket(self.fd, self.path)


def _keep_leases_fresh(fds):
    while True:
        time.sleep(TOUCH_S)
        touch_leases(fds)


def read_result(run_dir):
    """The supervisor's ``result.json`` (how the job ended), ``{}`` when there is none or it is not one."""
    try:
        with open(os.path.join(run_dir, "result.json")) as fh:
            rec = json.load(fh)
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


def ended_state(result):
    """How a job ended, by its supervisor's *result*: ``cancelled`` (a ``--wait`` ended before it
    started), ``stopped`` (something stopped it: ``ddpfab stop``, the controller, another node's
    failure; it did not fail on its own, so no ``failed_at``) or ``exited``. A job that exited 0
    while the controller stopped the run exited: its ranks had finished (a rank that left the
    others early is that node's story)."""
    if result.get("cancelled") is True:
        return "cancelled"
    why = result.get("stopped")
    # (a job that exited 0 under the controller's stop had finished; one a signal stopped, as
    # `ddpfab stop` sends, was stopped, whatever its exit code)
    finished = result.get("exit_code") == 0 and result.get("stop_signal") is None
    if isinstance(why, str) and why and not result.get("failed_at") and not finished:
        return "stopped"
    return "exited"


#: What :func:`stop_job` says on a node that has no record of the run (and nothing of it running).
ABSENT = "absent"


def stop_job(run_dir, grace, why=None):
    """``ddpfab stop`` on this node: TERM the run's supervisor (it ends its job tree) and wait;
    then end whatever of the job is left by its marker: a job whose supervisor was killed (its
    orphans) is ended too, and said so. A ``run --tmux`` launch (no supervisor) is ended by its
    session (:func:`tmux_session`), after *why* (what stops it, for people) is written to its
    record's ``stopped``: the run's watcher reads it, so that the node whose launch this ended is
    not named as the first to fail. Returns (one line saying what happened, 1 if something would
    not stop else 0)."""
    run_dir = os.path.expanduser(run_dir)
    run_id = os.path.basename(run_dir.rstrip("/"))
    try:
        with open(os.path.join(run_dir, "agent.json")) as fh:
            pid = int(json.load(fh)["agent_pid"])
        said = "not running"
    except (OSError, ValueError, KeyError, TypeError):
        pid, said = None, ABSENT
        sid = tmux_session(run_dir)
        if sid is not None:  # no supervisor: a `run --tmux` window launched it
            return _end_tmux_launch(sid, run_id, grace, run_dir, why)

    def alive():
        try:
            with open("/proc/%d/cmdline" % pid, "rb") as fh:
                return run_id.encode() in fh.read().split(b"\0")
        except (OSError, TypeError):
            return False

    if pid and alive():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass  # it ended between the look and the signal: another stop's, or its own end
        deadline = time.monotonic() + grace + 5
        while alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if alive():
            return "still running", 1
        said = "stopped"
    orphans = end_marked(run_id, grace)
    if orphans:
        said = ("stopped, and" if said == "stopped" else "its supervisor was gone:") + \
            " ended %d orphaned job process%s" % (orphans, "" if orphans == 1 else "es")
    return said, (1 if marked_processes(run_id) else 0)


def detach_stdin():
    """A detached supervisor has read its spec: stdin is the finished SSH session's, let it go."""
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
