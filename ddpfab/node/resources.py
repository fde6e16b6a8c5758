"""The node's resources a job needs, as facts (the node side of :mod:`ddpfab.health.resourcecheck`).

Part of the shipped node program (:data:`ddpfab.remote.nodeprogram.SOURCES`): standard library only, Python
3.6+, no ddpfab imports; top-level names start with ``res_``/``RES_`` because the modules share
one namespace there. ``facts`` adds :func:`res_facts`'s answer: /dev/shm, the filesystems where
the job writes, the limits the node program got over ssh (a supervisor started the same way gives
its ranks the same), free memory, and the processes behind what is taken (a listener on the master
port, a GPU used without a lease). Cheap by design: a few ``statvfs`` and ``/proc`` reads; the
scan of every process's descriptors runs only when the master port is found taken. Only facts
here: what is enough is decided on the controller, once.
"""

import os
import pwd
import re
import resource
import time

#: Where the job writes besides its workdir: the runs dir (the supervisor's record, the ranks'
#: logs) and ~/.cache (torch hub, compiled kernels, dataset caches).
RES_PATHS = (("runs", "~/.ddpfab/runs"), ("cache", "~/.cache"))


def res_mounts():
    """Mount point -> filesystem type, from this process's mount namespace."""
    out = {}
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                parts = line.split()
                if "-" not in parts:
                    continue
                sep = parts.index("-")
                point = parts[4]
                if "\\" in point:  # the kernel's octal escapes (a space is \040); re only where there is one
                    point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point)
                out[point] = parts[sep + 1] if len(parts) > sep + 1 else "?"
    except OSError:
        pass
    return out


def res_filesystem(path, mounts):
    """Size and free space (for an unprivileged writer) of the filesystem holding *path* (its
    nearest existing ancestor when it does not exist yet), with its mount point and type."""
    at = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(at) and os.path.dirname(at) != at:
        at = os.path.dirname(at)
    try:
        st = os.statvfs(at)
    except OSError as exc:
        return {"path": path, "error": str(exc)}
    real = os.path.realpath(at)
    points = [m for m in mounts if real == m or real.startswith(m.rstrip("/") + "/")]
    mount = max(points, key=len) if points else "/"
    return {"path": path, "at": at, "total": st.f_blocks * st.f_frsize, "free": st.f_bavail * st.f_frsize,
            "mount": mount, "fstype": mounts.get(mount, "?")}


def res_limit(which):
    """[soft, hard] of an rlimit, -1 for unlimited."""
    soft, hard = resource.getrlimit(which)
    return [-1 if v == resource.RLIM_INFINITY else v for v in (soft, hard)]


def res_meminfo():
    """MemAvailable and MemTotal in bytes (None where unreadable)."""
    got = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("MemAvailable", "MemTotal"):
                    got[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return got.get("MemAvailable"), got.get("MemTotal")


def res_boot_time():
    try:
        with open("/proc/stat") as fh:
            for line in fh:
                if line.startswith("btime "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def res_process(pid, boot=None):
    """Who a process is: pid, user, command line, age in s, and the ddpfab run it belongs to
    (``DDPFAB_JOB`` in its environment, readable for our own processes only)."""
    out = {"pid": pid, "user": None, "cmd": None, "age_s": None, "run_id": None}
    base = "/proc/%d" % pid
    try:
        uid = os.stat(base).st_uid
    except OSError:
        return out  # gone, or not visible from here
    try:
        out["user"] = pwd.getpwuid(uid).pw_name
    except KeyError:
        out["user"] = str(uid)
    try:
        with open(base + "/cmdline", "rb") as fh:
            out["cmd"] = fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()[:200]
        with open(base + "/stat", "rb") as fh:
            stat = fh.read()
        start = int(stat[stat.rfind(b")") + 2:].split()[19])  # field 22, counted after the name
        boot = res_boot_time() if boot is None else boot
        if boot is not None:
            out["age_s"] = round(time.time() - (boot + start / os.sysconf("SC_CLK_TCK")), 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(base + "/environ", "rb") as fh:
            for item in fh.read().split(b"\0"):
                if item.startswith(b"DDPFAB_JOB="):
                    out["run_id"] = item[len(b"DDPFAB_JOB="):].decode("utf-8", "replace")[:100]
    except OSError:
        pass  # another user's: its run is not ours to name
    return out


def res_listening_inodes(port):
    """Socket inodes listening on TCP *port* in this network namespace (IPv4 and IPv6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                next(fh, None)
                for line in fh:
                    parts = line.split()
                    if len(parts) > 9 and parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                        found.add(parts[9])
        except (OSError, ValueError):
            continue
    return found


def res_port_holders(port):
    """The processes that hold a listening socket on *port* (those we may look into)."""
    inodes = res_listening_inodes(port)
    if not inodes:
        return []
    wanted = set("socket:[%s]" % i for i in inodes)
    me, boot, out = os.getpid(), res_boot_time(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            fds = os.listdir("/proc/%s/fd" % entry)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink("/proc/%s/fd/%s" % (entry, fd)) in wanted:
                    out.append(res_process(int(entry), boot))
                    break
            except OSError:
                continue
    return out


def res_facts(req, facts):
    """The resources part of a ``facts`` reply; *facts*: the reply so far (its port and leases)."""
    mounts = res_mounts()
    out = {"shm": res_filesystem("/dev/shm", mounts),
           "paths": dict([("workdir", res_filesystem(req["workdir"], mounts))] +
                         [(key, res_filesystem(path, mounts)) for key, path in RES_PATHS]),
           "nofile": res_limit(resource.RLIMIT_NOFILE), "memlock": res_limit(resource.RLIMIT_MEMLOCK),
           "infiniband": bool(os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"))}
    out["mem_available"], out["mem_total"] = res_meminfo()
    if req.get("port") and facts.get("port_free") is False:
        out["port_holders"] = res_port_holders(int(req["port"]))
    pids = set()
    for gpu in (facts.get("leases") or {}).get("gpus") or []:
        if gpu.get("state") == "busy":
            pids.update(p["pid"] for p in gpu.get("procs") or [] if isinstance(p.get("pid"), int))
    if pids:
        boot = res_boot_time()
        out["gpu_holders"] = [res_process(pid, boot) for pid in sorted(pids)]
    return out
