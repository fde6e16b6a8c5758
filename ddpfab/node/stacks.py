"""The node side of ``ddpfab doctor``: each rank of a run's job, its process state and its Python stack.

Part of the node program (standard library only, Python 3.6+; on a node this source follows
:mod:`ddpfab.node.agent`'s in one text, so the names it uses from there are already defined).
Everything returned is data, never text for the controller to parse: the ranks are the children of
the torchrun that the run's supervisor started (its pid in ``agent.json``; for a ``run --tmux``
launch, which has none, under the window's shell that ``tmux.pid`` names), each with its global
and local rank (from its environment: same user), its state letter from ``/proc/<pid>/stat``
(R running, S sleeping, D uninterruptible, T stopped, Z gone but not reaped), the CPU time it used
during the sample, and its stack as ``py-spy dump --json --nonblocking`` gives it: non-blocking, so
the doctor never pauses a running job, and so a stopped (T) rank can be read at all (py-spy's
default attach waits for a stop that never comes).
"""

import base64
import json
import os
import subprocess
import sys
import threading
import time

try:  # as a module of ddpfab; on a node their source comes first in the same program
    from .agent import ended_state, proc_stat, ranks_done, read_result, tmux_session, torchrun_workers
    from .workdir import which
except ImportError:
    pass

#: Seconds one ``py-spy dump`` may take before its rank is reported without a stack.
PY_SPY_TIMEOUT_S = 15.0
#: The most bytes of one flight-recorder dump the doctor brings back (a dump is a few MB at most).
MAX_DUMP_BYTES = 16 * 2**20
#: How the ranks' NCCL flight recorder dumps are named in the run's dir (ddpfab's plan sets
#: TORCH_FR_DUMP_TEMP_FILE to ``<run dir>/nccl_trace_rank_``; torch appends the global rank):
#: ddpfab.planning.plan.FLIGHT_RECORDER_PREFIX.
TRACE_PREFIX = "nccl_trace_rank_"
#: The state letters of /proc/<pid>/stat a doctor reports (anything else: as found).
STATE_WORDS = {"R": "running", "S": "sleeping", "D": "uninterruptible", "T": "stopped", "t": "traced",
               "Z": "gone (zombie)", "X": "gone", "I": "idle"}


def rank_ids(pid):
    """(RANK, LOCAL_RANK) from the environment torchrun gave *pid* (ints, None where unreadable)."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as fh:
            env = dict(kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None, None
    out = []
    for key in (b"RANK", b"LOCAL_RANK"):
        value = env.get(key, b"")
        out.append(int(value) if value.isdigit() else None)
    return out[0], out[1]


def find_py_spy(python=None):
    """The py-spy to use: next to the node's python (installed with it: the node extra, provision),
    else on PATH; None when there is none."""
    here = os.path.join(os.path.dirname(python or sys.executable), "py-spy")
    if os.access(here, os.X_OK):
        return here
    return which("py-spy")


def ptrace_scope():
    """The kernel's Yama ptrace_scope (0-3), None where the kernel has no Yama."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def frames_of(threads):
    """py-spy's JSON (a list of threads) as data the controller checks: per thread its name and
    frames (innermost first: function, file, line). Every frame is kept: py-spy's ``is_shim_entry``
    marks a real frame (a thread's outermost, entered from C: a script's ``<module>`` among them),
    and dropping those lost a script that works at module level."""
    out = []
    for th in threads if isinstance(threads, list) else []:
        if not isinstance(th, dict) or not isinstance(th.get("frames"), list):
            continue
        frames = [{"name": str(f.get("name")), "file": str(f.get("filename")), "line": f.get("line")
                   if type(f.get("line")) is int else None}
                  for f in th["frames"] if isinstance(f, dict)]
        out.append({"thread": th.get("thread_name") if isinstance(th.get("thread_name"), str) else None,
                    "tid": th.get("os_thread_id") if type(th.get("os_thread_id")) is int else None,
                    "active": bool(th.get("active")), "frames": frames})
    return out


def dump_stack(py_spy, pid, timeout=PY_SPY_TIMEOUT_S):
    """``{"threads": [...]}`` for *pid*, or ``{"error": what happened, "fix": what to do}``."""
    if py_spy is None:
        return {"error": "py-spy is not installed", "fix": "pip install py-spy into the node's python "
                "(the node extra: pip install 'ddpfab[node]'), or run `ddpfab provision`"}
    try:
        proc = subprocess.run([py_spy, "dump", "--pid", str(pid), "--json", "--nonblocking"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": "py-spy dump took more than %g s" % timeout, "fix": "run `ddpfab doctor` again"}
    except OSError as exc:
        return {"error": "cannot run %s: %s" % (py_spy, exc), "fix": "pip install py-spy into the node's python"}
    if proc.returncode != 0:
        # py-spy's own first line is what was found; the fix is decided from the kernel's setting
        # (data), never from py-spy's wording
        lines = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        found = (lines[0] if lines else "py-spy dump: exit %d" % proc.returncode)[:300]
        scope = ptrace_scope()
        if scope is not None and (scope >= 2 or scope == 1 and os.geteuid() != 0):
            fix = ("the kernel restricts ptrace (kernel.yama.ptrace_scope=%d): sysctl kernel.yama.ptrace_scope=0, "
                   "or give py-spy CAP_SYS_PTRACE (setcap cap_sys_ptrace+ep %s)" % (scope, py_spy))
        else:
            fix = "check that py-spy reads this Python (pip install -U py-spy) and runs as the job's user"
        return {"error": found, "fix": fix}
    try:
        return {"threads": frames_of(json.loads(proc.stdout.decode("utf-8", "replace")))}
    except ValueError:
        return {"error": "py-spy's output is not JSON (py-spy too old for --json?)", "fix": "pip install -U py-spy"}


def trace_dumps(run_dir, limit=MAX_DUMP_BYTES):
    """The NCCL flight recorder's dumps under the run's dir, as bytes (base64): never read here,
    never unpickled by the controller; only listed and kept."""
    d, out = run_dir, []
    try:
        names = sorted(n for n in os.listdir(d) if n.startswith(TRACE_PREFIX))
    except OSError:
        return out
    for name in names:
        path = os.path.join(d, name)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            if os.fstat(fd).st_mode & 0o170000 != 0o100000:  # not a regular file
                continue
            data = os.read(fd, limit + 1)
        finally:
            os.close(fd)
        out.append({"name": name, "size": len(data), "truncated": len(data) > limit,
                    "b64": base64.b64encode(data[:limit]).decode()})
    return out


def job_record(run_dir):
    """The supervisor's ``agent.json`` (its pid, the job's pid) and the job's exit code if it ended."""
    rec, code = None, None
    try:
        with open(os.path.join(run_dir, "agent.json")) as fh:
            rec = json.load(fh)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(run_dir, "exit_code")) as fh:
            text = fh.read().strip()
        code = int(text) if text.lstrip("-").isdigit() else -1
    except OSError:
        pass
    return rec if isinstance(rec, dict) else None, code


def node_stacks(run_dir, sample_s=1.0, python=None):
    """Every rank of the job in *run_dir*: pid, rank, local rank, state, CPU ticks used in
    *sample_s*, stack; plus the done records of ranks that ended, and the flight-recorder dumps."""
    run_dir = os.path.expanduser(run_dir)
    rec, code = job_record(run_dir)
    out = {"job": None, "exit_code": code, "ranks": [], "ended": [], "dumps": trace_dumps(run_dir),
           "py_spy": None, "clock_ticks": os.sysconf("SC_CLK_TCK")}
    job = rec.get("pid") if rec else None
    if type(job) is not int:  # a `run --tmux` launch: no supervisor; its window's shell leads the job
        job = tmux_session(run_dir)
    if type(job) is not int:
        out["error"] = "no job record in %s (the run never started here, or its record is gone)" % run_dir
        return out
    out["job"] = {"pid": job, "alive": proc_stat(job) is not None}
    if code is not None:  # ended: how, in its supervisor's words (stopped by ddpfab stop, the controller...)
        result = read_result(run_dir)
        out["how"] = ended_state(result)
        out["stopped"] = str(result["stopped"])[:200] if out["how"] != "exited" else None
    py_spy = find_py_spy(python)
    out["py_spy"] = py_spy
    pids = torchrun_workers(job)
    before = {p: proc_stat(p) for p in pids}
    time.sleep(sample_s)
    stacks = {}

    def dump(pid):
        stacks[pid] = dump_stack(py_spy, pid)
    threads = [threading.Thread(target=dump, args=(p,)) for p in pids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for pid in pids:
        now = proc_stat(pid)
        rank, local = rank_ids(pid)
        then = before.get(pid)
        out["ranks"].append({
            "pid": pid, "rank": rank, "local_rank": local, "state": now[0] if now else "X",
            "cpu_ticks": (now[1] - then[1]) if now and then else None, "stack": stacks.get(pid)})
    for _local, done in sorted(ranks_done(run_dir).items()):
        out["ended"].append(done)
    return out


def op_stacks(req, session):
    """The ``stacks`` operation: :func:`node_stacks` of run ``dir``."""
    return node_stacks(req["dir"], float(req.get("sample_s", 1.0)))
