"""Where the test suite's CPU goes: every process it starts (the lab hosts' too), from the kernel's
process accounting (BSD ``acct``, version 3 records), by kind. It answers how short the suite can
be on this machine: no schedule runs it faster than its CPU-seconds divided by the cores.

    .venv/bin/python bench/suite_cpu.py run -- bash scripts/test.sh     # as root (accton)
    .venv/bin/python bench/suite_cpu.py read /var/log/account/pacct     # a file written before

Kinds, by what a process is and where it ran: "node" is one below a lab host's sshd (a command or
job the suite started over SSH); a process that mapped torch has a virtual size at exit over
TORCH_VSZ_KB (torch's libraries alone map more) and is a node's, or named by a torch thread, or
a child of one (a ddpfab command's many thread stacks map as much on the controller); a "rank"
is such a process whose parent is one too (torchrun's workers). Writes
bench/results/suite_cpu.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

RESULT = Path(__file__).resolve().parent / "results" / "suite_cpu.json"
#: linux/acct.h's struct acct_v3: flag, version, tty, exitcode, uid, gid, pid, ppid, btime,
#: etime (float, ticks), utime, stime, mem (KiB), io, rw, minflt, majflt, swaps (comp_t), comm
RECORD = struct.Struct("=BBHIIIIIIf8H16s")
AHZ = 100  # the ticks of acct's times
TORCH_VSZ_KB = 500 * 1024


def comp_t(value: int) -> int:
    """acct's 16-bit float: 13 bits of mantissa, 3 of base-8 exponent."""
    return (value & 0x1FFF) << (3 * (value >> 13))


@dataclass
class Proc:
    comm: str
    pid: int
    ppid: int
    start: int
    elapsed: float
    cpu: float
    vsz_kb: int
    parent: Proc | None = None


def read(path: str) -> list[Proc]:
    data = Path(path).read_bytes()
    procs = []
    for off in range(0, len(data) - RECORD.size + 1, RECORD.size):
        f = RECORD.unpack_from(data, off)
        if f[1] != 3:  # not a v3 record: the file is not what this reads
            raise SystemExit(f"{path}: record {off // RECORD.size} is version {f[1]}, not 3")
        procs.append(Proc(f[18].split(b"\0")[0].decode(errors="replace"), f[6], f[7], f[8], f[9] / AHZ,
                          (comp_t(f[10]) + comp_t(f[11])) / AHZ, comp_t(f[12])))
    procs.sort(key=lambda p: p.start)
    by_pid: dict[int, list[Proc]] = collections.defaultdict(list)
    for p in procs:
        by_pid[p.pid].append(p)
    for p in procs:  # a parent: the latest process of that pid alive when the child started (pids recur)
        cands = [q for q in by_pid.get(p.ppid, []) if q.start <= p.start <= q.start + q.elapsed + 2 and q is not p]
        p.parent = cands[-1] if cands else None
    return procs


def _ancestors(p: Proc) -> list[Proc]:
    chain, q = [], p.parent
    while q is not None and len(chain) < 64:
        chain.append(q)
        q = q.parent
    return chain


def on_node(p: Proc) -> bool:
    """Started over SSH: below a lab host's sshd."""
    return any(a.comm.startswith("sshd") for a in _ancestors(p))


def mapped_torch(p: Proc) -> bool:
    """A process that imported torch: a large mapping, and a node's process, a torch thread's name
    (the last thread to end names the record), or a torch parent. (A ddpfab command with many
    threads maps as much in stacks, on the controller.)"""
    if p.vsz_kb < TORCH_VSZ_KB:
        return False
    return on_node(p) or p.comm.startswith(("pt_", "gloo")) or (p.parent is not None and mapped_torch(p.parent))


def kind(p: Proc) -> str:
    node = on_node(p)
    if mapped_torch(p):
        if node:
            return "node: rank" if p.parent is not None and mapped_torch(p.parent) else "node: torchrun"
        return "controller: torch (local torchrun and ranks, unit tests)"
    if p.comm.startswith("ansible"):
        return "ansible"
    if p.comm.startswith("pip"):
        return "pip (setup)"
    if node:
        return "node: other python" if p.comm.startswith("python") else "node: shells, sshd, tools"
    if p.comm.startswith("python") or p.comm == "ddpfab":
        return "controller: python (pytest, ddpfab commands)"
    if p.comm in ("ssh", "rsync"):
        return "controller: ssh, rsync"
    return "controller: other"


def summary(procs: list[Proc], wall: float | None, busy: float | None) -> dict:
    cpu: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for p in procs:
        k = kind(p)
        cpu[k] += p.cpu
        count[k] += 1
    total = sum(cpu.values())
    torch = [p for p in procs if mapped_torch(p)]
    cores = os.cpu_count() or 1
    return {"processes": len(procs), "cpu_s": round(total, 1), "cores": cores,
            "floor_min": round(total / cores / 60, 1), "torch_processes": len(torch),
            "torch_cpu_s": round(sum(p.cpu for p in torch), 1), "wall_s": wall, "busy": busy,
            "kinds": [{"kind": k, "cpu_s": round(v, 1), "processes": count[k]} for k, v in cpu.most_common()]}


def cpu_times() -> tuple[int, int]:
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(f) - f[3] - f[4], sum(f)  # busy (all but idle and iowait), all


def show(s: dict) -> None:
    print(f"{s['processes']} processes, {s['cpu_s']:.0f} CPU-s: at least {s['floor_min']} min on {s['cores']} cores"
          + (f"; ran {s['wall_s'] / 60:.1f} min, CPUs {100 * s['busy']:.0f} % busy" if s["wall_s"] else ""))
    print(f"processes that mapped torch: {s['torch_processes']}, {s['torch_cpu_s']:.0f} CPU-s "
          f"({100 * s['torch_cpu_s'] / max(s['cpu_s'], 1):.0f} %)")
    for k in s["kinds"]:
        print(f"{k['cpu_s']:9.0f} s {100 * k['cpu_s'] / max(s['cpu_s'], 1):5.1f} % {k['processes']:8d}  {k['kind']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="how", required=True)
    sub.add_parser("run").add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("read").add_argument("pacct")
    args = ap.parse_args()
    if args.how == "read":
        show(summary(read(args.pacct), None, None))
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    fd, pacct = tempfile.mkstemp(prefix="suite-", suffix=".pacct")
    os.close(fd)
    subprocess.run(["accton", pacct], check=True, stdout=subprocess.DEVNULL)
    began, (busy0, all0) = time.monotonic(), cpu_times()
    try:
        code = subprocess.call(command)
    finally:
        subprocess.run(["accton", "off"], check=False, stdout=subprocess.DEVNULL)
    busy1, all1 = cpu_times()
    s = summary(read(pacct), round(time.monotonic() - began, 1), round((busy1 - busy0) / max(all1 - all0, 1), 3))
    s["command"], s["exit_code"] = command, code
    RESULT.write_text(json.dumps(s, indent=1) + "\n")
    show(s)
    return code


if __name__ == "__main__":
    sys.exit(main())
