"""The node's resources a job needs, judged: shared memory, free space where the job writes,
limits, free memory, and left-overs of earlier jobs (issue 25).

The facts come from the node program (:mod:`ddpfab.node.resources`, part of every ``facts``
reply, so ``check`` and ``run``'s preflight read the same); this module decides what is enough,
once, for both. Pure: facts in, :class:`Finding` rows out (:mod:`ddpfab.health.check` turns them
into its results), unit-tested without hosts.

The floors (``--resource-floors shm=2G,disk=5G,mem=4G,nofile=4096``, on check and run):

- ``shm``: free space in /dev/shm; default the larger of 512 MiB and 256 MiB per process the node
  starts (DataLoader workers pass every batch through it; docker's default is 64 MiB).
- ``disk``: free space in the workdir's and the runs dir's filesystems (fail), ~/.cache's (warn);
  default 1 GiB.
- ``mem``: MemAvailable; default 1 GiB.
- ``nofile``: the soft open-files limit the ranks get (the ssh login's, which the supervisor
  passes on); default 1024.

Locked memory (RLIMIT_MEMLOCK) matters to NCCL over InfiniBand (it pins buffers): a limit below
:data:`MEMLOCK_IB` fails a node with IB devices, is a warning on a GPU node without, and is only
shown elsewhere. Left-overs: a process listening on the master port, and a process using a GPU
without a ddpfab lease (the lease facts say "busy"; here they get their user, command, age and the
fix), a failure where the node has fewer free GPUs than the job's processes need.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ddpfab.optionnames import option
from ddpfab.remote.nodeprogram import printable
from ddpfab.planning import gpu_leases
from ddpfab.planning.plan import PlanError

MIB = 2**20
GIB = 2**30
#: Default floors (see the module's docstring).
SHM_MIN = 512 * MIB
SHM_PER_PROCESS = 256 * MIB
DISK_MIN = GIB
MEM_MIN = GIB
NOFILE_MIN = 1024
#: Locked memory NCCL's InfiniBand transport wants (it pins its buffers; the usual advice is
#: ``unlimited``): below it a node with IB devices fails.
MEMLOCK_IB = 64 * MIB
#: What each place where the job writes is, in words, and whether too little space there fails.
PLACES = {"workdir": ("the workdir", True), "runs": ("the runs dir", True), "cache": ("~/.cache", False)}
FLOOR_KEYS = ("shm", "disk", "mem", "nofile")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.I)


class FloorError(PlanError):
    """A ``--resource-floors`` value that cannot be read (a user's input: the message says why)."""


@dataclass(frozen=True)
class Floors:
    """What is enough on a node; None: the default rule."""

    shm: int | None = None
    disk: int = DISK_MIN
    mem: int = MEM_MIN
    nofile: int = NOFILE_MIN

    def shm_for(self, nproc: int) -> int:
        return self.shm if self.shm is not None else max(SHM_MIN, SHM_PER_PROCESS * max(nproc, 1))


@dataclass(frozen=True)
class Finding:
    """One row of the report: check, status (pass|fail|warn), found, expected, fix (on *node*)."""

    node: str
    check: str
    status: str
    found: str
    expected: str = ""
    fix: str = ""


def parse_size(text: str) -> int:
    """``512M``, ``1.5G``, ``2GiB``, ``1048576`` (bytes) -> bytes (binary units)."""
    m = _SIZE.match(text)
    if not m:
        raise FloorError(f"{text!r} is not a size (examples: 512M, 2G, 1.5GiB)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index((m.group(2) or " ").lower()))


def parse_floors(spec: str | None) -> Floors:
    """``--resource-floors``' value (``shm=2G,disk=5G,mem=4G,nofile=4096``; any subset) as Floors."""
    if not spec:
        return Floors()
    values: dict[str, int] = {}
    for item in spec.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or key not in FLOOR_KEYS:
            raise FloorError(f"{option('resource_floors')}: {item.strip()!r} is not KEY=VALUE with KEY one of "
                             f"{', '.join(FLOOR_KEYS)} (e.g. shm=2G,disk=5G,mem=4G,nofile=4096)")
        if key == "nofile":
            if not value.strip().isdigit():
                raise FloorError(f"{option('resource_floors')}: nofile={value!r} is not a count of files")
            values[key] = int(value)
        else:
            values[key] = parse_size(value)
    return Floors(**values)


def size(n: int | None) -> str:
    """Bytes in words: ``256 KiB``, ``64 MiB``, ``1.5 GiB``."""
    if n is None:
        return "?"
    if n >= GIB:
        return f"{n / GIB:.1f} GiB".replace(".0 ", " ")
    return f"{n / MIB:.0f} MiB" if n >= MIB else f"{n // 1024} KiB" if n >= 1024 else f"{n} B"


def limit(n: int) -> str:
    return "unlimited" if n < 0 else str(n)


def age(seconds: float | None) -> str:
    if seconds is None:
        return "age unknown"
    for unit, span in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= span:
            return f"up {seconds / span:.0f} {unit}"
    return f"up {seconds:.0f} s"


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: object, limit: int = 200) -> str:
    return printable(value)[:limit] if isinstance(value, str) else "?"


def _fs(raw: object) -> dict | None:
    """A filesystem record from a node, validated (records are data): None when it is not one."""
    if not isinstance(raw, dict) or _int(raw.get("free")) is None:
        return None
    return {"free": raw["free"], "total": _int(raw.get("total")),
            **{k: _text(raw.get(k)) for k in ("path", "mount", "fstype")}}


def _proc(raw: object) -> dict | None:
    """A process record from a node, validated: pid, user, cmd, age_s, run_id."""
    if not isinstance(raw, dict) or _int(raw.get("pid")) is None:
        return None
    age_s = raw.get("age_s")
    return {"pid": raw["pid"], "user": _text(raw.get("user"), 64), "cmd": _text(raw.get("cmd")),
            "age_s": age_s if isinstance(age_s, (int, float)) and not isinstance(age_s, bool) else None,
            "run_id": printable(raw["run_id"])[:100] if isinstance(raw.get("run_id"), str) and raw["run_id"] else None}


def _limit(raw: object) -> tuple[int, int] | None:
    if isinstance(raw, list) and len(raw) == 2 and all(_int(v) is not None for v in raw):
        return raw[0], raw[1]
    return None


def holder(proc: dict) -> str:
    """``pid 4242 (user alice, `python train.py`, up 3 h, ddpfab run R)``."""
    what = [f"user {proc.get('user') or '?'}", f"`{proc.get('cmd') or '?'}`", age(proc.get("age_s"))]
    if proc.get("run_id"):
        what.append(f"ddpfab run {proc['run_id']}")
    return f"pid {proc.get('pid')} ({', '.join(what)})"


#: What a training job's left-over runs as: a port held by anything else (sshd, a database) is not
#: one to suggest killing.
JOB_WORDS = ("python", "torchrun")


def holder_fix(procs: list[dict], jobs_only: bool = False) -> str:
    """``ddpfab stop RUN`` for a ddpfab job's process (its supervisor ends it all), else kill
    (never pid 1; with *jobs_only*, only a python or torchrun); empty when neither applies."""
    runs = sorted({p["run_id"] for p in procs if p.get("run_id")})
    pids = [str(p.get("pid")) for p in procs if not p.get("run_id") and p.get("pid") != 1
            and (not jobs_only or any(w in (p.get("cmd") or "") for w in JOB_WORDS))]
    fixes = [f"ddpfab stop {r}" for r in runs] + ([f"kill {' '.join(pids)} (if it is a left-over)"] if pids else [])
    return ", or ".join(fixes)


def evaluate(node: str, raw: dict, nproc: int, floors: Floors, *, master_port: int | None = None,
             busy_gpus_fail: bool = True) -> list[Finding]:
    """The resource findings of one node.

    Args:
        node: its name.
        raw: its ``facts`` reply (``resources``, ``leases``, ``nvidia_gpus``/``gpus``).
        nproc: the processes the job starts there.
        floors: what is enough.
        master_port: the port the job's master listens on (its holders are named on the master).
        busy_gpus_fail: a GPU in use without a lease fails when the node has too few free (run leaves
            that to its lease refusal, which knows --wait): else it is a warning.
    """
    res = raw.get("resources")
    if not isinstance(res, dict):
        return []  # a node program without them (an older ddpfab on the node): nothing to judge
    return (_check_shm(node, res, nproc, floors) + _check_disk(node, res, floors) + _check_nofile(node, res, floors)
            + _check_memlock(node, raw, res) + _check_memory(node, res, floors)
            + _leftovers(node, raw, res, nproc, master_port, busy_gpus_fail))


def _check_shm(node: str, res: dict, nproc: int, floors: Floors) -> list[Finding]:
    """Free shared memory against the floor for *nproc* processes (DataLoader workers pass every
    batch through /dev/shm); nothing when the node did not report it."""
    shm, need = _fs(res.get("shm")), floors.shm_for(nproc)
    if not shm:
        return []
    found = f"/dev/shm {size(shm['free'])} free of {size(shm.get('total'))} ({shm.get('fstype')})"
    if shm["free"] < need:
        return [Finding(node, "shm", "fail", found,
                        expected=f"at least {size(need)} free for {nproc} processes and their DataLoader workers",
                        fix=f"mount -o remount,size={-(-need // GIB) * 2}G /dev/shm (as root; in docker: "
                            f"--shm-size={-(-need // GIB) * 2}g), or lower the floor with "
                            f"{option('resource_floors', 'shm=SIZE')}")]
    return [Finding(node, "shm", "pass", found)]


def _check_disk(node: str, res: dict, floors: Floors) -> list[Finding]:
    """Free space in each place where the job writes (:data:`PLACES`): a row per place short of
    the floor, else one pass row for the workdir."""
    short = []
    paths: dict = res["paths"] if isinstance(res.get("paths"), dict) else {}
    for key, where_fails in PLACES.items():
        where, fails = where_fails
        fs = _fs(paths.get(key))
        if not fs:
            continue
        if fs["free"] < floors.disk:
            short.append(Finding(node, "disk", "fail" if fails else "warn",
                                 f"{where} {fs['path']}: {size(fs['free'])} free on {fs.get('mount')} ({fs.get('fstype')})",
                                 expected=f"at least {size(floors.disk)} free",
                                 fix=f"free space on {fs.get('mount')}, or lower the floor with "
                                     f"{option('resource_floors', 'disk=SIZE')}"))
    wd = _fs(paths.get("workdir")) or {}
    return short or [Finding(node, "disk", "pass", f"workdir {size(wd.get('free'))} free")]


def _check_nofile(node: str, res: dict, floors: Floors) -> list[Finding]:
    """The open-files limit against the floor: the ssh login's, which is what the supervisor
    gives the ranks; nothing when the node did not report it."""
    nofile = _limit(res.get("nofile"))
    if not nofile:
        return []
    soft, hard = nofile
    if 0 <= soft < floors.nofile:
        raise_to = f"ulimit -n {min(floors.nofile * 4, hard) if hard >= 0 else floors.nofile * 4}"
        return [Finding(node, "nofile", "fail", f"open files limit {soft} (hard {limit(hard)})",
                        expected=f"at least {floors.nofile} (gloo/NCCL keep a socket per peer, DataLoader "
                                 "workers pass descriptors)",
                        fix=f"raise nofile for the login user in /etc/security/limits.conf (pam_limits) or "
                            f"LimitNOFILE= of sshd's unit ({raise_to} in a login shell shows it took)")]
    return [Finding(node, "nofile", "pass", f"open files {limit(soft)} (hard {limit(hard)})")]


def _check_memlock(node: str, raw: dict, res: dict) -> list[Finding]:
    """The locked-memory limit: too low fails a node with InfiniBand (NCCL pins its buffers), warns
    on a GPU node without, passes elsewhere; nothing when the node did not report it."""
    memlock = _limit(res.get("memlock"))
    if not memlock:
        return []
    soft = memlock[0]
    gpus = bool(raw.get("nvidia_gpus") or raw.get("gpus"))
    low = 0 <= soft < MEMLOCK_IB
    found = f"locked memory {'unlimited' if soft < 0 else size(soft)}"
    fix = "set memlock unlimited for the login user in /etc/security/limits.conf (or LimitMEMLOCK=infinity of sshd)"
    if low and res.get("infiniband"):
        return [Finding(node, "memlock", "fail", found, expected="unlimited (NCCL pins its InfiniBand buffers)",
                        fix=fix)]
    if low and gpus:
        return [Finding(node, "memlock", "warn", found + " (no InfiniBand here: NCCL over sockets copes)", fix=fix)]
    return [Finding(node, "memlock", "pass", found)]


def _check_memory(node: str, res: dict, floors: Floors) -> list[Finding]:
    """Available memory against the floor; nothing when the node did not report it."""
    avail = _int(res.get("mem_available"))
    if avail is None:
        return []
    found = f"{size(avail)} available of {size(_int(res.get('mem_total')))}"
    if avail < floors.mem:
        return [Finding(node, "memory", "fail", found, expected=f"at least {size(floors.mem)} available",
                        fix=f"end what uses the memory there, or lower the floor with {option('resource_floors', 'mem=SIZE')}")]
    return [Finding(node, "memory", "pass", found)]


def _list(value: object) -> list:
    return value if isinstance(value, list) else []


def _leftovers(node: str, raw: dict, res: dict, nproc: int, master_port: int | None, busy_gpus_fail: bool) -> list[Finding]:
    """The processes that hold what the job will use: the master port, GPUs without a lease."""
    out = []
    holders = [p for p in map(_proc, _list(res.get("port_holders"))) if p]
    if holders:
        out.append(Finding(node, "leftovers", "fail", f"port {master_port} held by " + "; ".join(map(holder, holders)),
                           expected=f"port {master_port} free for the job's master",
                           fix=", or ".join(filter(None, (holder_fix(holders, jobs_only=True),
                                                          f"pick another {option('master_port')} (or leave it out)")))))
    states = gpu_leases.parse(raw.get("leases")) or []
    busy = [s for s in states if s.state == "busy"]
    if busy:
        about = {p["pid"]: p for p in map(_proc, _list(res.get("gpu_holders"))) if p}
        procs = [about.get(pid, {"pid": pid, "cmd": name}) for s in busy for pid, name in s.procs]
        free = sum(s.state == "free" for s in states)
        status = "fail" if nproc > free and busy_gpus_fail else "warn"
        gpus = ",".join(str(s.gpu) for s in busy)
        out.append(Finding(node, "leftovers", status,
                           f"GPU {gpus} in use without a ddpfab lease by " + "; ".join(map(holder, procs)),
                           expected=f"{nproc} free GPUs for {nproc} processes ({free} free)" if status == "fail" else "",
                           fix=holder_fix(procs) or "find out whose it is before starting a job there"))
    if not out:
        out.append(Finding(node, "leftovers", "pass", "nothing holds the job's port or GPUs"))
    return out


def port_holders(raw: dict) -> tuple[str, str]:
    """The master's facts' listeners on the asked port, for the probe's "in use" refusal:
    (`` by pid N (...)``, ``ddpfab stop R ; or ``), or empty strings when none is known."""
    res = raw.get("resources") if isinstance(raw, dict) else None
    procs = [p for p in map(_proc, _list((res or {}).get("port_holders") if isinstance(res, dict) else None)) if p]
    if not procs:
        return "", ""
    fix = holder_fix(procs, jobs_only=True)
    return " by " + "; ".join(map(holder, procs)), fix + ", or " if fix else ""
