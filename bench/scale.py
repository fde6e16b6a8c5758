#!/usr/bin/env python3
"""Scale: ddpfab's commands at N = 8, 32, 64, 128 lab hosts against pdsh, and what the controller
holds while they run.

    .venv/bin/python bench/scale.py --subnet 10.NN.105.0/24          # 8,32,64,128 hosts, 3 repetitions
    .venv/bin/python bench/scale.py --quick --subnet 10.NN.105.0/24  # 8,32 hosts, 1 repetition

Tools, each a fresh process as a user types it, interleaved (rotated order in every repetition):
  ddpfab exec           ddpfab exec -i INV -- hostname
  pdsh                  pdsh -R ssh -w node[1-N] hostname (the fan-out floor: no host-key policy, no
                        per-host result map; pdsh has no data-plane check and no launch plan of its own)
  ddpfab check          ddpfab check --fast -i INV (ssh, versions, names, clocks, the mesh probe:
                        all pairs up to 32 nodes, 16 sampled peers per node beyond)
  ddpfab plan           ddpfab plan -i INV SCRIPT: every step `run` takes before a node starts
                        (connect, probe, preflight mesh, plan), nothing started
  ddpfab plan --no-check  the same without the preflight mesh
Once at max(N), the other commands that need no job: `plan --emit DIR`, `sync` of a small git
project into a workdir under /opt (first copy, then the no-change re-sync) and `ps`.
Then the parts that run a job on the hosts (bench/scale_torch.py): teardown after a rank crash at
every N (`ddpfab run` against pdsh + torchrun, bench/teardown.py's method), a real `ddpfab run` of a
small gloo script step by step, and a detached job's `run --detach`, `ps`, `logs`, `attach`, `stop`
at --torch-sizes (default 64, 128). A torch job runs only where it fits in memory (see there).
Per ddpfab run, the controller process is sampled every 20 ms: peak threads, open files, resident
memory, and its CPU seconds (wait4's rusage). Also the lab itself: `up` and `down` of max(N) hosts,
the memory the hosts' processes take (their PSS), and what is left after `down`.
(A torch job takes ~0.3 GiB per host: 64 hosts only just fit in 24 GiB, 128 do not.)
Writes bench/results/scale.json.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
import scale_torch
from common import PYTHON, REPO, log

SIZES = (8, 32, 64, 128)
QUICK_SIZES = (8, 32)
TOOLS = ("ddpfab exec", "pdsh", "ddpfab check", "ddpfab plan", "ddpfab plan --no-check")
SCRIPT = "tests/lab/scripts/report.py"
TIMEOUT = 600
#: fanout: exec/check/plan against pdsh at every size; other: plan --emit, sync, ps at max(N);
#: the torch parts (bench/scale_torch.py): teardown after a crash at every size, a real run and a
#: detached job's ps/logs/attach/stop at --torch-sizes
PARTS = ("fanout", "other", "teardown", "run", "jobs")


def lab_pss_mib(lab) -> float:
    """The lab hosts' processes' proportional memory (every process in their PID namespaces, plus
    the `unshare` parents): what the hosts themselves take, whatever else runs on the machine.
    (Kernel memory for namespaces, veths and overlays is not in it.)"""
    namespaces = {h.pid_namespace() for h in lab.hosts} - {None}
    parents = {h.pid for h in lab.hosts}
    total_kb = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if int(entry) not in parents and os.readlink(f"/proc/{entry}/ns/pid") not in namespaces:
                continue
            for line in Path(f"/proc/{entry}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total_kb += int(line.split()[1])
        except (OSError, ValueError):
            continue
    return total_kb / 1024


def sample_run(argv: list[str], env: dict, cwd: Path = REPO, until=None, timeout: float = TIMEOUT) -> dict:
    """Run *argv*; wall time, exit code, output, and the process's peak threads/fds/RSS and CPU.
    With *until* (a test on the output so far), SIGINT the process once it holds (Ctrl-C: how one
    leaves `attach`); "until_s" says when."""
    with tempfile.TemporaryFile() as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL,
                                cwd=cwd)
        peak = {"threads": 0, "fds": 0, "rss_mib": 0.0}
        until_s = None
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            common.sample_process(proc.pid, peak)
            if until is not None and until_s is None:
                out.seek(0)
                if until(out.read().decode(errors="replace")):
                    until_s = time.perf_counter() - t0
                    proc.send_signal(signal.SIGINT)
            if time.perf_counter() - t0 > timeout:
                proc.kill()
            time.sleep(0.02)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read().decode(errors="replace")
    # wait4's rusage covers the process and the children it waited for (none of ddpfab's matter)
    peak.pop("cpu_s", None)
    return {"wall": wall, "rc": proc.returncode, "out": text, "cpu_s": ru.ru_utime + ru.ru_stime,
            "maxrss_mib": ru.ru_maxrss / 1024, "until_s": until_s, **peak}


class Bench:
    def __init__(self, lab, work: Path, sizes: tuple[int, ...]):
        self.lab = lab
        self.inv = {n: common.write_inventory(lab, common.names(n), work / f"inventory{n}.yml") for n in sizes}

    def argv_env(self, tool: str, n: int) -> tuple[list[str], dict]:
        inv = str(self.inv[n])
        if tool == "ddpfab exec":
            return [PYTHON, "-m", "ddpfab", "exec", "-i", inv, "--no-color", "--", "hostname"], common.env_with()
        if tool == "pdsh":
            return ["pdsh", "-w", common.pdsh_hosts(n), "hostname"], common.pdsh_env(self.lab)
        if tool == "ddpfab check":
            return [PYTHON, "-m", "ddpfab", "check", "--fast", "-i", inv], common.env_with()
        if tool.startswith("ddpfab plan"):
            extra = ["--no-check"] if tool.endswith("--no-check") else []
            return [PYTHON, "-m", "ddpfab", "plan", "-i", inv, "--nproc-per-node", "1", *extra, SCRIPT], \
                common.env_with()
        raise ValueError(tool)

    def once(self, tool: str, n: int) -> dict:
        argv, env = self.argv_env(tool, n)
        res = sample_run(argv, env)
        if tool in ("ddpfab exec", "pdsh"):
            ok = res["rc"] == 0 and {int(x) for x in common.HOSTNAME_RE.findall(res["out"])} >= set(range(1, n + 1))
        elif tool == "ddpfab check":
            ok = res["rc"] == 0 and f"all checks passed on {n} nodes" in res["out"]
        else:
            ok = res["rc"] == 0
        if not ok:
            raise RuntimeError(f"{tool} on {n} hosts failed (exit {res['rc']}):\n{res['out'][-3000:]}")
        return res


def other_commands(b: Bench, n: int, work: Path) -> list[dict]:
    """plan --emit, sync (cold, then no change) and ps once on *n* hosts, with the controller sampled."""
    project = work / "project"
    if not (project / ".git").exists():
        project.mkdir(parents=True, exist_ok=True)
        for i in range(20):
            (project / f"mod{i}.py").write_text(f"X = {i}\n" * 200)
        subprocess.run(["git", "init", "-q"], cwd=project, check=True)
        subprocess.run(["git", "add", "."], cwd=project, check=True)
        subprocess.run(["git", "-c", "user.email=b@b", "-c", "user.name=b", "commit", "-qm", "p"], cwd=project,
                       check=True)
    inv_opt = common.write_inventory(b.lab, common.names(n), work / f"inventory{n}-opt.yml",
                                     ddpfab_workdir="/opt/ddpfab-bench-scale")
    # a dir of its own each time: --emit refuses a non-empty dir ddpfab did not write (an earlier run's)
    emit = Path(tempfile.mkdtemp(prefix="emit-", dir=work)) / "scripts"
    base = [PYTHON, "-m", "ddpfab"]
    steps = [("plan --emit", [*base, "plan", "-i", str(b.inv[n]), "--nproc-per-node", "1", "--emit", str(emit), SCRIPT]),
             ("sync (first)", [*base, "sync", "-i", str(inv_opt), str(project)]),
             ("sync (no change)", [*base, "sync", "-i", str(inv_opt), str(project)]),
             ("ps", [*base, "ps", "-i", str(b.inv[n]), "--runs-dir", str(work / "runs")])]
    out = []
    for name, argv in steps:
        res = sample_run(argv, common.env_with())
        if res["rc"] != 0:
            raise RuntimeError(f"{name} on {n} hosts failed (exit {res['rc']}):\n{res['out'][-3000:]}")
        if name == "plan --emit":
            assert len(list(emit.glob("node*.sh"))) == n, "plan --emit wrote one script per node"
        out.append({"command": name, "hosts": n, "wall": round(res["wall"], 3), "output_lines": len(res["out"].splitlines()),
                    **{k: (round(res[k], 2) if isinstance(res[k], float) else res[k])
                       for k in ("cpu_s", "threads", "fds", "rss_mib")}})
        log(f"{name} on {n} hosts: {out[-1]}")
    return out


def main() -> int:
    parser = common.base_parser("scale", __doc__, reps=3, quick_reps=1)
    parser.add_argument("--sizes", help="comma-separated host counts (default 8,32,64,128; --quick 8,32)")
    parser.add_argument("--no-commands", action="store_true", help="skip plan --emit / sync / ps at max(N)")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of: " + ", ".join(PARTS))
    parser.add_argument("--torch-sizes", help="host counts of the real run and the detached job's commands "
                        "(default: the sizes >= 64, else the largest)")
    parser.add_argument("--cap", type=float, default=30.0, help="teardown: seconds counted as '> cap' (default 30)")
    args = parser.parse_args()
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    reps, meta, started = common.begin(args)
    sizes = common.sizes_of(args, SIZES, QUICK_SIZES)
    work = common.WORK_ROOT / "scale"
    work.mkdir(parents=True, exist_ok=True)
    samples: dict[str, dict[int, list[dict]]] = {}
    from ddpfab import lab as labmod

    lab_dir = common.WORK_ROOT / "scale" / "lab"
    if labmod.Lab.load(lab_dir) is not None:
        labmod.down(lab_dir)
    t0 = time.monotonic()
    # (the hosts see the work dir: the torch parts' scripts and READY markers live there)
    lab, _ = labmod.up(lab_dir, hosts=max(sizes), subnet=args.subnet, python=PYTHON, share=[common.WORK_ROOT])
    lab_up_s = time.monotonic() - t0
    lab_mem_mib = lab_pss_mib(lab)
    lab_id = labmod.lab_id(lab_dir)
    log(f"lab of {max(sizes)} hosts up in {lab_up_s:.1f} s, ~{lab_mem_mib:.0f} MiB ({args.subnet})")
    torch_sizes = (tuple(int(x) for x in args.torch_sizes.split(",")) if args.torch_sizes
                   else tuple(n for n in sizes if n >= 64) or (max(sizes),))
    torch_parts: dict[str, list] = {}
    try:
        b = Bench(lab, work, sizes)
        if "fanout" in parts:
            log("warm-up: one untimed run of each tool")
            for tool in TOOLS:
                b.once(tool, min(sizes))
        for rep in range(reps if "fanout" in parts else 0):
            for i, n in enumerate(sizes):
                k = (rep + i) % len(TOOLS)
                for tool in TOOLS[k:] + TOOLS[:k]:
                    samples.setdefault(tool, {}).setdefault(n, []).append(b.once(tool, n))
                log(f"rep {rep + 1}/{reps} N={n}: " + "  ".join(
                    f"{t}={samples[t][n][-1]['wall']:.2f}" for t in TOOLS))
        commands = []
        if not args.no_commands and "other" in parts:
            try:
                commands = other_commands(b, max(sizes), work)
            except Exception as exc:  # noqa: BLE001 - recorded in the result; the fan-out figures still count
                log(f"part other failed: {exc}")
                torch_parts.setdefault("errors", {})["other"] = str(exc)[-3000:]
        # a part that fails is recorded as such; the others' figures still count
        for part, measure in (
                ("teardown", lambda: scale_torch.crash_teardown(lab, work / "torch", sizes, args.cap,
                                                                light_sizes=torch_sizes)),
                ("run", lambda: scale_torch.real_run(lab, work / "torch", torch_sizes)),
                ("jobs", lambda: scale_torch.detached_commands(lab, work / "torch", torch_sizes, sample_run))):
            if part not in parts:
                continue
            try:
                torch_parts[part] = measure()
            except Exception as exc:  # noqa: BLE001 - recorded in the result, shown by the report
                log(f"part {part} failed: {exc}")
                torch_parts.setdefault("errors", {})[part] = str(exc)[-3000:]
    finally:
        t0 = time.monotonic()
        labmod.down(lab_dir)
        lab_down_s = time.monotonic() - t0
    netns_left = [ln for ln in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
                  if f"ddpfab-{lab_id}-" in ln]
    leftovers = {"netns": len(netns_left), "bridge": Path(f"/sys/class/net/dfb{lab_id}").exists(),
                 "store": Path(labmod.STORE_ROOT / lab_id).exists()}
    log(f"lab down in {lab_down_s:.1f} s; left: {leftovers}")

    series = []
    for tool, per_n in samples.items():
        for n, runs in sorted(per_n.items()):
            s = {"tool": tool, "hosts": n, **common.summarize([r["wall"] for r in runs])}
            if tool.startswith("ddpfab"):
                s["controller"] = {k: max(r[k] for r in runs) for k in ("threads", "fds", "rss_mib", "maxrss_mib")}
                s["controller"]["cpu_s"] = common.summarize([r["cpu_s"] for r in runs])["median"]
            series.append(s)
    config = {"sizes": list(sizes), "tools": list(TOOLS), "pdsh_fanout": 32, "script": SCRIPT,
              "parts": sorted(parts), "torch_sizes": list(torch_sizes), "teardown_cap_s": args.cap,
              "teardown_job": scale_torch.teardown.JOB, "run_job": scale_torch.GLOO, "detached_job": scale_torch.LIGHT, "standin_torchrun": scale_torch.STANDIN_RUN,
              "light_crash_job": scale_torch.LIGHT_CRASH,
              "fd_limit": list(__import__("resource").getrlimit(__import__("resource").RLIMIT_NOFILE))}
    lab_info = {"hosts": max(sizes), "up_s": round(lab_up_s, 2), "down_s": round(lab_down_s, 2),
                "mem_mib": round(lab_mem_mib), "leftovers": leftovers}
    common.write_result(args.out, "scale", args, config, {"series": series, "lab": lab_info, "commands": commands, **torch_parts}, meta, started)
    for s in series:
        extra = f"  controller {s['controller']}" if "controller" in s else ""
        log(f"{s['tool']:<24} N={s['hosts']:<3} {common.fmt(s)}{extra}")
    return 0 if not any(leftovers.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
