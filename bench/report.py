#!/usr/bin/env python3
"""Regenerate docs/benchmarks.md and docs/bench-*.png from bench/results/*.json, and the figures
README.md and docs/*.md quote from them (behind `<!-- bench:KEY -->` markers, bench/markers.py).

    .venv/bin/python bench/report.py

Needs no root and no lab; the plots need matplotlib (`.venv/bin/pip install matplotlib`), without
it the markdown is still written (and says the plots are missing).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import markers
from common import BUSY_LIMIT, REPO, RESULTS, fmt
from markers import Figure

DOCS = REPO / "docs"
DOC = DOCS / "benchmarks.md"
FANOUT_ORDER = ("ddpfab exec", "pdsh", "ssh loop", "ansible", "ansible (warm)", "ddpfab startup",
                "ddpfab exec (held)", "in-process cold", "in-process warm")
FANOUT_LABEL = {
    "ddpfab exec": "`ddpfab exec`",
    "pdsh": "`pdsh -R ssh`",
    "ssh loop": "sequential `ssh` loop",
    "ansible": "`ansible -m command` (cold)",
    "ansible (warm)": "`ansible -m command` (warm ControlPersist)",
    "ddpfab startup": "ddpfab startup only (imports + inventory, no SSH)",
    "ddpfab exec (held)": "`ddpfab exec` over `ddpfab hold`'s connections",
    "in-process cold": "in-process `ssh.connect` + `ssh.run` (no startup)",
    "in-process warm": "in-process `ssh.run` on open connections (what a warm pool would give)",
}
LAUNCH_ORDER = ("ddpfab run", "ddpfab run --no-check", "ddpfab run --no-sync", "pdsh + torchrun", "torchrun (local)")
TEARDOWN_ORDER = ("ddpfab run", "pdsh + torchrun", "torchrun alone")
#: the launch target: what ddpfab adds to a torchrun on the same hosts, at 8 hosts (seconds)
LAUNCH_TARGET_S = 0.5
#: bench/launch.py's isolated cost of loading an inventory through Ansible (its `micro` key)
INVENTORY_PARSE = "ddpfab.inventory.load(inventory) (Ansible parses it)"
COLORS = {"ddpfab exec": "C0", "ddpfab run": "C0", "ddpfab run --no-check": "C9", "ddpfab run --no-sync": "C4",
          "pdsh": "C1",
          "pdsh + torchrun": "C1", "ssh loop": "C3", "ansible": "C2", "ansible (warm)": "C8",
          "ddpfab startup": "C7", "in-process cold": "C4", "in-process warm": "C6", "torchrun (local)": "C5",
          "torchrun alone": "C5", "ddpfab check": "C3", "ddpfab plan": "C4", "ddpfab plan --no-check": "C2"}


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if data.get("series") and "hosts" not in data["series"][0]:
        return None  # an older format
    return data


def get(data: dict | None, tool: str, hosts: int, **match) -> dict | None:
    if not data:
        return None
    for s in data["series"]:
        if s["tool"] == tool and s["hosts"] == hosts and all(s.get(k) == v for k, v in match.items()):
            return s
    return None


def med(stat: dict | None) -> float | None:
    return stat.get("median") if stat else None


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "n/a"
    return f"{a / b:.2f}x"


def noisy(meta: dict) -> bool:
    if meta.get("quick"):
        return True
    if "busy_before" in meta:  # other work on the CPUs just before the start
        return meta["busy_before"] > BUSY_LIMIT
    return meta.get("loadavg_start", [0])[0] > 0.5 * (meta.get("cpus") or 1)


def describe(name: str, data: dict) -> str:
    m = data["meta"]
    flag = " **NOISY: taken on a busy machine or with --quick; not for conclusions.**" if noisy(m) else ""
    busy = (f"CPUs {100 * m['busy_before']:.0f}% busy with other work in the 3 s before the start, "
            if "busy_before" in m else "")
    return (f"_{name}: {m['date']}, git {m.get('git')}, {m['reps']} repetition(s){' (--quick)' if m['quick'] else ''}, "
            f"{busy}load average {m['loadavg_start'][0]:.1f} at start / {m['loadavg_end'][0]:.1f} at end on "
            f"{m['cpus']} CPUs, {m['duration_s']:.0f} s._{flag}")


# -- plots -------------------------------------------------------------------------------------
def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _line(ax, data, tool, label=None, style="-", scenario=None, cap=None):
    match = {"scenario": scenario} if scenario else {}
    pts = sorted((s["hosts"], s) for s in data["series"] if s["tool"] == tool
                 and all(s.get(k) == v for k, v in match.items()))
    if not pts:
        return
    xs, ys, lo, hi, capped_x = [], [], [], [], []
    for n, s in pts:
        if s.get("median") is None:
            capped_x.append(n)
            continue
        xs.append(n)
        ys.append(s["median"])
        lo.append(s["median"] - (s["min"] if s["min"] is not None else s["median"]))
        hi.append((s["max"] if s["max"] is not None else (cap or s["median"])) - s["median"])
    color = COLORS.get(tool)
    if xs:
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt=style + "o", color=color, label=label or tool, capsize=3, ms=4)
    if capped_x and cap:
        ax.scatter(capped_x, [cap] * len(capped_x), marker="^", s=60, color=color,
                   label=f"{label or tool}: > {cap:g} s (cap)")


def plot_fanout(data, plt) -> str | None:
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for tool in FANOUT_ORDER:
        style = "--" if tool.startswith("in-process") else (":" if tool == "ddpfab startup" else "-")
        _line(ax, data, tool, label=tool, style=style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = data["config"]["sizes"]
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("hosts")
    ax.set_ylabel("seconds (median, bars: min-max)")
    ax.set_title("Fan-out: `hostname` on N lab hosts, end to end")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    return _save(fig, plt, "bench-fanout.png")


def plot_launch(data, plt) -> str | None:
    before = load("launch-main")
    rows = [r for r in compare_launch(data, before)
            if "until it starts" in r[0] or "own steps" in r[0] or "on the nodes" in r[0]]
    if before and noisy(before["meta"]) != noisy(data["meta"]):  # not a pair (see before_after)
        rows = []
    if rows:
        fig, (ax, ax2, ax3) = plt.subplots(1, 3, figsize=(19, 4.5), gridspec_kw={"width_ratios": [1.1, 1, 1]})
        labels = [r[0].split(",")[0].replace("`", "").replace("the run's own steps before it starts the nodes",
                                                                "own steps").replace(
            "of them on the nodes: code check + probe + mesh (+ the node program's start)", "on the nodes")
            for r in rows]
        xs = range(len(rows))
        ax3.bar([x - 0.2 for x in xs], [r[1] or 0 for r in rows], width=0.4, label="before (main)", color="C7")
        ax3.bar([x + 0.2 for x in xs], [r[2] or 0 for r in rows], width=0.4, label="after (one node program)",
                color="C2")
        ax3.set_xticks(list(xs), labels, fontsize=6, rotation=15)
        ax3.set_ylabel("seconds (median)")
        ax3.set_title("Before the nodes start: before vs after")
        ax3.legend(fontsize=7)
        ax3.grid(True, axis="y", alpha=0.3)
    else:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [1.1, 1]})
    for tool in LAUNCH_ORDER:
        _line(ax, data, tool)
    sizes = data["config"]["sizes"]
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("hosts (1 process each)")
    ax.set_ylabel("seconds to every rank's first line")
    ax.set_title("Launch: start -> every rank printed")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    phases = data.get("phases") or []
    if phases:
        steps = [s["step"] for s in phases[0]["steps"]]
        bottom = [0.0] * len(phases)
        xs = [str(p["hosts"]) for p in phases]
        for i, step in enumerate(steps):
            vals = [max(0.0, p["steps"][i]["seconds"]) for p in phases]
            ax2.bar(xs, vals, bottom=bottom, label=step, color=f"C{i % 10}")
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax2.set_xlabel("hosts")
        ax2.set_ylabel("seconds")
        ax2.set_title("One `ddpfab run`, by step")
        ax2.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax2.set_visible(False)
    return _save(fig, plt, "bench-launch.png")


def plot_teardown(data, plt) -> str | None:
    cap = data["config"]["cap_s"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, scenario, title in zip(axes, ("crash", "sigint"), ("after a rank crashes", "after Ctrl-C")):
        for tool in TEARDOWN_ORDER:
            _line(ax, data, tool, scenario=scenario, cap=cap)
        ax.axhline(2.0, color="grey", ls="--", lw=1, label="target: 2 s")
        _log_hosts_axes(ax, data["config"]["sizes"], "hosts (1 process each)", f"Last job process gone {title}")
    axes[0].set_ylabel("seconds (log)")
    return _save(fig, plt, "bench-teardown.png")


def _log_hosts_axes(ax, sizes, xlabel: str, title: str) -> None:
    """Hosts on x (one tick per size), seconds on a log y axis, grid and legend."""
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def plot_provision(data, plt) -> str | None:
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    rows = [(s["tool"] + " (re-run)", s) for s in data["series"]]
    labels = [r[0] for r in rows]
    vals = [r[1]["median"] for r in rows]
    err = [[v - r[1]["min"] for v, r in zip(vals, rows)], [r[1]["max"] - v for v, r in zip(vals, rows)]]
    if data.get("first_run"):
        labels.append("ddpfab provision (first run)")
        vals.append(data["first_run"]["seconds"])
        err[0].append(0)
        err[1].append(0)
    ax.barh(labels, vals, xerr=err, color=["C0", "C2", "C1", "C7"][:len(vals)], capsize=3)
    ax.set_xlabel("seconds (median, bars: min-max)")
    ax.set_title(f"playbooks/provision.yml on {data['config']['hosts']} lab hosts")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    return _save(fig, plt, "bench-provision.png")


SCALE_TOOLS = ("ddpfab exec", "pdsh", "ddpfab check", "ddpfab plan", "ddpfab plan --no-check")


def plot_scale(data, plt) -> str | None:
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for tool in SCALE_TOOLS:
        _line(ax, data, tool, label=tool, style="--" if tool == "pdsh" else "-")
    sizes = data["config"]["sizes"]
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("hosts")
    ax.set_ylabel("seconds (median, bars: min-max)")
    ax.set_title("Scale: commands on N lab hosts (all on one 2-core machine)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    return _save(fig, plt, "bench-scale.png")


def plot_scale_torch(data, plt) -> str | None:
    """Teardown after a crash against N (the torch job: ddpfab run, pdsh + torchrun; the stand-in
    job: ddpfab run), and the detached job's commands at each size."""
    rows = [r for r in data.get("teardown") or [] if "skipped" not in r]
    jobs = data.get("jobs") or []
    if not rows and not jobs:
        return None
    cap = data["config"].get("teardown_cap_s", 30)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.4))
    for (tool, job), style, color in ((("ddpfab run", "torch"), "-o", "C0"), (("pdsh + torchrun", "torch"), "--s", "C1"),
                                      (("ddpfab run", "stand-in"), ":^", "C2")):
        pts = sorted((r["hosts"], r["gone"]) for r in rows if r["tool"] == tool and r["job"] == job)
        if pts:  # a run beyond the cap is drawn at the cap
            ax.plot([n for n, _ in pts], [g if g is not None else cap for _, g in pts], style, color=color,
                    label=f"{tool} ({job} job)")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    _log_hosts_axes(ax, sorted({r["hosts"] for r in rows}) or [8], "hosts", "Teardown after a rank crash")
    ax.set_ylabel(f"seconds, crash -> last job process gone (cap {cap:g} s)")
    names = [c for c in ("run --detach", "ps", "logs", "attach", "stop") if any(j["command"] == c for j in jobs)]
    sizes_j = sorted({j["hosts"] for j in jobs})
    width = 0.8 / max(1, len(sizes_j))
    for k, n in enumerate(sizes_j):
        vals = [next((j["wall"] for j in jobs if j["command"] == c and j["hosts"] == n), 0) for c in names]
        bx.bar([i + k * width for i in range(len(names))], vals, width, label=f"N={n}", color=f"C{k}")
    bx.set_xticks([i + width * (len(sizes_j) - 1) / 2 for i in range(len(names))], names)
    bx.set_ylabel("seconds, spawn -> exit")
    bx.set_title("A detached job's commands (stand-in job)")
    bx.grid(True, axis="y", alpha=0.3)
    bx.legend(fontsize=7)
    return _save(fig, plt, "bench-scale-torch.png")


def _save(fig, plt, name: str) -> str:
    fig.tight_layout()
    fig.savefig(DOCS / name, dpi=110)
    plt.close(fig)
    return name


# -- markdown ------------------------------------------------------------------------------------
def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out + [""]


def fanout_section(data, plots) -> tuple[list[str], dict]:
    lines = ["## 1. Fan-out latency (`bench/fanout.py`)", ""]
    if not data:
        return lines + ["Not run yet: `.venv/bin/python bench/fanout.py`.", ""], {}
    sizes = data["config"]["sizes"]
    lines += [describe("fanout", data), "",
              "`hostname` on N hosts, wall time from spawning the command to its exit (its output checked: "
              "every host answered). Every tool opens fresh SSH connections (ansible's ControlPersist "
              "masters are closed before its cold run). Median (min-max) in seconds.", ""]
    rows = []
    for tool in FANOUT_ORDER:
        if any(get(data, tool, n) for n in sizes):
            rows.append([FANOUT_LABEL.get(tool, tool)] + [fmt(get(data, tool, n)) for n in sizes])
    lines += table(["tool"] + [f"N={n}" for n in sizes], rows)
    d = {n: med(get(data, "ddpfab exec", n)) for n in sizes}
    ratio_rows = [
        ["ddpfab exec / pdsh (target <= 1.2)"] + [ratio(d[n], med(get(data, "pdsh", n))) for n in sizes],
        ["ssh loop / ddpfab exec (target >= 5)"] + [ratio(med(get(data, "ssh loop", n)), d[n]) for n in sizes],
        ["ansible / ddpfab exec (target >= 5)"] + [ratio(med(get(data, "ansible", n)), d[n]) for n in sizes],
        ["ansible warm / ddpfab exec"] + [ratio(med(get(data, "ansible (warm)", n)), d[n]) for n in sizes],
        ["ddpfab exec / in-process warm"] + [ratio(d[n], med(get(data, "in-process warm", n))) for n in sizes],
    ]
    lines += ["Ratios of medians, same run:", ""] + table(["ratio"] + [f"N={n}" for n in sizes], ratio_rows)
    if "bench-fanout.png" in plots:
        lines += ["![fan-out latency vs hosts](bench-fanout.png)", ""]
    lines += ["Caveat for the ratios against the sequential loop and Ansible: on this lab the client and all N "
              "sshd's share the machine's CPUs, and an SSH connection is mostly CPU on both ends (key exchange, "
              "authentication, a session and a shell). A parallel tool can therefore overlap only as many "
              "connections as there are cores, while the loop pays the same CPU plus its waits; on real hosts "
              "(each sshd on its own machine, real network round trips) the parallel tools' advantage grows with N "
              "and the loop's cost grows linearly, so the lab understates the ratio against the loop. Ansible's cost "
              "is mostly controller CPU (a forked worker and a packaged Python module per host, a Python start on "
              "each host), so for it the lab is closer to what real hosts would show.", ""]
    big, small = max(sizes), min(sizes)
    growth = {t: ratio(med(get(data, t, big)), med(get(data, t, small))) for t in ("ddpfab exec", "pdsh", "ssh loop")}
    lines += [f"Growth from {small} to {big} hosts (median at {big} / median at {small}): "
              + ", ".join(f"{t} {g}" for t, g in growth.items()) + ".", ""]
    cpu = {c["hosts"]: c["median"] for c in data.get("controller_cpu") or []}
    cold_big = med(get(data, "in-process cold", big))
    if cpu.get(big) and cold_big:
        lines += [f"What grows with N here is CPU, not waiting: the in-process cold run on {big} hosts takes "
                  f"{cold_big:.2f} s of wall time, of which the controller's own CPU (this process: paramiko's "
                  f"handshakes, host-key checks, sessions) is {cpu[big]:.2f} s, {1000 * cpu[big] / big:.1f} ms per "
                  f"host; the rest is the {big} sshd's (fork, re-exec, key exchange, a shell) queueing for the same "
                  "2 cores. On real hosts each sshd has its own machine, so ddpfab's time grows by about the "
                  f"controller's {1000 * cpu[big] / big:.1f} ms per host.", ""]
    startup = med(get(data, "ddpfab startup", big))
    cold = med(get(data, "in-process cold", big))
    warm = med(get(data, "in-process warm", big))
    if startup and cold and d.get(big):
        lines += [f"Where `ddpfab exec`'s {d[big]:.2f} s on {big} hosts go: {startup:.2f} s before any SSH "
                  f"(interpreter, imports, the inventory), {cold:.2f} s to connect (host keys "
                  f"verified) and run on all hosts at once in-process; on connections already open the same "
                  f"command takes {warm:.2f} s. A persistent connection pool (ddpfab has none) would save "
                  f"about {cold - warm:.2f} s per command at {big} hosts. "
                  "Profile: `bench/results/fanout-profile.txt`.", ""]
    targets = {}
    if d.get(big):
        targets["fanout_pdsh"] = (d[big] / med(get(data, "pdsh", big))) if get(data, "pdsh", big) else None
        targets["fanout_loop"] = (med(get(data, "ssh loop", big)) / d[big]) if get(data, "ssh loop", big) else None
        targets["fanout_ansible"] = (med(get(data, "ansible", big)) / d[big]) if get(data, "ansible", big) else None
        targets["fanout_growth"] = d[big] / d[small] if d.get(small) else None
        targets["fanout_growth_pdsh"] = (med(get(data, "pdsh", big)) / med(get(data, "pdsh", small))
                                         if get(data, "pdsh", big) and get(data, "pdsh", small) else None)
        targets["fanout_n"] = big
    return lines, targets


def own_steps(phase: dict) -> float:
    """The run's own steps before it starts the nodes, from one phase breakdown (seconds)."""
    return sum(st["seconds"] for st in phase["steps"] if not st["step"].startswith(("run record", "first ->", "other")))


def node_steps(phase: dict) -> float:
    """The steps that ask the nodes before they start (code check, probe, mesh; the node program's
    start), from one phase breakdown (seconds): what the one node program changes."""
    return sum(st["seconds"] for st in phase["steps"]
               if st["step"].startswith(("code sync", "probe", "preflight", "start the node program")))


def compare_launch(after, before) -> list[tuple[str, float | None, float | None]]:
    """(what, before, after) at the largest N both measured: medians, seconds."""
    if not after or not before:
        return []
    common_n = sorted(set(after["config"]["sizes"]) & set(before["config"]["sizes"]))
    if not common_n:
        return []
    n = common_n[-1]
    ov = {d: {o["hosts"]: o for o in x.get("overhead", [])}.get(n, {}) for d, x in (("a", after), ("b", before))}
    ph = {d: next((p for p in x.get("phases") or [] if p["hosts"] == n), None) for d, x in (("a", after), ("b", before))}
    rows = [(f"ddpfab run - pdsh + torchrun at N={n} (target <= 0.5 s)",
             (ov["b"].get("vs_pdsh_torchrun") or {}).get("median"), (ov["a"].get("vs_pdsh_torchrun") or {}).get("median")),
            (f"ddpfab run --no-check - pdsh + torchrun at N={n}", (ov["b"].get("no_check_vs_pdsh_torchrun") or {}).get("median"),
             (ov["a"].get("no_check_vs_pdsh_torchrun") or {}).get("median")),
            (f"the run's own steps before it starts the nodes, N={n} (phase breakdown)",
             own_steps(ph["b"]) if ph["b"] else None, own_steps(ph["a"]) if ph["a"] else None),
            (f"of them on the nodes: code check + probe + mesh (+ the node program's start), N={n}",
             node_steps(ph["b"]) if ph["b"] else None, node_steps(ph["a"]) if ph["a"] else None)]
    for tool in ("ddpfab run", "ddpfab run --no-check", "ddpfab run --no-sync"):
        rows.append((f"`{tool}`: until it starts the nodes, N={n}", med(get(before, f"{tool}: prepared", n)),
                     med(get(after, f"{tool}: prepared", n))))
    rows += [(f"`ddpfab run` to every rank's line, N={n}", med(get(before, "ddpfab run", n)), med(get(after, "ddpfab run", n))),
             (f"pdsh + torchrun to every rank's line, N={n}", med(get(before, "pdsh + torchrun", n)),
              med(get(after, "pdsh + torchrun", n)))]
    return rows


def before_after(after, before) -> list[str]:
    """The launch before (main, `bench/results/launch-main.json`) and after this change, same session."""
    rows = compare_launch(after, before)
    if not rows:
        return []
    m = before["meta"]
    if noisy(m) != noisy(after["meta"]):  # a loaded run against a quiet one says nothing about the change
        return [f"(The before of the node-program change, `bench/results/launch-main.json` (git "
                f"{m.get('git', '?')}), was taken {'on a busy machine' if noisy(m) else 'on a quiet machine'} "
                f"and this run {'on a busy one' if noisy(after['meta']) else 'on a quiet one'}: not a pair to "
                "compare. In the session where both ran loaded, the nodes' part before the start went from "
                "10.66 s to 5.21 s at N=8 (this page's git history, 2026-11-30).)", ""]

    def rel(b, a):
        return f"{a / b:.2f}x" if a is not None and b and b > 0 and a > 0 else "n/a"

    lines = ["Before (main, one python program per node operation: tree hash, probe, mesh; three python starts "
             "per node before the supervisor's) and after (one node program per node, `ddpfab/node/`: hash, facts "
             "and mesh listen in one round trip of one session, then mesh connect in the same session; one python "
             "start per node before the supervisor's), measured in the same session, the two benchmarks side by "
             "side on the same loaded machine. Medians, seconds; the ratio is after/before (a difference's ratio "
             "only where both are positive).", "", describe("launch-main (before)", before), ""]
    lines += table(["measure", "before (main)", "after", "after/before"],
                   [[what, "n/a" if b is None else f"{b:.2f}", "n/a" if a is None else f"{a:.2f}", rel(b, a)]
                    for what, b, a in rows])
    lines += [f"(before: git {m.get('git', '?')}; the differences to pdsh + torchrun are medians of "
              "per-repetition differences; with every run near a minute here, their spread is far above the "
              "0.5 s target: the phase breakdown and the \"until it starts the nodes\" times carry the change.)", ""]
    return lines


def launch_section(data, plots) -> tuple[list[str], dict]:
    lines = ["## 2. Launch overhead (`bench/launch.py`)", ""]
    if not data:
        return lines + ["Not run yet: `.venv/bin/python bench/launch.py`.", ""], {}
    sizes = data["config"]["sizes"]
    lines += [describe("launch", data), "",
              "From spawning the launcher to the last rank's first line on its stdout; 1 process per host; "
              "the script prints one line right after `import torch` and exits (no process group). "
              "Median (min-max) in seconds.", ""]
    rows = []
    present = [t for t in LAUNCH_ORDER if any(get(data, t, n) for n in sizes)]
    for tool in present:
        rows.append([f"`{tool}`" if "ddpfab" in tool else tool] + [fmt(get(data, tool, n)) for n in sizes])
    for tool in present:
        if "ddpfab" in tool:
            rows.append([f"(`{tool}`: until it starts the nodes)"]
                        + [fmt(get(data, f"{tool}: prepared", n)) for n in sizes])
    lines += table(["launcher"] + [f"N={n}" for n in sizes], rows)

    def p(o, key):
        v = o.get(key) or {}
        return f"{v['median']:+.2f} s ({v['min']:+.2f}..{v['max']:+.2f})" if v.get("median") is not None else "n/a"

    ov = {o["hosts"]: o for o in data.get("overhead", [])}
    lines += ["What ddpfab adds: median of the per-repetition differences (drift cancelled), seconds.", ""]
    lines += table(["difference"] + [f"N={n}" for n in sizes], [
        ["ddpfab run - torchrun (local)  (target < 0.5 s at N=8)"] + [p(ov[n], "vs_local_torchrun") for n in sizes],
        ["ddpfab run --no-check - torchrun (local)"] + [p(ov[n], "no_check_vs_local_torchrun") for n in sizes],
        ["pdsh + torchrun - torchrun (local): N hosts sharing this machine's CPUs"]
        + [p(ov[n], "pdsh_torchrun_vs_local") for n in sizes],
        ["ddpfab run - pdsh + torchrun: same hosts, same contention"] + [p(ov[n], "vs_pdsh_torchrun") for n in sizes],
        ["ddpfab run --no-check - pdsh + torchrun"] + [p(ov[n], "no_check_vs_pdsh_torchrun") for n in sizes],
        ["preflight mesh check: ddpfab run - ddpfab run --no-check"] + [p(ov[n], "preflight_check") for n in sizes],
    ] + ([
        ["ddpfab run --no-sync - torchrun (local)"] + [p(ov[n], "no_sync_vs_local_torchrun") for n in sizes],
        ["ddpfab run --no-sync - pdsh + torchrun"] + [p(ov[n], "no_sync_vs_pdsh_torchrun") for n in sizes],
        ["code sync: ddpfab run - ddpfab run --no-sync"] + [p(ov[n], "code_sync") for n in sizes],
    ] if any("code_sync" in ov[n] for n in sizes) else []))
    lines += ["On this lab every host is a namespace on the same 2 CPUs: N hosts importing torch at once "
              "(torchrun, then its worker, on every host) take longer than one, whoever starts them. The local "
              "single-host torchrun is the baseline the target names; `pdsh + torchrun` starts the very same "
              "torchrun commands on the same N hosts with the least an SSH fan-out can do, so "
              "`ddpfab run - pdsh + torchrun` is what ddpfab itself adds under the same contention. On real "
              "machines (one host per box) the contention term vanishes and the two baselines converge.", ""]
    lines += before_after(data, load("launch-main"))
    if "bench-launch.png" in plots:
        lines += ["![launch time vs hosts, one run by step, and before/after](bench-launch.png)", ""]
    phases = data.get("phases") or []
    if phases:
        steps = [s["step"] for s in phases[0]["steps"]]
        lines += ["One `ddpfab run` by step (the CLI run in-process with timers around each step; one run per N, "
                  "seconds):", ""]
        lines += table(["step"] + [f"N={ph['hosts']}" for ph in phases],
                       [[st] + [f"{ph['steps'][i]['seconds']:.2f}" for ph in phases] for i, st in enumerate(steps)]
                       + [["**total to every rank's line**"] + [f"**{ph['ready']:.2f}**" for ph in phases]])
    targets = {}
    n8 = 8 if 8 in ov else max(ov) if ov else None
    if n8:
        targets["launch_n"] = n8
        targets["launch_local"] = (ov[n8].get("vs_local_torchrun") or {}).get("median")
        targets["launch_pdsh"] = (ov[n8].get("vs_pdsh_torchrun") or {}).get("median")
        targets["launch_nocheck_pdsh"] = (ov[n8].get("no_check_vs_pdsh_torchrun") or {}).get("median")
        targets["launch_nosync_local"] = (ov[n8].get("no_sync_vs_local_torchrun") or {}).get("median")
        targets["launch_sync"] = (ov[n8].get("code_sync") or {}).get("median")
        targets["launch_pdsh_local"] = (ov[n8].get("pdsh_torchrun_vs_local") or {}).get("median")
        ph = next((p for p in phases if p["hosts"] == n8), None)
        if ph:
            targets["launch_own"] = sum(st["seconds"] for st in ph["steps"]
                                        if not st["step"].startswith(("run record", "first ->", "other")))
    return lines, targets


def profile_section(launch, fanout) -> list[str]:
    lines = ["## What ddpfab's own time is made of, what was cut, what is left", ""]
    if not launch or not launch.get("phases"):
        return lines + ["Run `bench/launch.py` (without --no-profile) for the phase breakdown and profiles.", ""]
    ph = {p["hosts"]: {s["step"]: s["seconds"] for s in p["steps"]} for p in launch["phases"]}
    big = max(ph)
    own_steps = [k for k in ph[big] if not k.startswith(("run record", "first ->", "other"))]
    own = {n: sum(v for k, v in ph[n].items() if k in own_steps) for n in ph}
    mic = launch.get("micro") or {}

    def m(key: str) -> float | None:
        return next((v for k, v in mic.items() if k.startswith(key)), None)

    def s(x: float | None, spec: str = "{:.3f} s") -> str:
        return "n/a" if x is None else spec.format(x)

    sync_step = next((k for k in ph[big] if k.startswith("code sync")), None)
    lines += ["ddpfab's own serial work (every step before \"start nodes\" in the breakdown above): "
              + ", ".join(f"{own[n]:.2f} s at N={n}" for n in sorted(own))
              + ". After it the time is torchrun's and the script's (`import torch` twice per host) plus one "
              "supervisor start per node. Isolated costs are in the table at the end of this section (min of 5). "
              "Profiles: `bench/results/launch-profile.txt` (importtime, pyinstrument of one run), "
              "`bench/results/fanout-profile.txt`.", "",
              "Cut in this round (each measured; the earlier figures are from the previous run of these scripts, "
              "git a0c45be/4afe7e0, on a loaded machine):", "",
              f"1. **Nagle's algorithm off on every SSH connection** (`ddpfab/remote/sshopen.py:_socket`). paramiko leaves "
              f"it on, so each request written while a small packet is unacknowledged waits for the peer's "
              f"delayed ACK (40 ms on Linux): every session open and exec, and several handshake steps. "
              f"`ssh.run true` on an open connection: {s(m('ssh.run true (Nagle on'))} with Nagle on (paramiko's "
              f"default), {s(m('ssh.run true (open connection'))} with TCP_NODELAY.",
              "2. **No-copy code check before `run`** (`ddpfab/transfer/sync.py:unchanged`): the nodes' tree hashes are "
              "computed over the run's own SSH connections (one python per node); only when one differs does the "
              "full sync start (OpenSSH masters, rsync, verification). "
              + (f"The step now takes {', '.join(f'{ph[n][sync_step]:.2f} s at N={n}' for n in sorted(ph))} "
                 "(was 0.68 s at N=2, 1.78 s at N=8)." if sync_step else ""),
              "7. **One node program, one session per node for the whole preparation** (`ddpfab/node/`): the "
              "probe's facts, the code's tree hash and the preflight's mesh listeners are operations of one "
              "stdlib-only program with one request/response protocol (framed JSON on stdin, one JSON reply per "
              "request), started once per node; facts and listeners are sent the moment it starts, the hash "
              "follows on the same session, so all three are answered in one round trip, and the mesh connects "
              "in the same session. Before, each was a python program of its own per node (three starts per node "
              "before the supervisor's, each with its own protocol); the nodes' part before the start went from 10.66 s to 5.21 s at N=8 (measured loaded, section 2).",
              f"3. **The parsed inventory is cached** (`ddpfab/hosts/invcache.py`): Ansible still parses it, but its "
              f"answer is reused while every file it read, the Ansible settings and versions are unchanged (never "
              f"for templated, script or plugin inventories). `inventory.load` in a fresh process: "
              f"{s(m('ddpfab.inventory.load(inventory) (Ansible'))} parsed by Ansible, "
              f"{s(m('ddpfab.inventory.load(inventory) (cached'))} from the cache; every command that reads an "
              "inventory gains the difference.",
              f"4. **The probe starts no processes** (`ddpfab/health/probe.py`, the `routes` part and the torch version): "
              f"the interface towards each peer comes from the kernel's source-address choice (a UDP `connect()`, "
              f"nothing sent) mapped to the interface holding that address, instead of one `ip route get` per "
              f"peer (N-1 processes per node: {s(m('ssh.run 31 x ip -o route get'))} for 31 peers, one round trip "
              f"included), and torch's version from `torch/version.py` instead of importlib.metadata (20+ ms). "
              f"One node's probe with 7 peers now: {s(m('probe.probe_node on one node'))}.",
              "5. **The supervisor watches torchrun's workers** (`ddpfab/node/agent.py:watch_workers`): see the "
              "teardown section.",
              "6. **Lab hosts start with a distribution's root dotfiles** (`ddpfab/lab/__init__.py`), not the "
              "controller's: bash sources `~/.bashrc` for every SSH command, and this machine's has a pyenv "
              "init that cost about 0.09 s of CPU per command (measured once: `ssh.run true` 0.093 s before, "
              "0.003 s after), on every tool alike. It was the largest term of every fan-out number before. "
              "A real cluster with a `conda init` in `~/.bashrc` pays the same per command, whatever the tool.",
              "",
              "Left, and why:", "",
              f"- **Imports**: paramiko (with cryptography) {s(m('import paramiko'))} of every command; fabric on "
              f"top of it {s((m('import fabric') or 0) - (m('import paramiko') or 0), '{:+.3f} s')}. ddpfab uses "
              "Fabric's Connection only as a holder of a paramiko client; dropping it would save that difference.",
              f"- **Building the parser imports every subcommand's module** ({s(m('ddpfab.cli.build_parser()'))} "
              f"vs {s(m('import ddpfab.cli'))} for the bare CLI module), but `run` and `exec` need those imports "
              f"anyway: `build_parser()` + `import ddpfab.runner` {s(m('build_parser() then import ddpfab.runner'))}, "
              f"`import ddpfab.runner` alone {s(m('import ddpfab.runner'))}. A lazy parser would help only the "
              "light subcommands (`lab`, `plan --offline`).",
              f"- **Two python starts per node** (the node program for the preparation, then the supervisor), "
              f"{s((m('ssh.run python -c pass') or 0) - (m('ssh.run true (open connection') or 0))} each over an "
              f"exec, plus reading and compiling the node program: "
              f"{s(m('node program: start'))} for a start, the program and one request, against "
              f"{s(m('ssh.run python -c pass'))} for `python -c pass`. Since 2026-12-07 an attached cold run "
              "has one: the supervisor is the preparation's program, given a last `supervise` request on its "
              "session (a failed preparation still closes every session; the program lets go of the probe's "
              "listeners and reservations first: docs/design.md, \"Start-up costs\"). On 8 lab hosts, 12 runs "
              "each (`bench/warm.py`, one session before and one after): the last torchrun started 0.21 s after "
              "pdsh's (paired median), 0.40 s before. Over `ddpfab hold` the preparation's program is one the "
              "holder started ahead, before any run id, so a warm run still starts its supervisors in sessions "
              "of their own.",
          ]
    if fanout:
        big_f = max(fanout["config"]["sizes"])
        cold = med(get(fanout, "in-process cold", big_f))
        warm = med(get(fanout, "in-process warm", big_f))
        if cold and warm:
            lines.append(f"- **Connections per command** (`ddpfab/remote/ssh.py:connect`, once per host per "
                         f"command): on {big_f} hosts connect + run takes {cold:.2f} s in-process, run on open "
                         f"connections {warm:.2f} s. `ddpfab hold` (a process of the user holding them, in the "
                         "spirit of ssh's ControlMaster) saves the difference per `exec`; `run` reuses its own "
                         "connections from the code check to the job; every other command that reaches nodes "
                         "uses the holder's too (section 9).")
    lines += ["", "Not worth cutting: the plan (milliseconds), the run record, and the supervisor itself "
              "(the node program on stdin; its cost is one python start per node).", ""]
    if mic:
        lines += ["Isolated costs (min of 5 runs; local = a fresh python on the controller, ssh.run = on an "
                  "already open connection to a lab host):", ""]
        lines += table(["what", "seconds"], [[k, f"{v:.3f}"] for k, v in mic.items()])
    return lines


def teardown_section(data, plots) -> tuple[list[str], dict]:
    lines = ["## 3. Teardown (`bench/teardown.py`)", ""]
    if not data:
        return lines + ["Not run yet: `.venv/bin/python bench/teardown.py`.", ""], {}
    sizes = data["config"]["sizes"]
    cap = data["config"]["cap_s"]
    lines += [describe("teardown", data), "",
              f"From the crash (the crashed rank's process gone from /proc) or the Ctrl-C, to the last process "
              f"of the job gone from every host's process table. gloo process group, 1 process per host, the "
              f"others inside `all_reduce`. Capped at {cap:g} s (\"> cap\": still there, then killed; not "
              "repeated). Median (min-max) in seconds.", ""]
    rows = []
    for scenario in ("crash", "sigint"):
        for tool in TEARDOWN_ORDER:
            if any(get(data, tool, n, scenario=scenario) for n in sizes):
                rows.append([f"{scenario}: {tool}"] + [fmt(get(data, tool, n, scenario=scenario)) for n in sizes])
    lines += table(["scenario: launcher"] + [f"N={n}" for n in sizes], rows)
    exits = []
    for scenario in ("crash", "sigint"):
        for tool in TEARDOWN_ORDER:
            cells = []
            for n in sizes:
                s = get(data, tool, n, scenario=scenario)
                cells.append(fmt(s.get("launcher_exit")) if s else "n/a")
            if any(c != "n/a" for c in cells):
                exits.append([f"{scenario}: {tool}"] + cells)
    tr = []
    for scenario in ("crash", "sigint"):
        st = [get(data, "ddpfab run", n, scenario=scenario) for n in sizes]
        if any(x and x.get("training_gone") for x in st):
            tr.append([f"{scenario}: ddpfab run"] + [fmt(x.get("training_gone")) if x else "n/a" for x in st])
    st = [get(data, "ddpfab run", n, scenario="crash") for n in sizes]
    if any(x and x.get("noticed") for x in st):
        tr.append(["crash: ddpfab noticed the failed node (its \"stopping the other nodes\" line)"]
                  + [fmt(x.get("noticed")) if x and x.get("noticed") else "n/a" for x in st])
    if tr:
        lines += ["ddpfab in detail (same t=0): when torchrun and its workers were gone (only ddpfab's supervisors, "
                  "finishing their records, left), and when ddpfab noticed the failed node:", ""]
        lines += table(["scenario: launcher"] + [f"N={n}" for n in sizes], tr)
    lines += ["When the launcher itself returned (same t=0; \"> cap\": still running):", ""]
    lines += table(["scenario: launcher"] + [f"N={n}" for n in sizes], exits)
    last_rows = []
    for scenario in ("crash", "sigint"):
        for tool in TEARDOWN_ORDER:
            counts: dict[str, int] = {}
            for n in sizes:
                one = get(data, tool, n, scenario=scenario)
                for last in (one or {}).get("last_to_go") or []:
                    for kind in {x.split(":", 1)[1] for x in last}:
                        counts[kind] = counts.get(kind, 0) + 1
            if counts:
                last_rows.append([f"{scenario}: {tool}", ", ".join(f"{k} ({v})" for k, v in sorted(counts.items()))])
    if last_rows:
        lines += ["Which processes were the last to go (kinds still present at the last poll before the end; "
                  "in how many runs):", ""]
        lines += table(["scenario: launcher", "last to go"], last_rows)
    st = [get(data, "ddpfab run", n, scenario="crash") for n in sizes]
    noticed = [x.get("noticed") for x in st if x and x.get("noticed") and x["noticed"].get("median") is not None]
    if noticed and len(noticed) == len(st) and all(x.get("median") is not None for x in st):
        worst = max(range(len(st)), key=lambda i: st[i]["median"])
        nt, total = st[worst]["noticed"]["median"], st[worst]["median"]
        lines += [f"Where ddpfab's crash teardown goes (N={sizes[worst]}, the slowest median): {nt:.2f} s until "
                  f"ddpfab hears of the failure, {total - nt:.2f} s from there to the last process gone. The "
                  "supervisor on the failed node watches torchrun's workers through pidfds "
                  "(`ddpfab/node/agent.py:watch_workers`, on with `--max-restarts 0`, the default): the moment a worker "
                  "exits with an error (its status read from its zombie before torchrun reaps it) it waits 0.25 s "
                  "(`TAIL_SETTLE`: torchrun's `--tee` relays the worker's last lines, its traceback, every 0.1 s), "
                  "then ends the node's job tree (TERM, KILL after `FAST_GRACE` = 0.1 s) instead of waiting for "
                  "torchrun's own shutdown with torch loaded (0.7 s on an idle machine, more under load: most of "
                  "the 1.8-2.0 s measured before this change, git a0c45be). The other nodes' workers fail on their "
                  "own when gloo sees the peer gone and their supervisors do the same; ddpfab's fast stop (`!` to "
                  "every supervisor) is what ends peers that would hang instead (NCCL).", ""]
    lines += ["How to read it: with gloo on TCP a dead peer closes its sockets, so the other ranks' "
              "`all_reduce` fails within moments and plain torchrun launches also end soon after a crash; the "
              "difference is who cleans up. ddpfab's supervisor ends each node's whole process tree as soon as one "
              "node fails. After a Ctrl-C, pdsh drops its ssh clients and the remote torchruns (no terminal, "
              "nothing printed) train on as orphans; a Ctrl-C in one node's terminal ends that node, and the "
              "others follow only when gloo notices. With NCCL over InfiniBand/RoCE a dead peer is usually "
              "*not* noticed until the collective timeout (10-30 min by default): the case the supervisor "
              "exists for, not reproducible with gloo on this lab.", ""]
    if "bench-teardown.png" in plots:
        lines += ["![teardown vs hosts](bench-teardown.png)", ""]
    targets = {}
    crash = [get(data, "ddpfab run", n, scenario="crash") for n in sizes]
    if all(crash):
        targets["teardown_worst_median"] = max((c["median"] if c["median"] is not None else float("inf")) for c in crash)
        targets["teardown_worst_sample"] = max((x if x is not None else float("inf")) for c in crash for x in c["samples"])
    return lines, targets


def provision_section(data, plots) -> list[str]:
    lines = ["## 4. Provisioning (`bench/provision.py`)", ""]
    if not data:
        return lines + ["Not run yet: `.venv/bin/python bench/provision.py` (needs playbooks/ and roles/ to work).", ""]
    lines += [describe("provision", data), "",
              f"`playbooks/provision.yml` on {data['config']['hosts']} lab hosts. First run: fresh hosts to ready "
              "(torch venv from the local wheel mirror, `ddpfab_python_pip_compile: false`). Re-run: nothing to "
              "change (changed=0 checked on every host), cold SSH (ControlPersist masters closed before each run). "
              "\"defaults\" = `ANSIBLE_CONFIG` pointing to an empty file (only `ANSIBLE_ROLES_PATH` set): no "
              "pipelining, forks 5, Ansible's default ssh_args.", ""]
    rows = []
    fr = data.get("first_run")
    if fr:
        rows.append(["`ddpfab provision`, first run", f"{fr['seconds']:.1f} s", "-"])
    base = med(get(data, "ddpfab provision", data["config"]["hosts"]))
    for s in data["series"]:
        rows.append([f"`{s['tool']}`, re-run", fmt(s), ratio(s["median"], base)])
    lines += table(["what", "median (min-max)", "vs ddpfab provision re-run"], rows)
    slow = next((s.get("slowest_tasks") for s in data["series"] if s["tool"] == "ddpfab provision"), None)
    if slow:
        count = next((t["seconds"] for t in slow if t["task"] == "(tasks)"), None)
        lines += [f"Slowest tasks of one `ddpfab provision` re-run ({count} task headers; wall time from a task's "
                  "header to the next, all hosts together):", ""]
        lines += table(["task", "s"], [[t["task"].replace("|", "/"), f"{t['seconds']:.2f}"]
                                       for t in slow if t["task"] != "(tasks)"])
    if "bench-provision.png" in plots:
        lines += ["![provisioning times](bench-provision.png)", ""]
    return lines


def recovery_section(data) -> list[str]:
    lines = ["## 5. Recovery onto a spare (`bench/recovery.py`)", ""]
    if not data:
        return lines + ["Not run yet: `.venv/bin/python bench/recovery.py`.", ""]
    s = data["summary"]
    lines += [describe("recovery", data), "",
              "node1 + node2 train (gloo, one process each, a checkpoint every 0.3 s step in a shared dir, "
              "`ddpfab.dist.save_checkpoint`/`resume`), node3 stands by in the inventory group `spares`; "
              "`ddpfab run --max-job-restarts 1 --spares spares`, the code synced to a workdir under /opt, so the "
              "spare receives it during the recovery. t=0: node2's link is cut (`ip link set <veth> down`) after "
              "step 3. No other tool recovers onto another machine, so the comparison is with a person who "
              "noticed: the same job cold-started on node1 + node3 with `ddpfab run` (code already there), "
              "launch to first step.", ""]
    base = med(s.get("cold_start_to_first_step"))
    rows = [
        ["loss -> first step of the restarted job (the whole recovery)", fmt(s.get("loss_to_first_step")),
         ratio(med(s.get("loss_to_first_step")), base)],
        ["  of which: loss -> detected (keepalives unanswered for 5 s)", fmt(s.get("loss_to_detected")), ""],
        ["  of which: detected -> next attempt started (health check, re-plan, sync to the spare, probe, "
         "preflight; manifest `recovery_s`)", fmt(s.get("recovery_s")), ""],
        ["  of which: attempt started -> first step (torchrun, import torch, rendezvous, resume)",
         fmt(s.get("attempt_start_to_first_step")), ""],
        ["cold start by hand on the new set: launch -> first step", fmt(s.get("cold_start_to_first_step")), "1.00x"],
    ]
    lines += table(["what", "median (min-max)", "vs cold start"], rows)
    return lines


def leases_section(data) -> list[str]:
    """`bench/leases.py`: release of a lease -> the next waiting job's start; leasing's cost on a launch."""
    lines = ["## 6. GPU leases and the queue (`bench/leases.py`)", ""]
    if not data:
        return lines + ["Not run yet: `.venv/bin/python bench/leases.py`.", ""]
    res, over = data["results"], data["overhead_vs_no_lease"]
    lines += [describe("leases", data), "",
              "One lab of 8 hosts with 4 stand-in GPUs each (the leases are the real lease sockets). **Release -> start**: "
              "a plain process holds every GPU lease of node1 and node2, a `ddpfab run --wait --gpus-per-node 4` "
              "queues behind it; t=0 just before the holder lets go (it closes its lease files and exits). "
              "**Leasing's cost**: `ddpfab run` of a script that exits at once on all 8 hosts, spawn to exit, "
              "without a GPU lease (`--gpus-per-node 0`, the same lab and probe) against a lease per node, "
              "and a lease per node with `--wait` (tickets and the two-phase go), interleaved per repetition.", ""]
    rows = [["release -> the waiting job's go on its last node (`leased GPU` seen by ddpfab)",
             fmt(res["release -> go"]), ""],
            ["release -> its script's first statement on its last node (after torchrun's start)",
             fmt(res["release -> script start"]), ""]]
    for name, stat in res.items():
        if name.startswith("release"):
            continue
        o = over.get(name)
        rows.append([f"launch on 8 hosts, {name}", fmt(stat),
                     f"{o['delta_s']:+.2f} s ({o['ratio']:.2f}x)" if o else "baseline"])
    return lines + table(["what", "median (min-max)", "vs no lease"], rows)


def preflight_section(dataplane, resources) -> list[str]:
    """`bench/preflight_dataplane.py` and `bench/preflight_resources.py`: what issue 25's preflight
    checks add to `check --fast` (what `ddpfab run` runs before a launch), before and after."""
    lines = ["## 7. The preflight's checks (`bench/preflight_dataplane.py`, `bench/preflight_resources.py`)", ""]
    if not dataplane and not resources:
        return lines + ["Not run yet: `.venv/bin/python bench/preflight_dataplane.py`, "
                        "`.venv/bin/python bench/preflight_resources.py`.", ""]
    if dataplane:
        lines += ["### The data plane (bulk transfers across a path-MTU black hole, the advertised address)", "",
                  describe("preflight_dataplane", dataplane), "",
                  "`ddpfab check --fast` before (the tree without them) and after the bulk transfers (256 KiB "
                  "from each node to its ring neighbour and to the master, answered with as many bytes back) and "
                  "the advertised-address connects, interleaved on one lab. Median (min-max); the mesh phase "
                  "holds the new probes.", ""]
        rows = []
        for n in sorted(dataplane["table"], key=int):
            row = dataplane["table"][n]
            before, after = row["before"], row["after"]
            delta = med(after) - med(before)
            rows.append([n, fmt(before), fmt(after), f"{delta:+.2f} s ({med(after) / med(before):.2f}x)",
                         f"{med(row['before_mesh']):.2f} s", f"{med(row['after_mesh']):.2f} s"])
        lines += table(["hosts", "before", "after", "added", "mesh before", "mesh after"], rows)
    if resources:
        lines += ["### The node's resources (/dev/shm, free space, limits, memory, left-overs)", "",
                  describe("preflight_resources", resources), "",
                  "`ddpfab plan` (the whole preflight) and `ddpfab check --fast`, base tree against this one, "
                  "interleaved on one lab. Median (min-max).", ""]
        by = {(s["tool"], s["hosts"]): s for s in resources["series"]}
        rows = []
        for n in resources["config"]["sizes"]:
            for what in ("plan", "check"):
                base, this = by.get((f"{what} (base)", n)), by.get((f"{what} ({'this'})", n))
                if base and this:
                    rows.append([str(n), what, fmt(base), fmt(this), f"{med(this) / med(base):.2f}x"])
        lines += table(["hosts", "command", "base", "with the resource checks", "ratio"], rows)
        node = (resources.get("node_side_ms") or {}).get("res_facts")
        if node:
            lines += [f"The node side of the resource facts: {node['median']:.2f} ms median over {node['runs']} "
                      "calls on this machine.", ""]
    return lines


def hang_section(data) -> list[str]:
    """`bench/hang.py`: from a rank stopped with SIGSTOP to the first message that says something is wrong."""
    lines = ["## 8. A stopped rank: time to the first word (`bench/hang.py`)", ""]
    if not data:
        return lines + ["Not run yet: `.venv/bin/python bench/hang.py`.", ""]
    c = data["config"]
    lines += [describe("hang", data), "",
              f"A gloo job ({c['nproc_per_node']} process per host, an all_reduce every 50 ms) on the lab; t=0 "
              "is the SIGSTOP of the last rank; t ends at the first line the launcher prints that is not the "
              f"job's own progress. `ddpfab run --hang-timeout {c['hang_timeout_s']} --on-hang stop` against "
              "pdsh + torchrun and torchrun alone, whose first word is the ranks' collective timeout error: "
              f"the job's process group timeout is **{c['pg_timeout_s']:g} s** for every launcher (a user's "
              "default is 30 minutes for gloo, 10 for NCCL; no benchmark waits that long). A launcher silent "
              f"until {c['cap_s']:g} s counts as \"> cap\".", ""]
    rows = []
    for srow in sorted(data["series"], key=lambda x: (x["hosts"], c["launchers"].index(x["tool"])
                                                      if x["tool"] in c["launchers"] else 99)):
        verdict = fmt(srow["verdict"]) if srow.get("verdict") else ""
        rows.append([str(srow["hosts"]), srow["tool"], fmt(srow), verdict])
    return lines + table(["hosts", "launcher", "first message after the stop", "the verdict naming the rank"], rows)


def held_section(data) -> tuple[list[str], dict]:
    """`bench/warm.py`: `ddpfab run` and `check --fast` over `ddpfab hold`'s connections, beside
    the same commands cold and pdsh + torchrun."""
    lines = ["## 9. Every command on held connections (`bench/warm.py`)", ""]
    if not data:
        return lines + ["Not run yet: `.venv/bin/python bench/warm.py`.", ""], {}
    c, comp = data["config"], data["comparisons"]
    lines += [describe("warm", data), "",
              "Each command from process spawn: `ddpfab run` to every rank's first line (the job prints one "
              "line after `import torch`), `check --fast` to its exit; warm with `ddpfab hold` running for the "
              "inventory, cold with a copy of it (no holder), in alternating order within each repetition, each "
              "once the CPUs are quiet (what the command before left running has ended); after a warm-up of one "
              "warm check per size, which gives the holder its spares (each node's program started ahead of the "
              "next check: `ddpfab.remote.spares`). On this lab every node's work (its sshd, its python, its "
              "`import torch`) shares the controller's 2 cores: what a holder cannot save (a run's supervisor "
              "start on each node, the check's data-plane probe) weighs as much as the handshakes it saves. "
              "Each run's timeline says where its difference to pdsh arises: `torchrun started` (the last node's "
              "torchrun, by /proc) is ddpfab's own steps before the nodes start; `rank printed` adds the ranks' "
              "start, where what else runs on the shared cores (a supervisor per node, the holder, the "
              "controller) slows their `import torch`; the rest is the line's way back (torchrun's `--tee` "
              "polls each rank's log file every 0.1 s). Median (min-max), seconds.", ""]
    lines += table(["command", "time"], [[r["what"], fmt(r)] for r in data["series"]])
    lines += [f"- {k}: {compared(v, '{:.3f}' if ' / ' in k else '{:+.2f} s')}" for k, v in comp.items()]
    lines += ["", "A goal is met when the 95 % confidence interval of the median (order statistics of the "
              "paired differences or ratios, one pair a repetition) lies within it, not met when it lies outside, "
              "and not settled when it straddles the goal: more repetitions narrow it.", ""]
    run_n, checks = c["run_hosts"], c["check_hosts"]
    big = max(checks)
    return lines, {"held_n": run_n, "held_run_pdsh": as_estimate(comp.get(f"run warm - pdsh+torchrun, {run_n} hosts (s)")),
                   "held_cold_pdsh": as_estimate(comp.get(f"run cold - pdsh+torchrun, {run_n} hosts (s)")),
                   "held_check_n": big, "held_check_ratio": as_estimate(comp.get(f"check --fast warm / cold, {big} hosts"))}


def run_cpu_section(data) -> list[str]:
    """`bench/run_cpu.py`: where a run's CPU goes, ddpfab's (warm, cold) beside pdsh + torchrun's."""
    lines = ["### Where a run's CPU goes (`bench/run_cpu.py`)", ""]
    if not data:
        return lines + ["Not run yet: `.venv/bin/python bench/run_cpu.py`.", ""]
    cmds, n, cores = data["commands"], data["config"]["hosts"], data["config"]["cores"]
    labels = list(cmds)
    kinds = sorted({k for c in cmds.values() for k in c["kinds"]})
    lines += [describe("run_cpu", data), "",
              f"The same commands and job on {n} hosts, each process's CPU-seconds from the kernel's process "
              "accounting (from the command's start to 3 s after its exit), by what it is: the controller's "
              "processes are the launcher and those below it; a node's that mapped torch is a torchrun, or a "
              "rank when its parent did too. Median over the repetitions, CPU-seconds.", ""]
    rows = [[k] + [f"{cmds[c]['kinds'].get(k, 0.0):.2f}" for c in labels] for k in kinds]
    rows.append(["**all**"] + [f"**{cmds[c]['total']:.2f}**" for c in labels])
    lines += table(["process", *labels], rows)

    def own(c: str) -> float:  # what the launcher adds to torchrun and its ranks
        return sum(v for k, v in cmds[c]["kinds"].items() if k not in ("node: rank", "node: torchrun"))

    pdsh = next((c for c in labels if c.startswith("pdsh")), None)
    if pdsh:
        lines += ["", "Besides torchrun and its ranks, each launcher's own CPU: " + ", ".join(
            f"{c} {own(c):.2f} CPU-s" for c in labels) + f". On {cores} cores shared by every node a CPU-second "
            f"a launcher adds while the ranks start is 1/{cores} s of the time to their first line: "
            + ", ".join(f"{c} {(own(c) - own(pdsh)) / cores:+.2f} s" for c in labels if c != pdsh)
            + " against pdsh + torchrun. (The ranks' own CPU differs too: ddpfab's exit guard ends a "
            "finished rank with `os._exit`, skipping torch's interpreter teardown, which pdsh's ranks pay "
            "after their first line.) On real machines each node's share runs on that node's own CPUs, "
            "beside the others': only the launcher's share adds up. What the paired times of this section add "
            "beyond this is the latency of ddpfab's steps before the nodes start (section 2), while the cores "
            "are not full yet."]
    return lines + [""]


def as_estimate(v) -> dict | None:
    """A comparison of bench/results/warm.json as {median, ci95}: a dict (with its interval where
    the benchmark recorded one), or a bare median (results written before intervals were)."""
    if isinstance(v, dict):
        return v or None
    return None if v is None else {"median": v}


def compared(v, spec: str) -> str:
    e = as_estimate(v)
    if e is None:
        return "n/a"
    text = spec.format(e["median"])
    if "min" in e:
        text += f" (min {spec.format(e['min'])}, max {spec.format(e['max'])}"
        text += (f"; 95 % interval of the median {spec.format(e['ci95'][0])} to {spec.format(e['ci95'][1])}, "
                 f"{e['runs']} pairs)" if e.get("ci95") else f", {e['runs']} pairs)")
    return text


def warm_section(data) -> tuple[list[str], dict]:
    """`bench/fanout.py --sizes 128 --out fanout-128.json`: the fan-out at the moonshot's size, cold
    and on connections already open (in-process), against pdsh."""
    if not data:
        return [], {}
    n = max(data["config"]["sizes"])
    pdsh = med(get(data, "pdsh", n))
    tools = [tool for tool in FANOUT_ORDER if get(data, tool, n)]
    lines = [f"### The fan-out at {n} hosts, cold and warm (`bench/fanout.py --sizes {n}`)", "",
             describe("fanout-128", data), "",
             "The moonshot's figure: the same `hostname` on connections a process already holds open "
             "(`in-process warm`: `ssh.run` over open connections), against pdsh opening fresh ones. Median "
             "(min-max) in seconds, and each tool's time over pdsh's.", ""]
    lines += table(["tool", f"N={n}", "/ pdsh"], [[FANOUT_LABEL.get(t, t), fmt(get(data, t, n)),
                                                 ratio(med(get(data, t, n)), pdsh)] for t in tools])
    warm, cold = med(get(data, "in-process warm", n)), med(get(data, "in-process cold", n))
    held = med(get(data, "ddpfab exec (held)", n))
    return lines, {"warm_n": n, "warm_pdsh": warm / pdsh if warm and pdsh else None,
                   "cold_pdsh": cold / pdsh if cold and pdsh else None,
                   "held_pdsh": held / pdsh if held and pdsh else None}


def scale_section(data, plots) -> tuple[list[str], dict]:
    lines = ["## Scale: 8 to 128 hosts (`bench/scale.py`)", ""]
    if not data:
        return lines + ["Not run yet: `.venv/bin/python bench/scale.py`.", ""], {}
    sizes = data["config"]["sizes"]
    lines += [describe("scale", data), "",
              "Each command as a user types it, on N hosts of one lab, wall time from spawn to exit (output "
              "checked). `ddpfab plan` runs every step `run` takes before a node starts (connect, probe, the "
              "preflight mesh, the plan); pdsh has no such steps and no data-plane check, so its `hostname` "
              "is the floor any of them could reach (one SSH fan-out). Median (min-max) in seconds.", ""]
    rows = [[tool] + [fmt(get(data, tool, n)) for n in sizes] for tool in SCALE_TOOLS
            if any(get(data, tool, n) for n in sizes)]
    rows.append(["ddpfab exec / pdsh"] + [ratio(med(get(data, "ddpfab exec", n)), med(get(data, "pdsh", n)))
                                          for n in sizes])
    rows.append(["ddpfab check / pdsh"] + [ratio(med(get(data, "ddpfab check", n)), med(get(data, "pdsh", n)))
                                           for n in sizes])
    lines += table(["command"] + [f"N={n}" for n in sizes], rows)
    if "bench-scale.png" in plots:
        lines += ["![scale](bench-scale.png)", ""]
    big = max(sizes)
    crow = []
    for tool in SCALE_TOOLS:
        c = (get(data, tool, big) or {}).get("controller")
        if c:
            crow.append([tool, f"{c['cpu_s']:.2f} s", str(c["threads"]), str(c["fds"]), f"{c['rss_mib']:.0f} MiB"])
    lines += [f"The controller process at N={big} (peaks over the repetitions, sampled every 20 ms; CPU: "
              "median user+system seconds):", ""]
    lines += table(["command", "CPU", "threads", "open files", "resident memory"], crow)
    commands = data.get("commands") or (load("scale-commands") or {}).get("commands") or []
    if commands:
        lines += [f"The other commands that need no job, once at N={commands[0]['hosts']} (`sync`: a 20-file git "
                  "project into a workdir under /opt on every host):", ""]
        lines += table(["command", "wall", "output lines", "controller CPU", "threads", "open files", "memory"],
                       [[c["command"], f"{c['wall']:.2f} s", str(c["output_lines"]), f"{c['cpu_s']:.2f} s",
                         str(c["threads"]), str(c["fds"]), f"{c['rss_mib']:.0f} MiB"] for c in commands])
        if not data.get("jobs"):
            lines += ["`stop`, `attach` and `logs` need a running job, i.e. torch on every host: not measured at this "
                      "size (a torch worker holds ~0.3 GB; 128 do not fit in this machine's 24 GiB).", ""]
    at_big = [c for c in ([(get(data, t, big) or {}).get("controller") for t in SCALE_TOOLS] + commands
                          + [j for j in (data.get("jobs") or []) + ((load("scale-torch") or {}).get("jobs") or [])
                             if j["hosts"] == big]) if c]
    if at_big:
        lines += [f"Peaks over every command measured at N={big} ({len(at_big)} commands, the detached job's "
                  f"included): {max(c['threads'] for c in at_big)} threads, {max(c['fds'] for c in at_big)} open "
                  f"files, {max(c['rss_mib'] for c in at_big):.0f} MiB resident, "
                  f"{max(c['cpu_s'] for c in at_big):.1f} s of CPU.", ""]
    lines += ["Bounds, read from these figures and the code: threads = one paramiko transport thread per open "
              "connection + the fan-out window (64) + a few, so about N + 70 (~200 at 128), except `attach`, which "
              "follows every node at once: a thread per node on top, about 2N (257 at 128); open files = one "
              "socket per host + a few (the mesh probe polls its channels from one thread, no pipe per node; "
              "`sync` holds two pipes per rsync child); memory under 100 MiB. The controller's CPU (about 30 ms per "
              "host for `exec` in the run above) was mostly paramiko re-reading the shared known_hosts for every "
              "connection (each line parsed into a key and compared with every earlier one: N x N key parses); "
              "since issue 26 the file is parsed once per version (see the later run below), and what is left is "
              "mostly paramiko's SSH handshakes in Python, where pdsh spreads the same work "
              "over one C `ssh` process per host; on this 2-core machine every CPU second of the controller also "
              "competes with the N sshds it talks to, so the ratios to pdsh are for this lab, not a real cluster "
              "(where each sshd has its own machine).",
              ""]
    # the lab's memory is measured as its processes' PSS since the commands run (the first runs of
    # the script measured MemAvailable, which other work on the machine made meaningless)
    lab = data.get("lab") or (load("scale-commands") or {}).get("lab") or {}
    if lab:
        lines += [f"The lab itself: {lab['hosts']} hosts up in {lab['up_s']:.1f} s and down in {lab['down_s']:.1f} s "
                  f"{'on the loaded machine' if noisy(data['meta']) else 'on the quiet machine'}; the hosts' processes (init + sshd per host) took ~{lab['mem_mib']} MiB "
                  f"(their PSS; kernel memory for namespaces, veths and overlays not included); left after `down`: "
                  f"{'nothing' if not any(lab['leftovers'].values()) else lab['leftovers']}.", ""]
    torch_lines, t_torch = scale_torch_section(data, plots)
    lines += torch_lines
    # a later run of the same harness, fan-out part only (`--parts fanout --out scale-fanout.json`): the
    # commands' figures after a change, without re-running the hour of torch parts; the targets read it
    rerun = load("scale-fanout")
    if rerun:
        r_sizes = rerun["config"]["sizes"]
        lines += ["### The fan-out part again, later (`bench/scale.py --parts fanout`)", "", describe("scale-fanout", rerun),
                  "", "The commands above, re-measured after a change (the targets read these figures). Median "
                  "(min-max) in seconds; controller CPU: median user+system seconds.", ""]
        rows = [[tool] + [fmt(get(rerun, tool, n)) for n in r_sizes] for tool in SCALE_TOOLS
                if any(get(rerun, tool, n) for n in r_sizes)]
        rows += [[f"{tool} controller CPU"] + [f"{(get(rerun, tool, n) or {}).get('controller', {}).get('cpu_s', 0):.2f} s"
                                               for n in r_sizes] for tool in ("ddpfab exec", "ddpfab check")]
        for tool in ("ddpfab exec", "ddpfab check"):
            rows.append([f"{tool} / pdsh"] + [ratio(med(get(rerun, tool, n)), med(get(rerun, "pdsh", n)))
                                              for n in r_sizes])
        lines += table(["command"] + [f"N={n}" for n in r_sizes], rows)
    latest, top = (rerun, max(rerun["config"]["sizes"])) if rerun else (data, big)
    t = {**t_torch, "scale_n": top,
         "scale_exec_pdsh": (med(get(latest, "ddpfab exec", top)) / med(get(latest, "pdsh", top)))
         if med(get(latest, "ddpfab exec", top)) and med(get(latest, "pdsh", top)) else None,
         "scale_check_64": med(get(latest, "ddpfab check", 64))}
    p_lo, p_hi = med(get(data, "ddpfab plan", min(sizes))), med(get(data, "ddpfab plan", big))
    if p_lo and p_hi:
        t["scale_plan_growth"] = (p_hi / p_lo, big / min(sizes))
    return lines, t


def scale_torch_section(data, plots) -> tuple[list[str], dict]:
    """bench/scale_torch.py's parts of the scale run: teardown after a crash, a real run, the
    detached job's commands."""
    lines: list[str] = []
    t: dict = {}
    cap = data["config"].get("teardown_cap_s", 30)
    # later invocations of the same harness: the jobs part again after a fix (scale-torch), the
    # torch teardown at 64 once the machine had the memory free (scale-torch64); marked * and **
    for mark, name in (("*", "scale-torch"), ("**", "scale-torch64")):
        more = load(name)
        if not more:
            continue
        data = dict(data)
        keys = {"teardown": lambda r: (r.get("tool"), r["hosts"], r.get("job")), "run": lambda r: r["hosts"],
                "jobs": lambda r: (r["command"], r["hosts"])}
        for part, key in keys.items():
            done = [r for r in more.get(part) or [] if "skipped" not in r]
            have = {key(r) for r in done}
            data[part] = [r for r in data.get(part) or [] if key(r) not in have] + [dict(r, later=mark) for r in done]
        if more.get("jobs") and "jobs" in (data.get("errors") or {}):  # measured again, after a fix
            first = data["errors"]["jobs"].strip().splitlines()[0]
            data["errors"] = {k: v for k, v in data["errors"].items() if k != "jobs"}
            lines += [f"In the first invocation the jobs part stopped at `{first}`: `attach` followed the nodes "
                      "through the fan-out window of 64, so at 128 hosts the second 64 were never shown and attach "
                      "never saw every rank (a bug this benchmark found; fixed: attach follows every node at once, "
                      "tests/lab/test_faults.py::test_attach_follows_every_node_beyond_the_fanout_window). The "
                      "jobs part was then measured again on the fixed code.", ""]
        lines += [f"Rows and points marked {mark} come from a later invocation of the same harness "
                  f"(`--parts {','.join(more['config'].get('parts', []))} --sizes "
                  f"{','.join(str(x) for x in more['config'].get('sizes', []))}`): {describe(name, more)}", ""]

    def secs(v):
        return "n/a" if v is None else f"{v:.2f} s"

    tear = data.get("teardown") or []
    if tear:
        sizes = sorted({r["hosts"] for r in tear})
        lines += ["### Teardown after a crash, 8 to 128 hosts", "",
                  "bench/teardown.py's job and method in the same lab and run: one process per host (gloo), the "
                  "last rank calls `os._exit(17)` 2 s after a barrier while the others are in `all_reduce`; t=0 "
                  "is the moment the crashed process is gone, t ends when no process of the job is left on any "
                  f"host (cap {cap:g} s; one trial per point). *stand-in job*: the same crash in a job without "
                  "torch under a stand-in torchrun (`bench/scale_torch.py`), at the sizes where N real torchruns "
                  "do not fit in memory; its other ranks do not fail by themselves (no gloo), so everything "
                  "after the crash is ddpfab's own teardown: the supervisor ends the crashed node's job, the "
                  "controller stops every other node.", ""]
        rows = []
        for n in sizes:
            def gone(tool, job):
                r = next((x for x in tear if x["tool"] == tool and x["hosts"] == n and x["job"] == job), None)
                if r is None:
                    return None, "-"
                if "skipped" in r:
                    return None, "not run (memory)"
                star = r.get("later") or ""
                if r["gone"] is None:
                    return None, f"> {cap:g} s{star}"
                return r["gone"], secs(r["gone"]) + star
            (d, ds), (p, ps_), (sd, sds) = (gone("ddpfab run", "torch"), gone("pdsh + torchrun", "torch"),
                                            gone("ddpfab run", "stand-in"))
            beyond_cap = ps_.startswith(">") and d is not None  # pdsh's time is more than the cap
            rows.append([str(n), ds, ps_, f"< {d / cap:.2f}x" if beyond_cap else ratio(d, p), sds])
            if n == 64:
                t["scale_teardown_64"] = d if d is not None else sd
                t["scale_teardown_64_job"] = "torch" if d is not None else ("stand-in" if sd is not None else None)
        lines += table(["hosts", "ddpfab run (torch job)", "pdsh + torchrun (torch job)", "ddpfab / pdsh",
                        "ddpfab run (stand-in job)"], rows)
        skipped = sorted({r["skipped"] for r in tear if "skipped" in r})
        if skipped:
            lines += ["; ".join(skipped) + ".", ""]
        if "bench-scale-torch.png" in plots:
            lines += ["![scale: teardown and a detached job's commands](bench-scale-torch.png)", ""]
    runs = data.get("run") or []
    if runs:
        lines += ["### A real run at 64 and 128 hosts", "",
                  "`ddpfab run` of a small gloo script (init_process_group, one all_reduce checked, one line per "
                  "rank, exit; one process per host), step by step (bench/launch.py's phase driver), against "
                  "`pdsh` + torchrun of the same script in the same run. Most of the time is N hosts importing "
                  "torch twice each (torchrun, the worker) on this machine's 2 cores.", ""]
        for r in runs:
            if "skipped" in r:
                lines += [f"- N={r['hosts']}: {r['skipped']}.", ""]
                continue
            d, p = r["ddpfab"], r["pdsh + torchrun"]
            c = d["controller"]
            lines += [f"N={r['hosts']}{r.get('later') or ''}: every rank's line after {d['ready']:.1f} s, exit after {d['exit']:.1f} s "
                      f"(pdsh + torchrun: " + (f"{p['ready']:.1f} s and {p['exit']:.1f} s" if "ready" in p
                                              else p.get("skipped", "n/a")) + "); the controller: "
                      f"{c['cpu_s']:.1f} s CPU, {c['threads']} threads, {c['fds']} open files, {c['rss_mib']:.0f} MiB.",
                      ""]
            lines += table(["step", "seconds"], [[s["step"], f"{s['seconds']:.2f}"] for s in d["steps"]])
    jobs = data.get("jobs") or []
    if jobs:
        lines += ["### A detached job's commands at 64 and 128 hosts", "",
                  "`run --detach` of a job without torch under a stand-in torchrun (`bench/scale_torch.py`: "
                  "torchrun's flags, environment and `--tee` prefix, no torch import; 128 real torchruns need "
                  "~19 GiB for their torch imports alone, more than this shared 24 GiB machine has free), then, "
                  "with every rank up: `ps`, `logs`, `attach` (Ctrl-C once every rank's line is shown), `stop` "
                  "(and until its last process is gone). The commands' work is the controller's SSH fan-out and "
                  "reads of the run's files on each node, the same whatever the job runs. Each command once, "
                  "its controller process sampled every 20 ms.", ""]
        rows = []
        for j in jobs:
            extra = []
            if "all_ranks_ready_s" in j:
                extra.append(f"every rank up after {j['all_ranks_ready_s']:.1f} s")
            if "until_s" in j:
                extra.append(f"every rank's line shown after {j['until_s']:.1f} s")
            if "gone_after_s" in j:
                extra.append(f"last job process gone after {j['gone_after_s']:.1f} s")
            rows.append([j["command"] + (j.get("later") or ""), str(j["hosts"]), f"{j['wall']:.2f} s", f"{j['output_lines']} / {j['output_bytes']}",
                         f"{j['cpu_s']:.2f} s", str(j["threads"]), str(j["fds"]), f"{j['rss_mib']:.0f} MiB",
                         "; ".join(extra)])
        lines += table(["command", "N", "wall", "output lines / bytes", "controller CPU", "threads", "open files",
                        "memory", "also"], rows)
    errors = data.get("errors") or {}
    for part, err in errors.items():
        lines += [f"Part `{part}` failed in this run: `{err.strip().splitlines()[-1] if err.strip() else err}`.", ""]
    return lines, t


def nochange_targets(data: dict | None) -> dict:
    """`bench/nochange_sync.py`'s ratio at its largest size, with the load it was taken at."""
    if not data or not data.get("sizes"):
        return {}
    n = max(data["sizes"], key=int)
    point = data["sizes"][n]
    load = (data.get("meta") or {}).get("loadavg_start") or [None]
    return {"nochange_n": int(n), "nochange_ratio": point.get("ratio_sync_over_exec"), "nochange_load": load[0]}


def estimate(e: dict | None, spec: str) -> str:
    """A median, with its 95 % interval where there is one."""
    if not e:
        return "n/a"
    ci = e.get("ci95")
    return spec.format(e["median"]) + (f" (95 %: {spec.format(ci[0])} to {spec.format(ci[1])})" if ci else "")


def within(e: dict | None, goal: float) -> str:
    """An at-most goal's verdict on a median, by its 95 % interval (met: all of it within the
    goal; not met: none of it; not settled: it straddles the goal, or there is no interval)."""
    if not e:
        return "n/a"
    if not e.get("ci95"):  # under 6 pairs (or a result written before intervals were): a median alone
        return "**not settled** (too few pairs for an interval)"
    lo, hi = e["ci95"]
    if hi <= goal:
        return "**met**"
    if lo > goal:
        return "**not met**"
    return f"**not settled** (median {'within' if e['median'] <= goal else 'beyond'} it)"


def verdicts(t: dict) -> list[str]:
    def v(ok):
        return "n/a" if ok is None else ("**met**" if ok else "**not met**")

    def x(val, spec="{:.2f}x"):
        return "n/a" if val is None else spec.format(val)

    n = t.get("fanout_n", 32)
    rows = [
        [f"fan-out on {n} hosts within 1.2x of pdsh", f"ddpfab/pdsh = {x(t.get('fanout_pdsh'))}",
         v(None if t.get("fanout_pdsh") is None else t["fanout_pdsh"] <= 1.2)],
        [f"fan-out on {n} hosts >= 5x faster than the ssh loop", f"loop/ddpfab = {x(t.get('fanout_loop'))}",
         v(None if t.get("fanout_loop") is None else t["fanout_loop"] >= 5)],
        [f"fan-out on {n} hosts >= 5x faster than ansible ad-hoc", f"ansible/ddpfab = {x(t.get('fanout_ansible'))}",
         v(None if t.get("fanout_ansible") is None else t["fanout_ansible"] >= 5)],
        ["fan-out growth with N close to flat (here: t(32)/t(2) <= 2)",
         f"ddpfab {x(t.get('fanout_growth'))} (pdsh {x(t.get('fanout_growth_pdsh'))})",
         v(None if t.get("fanout_growth") is None else t["fanout_growth"] <= 2)],
        [f"launch overhead < {LAUNCH_TARGET_S:g} s at {t.get('launch_n', 8)} hosts beyond torchrun on the same hosts "
         "(pdsh + torchrun: the same torchruns, the same CPU contention)",
         f"ddpfab run - pdsh + torchrun = {x(t.get('launch_pdsh'), '{:+.2f} s')} (--no-check "
         f"{x(t.get('launch_nocheck_pdsh'), '{:+.2f} s')}); ddpfab's own steps before it starts the nodes "
         f"{x(t.get('launch_own'), '{:.2f} s')}; code check {x(t.get('launch_sync'), '{:+.2f} s')}",
         v(None if t.get("launch_pdsh") is None else t["launch_pdsh"] < LAUNCH_TARGET_S)],
        ["the same beyond one torchrun started locally (the target's literal baseline)",
         f"{x(t.get('launch_local'), '{:+.2f} s')}, of which pdsh + torchrun pays "
         f"{x(t.get('launch_pdsh_local'), '{:+.2f} s')} too: {t.get('launch_n', 8)} hosts importing torch twice "
         "each on this machine's 2 cores (see section 2)",
         v(None if t.get("launch_local") is None else t["launch_local"] < LAUNCH_TARGET_S)
         + (" on this lab (one machine)" if t.get("launch_local") is not None and t["launch_local"] >= LAUNCH_TARGET_S
            else "")],
        ["teardown < 2 s after a crash, every N", f"worst median {x(t.get('teardown_worst_median'), '{:.2f} s')}, "
         f"worst single run {x(t.get('teardown_worst_sample'), '{:.2f} s')}",
         v(None if t.get("teardown_worst_median") is None else t["teardown_worst_median"] < 2)],
        [f"exec at {t.get('scale_n', 128)} hosts at most 0.5x pdsh's time",
         f"ddpfab/pdsh = {x(t.get('scale_exec_pdsh'))}",
         v(None if t.get("scale_exec_pdsh") is None else t["scale_exec_pdsh"] <= 0.5)],
        ["check at 64 hosts in under 5 s", x(t.get("scale_check_64"), "{:.2f} s"),
         v(None if t.get("scale_check_64") is None else t["scale_check_64"] < 5)],
        [f"`sync` with nothing changed at {t.get('nochange_n', 128)} hosts at most 1.5x an `exec hostname` "
         "(bench/nochange_sync.py)",
         f"sync/exec = {x(t.get('nochange_ratio'))}"
         + (f" (load {t['nochange_load']:.0f} at the start)" if t.get("nochange_load") is not None else ""),
         v(None if t.get("nochange_ratio") is None else t["nochange_ratio"] <= 1.5)],
        [f"moonshot: a command on {t.get('warm_n', 128)} hosts over connections already open at most 0.1x pdsh's time",
         f"`ddpfab exec` over `ddpfab hold`'s connections / pdsh = {x(t.get('held_pdsh'))} (the whole command: "
         f"interpreter, inventory, output); in one process, warm = {x(t.get('warm_pdsh'))}, "
         f"cold = {x(t.get('cold_pdsh'))}",
         # the goal is repeated commands while debugging: the command a user types, not one process
         v(None if t.get("held_pdsh") is None else t["held_pdsh"] <= 0.1)],
        [f"`ddpfab run` on warm connections ({t.get('held_n', 8)} hosts) at most pdsh + torchrun + 0.2 s",
         f"warm {estimate(t.get('held_run_pdsh'), '{:+.2f} s')} (section 9)", within(t.get("held_run_pdsh"), 0.2)],
        [f"`ddpfab run` cold ({t.get('held_n', 8)} hosts) at most pdsh + torchrun + 0.5 s",
         f"cold {estimate(t.get('held_cold_pdsh'), '{:+.2f} s')} (section 9)", within(t.get("held_cold_pdsh"), 0.5)],
        [f"`check --fast` on warm connections at {t.get('held_check_n', 128)} hosts in at most half the cold time",
         f"warm/cold = {estimate(t.get('held_check_ratio'), '{:.3f}x')} (section 9)",
         within(t.get("held_check_ratio"), 0.5)],
        ["teardown after a crash under 1 s at 64 hosts",
         x(t.get("scale_teardown_64"), "{:.2f} s") + (f" ({t['scale_teardown_64_job']} job)"
                                                     if t.get("scale_teardown_64_job") else ""),
         v(None if t.get("scale_teardown_64") is None else t["scale_teardown_64"] < 1)],
        ["the run's own steps before the nodes start grow less than linearly with N",
         "n/a" if not t.get("scale_plan_growth") else
         f"t({t.get('scale_n')})/t(8) = {t['scale_plan_growth'][0]:.2f} for {t['scale_plan_growth'][1]:.0f}x the hosts",
         v(None if not t.get("scale_plan_growth") else t["scale_plan_growth"][0] < t["scale_plan_growth"][1])],
    ]
    return table(["target", "measured", "verdict"], rows)


RESULT_NAMES = ("fanout", "launch", "teardown", "provision", "recovery", "scale", "resync", "perf_check", "leases",
                "preflight_dataplane", "preflight_resources", "hang", "warm", "run_cpu")


def load_all() -> dict[str, dict | None]:
    """Every result this page and the quoted figures read, by name (None: not run yet)."""
    return {n: load(n) for n in RESULT_NAMES}


def plots_for(data: dict[str, dict | None], plt) -> set[str]:
    """Draw the plots the results allow; their file names under docs/."""
    plots: set[str] = set()
    for name, fn in (("fanout", plot_fanout), ("launch", plot_launch), ("teardown", plot_teardown),
                     ("provision", plot_provision), ("scale", plot_scale), ("scale", plot_scale_torch)):
        if data[name]:
            plots.add(fn(data[name], plt))
    return plots


def page(data: dict[str, dict | None], plots: set[str], have_plotter: bool = True) -> str:
    """docs/benchmarks.md from the results; *plots*: the docs/ images to show."""
    fanout, launch, teardown, provision, recovery, scale = (
        data[n] for n in ("fanout", "launch", "teardown", "provision", "recovery", "scale"))
    targets: dict = {}
    f_lines, t1 = fanout_section(fanout, plots)
    l_lines, t2 = launch_section(launch, plots)
    d_lines, t3 = teardown_section(teardown, plots)
    targets.update(t1)
    targets.update(t2)
    targets.update(t3)
    s_lines, t4 = scale_section(scale, plots)
    targets.update(t4)
    w_lines, t5 = warm_section(load("fanout-128"))
    targets.update(t5)
    h_lines, t6 = held_section(data.get("warm"))
    h_lines += run_cpu_section(data.get("run_cpu"))
    targets.update(t6)
    targets.update(nochange_targets(load("nochange_sync-128") or load("nochange_sync")))
    f_lines += w_lines
    metas = [d["meta"] for d in (fanout, launch, teardown, provision, recovery, scale) if d]
    m = metas[0] if metas else {}
    any_noisy = any(noisy(x) for x in metas)
    head = [
        "# Benchmarks: ddpfab against the alternatives",
        "",
        "<!-- generated by bench/report.py from bench/results/*.json; edit those scripts, not this file -->",
        "",
    ]
    if any_noisy:
        head += ["> **These numbers are noisy**: at least one benchmark ran on a busy machine (other work on more "
                 "than a quarter of the CPUs just before its start) or with `--quick`. Re-run `bench/run_all.py` on a quiet machine "
                 "before drawing conclusions.", ""]
    head += [
        "## Where and how this was measured",
        "",
        f"- Machine: {m.get('cpus', '?')} CPUs ({m.get('cpu', '?')}), {m.get('mem_gib', '?')} GiB, Linux "
        f"{m.get('kernel', '?')}, Python {m.get('python', '?')}; "
        + ", ".join(v if v.lower().startswith(k) else f"{k} {v}" for k, v in (m.get("versions") or {}).items() if v)
        + ".",
        "- Hosts are **`ddpfab lab` hosts: Linux namespaces on this one machine** (own address, sshd, host key, "
        "process table, hostname; see `ddpfab/lab/__init__.py`). The \"network\" is a Linux bridge (sub-millisecond, no "
        "bandwidth limit) and **all hosts share this machine's CPUs**: work that would run in parallel on N "
        "real machines (N sshd handshakes, N `import torch`) competes for the same cores here. Absolute times "
        "are therefore pessimistic for large N; ratios measured in the same run are the point.",
        "- Each tool is run as a user would type it (a fresh process), interleaved with the others in a "
        "rotating order inside every repetition, so load drifts hit all of them alike. Tables give the median "
        "and the min-max spread over the repetitions.",
        "- Reproduce: as root, `apt-get install -y pdsh` (bench-only), `.venv/bin/pip install matplotlib "
        "pyinstrument` (bench-only, not in pyproject), then `.venv/bin/python bench/run_all.py` "
        "(every benchmark, then this page). One benchmark: `.venv/bin/python bench/<name>.py [--quick]`; "
        "this page alone: `.venv/bin/python bench/report.py`. See `bench/README.md`.",
        "",
        "## Targets",
        "",
    ]
    head += verdicts(targets)
    body = f_lines + l_lines + profile_section(launch, fanout) + d_lines + provision_section(provision, plots)
    body += recovery_section(recovery) + s_lines + leases_section(data.get("leases"))
    body += preflight_section(data.get("preflight_dataplane"), data.get("preflight_resources"))
    body += hang_section(data.get("hang")) + h_lines
    if not have_plotter:
        body += ["_matplotlib is not installed: no plots (`.venv/bin/pip install matplotlib`, then "
                 "`.venv/bin/python bench/report.py`)._", ""]
    return "\n".join(head + body).rstrip() + "\n"


def quoted(data: dict[str, dict | None]) -> dict[str, Figure]:
    """The figures README.md and docs/*.md quote behind `<!-- bench:KEY -->` markers (bench/markers.py),
    computed as this page computes them."""
    t: dict = {}
    for section, name in ((fanout_section, "fanout"), (launch_section, "launch"), (teardown_section, "teardown")):
        t.update(section(data[name], set())[1])
    figs = {
        "fanout.hosts": Figure(t.get("fanout_n")),
        "fanout.exec_over_pdsh": Figure(t.get("fanout_pdsh"), "x"),
        "fanout.loop_over_exec": Figure(t.get("fanout_loop"), "x"),
        "fanout.ansible_over_exec": Figure(t.get("fanout_ansible"), "x"),
        "launch.hosts": Figure(t.get("launch_n")),
        "launch.own": Figure(t.get("launch_own"), " s"),
        "launch.over_pdsh": Figure(t.get("launch_pdsh"), " s"),
        "launch.target": Figure(LAUNCH_TARGET_S, " s"),
        "launch.verdict": Figure(None if t.get("launch_pdsh") is None else
                                 "met" if t["launch_pdsh"] < LAUNCH_TARGET_S else "not met"),
    }
    launch = data["launch"]
    if launch:
        figs["launch.reps"] = Figure(launch["meta"]["reps"])
        parse = (launch.get("micro") or {}).get(INVENTORY_PARSE)
        figs["launch.inventory_parse"] = Figure(parse, " s")
    teardown = data["teardown"]
    if teardown:
        figs["teardown.cap"] = Figure(teardown["config"]["cap_s"], " s")
        for key, tool in (("teardown.crash_ddpfab", "ddpfab run"), ("teardown.crash_pdsh", "pdsh + torchrun")):
            meds = [med(get(teardown, tool, n, scenario="crash")) for n in teardown["config"]["sizes"]]
            figs[key] = Figure((min(meds), max(meds)) if meds and None not in meds else None, " s")
    provision = data["provision"]
    if provision:
        n = provision["config"]["hosts"]
        base, defaults = (med(get(provision, tool, n)) for tool in ("ddpfab provision", "ansible-playbook (defaults)"))
        figs["provision.defaults_over_ddpfab"] = Figure(defaults / base if base and defaults else None, "x")
    figs.update(_resync_figures(data["resync"]))
    figs.update(_perf_check_figures(data["perf_check"]))
    return figs


def _resync_figures(data: dict | None) -> dict[str, Figure]:
    """docs/sync.md's table: the no-change re-sync, this checkout against its base (bench/resync.py)."""
    if not data:
        return {}
    res = data["results"]
    figs = {"resync.reps": Figure(data["meta"]["reps"])}
    base = next(k.split(": ")[0] for k in res if k.endswith(": fast path") and not k.startswith("this: "))
    for key, stat in (("fast_this", "this: fast path"), ("fast_base", f"{base}: fast path"),
                      ("full_this", "this: full sync"), ("full_base", f"{base}: full sync"), ("floor", "rsync loop")):
        figs[f"resync.{key}"] = Figure(res[stat]["median"], " s")
        figs[f"resync.{key}_iqr"] = Figure((res[stat]["p25"], res[stat]["p75"]))
    for key, op in (("fast_ratio", "fast path"), ("full_ratio", "full sync")):
        figs[f"resync.{key}"] = Figure(data["ratio_this_over_base"][op])
    return figs


def _perf_check_figures(data: dict | None) -> dict[str, Figure]:
    """docs/perf-check.md's spread of healthy checks and times (bench/perf_check.py), at its largest size."""
    if not data:
        return {}
    n = max(data["sizes"], key=int)
    one = data["sizes"][n]
    healthy = one["healthy"]
    figs = {"perf.nodes": Figure(int(n)), "perf.healthy_checks": Figure(len(healthy)),
            "perf.healthy_seconds": Figure((min(h["seconds"] for h in healthy), max(h["seconds"] for h in healthy)), " s")}
    for kind in ("compute", "memory", "link", "latency"):
        figs[f"perf.healthy_{kind}"] = Figure((min(h["spread"][kind][0] for h in healthy),
                                               max(h["spread"][kind][1] for h in healthy)),
                                              "x" if kind == "latency" else "")
    for drill in ("link_drill", "cpu_drill"):
        if one.get(drill):
            figs[f"perf.{drill}_seconds"] = Figure(one[drill]["seconds"], " s")
    return figs


def main() -> int:
    DOCS.mkdir(exist_ok=True)
    data = load_all()
    plt = _plt()
    plots = plots_for(data, plt) if plt is not None else set()
    DOC.write_text(page(data, plots, plt is not None))
    print(f"wrote {DOC}" + (f" and {', '.join(sorted('docs/' + p for p in plots))}" if plots else ""))
    figures = quoted(data)
    for path in markers.quoting_files():
        text = path.read_text()
        new = markers.update(text, figures)
        if new != text:
            path.write_text(new)
            print(f"updated the quoted figures in {path.relative_to(REPO)}")
        for problem in markers.problems(new, figures, str(path.relative_to(REPO))):
            print(problem, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
