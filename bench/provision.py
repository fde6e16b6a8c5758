#!/usr/bin/env python3
"""Provisioning: wall time of the idempotent re-run of playbooks/provision.yml on 4 lab hosts.

    .venv/bin/python bench/provision.py            # 1 first run + 3 re-runs per variant (~5 min on 2 idle cores)
    .venv/bin/python bench/provision.py --quick    # 1 first run + 1 re-run per variant

First `ddpfab provision -i INV` takes the 4 fresh hosts to "ready to train" (timed once, torch
venv included; the inventory sets ddpfab_python_pip_compile: false as tests/lab/test_provision.py
does). Then, interleaved, the re-run that must change nothing (changed=0 checked on every host):
  ddpfab provision              python -m ddpfab provision -i INV: the project's ansible.cfg
  ansible-playbook (project)    the same ansible-playbook argv and env, without the ddpfab wrapper
  ansible-playbook (defaults)   the same with ANSIBLE_CONFIG pointing to an empty file, i.e.
                                Ansible's defaults (only ANSIBLE_ROLES_PATH set, or the roles
                                are not found at all)
Every re-run is cold: the ControlPersist masters a previous run left to these hosts are closed
first. Writes bench/results/provision.json.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common
from common import PYTHON, REPO, log

HOSTS = 4
VARIANTS = ("ddpfab provision", "ansible-playbook (project cfg)", "ansible-playbook (defaults)")
TIMEOUT = 1200


def run_variant(variant: str, inv: Path, empty_cfg: Path) -> tuple[float, dict, str]:
    from ddpfab.remote import provision

    if variant == "ddpfab provision":
        argv, env = [PYTHON, "-m", "ddpfab", "provision", "-i", str(inv)], common.env_with()
    else:
        argv = provision.build_command(inv, "provision")
        env = provision.ansible_env(color=False)
        if variant == "ansible-playbook (defaults)":
            env["ANSIBLE_CONFIG"] = str(empty_cfg)
            env["ANSIBLE_ROLES_PATH"] = str(REPO / "roles")
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                            stdin=subprocess.DEVNULL, errors="replace")
    lines: list[tuple[float, str]] = []
    try:
        for line in proc.stdout:
            lines.append((time.perf_counter() - t0, line))
        rc = proc.wait(timeout=TIMEOUT)
    finally:
        common.stop_process(proc)
    elapsed = time.perf_counter() - t0
    out = "".join(line for _, line in lines)
    recap = {h.host: h.counts for h in provision.parse_recap(out)}
    if rc != 0 or len(recap) != HOSTS or any(c.get("failed") or c.get("unreachable") for c in recap.values()):
        raise RuntimeError(f"{variant} failed (exit {rc}):\n{out[-4000:]}")
    return elapsed, recap, out, task_times(lines, elapsed)


def task_times(lines: list[tuple[float, str]], end: float) -> list[tuple[str, float]]:
    """Wall time per task (all hosts together): from its TASK header to the next header (or to
    the PLAY RECAP, for the last task)."""
    marks = []
    for t, line in lines:
        if line.startswith(("TASK [", "RUNNING HANDLER [")):
            marks.append((t, line.split("[", 1)[1].rsplit("]", 1)[0]))
        elif line.startswith("PLAY RECAP"):
            marks.append((t, None))
    out = []
    for i, (t, name) in enumerate(marks):
        if name is None:
            continue
        nxt = marks[i + 1][0] if i + 1 < len(marks) else end
        out.append((name, nxt - t))
    return out


def slowest(tasks: list[tuple[str, float]], top: int = 10) -> list[dict]:
    """The *top* slowest tasks (a task name can repeat: role include, loops); plus the total count."""
    ranked = sorted(tasks, key=lambda kv: -kv[1])[:top]
    return [{"task": name, "seconds": round(t, 2)} for name, t in ranked] + [{"task": "(tasks)", "seconds": len(tasks)}]


def main() -> int:
    parser = common.base_parser("provision", __doc__, reps=2, quick_reps=1)
    parser.add_argument("--variants", default="ddpfab provision,ansible-playbook (defaults)",
                        help="comma-separated subset of: " + ", ".join(VARIANTS))
    args = parser.parse_args()
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}")
    reps, meta, started = common.begin(args)
    work = common.WORK_ROOT / "provision"
    work.mkdir(parents=True, exist_ok=True)
    empty_cfg = work / "empty-ansible.cfg"
    empty_cfg.write_text("")
    samples: dict[str, list[float]] = {}
    changed: dict[str, list[dict]] = {}
    task_samples: dict[str, list[list[tuple[str, float]]]] = {}
    first = None
    with common.bench_lab("provision", HOSTS, args.subnet) as lab:
        inv = common.write_inventory(lab, common.names(HOSTS), work / "inventory.yml", ddpfab_python_pip_compile=False)
        log("first run: ddpfab provision on fresh hosts (torch venv included)")
        t, recap, out, tasks = run_variant("ddpfab provision", inv, empty_cfg)
        (work / "first-run.log").write_text(out)
        first = {"seconds": round(t, 2), "changed": {h: c.get("changed") for h, c in recap.items()},
                 "slowest_tasks": slowest(tasks)}
        log(f"first run {t:.1f} s, changed per host: {first['changed']}")
        for rep in range(reps):
            k = rep % len(variants)
            for variant in variants[k:] + variants[:k]:
                common.close_control_masters(lab)
                t, recap, out, tasks = run_variant(variant, inv, empty_cfg)
                task_samples.setdefault(variant, []).append(tasks)
                ch = {h: c.get("changed", 0) for h, c in recap.items()}
                if any(ch.values()):
                    (work / "not-idempotent.log").write_text(out)
                    log(f"WARNING: {variant} re-run changed something: {ch} (log: {work / 'not-idempotent.log'})")
                samples.setdefault(variant, []).append(t)
                changed.setdefault(variant, []).append(ch)
                log(f"rep {rep + 1}/{reps} {variant:<30} {t:.1f} s")
        common.close_control_masters(lab)
    series = [{"tool": v, "hosts": HOSTS, **common.summarize(s), "changed": changed[v],
               "slowest_tasks": slowest(task_samples[v][-1])} for v, s in samples.items()]
    config = {"hosts": HOSTS, "playbook": "playbooks/provision.yml", "inventory_vars": {"ddpfab_python_pip_compile": False},
              "variants": list(variants)}
    common.write_result(args.out, "provision", args, config, {"series": series, "first_run": first}, meta, started)
    for s in series:
        log(f"{s['tool']:<30} {common.fmt(s)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
